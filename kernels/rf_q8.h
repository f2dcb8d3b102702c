// rf_q8.h - the int8-activation arithmetic that every quantized matmul kernel shares
// (gemv.hip for decode, gemm.hip for prefill), written once so that both give
// bit-identical outputs for the same activation row, whatever the batch or chunk.
//
// Activations are RMS-normalized (optionally, with a gain g: y = x * inv_rms * g,
// inv_rms = 1 / sqrtf(sum(x^2) / k + eps)) and quantized per 32-element block:
// d = amax / 127, q = roundf(y / d) (half away from zero), and d kept rounded to fp16
// (rf_q8_kept_scale), as llama.cpp keeps its q8 blocks' scales: a row's block dots are
// then llama.cpp's to the last bit.
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

// Four elements normalized with their gains g.
RF_DEVICE_INLINE rf_q8_f32x4 rf_normalize4(rf_q8_f32x4 v, float inv_rms, const rf_q8_f32x4& g) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        v.v[e] = rf_normalize(v.v[e], inv_rms, g.v[e]);
    }
    return v;
}

// inv_rms of a row from its RF_Q8_NORM_THREADS / RF_WARP_SIZE warps' sums of squares
// (`partial`, one float per warp), added in warp order.
RF_DEVICE_INLINE float rf_warps_inv_rms(const float* partial, int k, float eps) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < RF_Q8_NORM_THREADS / RF_WARP_SIZE; ++w) {
        total += partial[w];
    }
    return rf_inv_rms(total, k, eps);
}

// inv_rms of a row from each thread's sum of squares `ss` over its pieces (a block of
// RF_Q8_NORM_THREADS threads): a warp butterfly, then the warps' sums in warp order through
// `partial`, shared memory of one float per warp. Every thread gets the same value.
RF_DEVICE_INLINE float rf_block_inv_rms(float ss, int k, float eps, float* partial) {
    ss = rf_warp_sum(ss);
    if (threadIdx.x % RF_WARP_SIZE == 0) {
        partial[threadIdx.x / RF_WARP_SIZE] = ss;
    }
    __syncthreads();
    return rf_warps_inv_rms(partial, k, eps);
}

// inv_rms of row xr (k floats, 16-byte aligned) for a block of RF_Q8_NORM_THREADS threads,
// in the order described above (rf_block_inv_rms).
RF_DEVICE_INLINE float rf_row_inv_rms(const float* xr, int k, float eps, float* partial) {
    float ss = 0.0f;
#pragma unroll 4  // the pieces' loads in flight together (the sum's order is the loop's)
    for (int i = threadIdx.x * 4; i < k; i += RF_Q8_NORM_THREADS * 4) {
        const rf_q8_f32x4 v = *(const rf_q8_f32x4*)(xr + i);
        ss += rf_sum_squares4(v.v[0], v.v[1], v.v[2], v.v[3]);
    }
    return rf_block_inv_rms(ss, k, eps, partial);
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

// The scale a block keeps for its dot products: d rounded to the nearest fp16 (even on a
// tie), saturating at fp16's largest finite value.
RF_DEVICE_INLINE float rf_q8_kept_scale(float d) {
    return rf_half_to_float(rf_float_to_half(fminf(d, 65504.0f)));
}

// ---------------------------------------------------------------------------------------
// The GEMV's quantized rows (gemv.hip keeps them in shared memory; rf_quantize_q8_gemv and
// the decode attention kernel write one row of them to global memory for the GEMV to copy).

struct alignas(8) rf_q8_meta {
    float d;  // block scale
    int sum;  // sum of the block's int8 values
};

// Quantized activation rows, `padded` block slots per row. Block
// b = RF_Q8_STAGE * s + h of row t sits in slot t * padded + h * (padded / RF_Q8_STAGE) + s
// (rf_q8_slot): lanes reading block h of consecutive stages read consecutive slots
// (no bank conflicts). A slot keeps elements 0..15 at lo + slot * 16 and 16..31 at
// hi + slot * 16: the halves pair with a Q4_0 block's low and high nibbles.
struct rf_q8_rows {
    int8_t* lo;
    int8_t* hi;
    rf_q8_meta* meta;  // [n_rows][padded]
    int padded;        // block slots per row: n_blocks rounded up to RF_Q8_STAGE
};

// The layout over `n_rows` rows at `base`: all lo halves, all hi halves, then the metas.
RF_DEVICE_INLINE rf_q8_rows rf_q8_rows_at(uint8_t* base, int n_rows, int n_blocks) {
    rf_q8_rows rows;
    rows.padded = (n_blocks + RF_Q8_STAGE - 1) / RF_Q8_STAGE * RF_Q8_STAGE;
    rows.lo = (int8_t*)base;
    rows.hi = rows.lo + n_rows * rows.padded * 16;
    rows.meta = (rf_q8_meta*)(base + n_rows * rows.padded * RF_QK);
    return rows;
}

// Bytes of that layout: a multiple of 16.
RF_DEVICE_INLINE int rf_q8_rows_bytes(const rf_q8_rows& rows, int n_rows) {
    return n_rows * rows.padded * (RF_QK + (int)sizeof(rf_q8_meta));
}

RF_DEVICE_INLINE int rf_q8_slot(const rf_q8_rows& rows, int t, int b) {
    return t * rows.padded + (b % RF_Q8_STAGE) * (rows.padded / RF_Q8_STAGE) + b / RF_Q8_STAGE;
}

// Max and sum over the 8 aligned lanes that share one 32-element block.
RF_DEVICE_INLINE float rf_group8_max(float v) {
    v = fmaxf(v, rf_shfl_xor(v, 1));
    v = fmaxf(v, rf_shfl_xor(v, 2));
    return fmaxf(v, rf_shfl_xor(v, 4));
}
RF_DEVICE_INLINE int rf_group8_sum(int v) {
    v += rf_shfl_xor(v, 1);
    v += rf_shfl_xor(v, 2);
    return v + rf_shfl_xor(v, 4);
}

// Four consecutive elements quantized as one eighth of their 32-block: the 8 lanes of the
// block each hold one such piece. Every lane of the warp must call this together (it
// shuffles); inactive lanes pass zeros, in whole groups of 8.
struct rf_q8_piece {
    uint32_t packed;  // the four int8 values, element 0 in the low byte
    float d;          // the block's kept scale (rf_q8_kept_scale)
    int sum;          // the block's sum of int8 values
};

RF_DEVICE_INLINE rf_q8_piece rf_quantize4_piece(const rf_q8_f32x4& v) {
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        amax = fmaxf(amax, fabsf(v.v[e]));
    }
    amax = rf_group8_max(amax);
    const float d = rf_q8_scale(amax);
    rf_q8_piece piece{0u, rf_q8_kept_scale(d), 0};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int q = rf_q8_round(v.v[e], amax, d);
        piece.packed |= ((uint32_t)q & 0xFFu) << (8 * e);
        piece.sum += q;
    }
    piece.sum = rf_group8_sum(piece.sum);
    return piece;
}

// Store a piece of row t at column col (a multiple of 4) into `rows`.
RF_DEVICE_INLINE void rf_q8_store4(rf_q8_rows rows, int t, int col, const rf_q8_piece& piece) {
    const int e = col % RF_QK;
    const int blk = rf_q8_slot(rows, t, col / RF_QK);
    int8_t* half = e < 16 ? rows.lo : rows.hi;
    *(uint32_t*)(half + blk * 16 + (e % 16)) = piece.packed;
    if (e == 0) {
        rows.meta[blk].d = piece.d;
        rows.meta[blk].sum = piece.sum;
    }
}

// Quantize four consecutive elements (flat float4 index i of the activation,
// row t, column col) as one eighth of their 32-block. Every lane of the warp
// must call this together (it shuffles); inactive lanes pass active = false.
RF_DEVICE_INLINE void rf_quantize4(rf_q8_f32x4 v, bool active, int t, int col,
                                   const float* RF_RESTRICT gain, float inv_rms,
                                   rf_q8_rows rows) {
    if (active && gain != nullptr) {
        v = rf_normalize4(v, inv_rms, *(const rf_q8_f32x4*)(gain + col));
    }
    const rf_q8_piece piece = rf_quantize4_piece(v);  // inactive lanes hold zeros
    if (active) {
        rf_q8_store4(rows, t, col, piece);
    }
}

// One block's step of a stage sum (see the canonical sum above); `dot` holds the
// block's integer dot product exactly (|dot| < 2^24).
RF_DEVICE_INLINE float rf_q8_stage_add(float stage, float d_w, float d_x, float dot) {
    return fmaf(d_w * d_x, dot, stage);
}

#endif  // RF_Q8_H
