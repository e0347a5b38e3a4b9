// Embedding gather: row `tokens[t]` of the table into row `t` of `x` (f32), for every token of
// the step. The table keeps the storage type the weights were uploaded in (a block-typed one is
// its quants and scales, each element dequantized by the prelude's `load1`).

#define EMBED_BATCH 8

template <typename M>
__device__ void embed(M table, const int* tokens, float* x, int hidden) {
    allow_next_kernel();
    wait_for_inputs();
    const long row = (long)tokens[blockIdx.x] * hidden;
    float* out = x + (long)blockIdx.x * hidden;
    // A batch's loads before its stores (one by one, each store held back the next load).
    for (int i0 = threadIdx.x; i0 < hidden; i0 += EMBED_BATCH * blockDim.x) {
        float v[EMBED_BATCH];
#pragma unroll
        for (int u = 0; u < EMBED_BATCH; u++) {
            v[u] = load1(table, row + min(i0 + u * (int)blockDim.x, hidden - 1));
        }
#pragma unroll
        for (int u = 0; u < EMBED_BATCH; u++) {
            const int i = i0 + u * (int)blockDim.x;
            if (i < hidden) out[i] = v[u];
        }
    }
}

extern "C" __global__ void embed_f32(const float* table, const int* tokens, float* x, int hidden) {
    embed(table, tokens, x, hidden);
}

extern "C" __global__ void embed_f16(const f16_bits* table, const int* tokens, float* x,
                                     int hidden) {
    embed(table, tokens, x, hidden);
}

extern "C" __global__ void embed_bf16(const bf16_bits* table, const int* tokens, float* x,
                                      int hidden) {
    embed(table, tokens, x, hidden);
}

extern "C" __global__ void embed_q4_0(const unsigned int* q, const f16_bits* d, const int* tokens,
                                      float* x, int hidden) {
    embed(q4_0_blocks{q, d}, tokens, x, hidden);
}

extern "C" __global__ void embed_q4_1(const unsigned int* q, const unsigned int* dm,
                                      const int* tokens, float* x, int hidden) {
    embed(q4_1_blocks{q, dm}, tokens, x, hidden);
}

extern "C" __global__ void embed_q8_0(const uint2* q, const f16_bits* d, const int* tokens,
                                      float* x, int hidden) {
    embed(q8_0_blocks{q, d}, tokens, x, hidden);
}

extern "C" __global__ void embed_q4_k(const unsigned int* q, const float2* dm, const int* tokens,
                                      float* x, int hidden) {
    embed(q4_k_blocks{q, dm}, tokens, x, hidden);
}

extern "C" __global__ void embed_q6_k(const uint2* q, const float* s, const int* tokens,
                                      float* x, int hidden) {
    embed(q6_k_blocks{q, s}, tokens, x, hidden);
}

extern "C" __global__ void embed_q5_1(const uint2* q, const unsigned int* dm, const int* tokens,
                                      float* x, int hidden) {
    embed(q5_1_blocks{q, dm}, tokens, x, hidden);
}

extern "C" __global__ void embed_q5_k(const uint2* q, const float2* dm, const int* tokens,
                                      float* x, int hidden) {
    embed(q5_k_blocks{q, dm}, tokens, x, hidden);
}
