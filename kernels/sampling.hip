// Greedy sampling on the device, advancing the step state so that steady
// decode needs no host-to-device copy.
//
// logits     fp32 [n_rows, n_vocab]
// tokens     int32 [n_rows] step state: receives the argmax (the next step's input)
// positions  int32 [n_rows] step state: incremented by one
// sampled    int32 [n_rows]: the argmax again, for the host to read back
// logprob    fp32 [n_rows]: log-softmax of the chosen token
// Ties go to the lowest index, as numpy's argmax.
//
// Launch: grid (n_rows), block RF_ARGMAX_THREADS.
#include "rf_portability.h"

#define RF_ARGMAX_THREADS 1024
#define RF_ARGMAX_WARPS (RF_ARGMAX_THREADS / RF_WARP_SIZE)

RF_DEVICE_INLINE void rf_better(float& best, int& index, float v, int i) {
    if (v > best || (v == best && i < index)) {
        best = v;
        index = i;
    }
}

RF_KERNEL_BOUNDS(RF_ARGMAX_THREADS)
void rf_argmax_advance(const float* RF_RESTRICT logits, int n_vocab, int32_t* RF_RESTRICT tokens,
                       int32_t* RF_RESTRICT positions, int32_t* RF_RESTRICT sampled,
                       float* RF_RESTRICT logprob) {
    __shared__ float s_best[RF_ARGMAX_WARPS];
    __shared__ int s_index[RF_ARGMAX_WARPS];
    __shared__ float s_sum[RF_ARGMAX_WARPS];
    const int row = blockIdx.x;
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int n_warps = blockDim.x / RF_WARP_SIZE;
    const float* x = logits + (int64_t)row * n_vocab;

    float best = -RF_INFINITY;
    int index = 0x7fffffff;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
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
    for (int w = 1; w < n_warps; ++w) {
        rf_better(best, index, s_best[w], s_index[w]);
    }

    float sum = 0.0f;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        sum += expf(x[i] - best);
    }
    sum = rf_warp_sum(sum);
    if (lane == 0) {
        s_sum[warp] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < n_warps; ++w) {
            total += s_sum[w];
        }
        tokens[row] = index;
        positions[row] += 1;
        sampled[row] = index;
        logprob[row] = -logf(total);
    }
}
