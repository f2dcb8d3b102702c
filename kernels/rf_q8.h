// rf_q8.h - the int8-activation arithmetic that every quantized matmul kernel shares
// (gemv.hip for decode, gemm.hip for prefill), written once so that both give
// bit-identical outputs for the same activation row, whatever the batch or chunk.
//
// Activations are RMS-normalized (optionally, with a gain g: y = x * inv_rms * g,
// inv_rms = 1 / sqrtf(sum(x^2) / k + eps)) and quantized per 32-element block:
// d = amax / 127, q = roundf(y / d) (half away from zero), d kept in f32.
//
// Canonical sum of one output over the blocks b of a row:
//   stage s holds blocks RF_Q8_STAGE * s .. RF_Q8_STAGE * s + RF_Q8_STAGE - 1 (those < n_blocks);
//   P_s = 0; for each block b of the stage, in order: P_s = fmaf(d_w[b] * d_x[b], dot_b, P_s)
//   total = 0; for each stage s, in order: total = total + P_s
// where dot_b is the exact integer dot product of the block (weights as signed values,
// i.e. Q4_0 nibbles minus 8). A GEMM folds stages as its k loop walks them; a GEMV,
// whose lanes hold different stages, folds them in the same order with shuffles.
#ifndef RF_Q8_H
#define RF_Q8_H

#include "rf_portability.h"
#include "rf_constants.h"

// RF_QK (elements per quant block) and RF_Q8_STAGE (blocks per stage of the canonical
// sum) come from rf_constants.h, as does RF_Q8_NORM_THREADS: the threads that share one
// row's sum of squares. Each adds the squares of float4 pieces i, i + RF_Q8_NORM_THREADS,
// ... (rf_sum_squares4 each), then a warp butterfly, then the warps' sums in warp order.
// The order depends on this count, so every kernel that normalizes uses it.

RF_DEVICE_INLINE float rf_sum_squares4(float a, float b, float c, float d) {
    return a * a + b * b + c * c + d * d;
}

RF_DEVICE_INLINE float rf_inv_rms(float sum_squares, int k, float eps) {
    return 1.0f / sqrtf(sum_squares / (float)k + eps);
}

// One element normalized with its gain.
RF_DEVICE_INLINE float rf_normalize(float v, float inv_rms, float gain) {
    return v * inv_rms * gain;
}

struct alignas(16) rf_q8_f32x4 {
    float v[4];
};

// inv_rms of row xr (k floats, 16-byte aligned) for a block of RF_Q8_NORM_THREADS threads,
// in the order described above; `partial` is shared memory of one float per warp. Every
// thread of the block calls it and gets the same value.
RF_DEVICE_INLINE float rf_row_inv_rms(const float* xr, int k, float eps, float* partial) {
    float ss = 0.0f;
    for (int i = threadIdx.x * 4; i < k; i += RF_Q8_NORM_THREADS * 4) {
        const rf_q8_f32x4 v = *(const rf_q8_f32x4*)(xr + i);
        ss += rf_sum_squares4(v.v[0], v.v[1], v.v[2], v.v[3]);
    }
    ss = rf_warp_sum(ss);
    if (threadIdx.x % RF_WARP_SIZE == 0) {
        partial[threadIdx.x / RF_WARP_SIZE] = ss;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < RF_Q8_NORM_THREADS / RF_WARP_SIZE; ++w) {
        total += partial[w];
    }
    return rf_inv_rms(total, k, eps);
}

// The SwiGLU epilogue of the gate|up projection: silu(gate) * up.
RF_DEVICE_INLINE float rf_swiglu(float gate, float up) {
    return gate / (1.0f + expf(-gate)) * up;
}

RF_DEVICE_INLINE float rf_q8_scale(float amax) {
    return amax / 127.0f;
}

RF_DEVICE_INLINE int rf_q8_round(float v, float amax, float d) {
    return amax == 0.0f ? 0 : (int)roundf(v / d);
}

// One block's step of a stage sum (see the canonical sum above); `dot` holds the
// block's integer dot product exactly (|dot| < 2^24).
RF_DEVICE_INLINE float rf_q8_stage_add(float stage, float d_w, float d_x, float dot) {
    return fmaf(d_w * d_x, dot, stage);
}

#endif  // RF_Q8_H
