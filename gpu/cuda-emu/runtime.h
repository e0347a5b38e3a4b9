// The interface between a kernel module the emulator compiled (device.h's side) and the
// emulator's runtime that loads and runs it (driver.cpp, blocks.cpp): plain structs and function
// pointers, so the two need not link against each other (libloading opens our libcuda with
// RTLD_LOCAL, so a module could not find the runtime's symbols by name).

#pragma once

namespace lockstep_emu {

struct Dim {
    unsigned int x, y, z;
};

// Where the running fiber is: CUDA's built-in variables, and its lane within its warp.
struct Coordinates {
    Dim thread, block, block_dim, grid_dim;
    int lane;
};

// What a kernel calls into: the block's barriers, the warp's exchange, a trap. Each may switch
// to another fiber before it returns.
struct Runtime {
    void (*sync_block)();
    void (*sync_warp)(unsigned int mask);
    // Offers `size` bytes at `mine` to the warp and copies lane `from`'s offer into `out`.
    void (*exchange)(unsigned int mask, const void* mine, void* out, unsigned int size, int from);
    // Ends the launch with an error; never returns to the kernel.
    void (*trap)();
    // prelude.cu's `wait_for_inputs()`: where a dependent launch's block may first touch what
    // the kernels before it write (driver.cpp checks that it does not before).
    void (*wait_for_inputs)();
};

constexpr unsigned int PARAMETERS_MAX = 32;

// One `extern "C" __global__` function of a module.
struct Entry {
    const char* name;
    void (*call)(void** parameters);
    unsigned int parameter_count;
    unsigned int parameter_sizes[PARAMETERS_MAX];
    // Bit `i` set: parameter `i` is a pointer to memory the kernel may write (not to const).
    unsigned int writable;
};

// What a module exports as `lockstep_emu_module`: its entry points (ending with a null name),
// and where the runtime sets the runtime table and the running fiber's coordinates.
struct Module {
    const Entry* entries;
    const Runtime** runtime;
    Coordinates* (*coordinates)();
};

}  // namespace lockstep_emu
