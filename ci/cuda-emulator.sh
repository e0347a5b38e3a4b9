#!/usr/bin/env bash
# The CUDA backend's checks (gpu/tests/cuda_device.rs) on the CPU, through the CUDA emulator
# (gpu/cuda-emu: libcuda and libnvrtc over host memory, kernels compiled by the host's C++
# compiler, every thread a fiber): the executor's host code, graphs, page tables and every
# kernel run unchanged, so a kernel or launch bug fails here without a GPU. The tiny models
# only; the default model takes many minutes emulated (run it by hand with
# LOCKSTEP_DEFAULT_MODEL set). Then the emulator's own tests (gpu/tests/cuda_emulator.rs), and
# the lockstep binary serving on it, alone and split (server/tests/cuda_roles.rs).
#
# What it cannot show: speed, and the device's own rounding of expf and sincosf;
# ci/device-check.sh on a GPU does.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v "${LOCKSTEP_CUDA_EMU_CXX:-c++}" >/dev/null; then
    echo "installing g++ (the emulator compiles kernels with it)" >&2
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
    $sudo_ apt-get update -qq && $sudo_ apt-get install -y -qq g++ >/dev/null
fi

target="${CARGO_TARGET_DIR:-target}"
emu="$(gpu/cuda-emu/build.sh "$target/cuda-emu")"
# Compiled kernel modules, kept between runs (keyed by their source and compiler).
export LOCKSTEP_CUDA_EMU_CACHE="$emu/modules"
export LD_LIBRARY_PATH="$emu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LOCKSTEP_REQUIRE_CUDA=1 LOCKSTEP_REQUIRE_CUDA_EMULATOR=1
# Then the binary: `lockstep serve --device cuda` alone, with every launch option, and as a
# prefill and a decode worker behind a router, on a tiny model: the same completion.
# Selected from the whole workspace, so that the features are the workspace's (the server's
# default `cuda` turns on the gpu crate's) and `cargo test --workspace`'s build serves again.
env -u LOCKSTEP_DEFAULT_MODEL -u LOCKSTEP_REQUIRE_MODEL \
    cargo test --locked --workspace --test cuda_emulator --test cuda_device --test cuda_roles
