// The products with weight matrices: `y[t][r] (+)= sum_k w[r][k] * x[t][k]`, for `tokens` rows
// of `x`, `w` stored as f32, f16 or bf16.
//
// Batch invariance by construction: one warp owns weight row `r`; lane `l` takes the 8-element
// chunks starting at `k = 8 l + 256 i`, accumulating each chunk's elements in order into one f32
// fused chain per token, and the lanes are summed by `warp_sum`'s fixed butterfly. That order
// depends on `K` alone: never on how many tokens the step has, which tile a token falls in, or
// the device's SM count. Tokens go through in tiles of `TILE` so that a weight chunk loaded once
// serves several tokens. (cuBLAS is not used: it picks its algorithm, split-K included, by the
// shape, so a row's bits would change with the batch size.)
//
// `accumulate` adds into `y` (the residual stream after the attention output and down
// projections: the residual add fused into the product).

#define WARPS 4
#define TILE 8

template <typename T>
__device__ void matmul(const T* w, const float* x, float* y, int rows, int k_len, int tokens,
                       int accumulate) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;
    const T* row = w + (long)r * k_len;
    const bool vector = (k_len % 8) == 0;
    for (int t0 = 0; t0 < tokens; t0 += TILE) {
        // Conditions on `t < live` rather than breaks, so the tile unrolls and `acc` stays in
        // registers; a token's arithmetic is the same whichever slot of the tile it has.
        const int live = min(TILE, tokens - t0);
        float acc[TILE];
#pragma unroll
        for (int t = 0; t < TILE; t++) acc[t] = 0.0f;
        for (int k = lane * 8; k < k_len; k += 256) {
            float wv[8];
            if (vector) {
                load8(row, k, wv);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) wv[j] = (k + j < k_len) ? load1(row, k + j) : 0.0f;
            }
            const int n = (k + 8 <= k_len) ? 8 : k_len - k;
#pragma unroll
            for (int t = 0; t < TILE; t++) {
                if (t < live) {
                    const float* xt = x + (long)(t0 + t) * k_len + k;
                    if (n == 8) {
#pragma unroll
                        for (int j = 0; j < 8; j++) acc[t] = fmaf(wv[j], xt[j], acc[t]);
                    } else {
                        for (int j = 0; j < n; j++) acc[t] = fmaf(wv[j], xt[j], acc[t]);
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < TILE; t++) {
            if (t < live) {
                const float sum = warp_sum(acc[t]);
                if (lane == 0) {
                    float* out = y + (long)(t0 + t) * rows + r;
                    *out = accumulate ? *out + sum : sum;
                }
            }
        }
    }
}

extern "C" __global__ void matmul_f32(const float* w, const float* x, float* y, int rows,
                                      int k_len, int tokens, int accumulate) {
    matmul(w, x, y, rows, k_len, tokens, accumulate);
}

extern "C" __global__ void matmul_f16(const f16_bits* w, const float* x, float* y, int rows,
                                      int k_len, int tokens, int accumulate) {
    matmul(w, x, y, rows, k_len, tokens, accumulate);
}

extern "C" __global__ void matmul_bf16(const bf16_bits* w, const float* x, float* y, int rows,
                                       int k_len, int tokens, int accumulate) {
    matmul(w, x, y, rows, k_len, tokens, accumulate);
}
