// After the fused Q/K/V product of a token (one block per token; the token's row of `qkv` holds
// its Q heads, then its K heads, then its V heads): the Q/K/V biases (Qwen2, one vector in the
// same order), the rotary embedding of Q and K at the token's position, and K and V rounded to
// half precision into the paged cache through the token's row's page table. Q stays in `qkv`,
// rotated, for the attention that follows.
//
// RoPE as the CPU's `forward::rope`, through the prelude's `rope_angle` and `rope_rotate`
// (`theta_scale` computed on the host with the CPU's formula and passed in). `halves` picks
// Hugging Face's `(i, i + d/2)` pairs over GGUF's adjacent `(2i, 2i + 1)`. On steps of one token
// a row, attention can fold all of this in (`paged_attention_rope_*`).
//
// Cache layout per layer and part (keys, values): `[page][page_tokens][kv_heads][head_dim]`
// halves; position `p` of a row sits on page `tables[table_offsets[row] + p / page_tokens]`.

#define ROPE_PAIRS_MAX 256
#define ROTATE_BATCH 8

__device__ __forceinline__ void rotate(float* head, int i, int d, int halves, float c, float s) {
    const int a = rope_first(i, d, halves), b = rope_second(i, d, halves);
    rope_rotate(head[a], head[b], c, s, &head[a], &head[b]);
}

extern "C" __global__ void rope_kv_write(
    float* qkv, const float* bias, const int* positions, const int* token_rows,
    const int* table_offsets, const int* tables, f16_bits* key_cache, f16_bits* value_cache,
    const float* freq_factors, float theta_scale, int halves, int heads,
    int kv_heads, int head_dim, int page_tokens) {
    __shared__ float cos_of[ROPE_PAIRS_MAX];
    __shared__ float sin_of[ROPE_PAIRS_MAX];
    __shared__ float key[ROPE_PAIRS_MAX * 2 * 8];
    allow_next_kernel();
    const int t = blockIdx.x;
    const int pairs = head_dim / 2;
    const int position = positions[t];
    // The sines and cosines side by side, a pair a thread, not one after another.
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        sincosf(rope_angle(position, theta_scale, freq_factors, i), &sin_of[i], &cos_of[i]);
    }
    // The angles read only the step's inputs and the weights: with a dependent launch they are
    // computed while the Q/K/V product finishes.
    wait_for_inputs();
    __syncthreads();
    const int q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    float* qt = qkv + (long)t * (q_width + 2 * kv_width);
    const float* kt = qt + q_width;
    const float* vt = kt + kv_width;
    const float* q_bias = bias;
    const float* k_bias = bias ? bias + q_width : bias;
    const float* v_bias = bias ? bias + q_width + kv_width : bias;
    if (q_bias) {
        for (int i = threadIdx.x; i < q_width; i += blockDim.x) qt[i] += q_bias[i];
        __syncthreads();
    }
    // Q's pairs, 8 a thread at a time, each batch's values loaded before any pair is rotated
    // and stored: pair by pair, every load waited for the store before it (the compiler cannot
    // tell that they never overlap).
    const int q_pairs = heads * pairs;
    for (int j0 = threadIdx.x; j0 < q_pairs; j0 += ROTATE_BATCH * blockDim.x) {
        float x0[ROTATE_BATCH], x1[ROTATE_BATCH];
        int a[ROTATE_BATCH], b[ROTATE_BATCH];
#pragma unroll
        for (int u = 0; u < ROTATE_BATCH; u++) {
            const int j = min(j0 + u * (int)blockDim.x, q_pairs - 1);
            const int h = j / pairs, i = j % pairs;
            a[u] = h * head_dim + rope_first(i, head_dim, halves);
            b[u] = h * head_dim + rope_second(i, head_dim, halves);
            x0[u] = qt[a[u]];
            x1[u] = qt[b[u]];
        }
#pragma unroll
        for (int u = 0; u < ROTATE_BATCH; u++) {
            const int j = j0 + u * (int)blockDim.x;
            if (j < q_pairs) {
                rope_rotate(x0[u], x1[u], cos_of[j % pairs], sin_of[j % pairs], &qt[a[u]],
                            &qt[b[u]]);
            }
        }
    }
    const int page = tables[table_offsets[token_rows[t]] + position / page_tokens];
    const long at = ((long)page * page_tokens + position % page_tokens) * kv_width;
    // K heads a few at a time through shared memory: biased, rotated, then stored.
    const int heads_at_once = (ROPE_PAIRS_MAX * 2 * 8) / head_dim;
    for (int h0 = 0; h0 < kv_heads; h0 += heads_at_once) {
        const int n = min(heads_at_once, kv_heads - h0) * head_dim;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const int e = h0 * head_dim + i;
            key[i] = kt[e] + (k_bias ? k_bias[e] : 0.0f);
        }
        __syncthreads();
        for (int j = threadIdx.x; j < (n / head_dim) * pairs; j += blockDim.x) {
            const int h = j / pairs, i = j % pairs;
            rotate(key + h * head_dim, i, head_dim, halves, cos_of[i], sin_of[i]);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            key_cache[at + h0 * head_dim + i] = float_to_half(key[i]);
        }
    }
    // V likewise a batch at a time: loaded, then rounded and stored.
    for (int e0 = threadIdx.x; e0 < kv_width; e0 += ROTATE_BATCH * blockDim.x) {
        float v[ROTATE_BATCH];
#pragma unroll
        for (int u = 0; u < ROTATE_BATCH; u++) {
            const int e = min(e0 + u * (int)blockDim.x, kv_width - 1);
            v[u] = vt[e] + (v_bias ? v_bias[e] : 0.0f);
        }
#pragma unroll
        for (int u = 0; u < ROTATE_BATCH; u++) {
            const int e = e0 + u * (int)blockDim.x;
            if (e < kv_width) value_cache[at + e] = float_to_half(v[u]);
        }
    }
}
