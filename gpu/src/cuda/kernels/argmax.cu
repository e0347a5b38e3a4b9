// Greedy sampling on the device: per row of logits (one block each), the index of the largest
// value, ties to the lowest index, as core's `sampling::argmax`. NaN never wins a comparison,
// as on the host. A fixed tree over the block's threads: the result depends only on the row.

// 1024 threads: a row is 32k to 256k logits read once, and a block's threads are what keeps
// those reads in flight (the order of comparisons cannot change the winner: value, then the
// lower index, is a total order).
#define ARGMAX_THREADS 1024

extern "C" __global__ void argmax(const float* logits, int* out, int vocab) {
    __shared__ float best_value[ARGMAX_THREADS];
    __shared__ int best_index[ARGMAX_THREADS];
    allow_next_kernel();
    wait_for_inputs();
    const float* row = logits + (long)blockIdx.x * vocab;
    float value = row[0];
    int index = 0;
    for (int i = threadIdx.x; i < vocab; i += ARGMAX_THREADS) {
        if (row[i] > value) {
            value = row[i];
            index = i;
        }
    }
    best_value[threadIdx.x] = value;
    best_index[threadIdx.x] = index;
    __syncthreads();
    for (int half = ARGMAX_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            const float other = best_value[threadIdx.x + half];
            const int other_index = best_index[threadIdx.x + half];
            const float mine = best_value[threadIdx.x];
            if (other > mine || (other == mine && other_index < best_index[threadIdx.x])) {
                best_value[threadIdx.x] = other;
                best_index[threadIdx.x] = other_index;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_index[0];
}
