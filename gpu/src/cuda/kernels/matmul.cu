// The products with weight matrices: `y[t][r] (+)= sum_k w[r][k] * x[t][k]`, for `tokens` rows
// of `x`, `w` stored as f32, f16 or bf16; and the same product over the gate and up matrices
// with SwiGLU fused into its end.
//
// Batch invariance by construction: one warp owns weight row `r` (or a few consecutive rows,
// each computed as if alone); lane `l` takes the 8-element chunks starting at `k = 8 l + 256 i`,
// accumulating each chunk's elements in order into one f32 fused chain per token, and the lanes
// are summed by `warp_sum`'s fixed butterfly. That order depends on `K` alone: never on how many
// tokens the step has, which tile a token falls in, how many rows its warp has, or the device's
// SM count. Tokens go through in tiles of `TILE` so that a weight chunk loaded once
// serves several tokens. (cuBLAS is not used: it picks its algorithm, split-K included, by the
// shape, so a row's bits would change with the batch size.)
//
// At one token a step reads every weight once and does little else, so a lane requests a batch
// of its chunks before it uses any: several 16-byte loads per lane are in flight at once, which
// is what keeps HBM busy on the short rows (K = 2048) of a decode step, and the SwiGLU product
// walks its gate and up rows together. Each chain's order stays the chunks' order.
//
// With a dependent launch (prelude.cu), each warp starts its rows on their way into L2 before it
// waits for the kernel before: a decode step's products read their weights while the norm or the
// attention before them finishes. The prefetch changes no value.
//
// `accumulate` adds into `y` (the residual stream after the attention output and down
// projections: the residual add fused into the product).

#define WARPS 4
#define TILE 8

// The RMSNorm before a product, folded into it (`norm_weight` not null; `launch.rs` folds it at
// up to TILE tokens a step, where a separate norm kernel is one block of latency per layer): `x`
// is then the residual stream and each token's values enter the dot products as
// `(x * scale) * norm_weight`, the bits rms_norm.cu writes. Each block computes the scales of
// its tile's tokens itself, walking rms_norm.cu's tree of NORM_THREADS (256) threads with its
// 128: thread `i` takes the partial sums of threads `i` and `i + 128`, their warps' butterflies
// are the same shuffles, and the eight warp sums are added in rms_norm.cu's order. So a fused
// product's outputs are the unfused pair's, bit for bit, and folding by step size cannot make a
// request's bits depend on its batch.
#define NORM_THREADS 256

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// `scales[t]` for tokens `t0..t0 + live` of `x` (rows of `k_len`); every thread of the block
// calls it (it synchronizes the block), and `scales` is ready when it returns.
__device__ void norm_scales(const float* x, int k_len, float eps, int t0, int live,
                            double partial[TILE][NORM_THREADS / 32], float scales[TILE]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // The previous tile's products may still be reading `scales`.
    __syncthreads();
    for (int t = 0; t < live; t++) {
        const float* in = x + (long)(t0 + t) * k_len;
        double low = 0.0, high = 0.0;
        for (int i = threadIdx.x; i < k_len; i += NORM_THREADS) {
            const float v = in[i];
            low += (double)(v * v);
        }
        for (int i = threadIdx.x + NORM_THREADS / 2; i < k_len; i += NORM_THREADS) {
            const float v = in[i];
            high += (double)(v * v);
        }
        low = warp_sum_f64(low);
        high = warp_sum_f64(high);
        if (lane == 0) {
            partial[t][warp] = low;
            partial[t][NORM_THREADS / 64 + warp] = high;
        }
    }
    __syncthreads();
    if (threadIdx.x < live) {
        double total = 0.0;
#pragma unroll
        for (int w = 0; w < NORM_THREADS / 32; w++) total += partial[threadIdx.x][w];
        const float mean = (float)(total / (double)k_len);
        scales[threadIdx.x] = 1.0f / sqrtf(mean + eps);
    }
    __syncthreads();
}

// Where row `r` of a matrix starts: a pointer to its elements, or its blocks' quants and scales.
template <typename T>
__device__ __forceinline__ const T* row_start(const T* w, long r, int k_len) {
    return w + r * k_len;
}
__device__ __forceinline__ q4_0_blocks row_start(q4_0_blocks w, long r, int k_len) {
    return {w.q + r * k_len / 8, w.d + r * k_len / 32};
}
__device__ __forceinline__ q4_1_blocks row_start(q4_1_blocks w, long r, int k_len) {
    return {w.q + r * k_len / 8, w.dm + r * k_len / 32};
}
__device__ __forceinline__ q8_0_blocks row_start(q8_0_blocks w, long r, int k_len) {
    return {w.q + r * k_len / 8, w.d + r * k_len / 32};
}
__device__ __forceinline__ q4_k_blocks row_start(q4_k_blocks w, long r, int k_len) {
    return {w.q + r * k_len / 8, w.dm + r * k_len / 32};
}
__device__ __forceinline__ q5_1_blocks row_start(q5_1_blocks w, long r, int k_len) {
    return {w.q + r * k_len / 8, w.dm + r * k_len / 32};
}
__device__ __forceinline__ q5_k_blocks row_start(q5_k_blocks w, long r, int k_len) {
    return {w.q + r * k_len / 8, w.dm + r * k_len / 32};
}
__device__ __forceinline__ q6_k_blocks row_start(q6_k_blocks w, long r, int k_len) {
    return {w.q + r * k_len / 8, w.s + r * k_len / 16};
}

// Starts a row of `k_len` elements on its way into L2 (the vector path's rows: 16-byte
// aligned). A block row's scales need not be: their span is rounded out to 16 bytes, which
// `weights.rs` pads each scale array for.
__device__ __forceinline__ void prefetch_span(const void* begin, const void* end) {
    const unsigned long b = (unsigned long)begin & ~15ul, e = ((unsigned long)end + 15) & ~15ul;
    prefetch_to_l2((const void*)b, (unsigned int)(e - b));
}
template <typename T>
__device__ __forceinline__ void prefetch_row(const T* row, int k_len) {
    prefetch_to_l2(row, k_len * sizeof(T));
}
__device__ __forceinline__ void prefetch_row(q4_0_blocks row, int k_len) {
    prefetch_to_l2(row.q, k_len / 2);
    prefetch_span(row.d, row.d + k_len / 32);
}
__device__ __forceinline__ void prefetch_row(q4_1_blocks row, int k_len) {
    prefetch_to_l2(row.q, k_len / 2);
    prefetch_span(row.dm, row.dm + k_len / 32);
}
__device__ __forceinline__ void prefetch_row(q8_0_blocks row, int k_len) {
    prefetch_to_l2(row.q, k_len);
    prefetch_span(row.d, row.d + k_len / 32);
}
__device__ __forceinline__ void prefetch_row(q4_k_blocks row, int k_len) {
    prefetch_to_l2(row.q, k_len / 2);
    prefetch_span(row.dm, row.dm + k_len / 32);
}
__device__ __forceinline__ void prefetch_row(q5_1_blocks row, int k_len) {
    prefetch_to_l2(row.q, k_len);
    prefetch_span(row.dm, row.dm + k_len / 32);
}
__device__ __forceinline__ void prefetch_row(q5_k_blocks row, int k_len) {
    prefetch_to_l2(row.q, k_len);
    prefetch_span(row.dm, row.dm + k_len / 32);
}
__device__ __forceinline__ void prefetch_row(q6_k_blocks row, int k_len) {
    prefetch_to_l2(row.q, k_len);
    prefetch_span(row.s, row.s + k_len / 16);
}

// Eight weights as loaded (the chunk at element `k` of a row, `k` a multiple of 8; a dense
// row's chunks are 16-byte aligned): registers held until the batch's loads are all issued,
// then unpacked to f32, each element as `load1` gives it.
template <typename R>
struct Chunk;
template <>
struct Chunk<const float*> {
    float4 a, b;
};
template <>
struct Chunk<const f16_bits*> {
    uint4 v;
};
template <>
struct Chunk<const bf16_bits*> {
    uint4 v;
};
template <>
struct Chunk<q4_0_blocks> {
    unsigned int q;
    f16_bits d;
};
template <>
struct Chunk<q4_1_blocks> {
    unsigned int q, dm;
};
template <>
struct Chunk<q8_0_blocks> {
    uint2 q;
    f16_bits d;
};
template <>
struct Chunk<q4_k_blocks> {
    unsigned int q;
    float2 dm;
};
template <>
struct Chunk<q5_1_blocks> {
    uint2 q;
    unsigned int dm;
};
template <>
struct Chunk<q5_k_blocks> {
    uint2 q;
    float2 dm;
};
template <>
struct Chunk<q6_k_blocks> {
    uint2 q;
    float s;
};

// How many of its chunks a lane requests before it uses any (divided among its rows): 8 of a
// dense row (128 to 256 bytes) or of a Q8_0 row (64 bytes of quants), 16 of a Q4 row (64 bytes
// of quants; its 8 would be half that in flight). A row of 2048 elements is 8 chunks a lane, so
// the down product's rows (8192) are where 16 differ from 8.
template <typename R>
struct InFlight {
    static constexpr int CHUNKS = 8;
};
template <>
struct InFlight<q4_0_blocks> {
    static constexpr int CHUNKS = 16;
};
template <>
struct InFlight<q4_1_blocks> {
    static constexpr int CHUNKS = 16;
};
template <>
struct InFlight<q4_k_blocks> {
    static constexpr int CHUNKS = 16;
};

__device__ __forceinline__ void load_chunk(const float* row, int k, Chunk<const float*>& c) {
    c.a = *(const float4*)(row + k);
    c.b = *(const float4*)(row + k + 4);
}
template <typename T>
__device__ __forceinline__ void load_chunk(const T* row, int k, Chunk<const T*>& c) {
    c.v = *(const uint4*)(row + k);
}
__device__ __forceinline__ void load_chunk(q4_0_blocks row, int k, Chunk<q4_0_blocks>& c) {
    c.q = row.q[k / 8];
    c.d = row.d[k / 32];
}
__device__ __forceinline__ void load_chunk(q4_1_blocks row, int k, Chunk<q4_1_blocks>& c) {
    c.q = row.q[k / 8];
    c.dm = row.dm[k / 32];
}
__device__ __forceinline__ void load_chunk(q8_0_blocks row, int k, Chunk<q8_0_blocks>& c) {
    c.q = row.q[k / 8];
    c.d = row.d[k / 32];
}
__device__ __forceinline__ void load_chunk(q4_k_blocks row, int k, Chunk<q4_k_blocks>& c) {
    c.q = row.q[k / 8];
    c.dm = row.dm[k / 32];
}
__device__ __forceinline__ void load_chunk(q5_1_blocks row, int k, Chunk<q5_1_blocks>& c) {
    c.q = row.q[k / 8];
    c.dm = row.dm[k / 32];
}
__device__ __forceinline__ void load_chunk(q5_k_blocks row, int k, Chunk<q5_k_blocks>& c) {
    c.q = row.q[k / 8];
    c.dm = row.dm[k / 32];
}
// A chunk of 8 lies inside one 16 (chunks start at multiples of 8).
__device__ __forceinline__ void load_chunk(q6_k_blocks row, int k, Chunk<q6_k_blocks>& c) {
    c.q = row.q[k / 8];
    c.s = row.s[k / 16];
}

__device__ __forceinline__ void unpack_chunk(const Chunk<const float*>& c, float out[8]) {
    out[0] = c.a.x; out[1] = c.a.y; out[2] = c.a.z; out[3] = c.a.w;
    out[4] = c.b.x; out[5] = c.b.y; out[6] = c.b.z; out[7] = c.b.w;
}
__device__ __forceinline__ void unpack_chunk(const Chunk<const f16_bits*>& c, float out[8]) {
    unpack8(c.v, out, false);
}
__device__ __forceinline__ void unpack_chunk(const Chunk<const bf16_bits*>& c, float out[8]) {
    unpack8(c.v, out, true);
}
__device__ __forceinline__ void unpack_chunk(const Chunk<q4_0_blocks>& c, float out[8]) {
    const float d = half_to_float(c.d);
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = q4_0_value((c.q >> (4 * i)) & 15u, d);
}
__device__ __forceinline__ void unpack_chunk(const Chunk<q4_1_blocks>& c, float out[8]) {
    const float d = half_to_float(c.dm & 0xffffu), m = half_to_float(c.dm >> 16);
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = q4_1_value((c.q >> (4 * i)) & 15u, d, m);
}
__device__ __forceinline__ void unpack_chunk(const Chunk<q8_0_blocks>& c, float out[8]) {
    const float d = half_to_float(c.d);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        out[i] = q8_0_value(((i < 4 ? c.q.x : c.q.y) >> (8 * (i % 4))) & 0xffu, d);
    }
}

__device__ __forceinline__ void unpack_chunk(const Chunk<q4_k_blocks>& c, float out[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = q4_k_value((c.q >> (4 * i)) & 15u, c.dm);
}
__device__ __forceinline__ void unpack_chunk(const Chunk<q5_1_blocks>& c, float out[8]) {
    const float d = half_to_float(c.dm & 0xffffu), m = half_to_float(c.dm >> 16);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        out[i] = q4_1_value(((i < 4 ? c.q.x : c.q.y) >> (8 * (i % 4))) & 0xffu, d, m);
    }
}
__device__ __forceinline__ void unpack_chunk(const Chunk<q5_k_blocks>& c, float out[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        out[i] = q4_k_value(((i < 4 ? c.q.x : c.q.y) >> (8 * (i % 4))) & 0xffu, c.dm);
    }
}
__device__ __forceinline__ void unpack_chunk(const Chunk<q6_k_blocks>& c, float out[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        out[i] = q6_k_value(((i < 4 ? c.q.x : c.q.y) >> (8 * (i % 4))) & 0xffu, c.s);
    }
}

// Eight f32 values from `p`: two 16-byte loads with `VEC` (then `p` is 16-byte aligned).
template <bool VEC>
__device__ __forceinline__ void load8_f32(const float* p, float out[8]) {
    if (VEC) {
        load8(p, 0, out);
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) out[j] = p[j];
    }
}

// What the product reads of the activations: `x` as it is, or with the folded RMSNorm, the
// residual stream and what normalizes it (`norm` null: not folded).
struct Input {
    const float* x;
    const float* norm;
    const float* scales;
};

// Adds weight chunks `wv` (8 elements starting at `k` of each of `ROWS` rows) times tokens
// `t0..t0 + live` of `x` into `dots`, element by element in order; a token's 8 elements are
// loaded once for all the rows. `VEC`: `k_len` is a multiple of 8, so each token's 8 elements
// are 16-byte aligned (the buffers come from cudaMalloc) and load as two float4.
template <bool VEC, int ROWS>
__device__ __forceinline__ void chunk_dots(const float wv[ROWS][8], Input in, int k_len,
                                           int k, int t0, int live, float dots[ROWS][TILE]) {
    float nv[8];
    if (in.norm) load8_f32<VEC>(in.norm + k, nv);
    // Conditions on `t < live` rather than breaks, so the tile unrolls and `dots` stays in
    // registers; a token's arithmetic is the same whichever slot of the tile it has.
#pragma unroll
    for (int t = 0; t < TILE; t++) {
        if (t < live) {
            float xv[8];
            load8_f32<VEC>(in.x + (long)(t0 + t) * k_len + k, xv);
            if (in.norm) {
                const float scale = in.scales[t];
#pragma unroll
                for (int j = 0; j < 8; j++) xv[j] = (xv[j] * scale) * nv[j];
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
#pragma unroll
                for (int j = 0; j < 8; j++) dots[r][t] = fmaf(wv[r][j], xv[j], dots[r][t]);
            }
        }
    }
}

// The dot products of `ROWS` weight rows with tokens `t0..t0 + live` of `x`, summed over the
// warp: every lane ends with `dots[r][t]` for each row and live `t`. Lane `l`'s chain per row
// and token: its whole chunks in order, then, for the one lane whose next chunk it is, the
// row's last `k_len % 8` elements. The rows go through together, so their loads are in flight
// together; each row's arithmetic is what it would be alone.
template <typename R, bool VEC, int ROWS>
__device__ __forceinline__ void row_dots(const R* row, Input in, int k_len,
                                         int t0, int live, float dots[ROWS][TILE]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int t = 0; t < TILE; t++) dots[r][t] = 0.0f;
    }
    const int whole = k_len - k_len % 8;
    if (VEC) {
        // A batch of chunks (of a dense row 8 of one row, 4 of two, 2 of four; `InFlight`) is
        // requested before any is used, so a lane has that many loads in flight: a 2048-wide
        // f16 row is one batch, one round trip to memory. (Loading and using chunk by chunk,
        // ptxas kept one weight load in flight a lane, and the products read HBM at a third of
        // its bandwidth.)
        constexpr int BATCH = InFlight<R>::CHUNKS / ROWS;
        for (int k0 = lane * 8; k0 < whole; k0 += 256 * BATCH) {
            Chunk<R> raw[BATCH][ROWS];
#pragma unroll
            for (int b = 0; b < BATCH; b++) {
                if (k0 + 256 * b < whole) {
#pragma unroll
                    for (int r = 0; r < ROWS; r++) load_chunk(row[r], k0 + 256 * b, raw[b][r]);
                }
            }
#pragma unroll
            for (int b = 0; b < BATCH; b++) {
                const int k = k0 + 256 * b;
                if (k < whole) {
                    float wv[ROWS][8];
#pragma unroll
                    for (int r = 0; r < ROWS; r++) unpack_chunk(raw[b][r], wv[r]);
                    chunk_dots<true, ROWS>(wv, in, k_len, k, t0, live, dots);
                }
            }
        }
    } else {
        for (int k = lane * 8; k < whole; k += 256) {
            float wv[ROWS][8];
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
#pragma unroll
                for (int j = 0; j < 8; j++) wv[r][j] = load1(row[r], k + j);
            }
            chunk_dots<false, ROWS>(wv, in, k_len, k, t0, live, dots);
        }
        if (whole < k_len && lane == (whole / 8) % 32) {
            // Unrolled over the tile and the rows with constant indices, so `dots` stays in
            // registers (indexed by a loop variable, it went to the stack).
#pragma unroll
            for (int t = 0; t < TILE; t++) {
                if (t < live) {
                    const float* xt = in.x + (long)(t0 + t) * k_len;
#pragma unroll
                    for (int r = 0; r < ROWS; r++) {
                        for (int k = whole; k < k_len; k++) {
                            const float v = in.norm ? (xt[k] * in.scales[t]) * in.norm[k] : xt[k];
                            dots[r][t] = fmaf(load1(row[r], k), v, dots[r][t]);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            if (t < live) dots[r][t] = warp_sum(dots[r][t]);
        }
    }
}

// `OUT` consecutive output rows a warp (`launch.rs` takes 1, or with wide products 4 on steps of
// more than TILE tokens, where each activation load then serves 4 rows instead of 1). A row's
// chain is `row_dots`'s for that row whatever `OUT` is, so the bits do not depend on it.
template <typename M, bool VEC, int OUT>
__device__ void matmul(M w, const float* x, const float* norm, float eps, float* y,
                       int rows, int k_len, int tokens, int accumulate) {
    __shared__ double partial[TILE][NORM_THREADS / 32];
    __shared__ float scales[TILE];
    const int lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x * WARPS + threadIdx.x / 32) * OUT;
    // A warp past the last row still takes its part in the block's norm scales.
    const bool has_row = r0 < rows;
    allow_next_kernel();
    // Rows past the end read the last row again and are not written.
    using R = decltype(row_start(w, 0, 0));
    R row[OUT];
#pragma unroll
    for (int o = 0; o < OUT; o++) {
        row[o] = row_start(w, min(r0 + o, rows - 1), k_len);
        if (VEC && lane == 0 && r0 + o < rows) prefetch_row(row[o], k_len);
    }
    wait_for_inputs();
    const Input in = {x, norm, scales};
    for (int t0 = 0; t0 < tokens; t0 += TILE) {
        const int live = min(TILE, tokens - t0);
        if (norm) norm_scales(x, k_len, eps, t0, live, partial, scales);
        if (!has_row) continue;
        float dots[OUT][TILE];
        row_dots<R, VEC, OUT>(row, in, k_len, t0, live, dots);
        if (lane == 0) {
#pragma unroll
            for (int o = 0; o < OUT; o++) {
#pragma unroll
                for (int t = 0; t < TILE; t++) {
                    if (t < live && r0 + o < rows) {
                        float* out = y + (long)(t0 + t) * rows + r0 + o;
                        *out = accumulate ? *out + dots[o][t] : dots[o][t];
                    }
                }
            }
        }
    }
}

// `w` holds the gate matrix's `rows` rows and then the up matrix's: `y[t][r]` is
// `silu(gate_r . x_t) * (up_r . x_t)`, as the CPU's `numerics::swiglu`: `g / (1 + exp(-g)) * u`
// (the precise `expf`; the CPU's ggml exponential is within 1.5 ulp of it). Each product's bits
// are those of `matmul` over the matrix alone. `OUT` output rows a warp (1, or 2 wide): the
// gate's rows and then the up's are its `row_dots` rows.
template <typename M, bool VEC, int OUT>
__device__ void matmul_swiglu(M w, const float* x, const float* norm, float eps, float* y,
                              int rows, int k_len, int tokens) {
    __shared__ double partial[TILE][NORM_THREADS / 32];
    __shared__ float scales[TILE];
    const int lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x * WARPS + threadIdx.x / 32) * OUT;
    const bool has_row = r0 < rows;
    allow_next_kernel();
    using R = decltype(row_start(w, 0, 0));
    R gate_up[2 * OUT];
#pragma unroll
    for (int o = 0; o < OUT; o++) {
        const long kept = min(r0 + o, rows - 1);
        gate_up[o] = row_start(w, kept, k_len);
        gate_up[OUT + o] = row_start(w, rows + kept, k_len);
        if (VEC && lane == 0 && r0 + o < rows) {
            prefetch_row(gate_up[o], k_len);
            prefetch_row(gate_up[OUT + o], k_len);
        }
    }
    wait_for_inputs();
    const Input in = {x, norm, scales};
    for (int t0 = 0; t0 < tokens; t0 += TILE) {
        const int live = min(TILE, tokens - t0);
        if (norm) norm_scales(x, k_len, eps, t0, live, partial, scales);
        if (!has_row) continue;
        float dots[2 * OUT][TILE];
        row_dots<R, VEC, 2 * OUT>(gate_up, in, k_len, t0, live, dots);
        if (lane == 0) {
#pragma unroll
            for (int o = 0; o < OUT; o++) {
#pragma unroll
                for (int t = 0; t < TILE; t++) {
                    if (t < live && r0 + o < rows) {
                        const float g = dots[o][t], u = dots[OUT + o][t];
                        y[(long)(t0 + t) * rows + r0 + o] = (g / (1.0f + expf(0.0f - g))) * u;
                    }
                }
            }
        }
    }
}

// The entry points per storage type and rows a warp; each picks the vector path once, by `k_len`
// (the same for every launch over a given matrix, so a row's order never changes between steps).
// The wide ones have only the vector path (`launch.rs` takes them only for rows that are a
// multiple of 8 long): the scalar one, unrolled over their rows, would double the module. A
// block-typed matrix's rows are whole blocks of 32, so its entry points have only the vector
// path too; each takes the matrix as its quants and its scales.
#define WIDE_OUT 4
#define WIDE_SWIGLU_OUT 2

extern "C" __global__ void matmul_f32(const float* w, const float* x, const float* norm,
        float eps, float* y, int rows, int k_len, int tokens, int accumulate) {
    if (k_len % 8 == 0) matmul<const float*, true, 1>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
    else matmul<const float*, false, 1>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
}

extern "C" __global__ void matmul_f16(const f16_bits* w, const float* x, const float* norm,
        float eps, float* y, int rows, int k_len, int tokens, int accumulate) {
    if (k_len % 8 == 0) matmul<const f16_bits*, true, 1>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
    else matmul<const f16_bits*, false, 1>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
}

extern "C" __global__ void matmul_bf16(const bf16_bits* w, const float* x, const float* norm,
        float eps, float* y, int rows, int k_len, int tokens, int accumulate) {
    if (k_len % 8 == 0) matmul<const bf16_bits*, true, 1>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
    else matmul<const bf16_bits*, false, 1>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
}

extern "C" __global__ void matmul_wide_f32(const float* w, const float* x, const float* norm,
        float eps, float* y, int rows, int k_len, int tokens, int accumulate) {
    if (k_len % 8 == 0) matmul<const float*, true, WIDE_OUT>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_f16(const f16_bits* w, const float* x, const float* norm,
        float eps, float* y, int rows, int k_len, int tokens, int accumulate) {
    if (k_len % 8 == 0) matmul<const f16_bits*, true, WIDE_OUT>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_bf16(const bf16_bits* w, const float* x, const float* norm,
        float eps, float* y, int rows, int k_len, int tokens, int accumulate) {
    if (k_len % 8 == 0) matmul<const bf16_bits*, true, WIDE_OUT>(w, x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_q4_0(const unsigned int* q, const f16_bits* d,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 32 == 0) matmul<q4_0_blocks, true, 1>(q4_0_blocks{q, d},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_q4_1(const unsigned int* q, const unsigned int* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 32 == 0) matmul<q4_1_blocks, true, 1>(q4_1_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_q8_0(const uint2* q, const f16_bits* d,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 32 == 0) matmul<q8_0_blocks, true, 1>(q8_0_blocks{q, d},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_q4_k(const unsigned int* q, const float2* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 256 == 0) matmul<q4_k_blocks, true, 1>(q4_k_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_q6_k(const uint2* q, const float* s,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 256 == 0) matmul<q6_k_blocks, true, 1>(q6_k_blocks{q, s},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_q5_1(const uint2* q, const unsigned int* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 32 == 0) matmul<q5_1_blocks, true, 1>(q5_1_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_q5_k(const uint2* q, const float2* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 256 == 0) matmul<q5_k_blocks, true, 1>(q5_k_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_q4_0(const unsigned int* q, const f16_bits* d,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 32 == 0) matmul<q4_0_blocks, true, WIDE_OUT>(q4_0_blocks{q, d},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_q4_1(const unsigned int* q, const unsigned int* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 32 == 0) matmul<q4_1_blocks, true, WIDE_OUT>(q4_1_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_q8_0(const uint2* q, const f16_bits* d,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 32 == 0) matmul<q8_0_blocks, true, WIDE_OUT>(q8_0_blocks{q, d},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_q4_k(const unsigned int* q, const float2* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 256 == 0) matmul<q4_k_blocks, true, WIDE_OUT>(q4_k_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_q6_k(const uint2* q, const float* s,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 256 == 0) matmul<q6_k_blocks, true, WIDE_OUT>(q6_k_blocks{q, s},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_q5_1(const uint2* q, const unsigned int* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 32 == 0) matmul<q5_1_blocks, true, WIDE_OUT>(q5_1_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_wide_q5_k(const uint2* q, const float2* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len,
        int tokens, int accumulate) {
    if (k_len % 256 == 0) matmul<q5_k_blocks, true, WIDE_OUT>(q5_k_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens, accumulate);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_f32(const float* w, const float* x,
        const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 8 == 0) matmul_swiglu<const float*, true, 1>(w, x, norm, eps, y, rows, k_len, tokens);
    else matmul_swiglu<const float*, false, 1>(w, x, norm, eps, y, rows, k_len, tokens);
}

extern "C" __global__ void matmul_swiglu_f16(const f16_bits* w, const float* x,
        const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 8 == 0) matmul_swiglu<const f16_bits*, true, 1>(w, x, norm, eps, y, rows, k_len, tokens);
    else matmul_swiglu<const f16_bits*, false, 1>(w, x, norm, eps, y, rows, k_len, tokens);
}

extern "C" __global__ void matmul_swiglu_bf16(const bf16_bits* w, const float* x,
        const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 8 == 0) matmul_swiglu<const bf16_bits*, true, 1>(w, x, norm, eps, y, rows, k_len, tokens);
    else matmul_swiglu<const bf16_bits*, false, 1>(w, x, norm, eps, y, rows, k_len, tokens);
}

extern "C" __global__ void matmul_swiglu_wide_f32(const float* w, const float* x,
        const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 8 == 0) matmul_swiglu<const float*, true, WIDE_SWIGLU_OUT>(w, x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_f16(const f16_bits* w, const float* x,
        const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 8 == 0) matmul_swiglu<const f16_bits*, true, WIDE_SWIGLU_OUT>(w, x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_bf16(const bf16_bits* w, const float* x,
        const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 8 == 0) matmul_swiglu<const bf16_bits*, true, WIDE_SWIGLU_OUT>(w, x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_q4_0(const unsigned int* q, const f16_bits* d,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 32 == 0) matmul_swiglu<q4_0_blocks, true, 1>(q4_0_blocks{q, d},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_q4_1(const unsigned int* q, const unsigned int* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 32 == 0) matmul_swiglu<q4_1_blocks, true, 1>(q4_1_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_q8_0(const uint2* q, const f16_bits* d,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 32 == 0) matmul_swiglu<q8_0_blocks, true, 1>(q8_0_blocks{q, d},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_q4_k(const unsigned int* q, const float2* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 256 == 0) matmul_swiglu<q4_k_blocks, true, 1>(q4_k_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_q6_k(const uint2* q, const float* s,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 256 == 0) matmul_swiglu<q6_k_blocks, true, 1>(q6_k_blocks{q, s},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_q5_1(const uint2* q, const unsigned int* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 32 == 0) matmul_swiglu<q5_1_blocks, true, 1>(q5_1_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_q5_k(const uint2* q, const float2* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 256 == 0) matmul_swiglu<q5_k_blocks, true, 1>(q5_k_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_q4_0(const unsigned int* q, const f16_bits* d,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 32 == 0) matmul_swiglu<q4_0_blocks, true, WIDE_SWIGLU_OUT>(q4_0_blocks{q, d},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_q4_1(const unsigned int* q, const unsigned int* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 32 == 0) matmul_swiglu<q4_1_blocks, true, WIDE_SWIGLU_OUT>(q4_1_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_q8_0(const uint2* q, const f16_bits* d,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 32 == 0) matmul_swiglu<q8_0_blocks, true, WIDE_SWIGLU_OUT>(q8_0_blocks{q, d},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_q4_k(const unsigned int* q, const float2* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 256 == 0) matmul_swiglu<q4_k_blocks, true, WIDE_SWIGLU_OUT>(q4_k_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_q6_k(const uint2* q, const float* s,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 256 == 0) matmul_swiglu<q6_k_blocks, true, WIDE_SWIGLU_OUT>(q6_k_blocks{q, s},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_q5_1(const uint2* q, const unsigned int* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 32 == 0) matmul_swiglu<q5_1_blocks, true, WIDE_SWIGLU_OUT>(q5_1_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}

extern "C" __global__ void matmul_swiglu_wide_q5_k(const uint2* q, const float2* dm,
        const float* x, const float* norm, float eps, float* y, int rows, int k_len, int tokens) {
    if (k_len % 256 == 0) matmul_swiglu<q5_k_blocks, true, WIDE_SWIGLU_OUT>(q5_k_blocks{q, dm},
                                                x, norm, eps, y, rows, k_len, tokens);
    else __trap();
}
