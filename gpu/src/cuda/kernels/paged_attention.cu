// Attention of every token of a step over its row's paged KV: one block of `ATTENTION_WARPS`
// warps per (token, query head), grid (tokens, heads); in split blocks, (tokens, heads, blocks a
// token).
// A step mixes decode rows (one token) and prefill chunks (several consecutive positions of one
// row); every token attends to positions `first..=position` of its own row, reading K and V
// through the row's page table, so a chunk is causal by construction: its own K and V were
// written by `rope_kv_write` before this kernel runs. `first` is the sliding window's start
// (0 without a window), as the CPU's `LlamaConfig::window_start`.
//
// Fixed split per row (batch invariance): positions go in tiles of 32 aligned to multiples of 32,
// lane `l` scoring position `tile + l` (a sequential fused dot product over the head), and tiles
// go in splits of ATTENTION_SPLIT_POSITIONS counted from the window's first tile. In a split,
// warp `w` of the block takes tiles `w`, `w + ATTENTION_WARPS`, ..., merged by an online softmax
// in its tile order; then warp 0 merges the warps' states in warp order into the split's state,
// and the splits' states are merged in split order (`merge_state`). The order depends only on
// the token's position and the window, never on the batch. The query is rounded to half
// precision first, as the CPU's is to meet the half-precision cache. Head sizes up to 256.
//
// Splits are what lets a long context spread over the device: the plain entry points walk a
// token's splits one after another in one block; the `_split` ones (`LaunchOptions::
// split_attention`, on steps of a few tokens, where (token, head) blocks alone would leave most
// of the device idle at a long context) give each split a block of its own, and
// `attention_merge_*` then merges the splits' states in the same order with the same
// arithmetic: the same bits either way. A context of one split (up to 512 positions) has the
// bits it had before splits existed.
//
// Latency, not bandwidth, bounds a decode step's attention (a warp walks its row's positions):
// the warps of a block walk different tiles, each lane's key is read as 16-byte vectors, the
// values of `VALUE_BATCH` positions are loaded before any is weighed, so many loads are in
// flight, and a value's cache slot comes from the lane that scored its position by a shuffle,
// not from the page table again (a dependent load before every batch). Each head size class
// (up to 64, 128, 256) has its own entry point, so a lane holds only the output dimensions it
// can have.
//
// The queries are read from the fused Q/K/V rows that `rope_kv_write` rotated in place (a
// token's Q heads, then its K and V heads); the output is a row of `heads * head_dim` per token.
//
// On a step of one token a row (every decode step) `paged_attention_rope_*` folds
// `rope_kv_write` in, saving its launch: each block adds the biases to its own query head and
// its KV head's key and value and rotates them with the prelude's RoPE, exactly as
// `rope_kv_write` does; the first query head of each KV head's group writes the key and value
// into the cache. The token's own position is then read from shared memory, not the cache (its
// write may not have landed), in the same halves the cache holds: the same bits as the two
// kernels. No other block reads that slot: a step's tokens are each their row's only one, and a
// page being written is its row's alone (only full pages are shared).

#define HEAD_DIM_MAX 256
#define ATTENTION_WARPS 4
#define VALUE_BATCH 8
// A split's positions (`cuda::launch::ATTENTION_SPLIT_POSITIONS`): 16 tiles, 4 a warp.
#define ATTENTION_SPLIT_POSITIONS 512

// RoPE's inputs, for the entry points that fold it in (`FOLD_ROPE`).
struct Rope {
    const float* bias;  // Q, K and V's, one vector; null without
    const float* freq_factors;
    float theta_scale;
    int halves;
    f16_bits* key_cache;  // the caches again, written through
    f16_bits* value_cache;
};

// With `FOLD_ROPE`, `rope_kv_write`'s work for this block's heads (see the header): the rotated
// query into `query`, the key and value in halves into `own_key` and `own_value`, written into
// the cache at slot `at` when `write` (by one block of the group's first query head).
__device__ void fold_rope(const Rope& rope, const float* token_qkv, int h, int kv_head,
                          int heads, int kv_heads, int head_dim, long at, bool write,
                          float* query, f16_bits* own_key, f16_bits* own_value,
                          float* cos_of, float* sin_of) {
    const int pairs = head_dim / 2, q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    const float* qt = token_qkv + h * head_dim;
    const float* kt = token_qkv + q_width + kv_head * head_dim;
    const float* vt = token_qkv + q_width + kv_width + kv_head * head_dim;
    const float* q_bias = rope.bias ? rope.bias + h * head_dim : nullptr;
    const float* k_bias = rope.bias ? rope.bias + q_width + kv_head * head_dim : nullptr;
    const float* v_bias =
        rope.bias ? rope.bias + q_width + kv_width + kv_head * head_dim : nullptr;
    __syncthreads();  // the angles
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int a = rope_first(i, head_dim, rope.halves);
        const int b = rope_second(i, head_dim, rope.halves);
        // As `rope_kv_write`: Q's bias added in place first, K's as it is staged.
        float x0 = qt[a], x1 = qt[b];
        if (q_bias) {
            x0 += q_bias[a];
            x1 += q_bias[b];
        }
        float y0, y1;
        rope_rotate(x0, x1, cos_of[i], sin_of[i], &y0, &y1);
        query[a] = half_to_float(float_to_half(y0));
        query[b] = half_to_float(float_to_half(y1));
        const float k0 = kt[a] + (k_bias ? k_bias[a] : 0.0f);
        const float k1 = kt[b] + (k_bias ? k_bias[b] : 0.0f);
        rope_rotate(k0, k1, cos_of[i], sin_of[i], &y0, &y1);
        own_key[a] = float_to_half(y0);
        own_key[b] = float_to_half(y1);
    }
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        own_value[i] = float_to_half(vt[i] + (v_bias ? v_bias[i] : 0.0f));
    }
    __syncthreads();
    if (write) {
        const long slot = at * kv_width + kv_head * head_dim;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
            rope.key_cache[slot + i] = own_key[i];
            rope.value_cache[slot + i] = own_value[i];
        }
    }
}

// One split's softmax state for a (token, query head), or several splits merged: the largest
// score, the sum of the weights under it, and the values weighed by them, not yet divided by the
// sum. Warp 0 holds it, lane `l` the dimensions `l + 32 j`.
template <int DIMS_PER_LANE>
struct SoftmaxState {
    float max, total, acc[DIMS_PER_LANE];
};

template <int DIMS_PER_LANE>
__device__ __forceinline__ SoftmaxState<DIMS_PER_LANE> empty_state() {
    SoftmaxState<DIMS_PER_LANE> s;
    s.max = NEG_INFINITY;
    s.total = 0.0f;
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; j++) s.acc[j] = 0.0f;
    return s;
}

// `into` followed by `next`, the later positions, each rescaled to the larger maximum. Products
// and sums rounded one by one (no contraction), so that the kernel merging splits in a block and
// the merge kernel after split blocks, compiled apart, give the same bits. An empty `into` takes
// `next` as it is: a token of one split has the bits the kernel had before splits.
template <int DIMS_PER_LANE>
__device__ __forceinline__ void merge_state(SoftmaxState<DIMS_PER_LANE>& into,
                                            const SoftmaxState<DIMS_PER_LANE>& next) {
    if (into.max == NEG_INFINITY) {
        into = next;
        return;
    }
    const float m = fmaxf(into.max, next.max);
    const float f_into = expf(into.max - m), f_next = expf(next.max - m);
    into.total = __fadd_rn(__fmul_rn(into.total, f_into), __fmul_rn(next.total, f_next));
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; j++) {
        into.acc[j] = __fadd_rn(__fmul_rn(into.acc[j], f_into), __fmul_rn(next.acc[j], f_next));
    }
    into.max = m;
}

// The attention output row: the weighed values over the sum of the weights.
template <int DIMS_PER_LANE>
__device__ __forceinline__ void write_output(const SoftmaxState<DIMS_PER_LANE>& s, float* o,
                                             int lane, int head_dim) {
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; j++) {
        const int i = lane + 32 * j;
        if (i < head_dim) o[i] = s.acc[j] / s.total;
    }
}

// A token's positions in splits: `base..=position` (`base` the window's first tile) in splits of
// ATTENTION_SPLIT_POSITIONS, the last one short.
struct Span {
    int first, base, splits;
};

__device__ __forceinline__ Span span_of(int position, int window) {
    const int first = window > 0 ? max(0, position + 1 - window) : 0;
    const int base = first - first % 32;
    return {first, base, (position - base) / ATTENTION_SPLIT_POSITIONS + 1};
}

// Where split blocks leave their states (`paged_attention_split_*`) for the merge kernel: split
// `s` of (token `t`, head `h`) at index `(t * heads + h) * max_splits + s`, its weighed values in
// `acc` (`head_dim` floats an index) and its maximum and sum in `stats` (two an index). A token
// of more splits than `max_splits` is taken whole by one block.
struct Partials {
    float* acc;
    float* stats;
    int max_splits;
};

// What one block reads to walk a split: the token's query (shared), its row's page table, the
// caches at its KV head, and (folded RoPE) its own key and value.
struct Walk {
    const float* query;
    const int* table;
    const f16_bits* key_cache;
    const f16_bits* value_cache;
    const f16_bits* own_key;
    const f16_bits* own_value;
    int kv_head, kv_width, head_dim, page_tokens, first, position;
    float scale;
};

// The softmax state of the token's positions `lo..=hi` (one split, `lo` a multiple of 32 from
// the window's first tile): warp `w` walks the tiles `w`, `w + ATTENTION_WARPS`, ... of the split
// by an online softmax in tile order, then warp 0 merges the warps' states in warp order and
// returns it (the other warps return an empty state). Every thread of the block calls it.
template <int DIMS_PER_LANE, bool FOLD_ROPE>
__device__ SoftmaxState<DIMS_PER_LANE> attend_split(const Walk& k, int lo, int hi,
                                                    float* warp_max_of, float* warp_total_of,
                                                    float (*warp_acc_of)[HEAD_DIM_MAX]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int head_dim = k.head_dim, first = k.first, position = k.position;
    const float* query = k.query;
    float acc[DIMS_PER_LANE];
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; j++) acc[j] = 0.0f;
    float running_max = NEG_INFINITY, total = 0.0f;
    for (int tile = lo + 32 * warp; tile <= hi; tile += 32 * ATTENTION_WARPS) {
        const int p = tile + lane;
        const bool seen = p >= first && p <= position;
        float score = NEG_INFINITY;
        // Where position `p`'s K and V sit in the cache; the values' loop below takes it from
        // the lane that scored the position rather than reading the page table again.
        long at = 0;
        if (seen) {
            at = ((long)k.table[p / k.page_tokens] * k.page_tokens + p % k.page_tokens);
            const f16_bits* key = FOLD_ROPE && p == position
                                      ? k.own_key
                                      : k.key_cache + at * k.kv_width + k.kv_head * head_dim;
            float dot = 0.0f;
            if (head_dim % 8 == 0) {
                // 16-byte aligned: `at * kv_width` and `kv_head * head_dim` are multiples of 8.
                // Up to 8 chunks (64 dimensions) are requested before any is used: loaded and
                // used chunk by chunk, ptxas waited for each load in turn.
                for (int c0 = 0; c0 < head_dim; c0 += 64) {
                    uint4 raw[8];
#pragma unroll
                    for (int b = 0; b < 8; b++) {
                        if (c0 + 8 * b < head_dim) raw[b] = *(const uint4*)(key + c0 + 8 * b);
                    }
#pragma unroll
                    for (int b = 0; b < 8; b++) {
                        const int c = c0 + 8 * b;
                        if (c < head_dim) {
                            float k8[8];
                            unpack8(raw[b], k8, false);
#pragma unroll
                            for (int j = 0; j < 8; j++) dot = fmaf(k8[j], query[c + j], dot);
                        }
                    }
                }
            } else {
                for (int i = 0; i < head_dim; i++) {
                    dot = fmaf(half_to_float(key[i]), query[i], dot);
                }
            }
            score = dot * k.scale;
        }
        const float next_max = fmaxf(running_max, warp_max(score));
        const float weight = seen ? expf(score - next_max) : 0.0f;
        const float rescale = expf(running_max - next_max);
        total = total * rescale + warp_sum(weight);
#pragma unroll
        for (int j = 0; j < DIMS_PER_LANE; j++) acc[j] *= rescale;
        running_max = next_max;
        // `l0`, `u` and `last` are the same in every lane, so the shuffles stay warp-uniform.
        const int last = min(31, position - tile);
        for (int l0 = max(0, first - tile); l0 <= last; l0 += VALUE_BATCH) {
            // The batch's values are loaded as they are stored, without a branch and without
            // being converted (either made ptxas wait for each load before the next), and only
            // then converted and weighed. A position past `last` loads position `last` again
            // and is not weighed.
            f16_bits values[VALUE_BATCH][DIMS_PER_LANE];
#pragma unroll
            for (int u = 0; u < VALUE_BATCH; u++) {
                // Lane `min(l0 + u, last)` scored this position, so its `at` is set.
                const int l_u = min(l0 + u, last);
                const long at_u = __shfl_sync(0xffffffffu, at, l_u);
                const f16_bits* value =
                    FOLD_ROPE && tile + l_u == position
                        ? k.own_value
                        : k.value_cache + at_u * k.kv_width + k.kv_head * head_dim;
#pragma unroll
                for (int j = 0; j < DIMS_PER_LANE; j++) {
                    const int i = lane + 32 * j;
                    values[u][j] = i < head_dim ? value[i] : (f16_bits)0;
                }
            }
#pragma unroll
            for (int u = 0; u < VALUE_BATCH; u++) {
                if (l0 + u <= last) {
                    const float w = __shfl_sync(0xffffffffu, weight, l0 + u);
#pragma unroll
                    for (int j = 0; j < DIMS_PER_LANE; j++) {
                        if (lane + 32 * j < head_dim) {
                            acc[j] = fmaf(w, half_to_float(values[u][j]), acc[j]);
                        }
                    }
                }
            }
        }
    }
    // The warps' states, merged by warp 0 in warp order. Warp 0 always has the split's first
    // tile, which holds a position of the window, so the merged maximum is finite; a warp that
    // had no tile adds nothing.
    if (lane == 0) {
        warp_max_of[warp] = running_max;
        warp_total_of[warp] = total;
    }
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; j++) {
        const int i = lane + 32 * j;
        if (i < head_dim) warp_acc_of[warp][i] = acc[j];
    }
    __syncthreads();
    SoftmaxState<DIMS_PER_LANE> merged = empty_state<DIMS_PER_LANE>();
    if (warp != 0) return merged;
    merged.max = warp_max_of[0];
#pragma unroll
    for (int w = 1; w < ATTENTION_WARPS; w++) merged.max = fmaxf(merged.max, warp_max_of[w]);
#pragma unroll
    for (int w = 0; w < ATTENTION_WARPS; w++) {
        if (warp_max_of[w] == NEG_INFINITY) continue;
        const float factor = expf(warp_max_of[w] - merged.max);
        merged.total += warp_total_of[w] * factor;
#pragma unroll
        for (int j = 0; j < DIMS_PER_LANE; j++) {
            const int i = lane + 32 * j;
            if (i < head_dim) merged.acc[j] += warp_acc_of[w][i] * factor;
        }
    }
    return merged;
}

// One block per (token, query head), or with `SPLIT` per (token, query head, `blockIdx.z`): block
// `z` of `gridDim.z` takes the token's splits `z`, `z + gridDim.z`, ... and leaves each split's
// state in `partials` for `attention_merge`. A token of one split, or of more than the partials
// hold, is taken whole by block 0, which writes its output, as the kernel without `SPLIT` does
// for every token: its splits one after another, merged in split order by `merge_state`.
template <int DIMS_PER_LANE, bool FOLD_ROPE, bool SPLIT>
__device__ void paged_attention(
    const float* qkv, float* out, const int* positions, const int* token_rows,
    const int* table_offsets, const int* tables, const f16_bits* key_cache,
    const f16_bits* value_cache, int heads, int kv_heads, int head_dim, int page_tokens,
    int window, float scale, const Rope& rope, const Partials& partials) {
    __shared__ float query[HEAD_DIM_MAX];
    __shared__ float warp_max_of[ATTENTION_WARPS], warp_total_of[ATTENTION_WARPS];
    __shared__ float warp_acc_of[ATTENTION_WARPS][HEAD_DIM_MAX];
    // The token's own key and value when RoPE is folded in, 16-byte aligned for vector loads.
    __shared__ __align__(16) f16_bits own_key[FOLD_ROPE ? HEAD_DIM_MAX : 8];
    __shared__ __align__(16) f16_bits own_value[FOLD_ROPE ? HEAD_DIM_MAX : 8];
    __shared__ float cos_of[FOLD_ROPE ? HEAD_DIM_MAX / 2 : 1];
    __shared__ float sin_of[FOLD_ROPE ? HEAD_DIM_MAX / 2 : 1];
    allow_next_kernel();
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int group = heads / kv_heads, kv_head = h / group;
    const int kv_width = kv_heads * head_dim;
    const int position = positions[t];
    const Span span = span_of(position, window);
    const bool whole = !SPLIT || span.splits == 1 || span.splits > partials.max_splits;
    const int z = SPLIT ? blockIdx.z : 0;
    if (whole ? z != 0 : z >= span.splits) {
        // Nothing to do; waiting first keeps "this kernel done" meaning "its inputs were done"
        // for the kernel after it, which waits on this one alone.
        wait_for_inputs();
        return;
    }
    if (FOLD_ROPE) {
        // The angles read only the step's inputs: with a dependent launch they are computed
        // while the Q/K/V product finishes.
        for (int i = threadIdx.x; i < head_dim / 2; i += blockDim.x) {
            sincosf(rope_angle(position, rope.theta_scale, rope.freq_factors, i), &sin_of[i],
                    &cos_of[i]);
        }
    }
    wait_for_inputs();
    const float* token_qkv = qkv + (long)t * (kv_width * 2 + heads * head_dim);
    const int* table = tables + table_offsets[token_rows[t]];
    if (FOLD_ROPE) {
        const long at = (long)table[position / page_tokens] * page_tokens + position % page_tokens;
        // Block 0 of the group's first query head writes the key and value into the cache.
        const bool write = z == 0 && h % group == 0;
        fold_rope(rope, token_qkv, h, kv_head, heads, kv_heads, head_dim, at, write, query,
                  own_key, own_value, cos_of, sin_of);
    } else {
        const float* qt = token_qkv + h * head_dim;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
            query[i] = half_to_float(float_to_half(qt[i]));
        }
        __syncthreads();
    }
    const Walk walk = {query,    table,      key_cache,   value_cache, own_key,
                       own_value, kv_head,   kv_width,    head_dim,    page_tokens,
                       span.first, position, scale};
    SoftmaxState<DIMS_PER_LANE> merged = empty_state<DIMS_PER_LANE>();
    for (int s = z; s < span.splits; s += whole ? 1 : gridDim.z) {
        const int lo = span.base + s * ATTENTION_SPLIT_POSITIONS;
        const int hi = min(position, lo + ATTENTION_SPLIT_POSITIONS - 1);
        const SoftmaxState<DIMS_PER_LANE> split = attend_split<DIMS_PER_LANE, FOLD_ROPE>(
            walk, lo, hi, warp_max_of, warp_total_of, warp_acc_of);
        if (warp == 0) {
            if (whole) {
                merge_state(merged, split);
            } else {
                const long index = ((long)t * heads + h) * partials.max_splits + s;
#pragma unroll
                for (int j = 0; j < DIMS_PER_LANE; j++) {
                    const int i = lane + 32 * j;
                    if (i < head_dim) partials.acc[index * head_dim + i] = split.acc[j];
                }
                if (lane == 0) {
                    partials.stats[2 * index] = split.max;
                    partials.stats[2 * index + 1] = split.total;
                }
            }
        }
        // The next split writes the warps' states again once warp 0 has read them.
        __syncthreads();
    }
    if (whole && warp == 0) write_output(merged, out + ((long)t * heads + h) * head_dim, lane, head_dim);
}

// After `paged_attention_split_*`: one warp per (token, query head) merges the token's split
// states in split order, as the unsplit kernel does in its block, and writes the output; a token
// the split kernel took whole is left alone.
template <int DIMS_PER_LANE>
__device__ void attention_merge(const int* positions, float* out, int heads, int head_dim,
                                int window, const Partials& partials) {
    allow_next_kernel();
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const Span span = span_of(positions[t], window);
    wait_for_inputs();
    if (span.splits == 1 || span.splits > partials.max_splits) return;
    const long first_index = ((long)t * heads + h) * partials.max_splits;
    SoftmaxState<DIMS_PER_LANE> merged = empty_state<DIMS_PER_LANE>();
    for (int s = 0; s < span.splits; s++) {
        const long index = first_index + s;
        SoftmaxState<DIMS_PER_LANE> split;
        split.max = partials.stats[2 * index];
        split.total = partials.stats[2 * index + 1];
#pragma unroll
        for (int j = 0; j < DIMS_PER_LANE; j++) {
            const int i = lane + 32 * j;
            split.acc[j] = i < head_dim ? partials.acc[index * head_dim + i] : 0.0f;
        }
        merge_state(merged, split);
    }
    write_output(merged, out + ((long)t * heads + h) * head_dim, lane, head_dim);
}

#define ATTENTION_PARAMETERS                                                                \
    const float *qkv, float *out, const int *positions, const int *token_rows,             \
        const int *table_offsets, const int *tables, const f16_bits *key_cache,            \
        const f16_bits *value_cache, int heads, int kv_heads, int head_dim, int page_tokens, \
        int window, float scale
#define ATTENTION_ARGUMENTS                                                                  \
    qkv, out, positions, token_rows, table_offsets, tables, key_cache, value_cache, heads,  \
        kv_heads, head_dim, page_tokens, window, scale
// The folded entry points' RoPE parameters, after the plain ones.
#define ROPE_PARAMETERS                                                                      \
    const float *bias, const float *freq_factors, float theta_scale, int halves,           \
        f16_bits *key_out, f16_bits *value_out

// Where `paged_attention_split_*` leaves split states and `attention_merge_*` reads them.
#define SPLIT_PARAMETERS float *partial_acc, float *partial_stats, int max_splits
#define SPLIT_ARGUMENTS Partials{partial_acc, partial_stats, max_splits}
#define ROPE_ARGUMENTS Rope{bias, freq_factors, theta_scale, halves, key_out, value_out}

// Each head size class's entry points, written out (the emulator finds entry points by name in
// the source): plain, with RoPE folded in, the same two in split blocks, and the merge after
// the split ones.

extern "C" __global__ void paged_attention_d64(ATTENTION_PARAMETERS) {
    paged_attention<2, false, false>(ATTENTION_ARGUMENTS, Rope{}, Partials{});
}

extern "C" __global__ void paged_attention_rope_d64(ATTENTION_PARAMETERS, ROPE_PARAMETERS) {
    paged_attention<2, true, false>(ATTENTION_ARGUMENTS, ROPE_ARGUMENTS, Partials{});
}

extern "C" __global__ void paged_attention_split_d64(ATTENTION_PARAMETERS, SPLIT_PARAMETERS) {
    paged_attention<2, false, true>(ATTENTION_ARGUMENTS, Rope{}, SPLIT_ARGUMENTS);
}

extern "C" __global__ void paged_attention_rope_split_d64(ATTENTION_PARAMETERS, ROPE_PARAMETERS,
                                                         SPLIT_PARAMETERS) {
    paged_attention<2, true, true>(ATTENTION_ARGUMENTS, ROPE_ARGUMENTS, SPLIT_ARGUMENTS);
}

extern "C" __global__ void attention_merge_d64(const int* positions, float* out, int heads,
                                               int head_dim, int window, SPLIT_PARAMETERS) {
    attention_merge<2>(positions, out, heads, head_dim, window, SPLIT_ARGUMENTS);
}

extern "C" __global__ void paged_attention_d128(ATTENTION_PARAMETERS) {
    paged_attention<4, false, false>(ATTENTION_ARGUMENTS, Rope{}, Partials{});
}

extern "C" __global__ void paged_attention_rope_d128(ATTENTION_PARAMETERS, ROPE_PARAMETERS) {
    paged_attention<4, true, false>(ATTENTION_ARGUMENTS, ROPE_ARGUMENTS, Partials{});
}

extern "C" __global__ void paged_attention_split_d128(ATTENTION_PARAMETERS, SPLIT_PARAMETERS) {
    paged_attention<4, false, true>(ATTENTION_ARGUMENTS, Rope{}, SPLIT_ARGUMENTS);
}

extern "C" __global__ void paged_attention_rope_split_d128(ATTENTION_PARAMETERS, ROPE_PARAMETERS,
                                                         SPLIT_PARAMETERS) {
    paged_attention<4, true, true>(ATTENTION_ARGUMENTS, ROPE_ARGUMENTS, SPLIT_ARGUMENTS);
}

extern "C" __global__ void attention_merge_d128(const int* positions, float* out, int heads,
                                               int head_dim, int window, SPLIT_PARAMETERS) {
    attention_merge<4>(positions, out, heads, head_dim, window, SPLIT_ARGUMENTS);
}

extern "C" __global__ void paged_attention_d256(ATTENTION_PARAMETERS) {
    paged_attention<8, false, false>(ATTENTION_ARGUMENTS, Rope{}, Partials{});
}

extern "C" __global__ void paged_attention_rope_d256(ATTENTION_PARAMETERS, ROPE_PARAMETERS) {
    paged_attention<8, true, false>(ATTENTION_ARGUMENTS, ROPE_ARGUMENTS, Partials{});
}

extern "C" __global__ void paged_attention_split_d256(ATTENTION_PARAMETERS, SPLIT_PARAMETERS) {
    paged_attention<8, false, true>(ATTENTION_ARGUMENTS, Rope{}, SPLIT_ARGUMENTS);
}

extern "C" __global__ void paged_attention_rope_split_d256(ATTENTION_PARAMETERS, ROPE_PARAMETERS,
                                                         SPLIT_PARAMETERS) {
    paged_attention<8, true, true>(ATTENTION_ARGUMENTS, ROPE_ARGUMENTS, SPLIT_ARGUMENTS);
}

extern "C" __global__ void attention_merge_d256(const int* positions, float* out, int heads,
                                               int head_dim, int window, SPLIT_PARAMETERS) {
    attention_merge<8>(positions, out, heads, head_dim, window, SPLIT_ARGUMENTS);
}
