// The stack switch of context.h.

#include "context.h"

#include <cstdint>

namespace lockstep_emu {

#if LOCKSTEP_EMU_OWN_SWITCH

// What the System V ABI has a callee keep: rbx, rbp, r12 to r15, the stack pointer, and the
// control bits of MXCSR and the x87 control word. Pushed onto the stack being left, in the
// order `prepare` lays out a new stack's first frame.
asm(R"(
    .pushsection .text
    .p2align 4
    .globl lockstep_emu_switch_stack
    .hidden lockstep_emu_switch_stack
    .type lockstep_emu_switch_stack, @function
lockstep_emu_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size lockstep_emu_switch_stack, .-lockstep_emu_switch_stack

    .p2align 4
    .type lockstep_emu_stack_start, @function
lockstep_emu_stack_start:
    callq *%rbx
    ud2
    .size lockstep_emu_stack_start, .-lockstep_emu_stack_start
    .popsection
)");

extern "C" __attribute__((visibility("hidden"))) void lockstep_emu_stack_start();

void prepare(Context& context, void* stack, std::size_t bytes, void (*entry)()) {
    // The first switch pops the frame below and returns into `lockstep_emu_stack_start`, which
    // calls `entry` (in rbx) with the stack aligned to 16 bytes, as a call must be.
    const std::uintptr_t top =
        (reinterpret_cast<std::uintptr_t>(stack) + bytes) & ~std::uintptr_t{15};
    auto* frame = reinterpret_cast<std::uint64_t*>(top - 80);
    std::uint32_t mxcsr;
    std::uint16_t x87;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(x87));
    frame[0] = mxcsr | std::uint64_t{x87} << 32;
    frame[1] = frame[2] = frame[3] = frame[4] = 0;  // r15, r14, r13, r12
    frame[5] = reinterpret_cast<std::uint64_t>(entry);  // rbx
    frame[6] = 0;                                       // rbp: the end of a backtrace
    frame[7] = reinterpret_cast<std::uint64_t>(&lockstep_emu_stack_start);
    context.stack_pointer = frame;
}

#else

void prepare(Context& context, void* stack, std::size_t bytes, void (*entry)()) {
    getcontext(&context.start);
    context.start.uc_stack.ss_sp = stack;
    context.start.uc_stack.ss_size = bytes;
    context.start.uc_link = nullptr;
    makecontext(&context.start, entry, 0);
    context.fresh = true;
}

void switch_context(Context& save, Context& load) {
    save.fresh = false;
    if (_setjmp(save.resume) != 0) return;
    if (load.fresh) {
        load.fresh = false;
        setcontext(&load.start);
    }
    _longjmp(load.resume, 1);
}

#endif

}  // namespace lockstep_emu
