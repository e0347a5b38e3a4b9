#!/usr/bin/env bash
# Builds the CUDA emulator into DIR (default target/cuda-emu): one shared library standing in
# for both libcuda and libnvrtc, under the names cudarc opens, with the headers the emulator's
# NVRTC compiles kernels against. Put DIR first on LD_LIBRARY_PATH and the CUDA executor runs
# on the CPU; the emulator's own notes are in driver.cpp, nvrtc.cpp and blocks.cpp.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/../../target/cuda-emu}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cxx="${LOCKSTEP_CUDA_EMU_CXX:-c++}"
# No _FORTIFY_SOURCE: its longjmp refuses to switch stacks, which is how fibers switch where
# context.cpp has no switch of its own. TLS descriptors on x86-64 (aarch64's default): a
# library dlopen'ed as libcuda reaches its thread-locals through `__tls_get_addr` otherwise, a
# call at every fiber switch, which took a fifth of an emulated run.
tls=""
[ "$(uname -m)" = x86_64 ] && tls="-mtls-dialect=gnu2"
# Built beside and renamed into place: a process running on the old library keeps its copy.
"$cxx" -std=c++17 -O2 -g -fPIC $tls -shared -Wall -Wextra -Werror -U_FORTIFY_SOURCE -pthread \
    "$here/blocks.cpp" "$here/context.cpp" "$here/driver.cpp" "$here/nvrtc.cpp" -ldl \
    -o "$out/liblockstep-cuda-emu.so.new"
mv -f "$out/liblockstep-cuda-emu.so.new" "$out/liblockstep-cuda-emu.so"
cp "$here/device.h" "$here/runtime.h" "$out/"
for name in libcuda.so libcuda.so.1 libnvrtc.so libnvrtc.so.12; do
    ln -sf liblockstep-cuda-emu.so "$out/$name"
done
echo "$out"
