// Attention of every token of a step over its row's paged KV: one warp per (token, query head): grid (tokens, heads).
// A step mixes decode rows (one token) and prefill chunks (several consecutive positions of one
// row); every token attends to positions `first..=position` of its own row, reading K and V
// through the row's page table, so a chunk is causal by construction: its own K and V were
// written by `rope_kv_write` before this kernel runs. `first` is the sliding window's start
// (0 without a window), as the CPU's `LlamaConfig::window_start`.
//
// Fixed split per row (batch invariance): positions go in tiles of 32 aligned to multiples of 32,
// lane `l` scoring position `tile + l` (a sequential fused dot product over the head), merged by
// an online softmax in tile order. The order depends only on the token's position and the
// window, never on the batch. The query is rounded to half precision first, as the CPU's is to
// meet the half-precision cache. Head sizes up to 256.

#define HEAD_DIM_MAX 256
#define DIMS_PER_LANE (HEAD_DIM_MAX / 32)

extern "C" __global__ void paged_attention(
    const float* q, float* out, const int* positions, const int* token_rows,
    const int* table_offsets, const int* tables, const f16_bits* key_cache,
    const f16_bits* value_cache, int heads, int kv_heads, int head_dim, int page_tokens,
    int window, float scale) {
    __shared__ float query[HEAD_DIM_MAX];
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int group = heads / kv_heads, kv_head = h / group;
    const int kv_width = kv_heads * head_dim;
    const float* qt = q + ((long)t * heads + h) * head_dim;
    for (int i = lane; i < head_dim; i += 32) query[i] = half_to_float(float_to_half(qt[i]));
    __syncwarp();
    const int position = positions[t];
    const int first = window > 0 ? max(0, position + 1 - window) : 0;
    const int* table = tables + table_offsets[token_rows[t]];
    float acc[DIMS_PER_LANE];
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; j++) acc[j] = 0.0f;
    float running_max = NEG_INFINITY, total = 0.0f;
    for (int tile = first - first % 32; tile <= position; tile += 32) {
        const int p = tile + lane;
        const bool seen = p >= first && p <= position;
        float score = NEG_INFINITY;
        if (seen) {
            const long at = ((long)table[p / page_tokens] * page_tokens + p % page_tokens);
            const f16_bits* key = key_cache + at * kv_width + kv_head * head_dim;
            float dot = 0.0f;
            for (int i = 0; i < head_dim; i++) dot = fmaf(half_to_float(key[i]), query[i], dot);
            score = dot * scale;
        }
        const float next_max = fmaxf(running_max, warp_max(score));
        const float weight = seen ? expf(score - next_max) : 0.0f;
        const float rescale = expf(running_max - next_max);
        total = total * rescale + warp_sum(weight);
#pragma unroll
        for (int j = 0; j < DIMS_PER_LANE; j++) acc[j] *= rescale;
        running_max = next_max;
        const int last = min(31, position - tile);
        for (int l = max(0, first - tile); l <= last; l++) {
            const float w = __shfl_sync(0xffffffffu, weight, l);
            const int pos = tile + l;
            const long at = ((long)table[pos / page_tokens] * page_tokens + pos % page_tokens);
            const f16_bits* value = value_cache + at * kv_width + kv_head * head_dim;
#pragma unroll
            for (int j = 0; j < DIMS_PER_LANE; j++) {
                const int i = lane + 32 * j;
                if (i < head_dim) acc[j] = fmaf(w, half_to_float(value[i]), acc[j]);
            }
        }
    }
    float* o = out + ((long)t * heads + h) * head_dim;
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; j++) {
        const int i = lane + 32 * j;
        if (i < head_dim) o[i] = acc[j] / total;
    }
}
