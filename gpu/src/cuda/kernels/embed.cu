// Embedding gather: row `tokens[t]` of the table into row `t` of `x` (f32), for every token of
// the step. The table keeps the storage type the weights were uploaded in.

template <typename T>
__device__ void embed(const T* table, const int* tokens, float* x, int hidden) {
    allow_next_kernel();
    wait_for_inputs();
    const long row = (long)tokens[blockIdx.x] * hidden;
    float* out = x + (long)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = load1(table, row + i);
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
