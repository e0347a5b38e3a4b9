// Running a launch's blocks on the CPU: every thread of a block is a fiber, switched at the
// block's barriers and the warp's exchanges (blocks.cpp).

#pragma once

#include <string>

#include "runtime.h"

namespace lockstep_emu {

// A dependent launch's check (driver.cpp): `close` makes inaccessible what the kernels before
// it write, `open` restores it. A checked block runs closed until its threads reach
// `wait_for_inputs()`, so a touch before then faults and names the kernel.
struct PreWaitGuard {
    void (*close)(void* context);
    void (*open)(void* context);
    void* context;
};

// Runs every block of the grid, one after another, on the calling thread; with `guard`, the
// first and the last block are checked. Empty when the launch completed; otherwise what went
// wrong (a trap, a divergent barrier), naming the block and thread.
// The kernel a block on this OS thread is running, or null (for the fault handler).
const char* running_kernel();

std::string run_grid(const Module& module, const Entry& entry, Dim grid, Dim block,
                     void** parameters, const PreWaitGuard* guard);

}  // namespace lockstep_emu
