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
