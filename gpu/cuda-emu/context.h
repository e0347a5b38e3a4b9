// Switching one OS thread between stacks: what a fiber of blocks.cpp is. A launch switches
// millions of times (every lane at every shuffle and barrier, there and back), so the switch is
// most of the emulator's own time.
//
// On x86-64 a switch is a dozen instructions of our own (context.cpp): push the callee-saved
// registers and the floating-point control words, swap stack pointers, pop. Elsewhere it is
// `_setjmp` / `_longjmp` between stacks made by `makecontext` (glibc's longjmp also walks the
// thread's cleanup handlers and mangles pointers, which on x86-64 was about a tenth of a run;
// `swapcontext` would add a system call a switch for the signal mask).

#pragma once

#include <cstddef>

// LOCKSTEP_EMU_PORTABLE_CONTEXT (a -D in LOCKSTEP_CUDA_EMU_CXX) takes the portable switch on
// x86-64 too, to test it there.
#if defined(__x86_64__) && !defined(LOCKSTEP_EMU_PORTABLE_CONTEXT)
#define LOCKSTEP_EMU_OWN_SWITCH 1
#else
#define LOCKSTEP_EMU_OWN_SWITCH 0
#endif

#if !LOCKSTEP_EMU_OWN_SWITCH
#include <setjmp.h>
#include <ucontext.h>
#endif

namespace lockstep_emu {

// Where a stack stopped, enough to resume it; or, once `prepare`d, where one starts.
struct Context {
#if LOCKSTEP_EMU_OWN_SWITCH
    void* stack_pointer = nullptr;
#else
    ucontext_t start;  // only until the first switch to it
    jmp_buf resume;
    bool fresh = false;
#endif
};

// Makes `context` start `entry` on `stack` (`bytes` long) at the next switch to it. `entry`
// never returns: it switches away, and its stack is dropped or prepared again.
void prepare(Context& context, void* stack, std::size_t bytes, void (*entry)());

// Saves where this stack is into `save` and resumes `load`; returns when something switches
// back to `save`.
#if LOCKSTEP_EMU_OWN_SWITCH
extern "C" __attribute__((visibility("hidden"))) void lockstep_emu_switch_stack(void** save,
                                                                              void* load);
inline void switch_context(Context& save, Context& load) {
    lockstep_emu_switch_stack(&save.stack_pointer, load.stack_pointer);
}
#else
void switch_context(Context& save, Context& load);
#endif

}  // namespace lockstep_emu
