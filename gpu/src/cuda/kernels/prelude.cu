// Shared by every kernel source (prepended before compiling): half-precision and bfloat16 values
// as raw 16-bit patterns, converted with PTX instructions, so that no source includes a header
// and any NVRTC compiles them as they are.

typedef unsigned short f16_bits;

// -infinity without math.h.
#define NEG_INFINITY __int_as_float(0xff800000)

// A bfloat16 as its bits; a distinct type so that templates tell it from an IEEE half.
struct bf16_bits {
    unsigned short bits;
};

__device__ __forceinline__ float half_to_float(f16_bits h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    // The CPU emulator's (gpu/cuda-emu/device.h): the same conversion by the host.
    return lockstep_emu_half_to_float(h);
#endif
}

// Round to nearest even, as the CPU backend's `f32_to_f16` does.
__device__ __forceinline__ f16_bits float_to_half(float f) {
#ifdef __CUDA_ARCH__
    f16_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return lockstep_emu_float_to_half(f);
#endif
}

__device__ __forceinline__ float bf16_to_float(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// One weight element as f32, by storage type.
__device__ __forceinline__ float load1(const float* w, long i) { return w[i]; }
__device__ __forceinline__ float load1(const f16_bits* w, long i) { return half_to_float(w[i]); }
__device__ __forceinline__ float load1(const bf16_bits* w, long i) {
    return bf16_to_float(w[i].bits);
}

// GGUF's 32-element block types, kept in their blocks on the device (`weights.rs`,
// `LaunchOptions::block_weights`): each matrix is an array of quants, one 32-bit word per chunk
// of 8 elements (two for Q8_0), element `8c + i`'s quant in bits `4i..4i + 4` of chunk `c`'s
// word (Q8_0: byte `i` of its two), and an array of one scale per block of 32 (Q4_1: the scale's
// half-precision bits and the minimum's in one word, the scale low). A matrix's rows are whole
// blocks, so element `i` of the matrix is in chunk `i / 8` and block `i / 32`, and row `r`
// starts at element `r * k_len`.
struct q4_0_blocks {
    const unsigned int* q;
    const f16_bits* d;
};
struct q4_1_blocks {
    const unsigned int* q;
    const unsigned int* dm;
};
struct q8_0_blocks {
    const uint2* q;
    const f16_bits* d;
};
// The K-quants with their scales as the CPU's dequantizer computes them (f32 products, which half
// precision does not hold): `Q4_K`'s scale and minimum of each 32 (`dm`), `Q6_K`'s scale of each
// 16 (`s`, its quants stored less 32 as signed bytes).
struct q4_k_blocks {
    const unsigned int* q;
    const float2* dm;
};
struct q6_k_blocks {
    const uint2* q;
    const float* s;
};
// The 5-bit types with minimums, a byte a value: `Q5_1` under `Q4_1`'s scale and minimum pairs,
// `Q5_K` under `Q4_K`'s f32 ones.
struct q5_1_blocks {
    const uint2* q;
    const unsigned int* dm;
};
struct q5_k_blocks {
    const uint2* q;
    const float2* dm;
};

// An element from its quant, as the CPU's dequantizer (`gguf/dequant.rs`): `(q - 8) * d`,
// `q * d + m` and `q * d`, each operation rounded on its own (never fused: the CPU rounds the
// product before it adds the minimum), so the values are the ones the CPU dequantizes at load.
__device__ __forceinline__ float q4_0_value(unsigned int nibble, float d) {
    return __fmul_rn((float)((int)nibble - 8), d);
}
__device__ __forceinline__ float q4_1_value(unsigned int nibble, float d, float m) {
    return __fadd_rn(__fmul_rn((float)nibble, d), m);
}
__device__ __forceinline__ float q8_0_value(unsigned int byte, float d) {
    return __fmul_rn((float)(signed char)byte, d);
}
// `d1 * q - m1` and `s * q` (`gguf/dequant.rs`'s `q4_k`, `q6_k`).
__device__ __forceinline__ float q4_k_value(unsigned int nibble, float2 dm) {
    return __fsub_rn(__fmul_rn(dm.x, (float)nibble), dm.y);
}
__device__ __forceinline__ float q6_k_value(unsigned int byte, float s) {
    return __fmul_rn(s, (float)(signed char)byte);
}

__device__ __forceinline__ float load1(q4_0_blocks w, long i) {
    return q4_0_value((w.q[i / 8] >> (4 * (i % 8))) & 15u, half_to_float(w.d[i / 32]));
}
__device__ __forceinline__ float load1(q4_1_blocks w, long i) {
    const unsigned int dm = w.dm[i / 32];
    return q4_1_value((w.q[i / 8] >> (4 * (i % 8))) & 15u, half_to_float(dm & 0xffffu),
                      half_to_float(dm >> 16));
}
__device__ __forceinline__ float load1(q8_0_blocks w, long i) {
    const uint2 chunk = w.q[i / 8];
    const unsigned int word = i % 8 < 4 ? chunk.x : chunk.y;
    return q8_0_value((word >> (8 * (i % 4))) & 0xffu, half_to_float(w.d[i / 32]));
}

__device__ __forceinline__ float load1(q4_k_blocks w, long i) {
    return q4_k_value((w.q[i / 8] >> (4 * (i % 8))) & 15u, w.dm[i / 32]);
}
__device__ __forceinline__ unsigned int byte_at(const uint2* q, long i) {
    const uint2 chunk = q[i / 8];
    return ((i % 8 < 4 ? chunk.x : chunk.y) >> (8 * (i % 4))) & 0xffu;
}
__device__ __forceinline__ float load1(q5_1_blocks w, long i) {
    const unsigned int dm = w.dm[i / 32];
    return q4_1_value(byte_at(w.q, i), half_to_float(dm & 0xffffu), half_to_float(dm >> 16));
}
__device__ __forceinline__ float load1(q5_k_blocks w, long i) {
    return q4_k_value(byte_at(w.q, i), w.dm[i / 32]);
}
__device__ __forceinline__ float load1(q6_k_blocks w, long i) {
    const uint2 chunk = w.q[i / 8];
    const unsigned int word = i % 8 < 4 ? chunk.x : chunk.y;
    return q6_k_value((word >> (8 * (i % 4))) & 0xffu, w.s[i / 16]);
}

// Eight consecutive weight elements from `w + i`, `i` a multiple of 8 and the row 16-byte
// aligned (the caller checks): one or two vector loads.
__device__ __forceinline__ void load8(const float* w, long i, float out[8]) {
    float4 a = *(const float4*)(w + i);
    float4 b = *(const float4*)(w + i + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void unpack2(unsigned int v, float* out, bool brain) {
    unsigned short lo = (unsigned short)(v & 0xffffu), hi = (unsigned short)(v >> 16);
    out[0] = brain ? bf16_to_float(lo) : half_to_float(lo);
    out[1] = brain ? bf16_to_float(hi) : half_to_float(hi);
}

// Eight 16-bit values loaded as one 16-byte vector, as f32 (`brain`: bfloat16, else IEEE half).
__device__ __forceinline__ void unpack8(uint4 v, float out[8], bool brain) {
    unpack2(v.x, out, brain); unpack2(v.y, out + 2, brain);
    unpack2(v.z, out + 4, brain); unpack2(v.w, out + 6, brain);
}

__device__ __forceinline__ void load8(const f16_bits* w, long i, float out[8]) {
    unpack8(*(const uint4*)(w + i), out, false);
}

__device__ __forceinline__ void load8(const bf16_bits* w, long i, float out[8]) {
    unpack8(*(const uint4*)(w + i), out, true);
}

// The sum over a warp by xor butterfly. Addition commutes exactly, so every lane ends with the
// same bits, and the order depends on nothing but the lane layout.
__device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

// Programmatic dependent launch (sm_90 on; `launch.rs` launches every kernel after a step's first
// so when `LaunchOptions::dependent_launches` is set). Such a kernel may start while the kernel
// before it still runs: before `wait_for_inputs()` it may read only what no kernel of the step
// writes (the weights, and the step's inputs, copied before its first kernel began), and write
// nothing. `allow_next_kernel()` lets the next kernel start likewise, once every block of this
// one has called it. Launched plainly, or compiled for an older architecture, both do nothing:
// the stream already orders the kernels.
__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#elif !defined(__CUDA_ARCH__)
    // The CPU emulator, which holds a dependent launch to the contract above.
    lockstep_emu_wait_for_inputs();
#endif
}

__device__ __forceinline__ void allow_next_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Starts reading `bytes` from `p` into L2 and goes on (a hint: nothing waits for it, and it
// changes no value read later). `p` 16-byte aligned, `bytes` a multiple of 16.
__device__ __forceinline__ void prefetch_to_l2(const void* p, unsigned int bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// RoPE as the CPU's `forward::rope`, shared by `rope_kv_write` and the attention that folds it
// in (`paged_attention_rope_*`), so that both compute the same bits. Pair `i`'s angle is the
// CPU's running product `position * theta_scale * ...` (i factors), repeated up to the pair so
// the bits are the sequential loop's, divided by the pair's frequency factor when the model has
// them (Llama 3 rope scaling).
__device__ __forceinline__ float rope_angle(int position, float theta_scale,
                                            const float* freq_factors, int i) {
    float theta = (float)position;
    for (int j = 0; j < i; j++) theta *= theta_scale;
    return freq_factors ? theta / freq_factors[i] : theta;
}

// The elements pair `i` of a head of `d` rotates: Hugging Face's `(i, i + d/2)` with `halves`,
// GGUF's adjacent `(2i, 2i + 1)` without.
__device__ __forceinline__ int rope_first(int i, int d, int halves) { return halves ? i : 2 * i; }
__device__ __forceinline__ int rope_second(int i, int d, int halves) {
    return halves ? i + d / 2 : 2 * i + 1;
}

// The rotation fused as the CPU's: `x0 * cos - x1 * sin`, `x0 * sin + x1 * cos`.
__device__ __forceinline__ void rope_rotate(float x0, float x1, float c, float s, float* y0,
                                            float* y1) {
    *y0 = fmaf(x0, c, -(x1 * s));
    *y1 = fmaf(x0, s, x1 * c);
}
