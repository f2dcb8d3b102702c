// Greedy sampling on the device, advancing the step state so that steady
// decode needs no host-to-device copy.
//
// logits     fp32 [n_rows, n_vocab]
// tokens     int32 [n_rows] step state: receives the argmax (the next step's input)
// positions  int32 [n_rows] step state: incremented by one
// sampled    int32 [n_rows]: the argmax again, for the host to read back
// logprob    fp32 [n_rows]: log-softmax of the chosen token
// partial    scratch [n_rows, gridDim.x] of (max, index, sum of exp(x - max))
// counters   uint32 [n_rows], zero before the first launch; the combining block
//            resets its counter, so every launch (and graph replay) starts at 0
// Ties go to the lowest index, as numpy's argmax.
//
// Each block takes a contiguous slice of a row's vocabulary (its maximum, the
// maximum's index and the sum of exp(x - max) over the slice); the last block of
// the row to finish combines the slices in slice order.
//
// Launch: grid (n_slices, n_rows), block RF_ARGMAX_THREADS.
#include "rf_portability.h"

#define RF_ARGMAX_THREADS 256
#define RF_ARGMAX_WARPS (RF_ARGMAX_THREADS / RF_WARP_SIZE)

struct rf_argmax_part {
    float max;
    int index;
    float sum;  // of exp(x - max) over the slice
};

RF_DEVICE_INLINE void rf_better(float& best, int& index, float v, int i) {
    if (v > best || (v == best && i < index)) {
        best = v;
        index = i;
    }
}

RF_KERNEL_BOUNDS(RF_ARGMAX_THREADS)
void rf_argmax_advance(const float* RF_RESTRICT logits, int n_vocab, int32_t* RF_RESTRICT tokens,
                       int32_t* RF_RESTRICT positions, int32_t* RF_RESTRICT sampled,
                       float* RF_RESTRICT logprob, rf_argmax_part* RF_RESTRICT partial,
                       uint32_t* RF_RESTRICT counters) {
    __shared__ float s_best[RF_ARGMAX_WARPS];
    __shared__ int s_index[RF_ARGMAX_WARPS];
    __shared__ float s_sum[RF_ARGMAX_WARPS];
    __shared__ bool s_last;
    const int slice = blockIdx.x, row = blockIdx.y, n_slices = gridDim.x;
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int per_slice = (n_vocab + n_slices - 1) / n_slices;
    const int first = slice * per_slice, last = min(first + per_slice, n_vocab);
    const float* x = logits + (int64_t)row * n_vocab;

    float best = -RF_INFINITY;
    int index = 0x7fffffff;
    for (int i = first + threadIdx.x; i < last; i += RF_ARGMAX_THREADS) {
        rf_better(best, index, x[i], i);
    }
    for (int offset = RF_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        rf_better(best, index, rf_shfl_xor(best, offset), rf_shfl_xor(index, offset));
    }
    if (lane == 0) {
        s_best[warp] = best;
        s_index[warp] = index;
    }
    __syncthreads();
    best = s_best[0];
    index = s_index[0];
    for (int w = 1; w < RF_ARGMAX_WARPS; ++w) {
        rf_better(best, index, s_best[w], s_index[w]);
    }
    float sum = 0.0f;
    for (int i = first + threadIdx.x; i < last; i += RF_ARGMAX_THREADS) {
        sum += expf(x[i] - best);
    }
    sum = rf_warp_sum(sum);
    if (lane == 0) {
        s_sum[warp] = sum;
    }
    __syncthreads();
    rf_argmax_part* parts = partial + (int64_t)row * n_slices;
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < RF_ARGMAX_WARPS; ++w) {
            total += s_sum[w];
        }
        parts[slice].max = best;
        parts[slice].index = index;
        parts[slice].sum = total;
        __threadfence();
        const uint32_t done = atomicAdd(counters + row, 1u);
        s_last = done == (uint32_t)(n_slices - 1);
        if (s_last) {
            counters[row] = 0u;
        }
    }
    __syncthreads();
    if (!s_last || threadIdx.x != 0) {
        return;
    }
    __threadfence();
    const volatile rf_argmax_part* seen = parts;
    float row_best = -RF_INFINITY;
    int row_index = 0x7fffffff;
    for (int s = 0; s < n_slices; ++s) {
        rf_better(row_best, row_index, seen[s].max, seen[s].index);
    }
    float total = 0.0f;
    for (int s = 0; s < n_slices; ++s) {
        total += seen[s].sum * expf(seen[s].max - row_best);
    }
    tokens[row] = row_index;
    positions[row] += 1;
    sampled[row] = row_index;
    logprob[row] = -logf(total);
}
