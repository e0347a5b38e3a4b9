// What a kernel source sees when the CUDA emulator compiles it with the host's C++ compiler in
// place of NVRTC (the emulator's nvrtc.cpp puts `#include "device.h"` before the source): CUDA
// C++'s keywords, built-in variables, vector types and intrinsics, as plain C++ over the
// emulator's runtime (runtime.h), which runs every thread of a block as a fiber.
//
// Kept to what our kernels use, so that a kernel reaching for anything else fails to compile
// here as loudly as a typo would. `__CUDA_ARCH__` stays undefined: prelude.cu's PTX is the
// device's, and its `#else` branches are the emulator's.

#pragma once

#include <cmath>
#include <cstring>
#include <cstddef>
#include <type_traits>
#include <utility>

#include "runtime.h"

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
// Shared memory is one block's, and a host thread runs one block at a time (blocks.cpp): a
// static local per OS thread is exactly as shared as the device's.
#define __shared__ static thread_local

struct uint3 {
    unsigned int x, y, z;
};
typedef uint3 dim3;

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};

namespace lockstep_emu_device {
// Set by the runtime through `lockstep_emu_module` before each fiber runs.
inline const lockstep_emu::Runtime* runtime = nullptr;
inline thread_local lockstep_emu::Coordinates coordinates;
}  // namespace lockstep_emu_device

#define threadIdx (lockstep_emu_device::coordinates.thread)
#define blockIdx (lockstep_emu_device::coordinates.block)
#define blockDim (lockstep_emu_device::coordinates.block_dim)
#define gridDim (lockstep_emu_device::coordinates.grid_dim)

inline void __syncthreads() { lockstep_emu_device::runtime->sync_block(); }

inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    lockstep_emu_device::runtime->sync_warp(mask);
}

inline void lockstep_emu_wait_for_inputs() { lockstep_emu_device::runtime->wait_for_inputs(); }

[[noreturn]] inline void __trap() {
    lockstep_emu_device::runtime->trap();
    __builtin_unreachable();
}

// A warp shuffle: every lane of the warp offers `value` and takes lane `source`'s.
template <typename T>
inline T __shfl_sync(unsigned int mask, T value, int source, int width = 32) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    const int lane = lockstep_emu_device::coordinates.lane;
    const int base = lane - lane % width;
    const int from = base + ((source % width) + width) % width;
    T out;
    lockstep_emu_device::runtime->exchange(mask, &value, &out, sizeof(T), from);
    return out;
}

template <typename T>
inline T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    const int lane = lockstep_emu_device::coordinates.lane;
    const int from = lane ^ lane_mask;
    T out;
    // A partner past the width reads its own value, as on the device.
    lockstep_emu_device::runtime->exchange(mask, &value, &out, sizeof(T),
                                           from / width == lane / width ? from : lane);
    return out;
}

// Rounded products and sums that the compiler may not fuse (the module is compiled with
// -ffp-contract=off, so plain ones are not fused either).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int i;
    std::memcpy(&i, &f, 4);
    return i;
}

// CUDA's integer and floating `min` / `max` overloads (the floating ones are fminf / fmaxf).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// IEEE half precision, as PTX's `cvt.f32.f16` (exact) and `cvt.rn.f16.f32` (round to nearest
// even) convert it: prelude.cu calls these where the device runs those instructions.
inline float lockstep_emu_half_to_float(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
inline unsigned short lockstep_emu_float_to_half(float f) {
    const _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}

// The module's table of entry points (nvrtc.cpp lists every `extern "C" __global__` function
// after the source): each with a caller that unpacks the driver's parameter array into the
// function's typed arguments, and the arguments' sizes (what a graph capture copies).
namespace lockstep_emu_device {
template <typename... A, std::size_t... I>
void call(void (*f)(A...), void** parameters, std::index_sequence<I...>) {
    f(*static_cast<A*>(parameters[I])...);
}
template <typename A>
constexpr bool writable() {
    return std::is_pointer_v<A> && !std::is_const_v<std::remove_pointer_t<A>>;
}
template <typename... A, std::size_t... I>
constexpr unsigned writable_mask(std::index_sequence<I...>) {
    return (0u | ... | (writable<A>() ? 1u << I : 0u));
}
template <typename... A>
constexpr lockstep_emu::Entry entry(const char* name, void (*)(A...), void (*caller)(void**)) {
    static_assert(sizeof...(A) <= lockstep_emu::PARAMETERS_MAX, "too many parameters");
    return lockstep_emu::Entry{name, caller, sizeof...(A), {static_cast<unsigned>(sizeof(A))...},
                               writable_mask<A...>(std::index_sequence_for<A...>{})};
}
template <typename... A>
constexpr std::size_t arity(void (*)(A...)) {
    return sizeof...(A);
}
}  // namespace lockstep_emu_device

#define LOCKSTEP_EMU_ENTRY(name)                                                              \
    lockstep_emu_device::entry(#name, &name, [](void** p) {                                   \
        lockstep_emu_device::call(&name, p,                                                  \
                                  std::make_index_sequence<lockstep_emu_device::arity(&name)>{}); \
    })
