// Running a launch's blocks on the CPU: every thread of a block is a fiber, switched at the
// block's barriers and the warp's exchanges (blocks.cpp).

#pragma once

#include <string>

#include "runtime.h"

namespace lockstep_emu {

// Runs every block of the grid, one after another, on the calling thread. Empty when the
// launch completed; otherwise what went wrong (a trap, a divergent barrier), naming the block
// and thread.
std::string run_grid(const Module& module, const Entry& entry, Dim grid, Dim block,
                     void** parameters);

}  // namespace lockstep_emu
