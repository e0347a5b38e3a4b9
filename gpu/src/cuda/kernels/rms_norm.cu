// RMSNorm of one token's row per block, as the CPU's `numerics::rms_norm`: squares in f32 summed
// in f64, the mean rounded to f32, `scale = 1 / sqrt(mean + eps)`, `out = (x * scale) * w`.
// The f64 sum runs in a fixed tree over the block's threads, so a row's result depends only on
// the row. `rows`, when not null, picks which rows of `x` to normalize (the sampling rows before
// the output projection); block `b` writes row `b` of `out`.

#define NORM_THREADS 256
#define NORM_BATCH 8

extern "C" __global__ void rms_norm(const float* x, const int* rows, const float* weight,
                                    float* out, int hidden, float eps) {
    __shared__ double partial[NORM_THREADS / 32];
    allow_next_kernel();
    wait_for_inputs();
    const int row = rows ? rows[blockIdx.x] : blockIdx.x;
    const float* in = x + (long)row * hidden;
    double sum = 0.0;
    for (int i = threadIdx.x; i < hidden; i += NORM_THREADS) {
        const float v = in[i];
        sum += (double)(v * v);
    }
    // A fixed tree: a butterfly within each warp, then the warps' sums in order.
    for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    double total = 0.0;
#pragma unroll
    for (int w = 0; w < NORM_THREADS / 32; w++) total += partial[w];
    const float mean = (float)(total / (double)hidden);
    const float scale = 1.0f / sqrtf(mean + eps);
    float* o = out + (long)blockIdx.x * hidden;
    // A batch's loads before its stores: element by element, each store waited for its loads and
    // held back the next element's (in-order issue; `o` may alias `in` as far as ptxas knows).
    for (int i0 = threadIdx.x; i0 < hidden; i0 += NORM_BATCH * NORM_THREADS) {
        float v[NORM_BATCH], w[NORM_BATCH];
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            const int i = min(i0 + u * NORM_THREADS, hidden - 1);
            v[u] = in[i];
            w[u] = weight[i];
        }
#pragma unroll
        for (int u = 0; u < NORM_BATCH; u++) {
            const int i = i0 + u * NORM_THREADS;
            if (i < hidden) o[i] = (v[u] * scale) * w[u];
        }
    }
}
