// Prefill GEMM: out[t, :] = W x[t, :] for a whole prompt chunk of activation rows t,
// on the int8 matrix units (mma.m16n8k32 on NVIDIA; emulated with dp4a elsewhere,
// see rf_mma_s8_m16n8k32 in the header). The decode GEMV (gemv.hip) keeps rows <=
// RF_GEMV_MAX_ROWS.
//
// The arithmetic is rf_q8.h's, shared with the decode GEMV: activations (optionally
// RMS-normalized with gain g) are quantized to int8 per 32-element block, and each
// output is the canonical sum over blocks of d_w * d_x * (integer dot of the block),
// so a row gives bit-identical outputs here and in the GEMV.
//
// Two kernels per matmul:
//   rf_quantize_q8_rows  x fp32 [rows, k] -> xq int8 [rows, k] + xd f32 [rows, k / 32].
//                        Each 32-byte block of xq is stored in "mma order": for
//                        c = 0..3, elements 4c..4c+3 then 16+4c..16+4c+3, so that one
//                        8-byte load gives a lane both k-chunks an mma fragment needs.
//                        Block (row, y) quantizes the row's quant blocks
//                        y * RF_Q8_ROWS_BLOCKS.. (after its sum of squares, when
//                        normalizing: every block of the row computes it, in one order).
//                        Launch: grid (rows, ceil(k / 32 / RF_Q8_ROWS_BLOCKS)), block
//                        RF_Q8_THREADS. rf_quantize_q8_tiles is the same into the MMV's
//                        layout (below).
//   rf_gemm_<fmt>        tiled GEMM of the repacked weights (see gemv.hip: Q4_0 quants
//                        uint8 [n, k/2], byte j of a block = element j (low nibble) and
//                        j + 16 (high); Q8_0 int8 [n, k]; f16 scales [n, k/32] apart)
//                        with xq/xd. Weights are expanded to int8 in the same mma order
//                        while being copied to shared memory (the dot product does not
//                        depend on the order of k as long as both sides share it).
//                        Launch: grid (ceil(rows / RF_GEMM_TILE_M), n_tiles), block
//                        RF_GEMM_THREADS; n_tiles = ceil(n / RF_GEMM_TILE_N), or
//                        ceil(n / (RF_GEMM_TILE_N / 2)) for SwiGLU.
// Epilogues: RF_EPILOGUE_STORE; RF_EPILOGUE_RESIDUAL adds the residual (out may alias it);
//            RF_EPILOGUE_SWIGLU: weight rows [0, n) are gate, [n, 2n) up;
//            out[t, j] = silu(gate) * up.
#include "rf_portability.h"
#include "rf_q8.h"
#include "rf_rope.h"

// From rf_constants.h: RF_GEMM_THREADS (four 32-lane groups, 2 (n) x 2 (m)), RF_GEMM_TILE_N
// (weight rows per block; a group takes half: four 16-row mma tiles), RF_GEMM_TILE_M
// (activation rows per block; a group takes half: four 8-row tiles) and the RF_EPILOGUE_*
// codes. The thread-to-tile mapping below is written for these sizes:
static_assert(RF_GEMM_THREADS == 128 && RF_GEMM_TILE_N == 128 && RF_GEMM_TILE_M == 64,
              "the GEMM's thread-to-tile mapping is written for 128 threads, 128 x 64 tiles");
#define RF_Q8_THREADS RF_Q8_NORM_THREADS
#define RF_GEMM_KB 4          // quant blocks (32 k each) per shared-memory stage, whole
                              // canonical-sum stages (a multiple of RF_Q8_STAGE)
// Shared row pitch in bytes: 40 words = 8 (mod 32) banks, so the 8-byte fragment loads
// of a half-warp (4 rows x 4 lanes) hit 32 distinct banks.
#define RF_GEMM_PITCH (RF_GEMM_KB * RF_QK + 32)
static_assert(RF_GEMM_KB % RF_Q8_STAGE == 0, "a shared-memory stage holds whole sum stages");

// int32 accumulator start whose bits, read as fp32, are 1.5 * 2^23 + dot exactly for
// |dot| < 2^22 (a block's dot is at most 32 * 127 * 128): int -> float costs one add.
#define RF_GEMM_BIAS_BITS 0x4B400000
#define RF_GEMM_BIAS_VALUE 12582912.0f

struct alignas(16) rf_gemm_u32x4 {
    uint32_t v[4];
};
struct alignas(8) rf_gemm_u32x2 {
    uint32_t v[2];
};
struct alignas(16) rf_gemm_f32x4 {
    float v[4];
};

// ---------------------------------------------------------------------------------------
// Normalize (optional) and quantize activation rows into a global q8 buffer, in one of two
// layouts (where lane `sub` of a block's eight stores its packed word `slot` and the scale):
//   rows   xq int8 [rows, k], each 32-byte block in mma order; xd f32 [rows, k / 32]. The
//          GEMM's operand.
//   tiles  the MMV's operand: per 8-row tile j and canonical-sum stage s (RF_Q8_STAGE
//          blocks), 32 lane pieces of 8 * RF_Q8_STAGE bytes, piece 4g + t holding the
//          mma-order words 2t, 2t + 1 (elements 4t.., 16 + 4t..) of each block of the stage
//          for row 8j + g: one 16-byte load gives a lane its B fragments of a whole stage.
//          xd per (j, s): [row of the tile][block of the stage], so rows 2t, 2t + 1 are one
//          16-byte load. Stages are whole (the last one padded), rows past the batch unused.
struct rf_q8_rows_layout {
    __device__ __forceinline__ static void store(int8_t* xq, float* xd, int row, int k, int b, int slot,
                                       uint32_t packed, float d) {
        ((uint32_t*)(xq + (int64_t)row * k + b * RF_QK))[slot] = packed;
        if (slot == 0) {
            xd[(int64_t)row * (k / RF_QK) + b] = d;
        }
    }
};
struct rf_q8_tiles_layout {
    __device__ __forceinline__ static void store(int8_t* xq, float* xd, int row, int k, int b, int slot,
                                       uint32_t packed, float d) {
        const int n_stages = (k / RF_QK + RF_Q8_STAGE - 1) / RF_Q8_STAGE;
        const int64_t piece = (int64_t)((row >> 3) * n_stages + b / RF_Q8_STAGE) * 32;
        const int words = 2 * RF_Q8_STAGE;  // 4-byte words of a lane's piece
        ((uint32_t*)xq)[(piece + (row & 7) * 4 + (slot >> 1)) * words + (b % RF_Q8_STAGE) * 2 +
                        (slot & 1)] = packed;
        if (slot == 0) {
            xd[(piece / 4 + (row & 7)) * RF_Q8_STAGE + b % RF_Q8_STAGE] = d;
        }
    }
};

template <typename Layout>
RF_DEVICE_INLINE void rf_quantize_q8(const float* RF_RESTRICT x, int k, const float* RF_RESTRICT gain,
                                     float eps, int8_t* RF_RESTRICT xq, float* RF_RESTRICT xd) {
    __shared__ float s_partial[RF_Q8_THREADS / RF_WARP_SIZE];
    rf_pdl_begin();
    const int row = blockIdx.x;
    const int n_blocks = k / RF_QK;
    const float* xr = x + (int64_t)row * k;
    const float inv_rms = gain != nullptr ? rf_row_inv_rms(xr, k, eps, s_partial) : 1.0f;
    // Eight lanes per 32-element block, four elements each; every lane of the block
    // runs the one iteration, so the shuffles see whole warps.
    static_assert(RF_Q8_ROWS_BLOCKS * 8 == RF_Q8_THREADS, "eight lanes per quant block");
    const int sub = threadIdx.x & 7;
    const int slot = sub < 4 ? 2 * sub : 2 * (sub - 4) + 1;  // u32 index in mma order
    const int b = blockIdx.y * RF_Q8_ROWS_BLOCKS + (int)(threadIdx.x >> 3);
    const bool live = b < n_blocks;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (live) {
        const int e = b * RF_QK + sub * 4;
        const rf_gemm_f32x4 in = *(const rf_gemm_f32x4*)(xr + e);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = gain != nullptr ? rf_normalize(in.v[i], inv_rms, gain[e + i]) : in.v[i];
        }
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = fmaxf(amax, rf_shfl_xor(amax, 4));
    amax = fmaxf(amax, rf_shfl_xor(amax, 2));
    amax = fmaxf(amax, rf_shfl_xor(amax, 1));
    const float d = rf_q8_scale(amax);
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int q = rf_q8_round(v[i], amax, d);
        packed |= ((uint32_t)q & 0xFFu) << (8 * i);
    }
    if (live) {
        Layout::store(xq, xd, row, k, b, slot, packed, rf_q8_kept_scale(d));
    }
}

// rf_quantize_q8_rows and rf_quantize_q8_tiles: kernel_variants.py QuantizeRowsKernel.
#define RF_Q8_QUANTIZE_PARAMS                                                           \
    const float *RF_RESTRICT x, int k, const float *RF_RESTRICT gain, float eps,        \
        int8_t *RF_RESTRICT xq, float *RF_RESTRICT xd
#define RF_Q8_QUANTIZE_ARGS x, k, gain, eps, xq, xd

// ---------------------------------------------------------------------------------------
// Weight formats: how one (row, block) is fetched and expanded to 32 int8 in mma order.

// Four nibbles (one per byte) -> four int8 of nibble - 8, without borrows between bytes.
RF_DEVICE_INLINE uint32_t rf_gemm_nibbles_to_s8(uint32_t nibbles) {
    return ((nibbles | 0x80808080u) - 0x08080808u) ^ 0x80808080u;
}

struct rf_gemm_fmt_q4_0 {
    static constexpr int block_bytes = RF_QK / 2;
    static constexpr int loads = 1;  // 16-byte loads per block
    // Byte j of raw word q holds elements 4q + j (low nibble) and 16 + 4q + j (high).
    RF_DEVICE_INLINE void expand(const rf_gemm_u32x4 raw[loads], rf_gemm_u32x4 out[2]) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            out[q >> 1].v[(q & 1) * 2] = rf_gemm_nibbles_to_s8(raw[0].v[q] & 0x0F0F0F0Fu);
            out[q >> 1].v[(q & 1) * 2 + 1] = rf_gemm_nibbles_to_s8((raw[0].v[q] >> 4) & 0x0F0F0F0Fu);
        }
    }
};

struct rf_gemm_fmt_q8_0 {
    static constexpr int block_bytes = RF_QK;
    static constexpr int loads = 2;
    RF_DEVICE_INLINE void expand(const rf_gemm_u32x4 raw[loads], rf_gemm_u32x4 out[2]) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            out[q >> 1].v[(q & 1) * 2] = raw[0].v[q];      // elements 4q..4q+3
            out[q >> 1].v[(q & 1) * 2 + 1] = raw[1].v[q];  // elements 16+4q..16+4q+3
        }
    }
};

// Output column of tile row r (0..RF_GEMM_TILE_N) of N-tile `tile`. A SwiGLU tile holds
// 64 outputs: in each 64-row half (one group's rows) the 16-row mma tiles 0, 1 are gate
// rows and 2, 3 the up rows of the same outputs, so one lane holds both.
RF_DEVICE_INLINE int rf_gemm_out_col(int tile, int r, bool swiglu) {
    if (!swiglu) {
        return tile * RF_GEMM_TILE_N + r;
    }
    return tile * (RF_GEMM_TILE_N / 2) + (r >> 6) * 32 + ((r >> 4) & 1) * 16 + (r & 15);
}

// Weight row behind tile row r, or -1 past the matrix.
RF_DEVICE_INLINE int rf_gemm_weight_row(int tile, int r, int n, bool swiglu) {
    const int col = rf_gemm_out_col(tile, r, swiglu);
    if (col >= n) {
        return -1;
    }
    return swiglu && ((r >> 5) & 1) ? col + n : col;
}

struct alignas(16) rf_gemm_tiles {
    int8_t w[RF_GEMM_TILE_N * RF_GEMM_PITCH];
    int8_t x[RF_GEMM_TILE_M * RF_GEMM_PITCH];
    float wd[RF_GEMM_KB * RF_GEMM_TILE_N];  // [block][tile row]
    float xd[RF_GEMM_KB * RF_GEMM_TILE_M];  // [block][tile row]
};

template <typename Format>
RF_DEVICE_INLINE void rf_gemm(const uint8_t* RF_RESTRICT w_qs, const uint16_t* RF_RESTRICT w_d,
                              int n, int k, const int8_t* RF_RESTRICT xq,
                              const float* RF_RESTRICT xd, int n_rows, int epilogue,
                              const float* residual, float* out) {
    __shared__ rf_gemm_tiles s;
    rf_pdl_begin();
    const int tid = threadIdx.x;
    const int n_blocks = k / RF_QK;
    const int m0 = blockIdx.x * RF_GEMM_TILE_M;
    const int tile = blockIdx.y;
    const bool swiglu = epilogue == RF_EPILOGUE_SWIGLU;
    const int64_t w_row_bytes = (int64_t)n_blocks * Format::block_bytes;

    // What this thread copies per stage: block (tid & 3) of tile rows p * 32 + tid / 4
    // (p = 0..3), the scales of tile row tid, 16 bytes (chunk tid & 7) of activation rows
    // p * 16 + tid / 8, and two scales of activation row tid & 63.
    const int w_block = tid & 3;
    int w_rows[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        w_rows[p] = rf_gemm_weight_row(tile, p * 32 + (tid >> 2), n, swiglu);
    }
    const int wd_row = rf_gemm_weight_row(tile, tid, n, swiglu);
    const int x_chunk = tid & 7;
    const int xd_row = tid & (RF_GEMM_TILE_M - 1), xd_block = (tid >> 6) * 2;
    const bool xd_live = m0 + xd_row < n_rows;

    rf_gemm_u32x4 w_raw[4][Format::loads];
    float w_scale[RF_GEMM_KB];
    rf_gemm_u32x4 x_raw[4];
    float x_scale[2];

    auto fetch = [&](int kb0) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int kb = kb0 + w_block;
            const bool live = w_rows[p] >= 0 && kb < n_blocks;
            const uint8_t* src = w_qs + (live ? w_rows[p] * w_row_bytes + kb * Format::block_bytes : 0);
#pragma unroll
            for (int l = 0; l < Format::loads; ++l) {
                w_raw[p][l] = live ? *(const rf_gemm_u32x4*)(src + 16 * l) : rf_gemm_u32x4{{0, 0, 0, 0}};
            }
        }
#pragma unroll
        for (int c = 0; c < RF_GEMM_KB; ++c) {
            const int kb = kb0 + c;
            w_scale[c] = wd_row >= 0 && kb < n_blocks
                             ? rf_half_to_float(w_d[(int64_t)wd_row * n_blocks + kb])
                             : 0.0f;
        }
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int row = m0 + p * 16 + (tid >> 3);
            const bool live = row < n_rows && kb0 + (x_chunk >> 1) < n_blocks;
            x_raw[p] = live ? *(const rf_gemm_u32x4*)(xq + (int64_t)row * k + kb0 * RF_QK + x_chunk * 16)
                            : rf_gemm_u32x4{{0, 0, 0, 0}};
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int kb = kb0 + xd_block + c;
            x_scale[c] = xd_live && kb < n_blocks ? xd[(int64_t)(m0 + xd_row) * n_blocks + kb] : 0.0f;
        }
    };
    auto stash = [&]() {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            rf_gemm_u32x4 e[2];
            Format::expand(w_raw[p], e);
            rf_gemm_u32x4* dst =
                (rf_gemm_u32x4*)(s.w + (p * 32 + (tid >> 2)) * RF_GEMM_PITCH + w_block * RF_QK);
            dst[0] = e[0];
            dst[1] = e[1];
        }
#pragma unroll
        for (int c = 0; c < RF_GEMM_KB; ++c) {
            s.wd[c * RF_GEMM_TILE_N + tid] = w_scale[c];
        }
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            *(rf_gemm_u32x4*)(s.x + (p * 16 + (tid >> 3)) * RF_GEMM_PITCH + x_chunk * 16) = x_raw[p];
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            s.xd[(xd_block + c) * RF_GEMM_TILE_M + xd_row] = x_scale[c];
        }
    };

    const int group = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wn = group & 1, wm = group >> 1;  // this group's 64 tile rows and 32 activation rows

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[i][j][e] = 0.0f;
            }
        }
    }

    fetch(0);
    for (int kb0 = 0; kb0 < n_blocks; kb0 += RF_GEMM_KB) {
        stash();
        __syncthreads();
        if (kb0 + RF_GEMM_KB < n_blocks) {
            fetch(kb0 + RF_GEMM_KB);  // global loads in flight during the math below
        }
        // One canonical-sum stage (RF_Q8_STAGE blocks) at a time: each output's stage sum
        // is built over the stage's blocks in order, then added to its total.
#pragma unroll
        for (int kb_stage = 0; kb_stage < RF_GEMM_KB; kb_stage += RF_Q8_STAGE) {
            if (kb0 + kb_stage < n_blocks) {
                uint32_t a[RF_Q8_STAGE][4][4], b[RF_Q8_STAGE][4][2];
                float dw[RF_Q8_STAGE][4][2], dx[RF_Q8_STAGE][4][2];
#pragma unroll
                for (int h = 0; h < RF_Q8_STAGE; ++h) {
                    const int kb = kb_stage + h;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = wn * 64 + i * 16 + g;
                        const int8_t* src = s.w + r * RF_GEMM_PITCH + kb * RF_QK + 8 * t;
                        const rf_gemm_u32x2 lo = *(const rf_gemm_u32x2*)src;
                        const rf_gemm_u32x2 hi = *(const rf_gemm_u32x2*)(src + 8 * RF_GEMM_PITCH);
                        a[h][i][0] = lo.v[0];
                        a[h][i][1] = hi.v[0];
                        a[h][i][2] = lo.v[1];
                        a[h][i][3] = hi.v[1];
                        dw[h][i][0] = s.wd[kb * RF_GEMM_TILE_N + r];
                        dw[h][i][1] = s.wd[kb * RF_GEMM_TILE_N + r + 8];
                    }
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int m = wm * 32 + j * 8;
                        const rf_gemm_u32x2 v = *(const rf_gemm_u32x2*)(s.x + (m + g) * RF_GEMM_PITCH +
                                                                        kb * RF_QK + 8 * t);
                        b[h][j][0] = v.v[0];
                        b[h][j][1] = v.v[1];
                        dx[h][j][0] = s.xd[kb * RF_GEMM_TILE_M + m + 2 * t];
                        dx[h][j][1] = s.xd[kb * RF_GEMM_TILE_M + m + 2 * t + 1];
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        float stage[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                        for (int h = 0; h < RF_Q8_STAGE; ++h) {
                            if (kb0 + kb_stage + h < n_blocks) {
                                int c[4] = {RF_GEMM_BIAS_BITS, RF_GEMM_BIAS_BITS,
                                            RF_GEMM_BIAS_BITS, RF_GEMM_BIAS_BITS};
                                rf_mma_s8_m16n8k32(c, a[h][i], b[h][j]);
#pragma unroll
                                for (int e = 0; e < 4; ++e) {
                                    const float dot = rf_int_as_float(c[e]) - RF_GEMM_BIAS_VALUE;
                                    stage[e] = rf_q8_stage_add(stage[e], dw[h][i][e >> 1],
                                                               dx[h][j][e & 1], dot);
                                }
                            }
                        }
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            acc[i][j][e] += stage[e];
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    // Epilogue: lane holds tile rows wn*64 + i*16 + g (+8) x activation rows
    // wm*32 + j*8 + 2t (+1).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (swiglu && i >= 2) {
            break;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = wn * 64 + i * 16 + g + (e >> 1) * 8;
                const int col = rf_gemm_out_col(tile, r, swiglu);
                const int row = m0 + wm * 32 + j * 8 + 2 * t + (e & 1);
                if (col < n && row < n_rows) {
                    const int64_t o = (int64_t)row * n + col;
                    float y = acc[i][j][e];
                    if (epilogue == RF_EPILOGUE_RESIDUAL) {
                        y += residual[o];
                    } else if (swiglu) {
                        y = rf_swiglu(y, acc[(i + 2) & 3][j][e]);  // the up row
                    }
                    out[o] = y;
                }
            }
        }
    }
}

// rf_gemm_q4_0 and rf_gemm_q8_0: kernel_variants.py GemmKernel.
#define RF_GEMM_PARAMS                                                                    \
    const uint8_t *RF_RESTRICT w_qs, const uint16_t *RF_RESTRICT w_d, int n, int k,      \
        const int8_t *RF_RESTRICT xq, const float *RF_RESTRICT xd, int n_rows, int epilogue, \
        const float *residual, float *out
#define RF_GEMM_ARGS w_qs, w_d, n, k, xq, xd, n_rows, epilogue, residual, out

// ---------------------------------------------------------------------------------------
// Decode-batch matmul (MMV): out[t, :] = W x[t, :] for a few activation rows t (up to
// 8 * TW * MS per launch: the rows of a decode step), from rf_quantize_q8_tiles' output,
// on the int8 matrix units with each weight block loaded once for all rows. Every output
// is the canonical sum of rf_q8.h, so a row's outputs are bit-identical here, in the GEMV
// and in the GEMM.
//
// A block owns one 16-row weight tile, the A operand of mma.m16n8k32 (one quant block
// per mma: the scales are per block), and every activation row, in 8-row B tiles. Tile
// row g (0..7) and g + 8 are one lane's pair of outputs: outputs 2g and 2g + 1 of the
// tile (16 outputs; the _rope kernels rotate them as an (even, odd) pair), or with SwiGLU
// the gate and up rows of output g (8 outputs). A lane loads bytes 4t..4t+3 of each of
// its two rows' blocks: for Q4_0 the low nibbles are elements 4t..4t+3 (a0 / a1) and the
// high nibbles 16 + 4t.. (a2 / a3), the GGUF order itself. Its B fragments and
// activation scales of one stage and tile are one 16-byte load each (the tiles layout).
//
// The block's KS * MS warps split k KS ways and the B tiles MS ways (TW each). Along k,
// warp w takes canonical-sum stages w, w + KS, ... in rounds of CH stages, loading the
// next round's weights while it computes this one's. With KS > 1 each stage sum goes to
// shared memory and, after each round, the block adds the round's stage sums to each
// output's total in stage order; with KS = 1 a warp adds its stage sums itself. Warps
// are 32-lane groups, whatever the hardware's warp size.
//
// Launch: rf_quantize_q8_tiles over the rows first; then grid (ceil(n / outputs per
// tile)), block 32 * KS * MS, no dynamic shared memory. n_rows <= 8 * TW * MS.

#define RF_MMV_SHARED_BYTES 40960  // the most stage sums a block keeps (a round's)
#define RF_MMV_PITCH 20  // floats per activation row of a stage's sums: 16 + 4 (bank spread)
#define RF_MMV_PLAIN 0
#define RF_MMV_SWIGLU 1
#define RF_MMV_ROPE 2
static_assert(RF_Q8_STAGE == 2, "a lane's 16-byte operand load holds one two-block stage");

// A lane's words of one (weight row, block) and their A-fragment halves (int8 in k order:
// elements 4t..4t+3, then 16 + 4t..16 + 4t + 3).
struct rf_mmv_q4_0 {
    static constexpr int words = 1;
    static constexpr int block_bytes = RF_QK / 2;
    __device__ __forceinline__ static void load(uint32_t w[words], const uint8_t* block, int t) {
        w[0] = *(const uint32_t*)(block + 4 * t);
    }
    __device__ __forceinline__ static void expand(const uint32_t w[words], uint32_t& lo, uint32_t& hi) {
        lo = rf_gemm_nibbles_to_s8(w[0] & 0x0F0F0F0Fu);
        hi = rf_gemm_nibbles_to_s8((w[0] >> 4) & 0x0F0F0F0Fu);
    }
};
struct rf_mmv_q8_0 {
    static constexpr int words = 2;
    static constexpr int block_bytes = RF_QK;
    __device__ __forceinline__ static void load(uint32_t w[words], const uint8_t* block, int t) {
        w[0] = *(const uint32_t*)(block + 4 * t);
        w[1] = *(const uint32_t*)(block + 16 + 4 * t);
    }
    __device__ __forceinline__ static void expand(const uint32_t w[words], uint32_t& lo, uint32_t& hi) {
        lo = w[0];
        hi = w[1];
    }
};

// Weight row behind tile row r of tile `tile` (-1 past the matrix), and the output of the
// lane pair (g, g + 8): its first output, 2 outputs per pair (1 with SwiGLU).
template <int VARIANT>
RF_DEVICE_INLINE int rf_mmv_out(int tile, int g) {
    return VARIANT == RF_MMV_SWIGLU ? tile * 8 + g : tile * 16 + 2 * g;
}
template <int VARIANT>
RF_DEVICE_INLINE int rf_mmv_weight_row(int tile, int r, int n) {
    const int o = rf_mmv_out<VARIANT>(tile, r & 7);
    if (VARIANT == RF_MMV_SWIGLU) {
        return o < n ? o + (r >= 8 ? n : 0) : -1;
    }
    const int row = o + (r >> 3);
    return row < n ? row : -1;
}

// Store the outputs of activation row m from the lane pair (g, g + 8), whose sums are y0
// (tile row g) and y1 (tile row g + 8).
template <int VARIANT>
RF_DEVICE_INLINE void rf_mmv_store(int tile, int g, int m, float y0, float y1, int n,
                                   int n_rows, int epilogue, const float* residual, float* out,
                                   const rf_rope_out& rope) {
    const int o = rf_mmv_out<VARIANT>(tile, g);
    if (m >= n_rows || o >= n) {
        return;
    }
    const int64_t at = (int64_t)m * n + o;
    if (VARIANT == RF_MMV_SWIGLU) {
        out[at] = rf_swiglu(y0, y1);
    } else if (VARIANT == RF_MMV_ROPE) {
        rf_rope_store(rope, m, o, y0, y1);
    } else {
        const bool add = epilogue == RF_EPILOGUE_RESIDUAL;
        out[at] = add ? y0 + residual[at] : y0;
        if (o + 1 < n) {
            out[at + 1] = add ? y1 + residual[at + 1] : y1;
        }
    }
}

__host__ __device__ constexpr int rf_clamp_int(int v, int lo, int hi) {
    return v < lo ? lo : v > hi ? hi : v;
}

// One round's weights of a lane: [stage of the round][block of the stage][tile row g, g + 8].
template <typename Format, int CH>
struct rf_mmv_weights {
    uint32_t q[CH][RF_Q8_STAGE][2][Format::words];
    float d[CH][RF_Q8_STAGE][2];
};

template <typename Format, int VARIANT, int TW, int KS, int MS>
RF_DEVICE_INLINE void rf_mmv(const uint8_t* RF_RESTRICT w_qs, const uint16_t* RF_RESTRICT w_d,
                             int n, int k, const int8_t* RF_RESTRICT xq,
                             const float* RF_RESTRICT xd, int n_rows, int epilogue,
                             const float* residual, float* out, const rf_rope_out& rope) {
    constexpr int THREADS = 32 * KS * MS;
    constexpr int M_PAD = 8 * TW * MS;  // activation rows of the block
    constexpr int SLOT_FLOATS = M_PAD * RF_MMV_PITCH;  // one stage's sums
    // Stages per round: as many as RF_MMV_SHARED_BYTES of stage sums hold, 1 to 4.
    constexpr int CH = KS == 1 ? 4 : rf_clamp_int(RF_MMV_SHARED_BYTES / (KS * SLOT_FLOATS * 4), 1, 4);
    constexpr int PAIRS = (M_PAD * 8 + THREADS - 1) / THREADS;  // lane pairs a thread folds
    constexpr int SLOTS = KS > 1 ? KS * CH : 1;  // stage sums of one round
    __shared__ __align__(16) float s_sums[SLOTS * SLOT_FLOATS];

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int ks = warp % KS, ms = warp / KS;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x;
    const int block_tiles = (n_rows + 7) / 8;  // B tiles holding a row
    const int live_tiles = min(TW, block_tiles - ms * TW);  // the warp's (warp-uniform)
    const int n_blocks = k / RF_QK;
    const int n_stages = (n_blocks + RF_Q8_STAGE - 1) / RF_Q8_STAGE;
    const int64_t row_bytes = (int64_t)n_blocks * Format::block_bytes;
    int w_row[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        w_row[r] = rf_mmv_weight_row<VARIANT>(tile, g + 8 * r, n);
    }
    // A stage's two f16 scales of a row are one aligned 4-byte word when n_blocks is even.
    const bool paired_scales = n_blocks % 2 == 0;

    auto load_weights = [&](rf_mmv_weights<Format, CH>& w, int round) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int b0 = ((round * CH + i) * KS + ks) * RF_Q8_STAGE;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const bool row_live = w_row[r] >= 0 && b0 < n_blocks;
                const uint16_t* scales = w_d + (int64_t)w_row[r] * n_blocks + b0;
                if (row_live && paired_scales) {
                    const uint32_t pair = *(const uint32_t*)scales;
                    w.d[i][0][r] = rf_half_to_float((uint16_t)(pair & 0xFFFFu));
                    w.d[i][1][r] = rf_half_to_float((uint16_t)(pair >> 16));
                }
#pragma unroll
                for (int h = 0; h < RF_Q8_STAGE; ++h) {
                    if (row_live && b0 + h < n_blocks) {
                        Format::load(w.q[i][h][r], w_qs + w_row[r] * row_bytes + (b0 + h) * Format::block_bytes, t);
                        if (!paired_scales) {
                            w.d[i][h][r] = rf_half_to_float(scales[h]);
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < Format::words; ++e) {
                            w.q[i][h][r][e] = 0u;
                        }
                        w.d[i][h][r] = 0.0f;
                    }
                }
            }
        }
    };
    const int n_rounds = (n_stages + KS * CH - 1) / (KS * CH);
    rf_mmv_weights<Format, CH> w;
    load_weights(w, 0);  // in flight while the previous kernel finishes
    rf_pdl_wait();

    float acc[TW][4];  // KS == 1: the lane's totals (mma C layout)
    float total[PAIRS][2];  // KS > 1: this thread's pairs' totals
#pragma unroll
    for (int j = 0; j < TW; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc[j][e] = 0.0f;
        }
    }
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
        total[p][0] = total[p][1] = 0.0f;
    }

    for (int round = 0; round < n_rounds; ++round) {
        rf_mmv_weights<Format, CH> next;
        if (round + 1 < n_rounds) {
            load_weights(next, round + 1);
        }
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int stage = (round * CH + i) * KS + ks;
            if (stage >= n_stages) {
                continue;
            }
            // Every tile's B fragments and scales of the stage in flight at once.
            rf_gemm_u32x4 xb[TW];
            rf_gemm_f32x4 dx[TW];
#pragma unroll
            for (int j = 0; j < TW; ++j) {
                if (j < live_tiles) {
                    const int64_t piece = (int64_t)(ms * TW + j) * n_stages + stage;
                    xb[j] = *(const rf_gemm_u32x4*)(xq + (piece * 32 + lane) * 16);
                    dx[j] = *(const rf_gemm_f32x4*)(xd + (piece * 8 + 2 * t) * 2);
                }
            }
            uint32_t a[RF_Q8_STAGE][4];
#pragma unroll
            for (int h = 0; h < RF_Q8_STAGE; ++h) {
                Format::expand(w.q[i][h][0], a[h][0], a[h][2]);
                Format::expand(w.q[i][h][1], a[h][1], a[h][3]);
            }
#pragma unroll
            for (int j = 0; j < TW; ++j) {
                if (j >= live_tiles) {
                    continue;
                }
                float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int h = 0; h < RF_Q8_STAGE; ++h) {
                    if (stage * RF_Q8_STAGE + h < n_blocks) {
                        int c[4] = {RF_GEMM_BIAS_BITS, RF_GEMM_BIAS_BITS, RF_GEMM_BIAS_BITS,
                                    RF_GEMM_BIAS_BITS};
                        const uint32_t b[2] = {xb[j].v[2 * h], xb[j].v[2 * h + 1]};
                        rf_mma_s8_m16n8k32(c, a[h], b);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float dot = rf_int_as_float(c[e]) - RF_GEMM_BIAS_VALUE;
                            sum[e] = rf_q8_stage_add(sum[e], w.d[i][h][e >> 1], dx[j].v[2 * (e & 1) + h], dot);
                        }
                    }
                }
                if (KS == 1) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc[j][e] += sum[e];
                    }
                } else {
                    // The stage's sums by (activation row, pair): {tile row g, tile row g + 8}.
                    float* slot = s_sums + (i * KS + ks) * SLOT_FLOATS;
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int m = (ms * TW + j) * 8 + 2 * t + e;
                        *(float2*)(slot + m * RF_MMV_PITCH + 2 * g) = make_float2(sum[e], sum[2 + e]);
                    }
                }
            }
        }
        if (KS > 1) {
            // Add the round's stage sums to each output's total, in stage order.
            __syncthreads();
            const int round_stages = min(KS * CH, n_stages - round * KS * CH);
#pragma unroll
            for (int p = 0; p < PAIRS; ++p) {
                const int pair = p * THREADS + tid;
                if (pair < block_tiles * 64) {  // block_tiles <= TW * MS
                    const float* src = s_sums + (pair >> 3) * RF_MMV_PITCH + 2 * (pair & 7);
                    for (int s = 0; s < round_stages; ++s) {
                        const float2 v = *(const float2*)(src + s * SLOT_FLOATS);
                        total[p][0] += v.x;
                        total[p][1] += v.y;
                    }
                }
            }
            __syncthreads();
        }
        w = next;
    }
    rf_pdl_launch_dependents();

    if (KS == 1) {
#pragma unroll
        for (int j = 0; j < TW; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = (ms * TW + j) * 8 + 2 * t + e;
                rf_mmv_store<VARIANT>(tile, g, m, acc[j][e], acc[j][2 + e], n, n_rows, epilogue,
                                      residual, out, rope);
            }
        }
    } else {
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) {
            const int pair = p * THREADS + tid;
            if (pair < M_PAD * 8) {
                rf_mmv_store<VARIANT>(tile, pair & 7, pair >> 3, total[p][0], total[p][1], n,
                                      n_rows, epilogue, residual, out, rope);
            }
        }
    }
}

#define RF_MMV_PARAMS RF_GEMM_PARAMS  // the GEMM's
// The QKV projection with RoPE + KV-append (rf_rope.h) in place of the store.
#define RF_MMV_ROPE_PARAMS                                                                \
    const uint8_t *RF_RESTRICT w_qs, const uint16_t *RF_RESTRICT w_d, int n, int k,      \
        const int8_t *RF_RESTRICT xq, const float *RF_RESTRICT xd, int n_rows,            \
        const int32_t *positions, const int32_t *slots, const float *cos_table,           \
        const float *sin_table, float *q_out, uint8_t *k_cache, uint8_t *v_cache,         \
        int q_dim, int kv_dim, int head_dim, int rope_dims, int n_ctx
#define RF_MMV_CALL(format, variant, tw, ks, ms)                                          \
    rf_mmv<format, variant, tw, ks, ms>(w_qs, w_d, n, k, xq, xd, n_rows, epilogue, residual, \
                                        out, rf_rope_out{})
#define RF_MMV_ROPE_CALL(format, tw, ks, ms, fp8)                                                 \
    rf_mmv<format, RF_MMV_ROPE, tw, ks, ms>(                                                      \
        w_qs, w_d, n, k, xq, xd, n_rows, RF_EPILOGUE_STORE, nullptr, nullptr,                     \
        rf_rope_out{positions, slots, cos_table, sin_table, q_out, k_cache, v_cache, q_dim, kv_dim, \
                    head_dim, rope_dims, n_ctx, fp8})

// rf_mmv_<fmt>_t<TW>_k<KS>_m<MS>[_swiglu|_rope|_rope_fp8] (block 32 * KS * MS) for up to
// 8 * TW * MS rows (_rope_fp8: into an fp8 KV pool): kernel_variants.py MMV_KERNELS, appended
// when the source is compiled.
