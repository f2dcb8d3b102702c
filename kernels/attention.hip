// Attention over the KV pool with grouped-query heads, on the fp16 matrix units: a
// decode kernel (few tokens, any slots, the context split across blocks) and a prefill
// kernel (a prompt chunk of one slot, FlashAttention-2 style). Both compute every (token,
// head) output with the same arithmetic, so a token gives bit-identical results through
// either:
//
//   q * qscale (qscale = log2(e) / sqrt(d): scores in the log2 domain) enters the fp16
//   matrix units as two fp16 parts, hi + lo, rounded to nearest even:
//     hi = fp16(q[c] * qscale), lo = fp16(fmaf(q[c], qscale, -hi)),
//   so q keeps about 22 bits instead of fp16's 11 (the keys are fp16 already). The
//   context 0..L-1 (L = position + 1) goes in key tiles of RF_ATTN_TILE = 64 positions
//   aligned at position 0; tile j gives a part (m, l, acc):
//     s   = hi . k + lo . k for the tile's positions: per 8 positions, over k-steps of 16
//           dims in order, from 0, rf_mma_f16_m16n8k16 of hi then of lo, both into the
//           same fp32 accumulators; -inf past the token's position;
//     m   = the maximum of s; p = fp16(rf_exp2(s - m)) (0 where s = -inf);
//     l   = the sum of p: the lane of the row's quad that holds columns 2t, 2t+1 of
//           each 8 positions k = 0..7 adds each pair (w_k), then sums ((w0 + w1) +
//           (w2 + w3)) + ((w4 + w5) + (w6 + w7)); then the quad's butterfly (^1, ^2);
//     acc = p . v: per 8 dims, rf_mma_f16_m16n8k16 over the tile's 4 k-steps of 16
//           positions in order, from 0.
//   The fold of a part (m, l, acc) into a state (M, Lsum, A):
//     M' = fmaxf(M, m), alpha = rf_exp2(M - M'), beta = rf_exp2(m - M'),
//     Lsum = fmaf(l, beta, Lsum * alpha), A[c] = fmaf(acc[c], beta, A[c] * alpha).
//   A context of up to RF_ATTN_ONE_SPAN_TILES tiles is one span; a longer one goes in
//   spans of RF_ATTN_SPAN tiles (span s: tiles s RF_ATTN_SPAN, ...). The parts of a span's
//   tiles fold in order into a state that starts at (-inf, 0, 0), the span's state. A
//   context of one span ends with that state; a longer one folds its spans' states (M,
//   Lsum, A as a part's m, l, acc) in order into a state that starts at (-inf, 0, 0). The
//   output is A[c] / Lsum of the last state. The rows of an mma are independent, so a
//   row's result depends on its own q, the K/V rows and this decomposition only, not on
//   which rows share its fragments. A tile wholly past a row's position gives that row no part: the
//   prefill kernel, whose rows end at different tiles, skips the row's fold there (its p
//   is 0, so the values mma of the other rows adds nothing to it).
//
// q        fp32 [n_tokens, n_head, d]   (d = head dim, dk == dv here, d <= 128, d % 32 == 0)
// k_cache, v_cache [n_slots, n_ctx, n_kv, d] of this layer: fp16, or fp8 E4M3 for the
//                  kernels named _fp8 (rf_kv.h), which widen each staged tile to fp16
//                  (exactly), so the arithmetic below is the same on either pool
// positions, slots int32 [n_tokens]: token t attends to cache positions 0..positions[t]
//                  of slot slots[t] (step state, read on the device)
// out      fp32 [n_tokens, n_head * d]
// xq, ahead (decode kernel) in a one-row step: the output row quantized for the O
//          projection (else nullptr), and 1 (else 0): stage the cache before the wait
// wave     (decode kernel) the blocks the device runs at once (0: a block takes one tile)
// fold     (decode kernel) 1: its last blocks fold the parts; 0: rf_attention_fold_d<D> does
//
// rf_attention_decode_d<D>: head dim D; a block per (KV head, token, tile) computes the part
//   of each head of the group (the rows of one 16-row mma block; rows past the group idle).
//   Its 4 warps stage the tile's K and V rows in shared memory; warp w takes positions
//   16 w..16 w + 15 of s and p, passing the row maxima (exact in any order) and its pair
//   sums w_2w + w_2w+1 to the others through shared memory, then a share of the value
//   columns. A context of up to RF_ATTN_DECODE_TILES(D) tiles (their K and V fit the
//   stage together: 2 at D = 64) is block 0's alone: it stages them all at once and folds
//   their parts as it computes them, in order. A longer context takes a block a tile, or a
//   block per two tiles (RF_ATTN_DECODE_PART_TILES(D): where the stage holds them) when
//   a block a tile would need more than `wave` blocks: the parts are the same, the
//   launch takes half the waves. Its parts go to `partial`
//   [n_tokens, n_head, max_tiles + max_spans, d + 4] (records acc[d], m, l, 2 unused:
//   each tile's part, then each span's state; max_spans = ceil(max_tiles / RF_ATTN_SPAN)).
//   The last block of a span to finish folds its parts; with more than one span it
//   writes the span's state, and the last span to finish folds every span's state. A
//   folding thread loads RF_ATTN_FOLD_BATCH records at a time, one batch on its way while
//   the one before is folded (counters uint32 [n_tokens, n_kv, 1 + max_spans]: the spans
//   done, then each span's blocks done; zero before the first launch, reset by the block
//   that finds its count complete). With `fold` = 0 the blocks only write the parts, and
//   rf_attention_fold_d<D>, launched next, folds them.
//   The grid is sized for the whole context; blocks past the token's last tile exit. In a
//   one-row step a block stages the cache rows before the token's position ahead of its
//   wait for the previous kernel (they are earlier steps').
//   Launch: grid (n_kv, n_tokens, max_tiles), block RF_ATTN_WARPS * 32.
// rf_attention_fold_d<D>: the fold of a decode launch's parts (its `fold` = 0), in a kernel
//   of its own: a block per (head, token), whose context of more than
//   RF_ATTN_DECODE_TILES(D) tiles it folds as the decode kernel's last blocks would, into
//   the same bits. Its threads copy the records of as many spans as its shared memory
//   holds (rf_attn_fold_shared: 160 tiles at D = 64) at once, one round trip, then fold
//   them there: a context of one span by the first D / 4 threads (a thread per 4 dims); a
//   longer one a span per D / 4 threads (GROUPS spans a round), whose states the first
//   D / 4 fold in order. In a one-row step those threads also quantize the head's output
//   for the O projection (`xq`) from their registers.
//   Launch: grid (n_head, n_tokens), block RF_ATTN_WARPS * 32.
// rf_attention_prefill_d<D>: the tokens of one slot (a prompt chunk), head dim D. A block
//   takes one KV head and RF_ATTN_PREFILL_ROWS / group tokens: query rows (token, head of
//   the group), token-major, 16 a warp, whose q fragments (hi and lo) and span state stay
//   in registers; a row of more than one span folds its span state at each span's first
//   tile into the spans' state ((M, Lsum) in shared memory, A in the row's `out`).
//   The block stages the tiles up to its last token's position once for all its warps,
//   cp.async on NVIDIA: for D <= 64 the next tile loads while this one is used; for
//   larger D (one buffer each fits 48 KiB) K of the next tile loads while the values of
//   this one are used, and V while its scores are computed. A warp computes the tiles up
//   to its own last row's.
//   Launch: grid (n_kv, ceil(n_tokens / (RF_ATTN_PREFILL_ROWS / group))),
//           block RF_ATTN_WARPS * 32.
//
// A "warp" here is an aligned group of 32 lanes (threadIdx.x / 32): a CUDA warp, half a
// CDNA wavefront.
#include "rf_portability.h"
#include "rf_constants.h"
#include "rf_q8.h"
#include "rf_kv.h"

// From rf_constants.h: RF_ATTN_TILE (key positions a tile), RF_ATTN_SPAN and
// RF_ATTN_ONE_SPAN_TILES (the fold's spans), RF_ATTN_WARPS (warps a block),
// RF_ATTN_PREFILL_ROWS (query rows a prefill block takes), RF_ATTN_MAX_GROUP (query heads
// per KV head) and RF_ATTN_MAX_D (head dim).
static_assert(RF_ATTN_TILE == 64, "the fragment code is written for 64-position tiles");
static_assert(RF_ATTN_PREFILL_ROWS == 16 * RF_ATTN_WARPS, "a warp takes 16 query rows");
static_assert(RF_ATTN_WARPS == 4, "a decode warp takes 2 of a tile's 8 column blocks");
static_assert(RF_ATTN_MAX_GROUP <= 16, "a token's heads fit one 16-row mma block");
static_assert(RF_ATTN_MAX_D == 128, "the kernels are instantiated for d = 32, 64, 96, 128");
#define RF_ATTN_THREADS (RF_ATTN_WARPS * 32)
#define RF_ATTN_CHUNK 8  // 8-dim column blocks of acc computed at a time (registers)
#define RF_ATTN_FOLD_BATCH 6  // parts of a folding thread's batch (two batches: registers)
#define RF_ATTN_STAGE(D) (RF_ATTN_TILE * ((D) + 8))  // halves a staged tile of head dim D

struct alignas(8) rf_attn_f32x2 {
    float v[2];
};
struct alignas(16) rf_attn_f32x4 {
    float v[4];
};

struct alignas(16) rf_attn_u32x4 {
    uint32_t v[4];
};

// Rows [0, RF_ATTN_TILE) of a K or V tile into shared memory, D + 8 halves apart (16-byte
// aligned; the 8 rows an ldmatrix reads hit 32 distinct banks): rows [0, n) from `src`
// (`stride` elements apart), zeros past n, row `skip` left as it is (-1: none). Every
// thread of the block takes part; cp.async on NVIDIA (the caller commits and waits). The
// copy of 16-byte piece i (of a row's D / 8 fp16, or D / 16 fp8 pieces, row by row) is
// thread i % RF_ATTN_THREADS's. An fp8 pool's piece c of a row lands in the second half of
// the 32 bytes it widens to (bytes 32 c + 16..), so that the thread that copied it widens it
// in place (rf_attn_widen, which also writes the zeros past n) once its copies are done,
// touching no other thread's bytes.
template <int D, bool FP8>
RF_DEVICE_INLINE void rf_attn_stage(uint16_t* dst, const rf_kv_t<FP8>* src, int64_t stride,
                                    int n, int skip = -1) {
    constexpr int PER_ROW = D / (FP8 ? 16 : 8), CHUNKS = RF_ATTN_TILE * PER_ROW;
    static_assert(CHUNKS % RF_ATTN_THREADS == 0, "whole rounds of 16-byte copies");
#pragma unroll
    for (int i = (int)threadIdx.x; i < CHUNKS; i += RF_ATTN_THREADS) {
        const int row = i / PER_ROW, c = i % PER_ROW;
        const bool fill = row < n;
        if (row != skip && (fill || !FP8)) {
            rf_cp_async16(dst + row * (D + 8) + (FP8 ? 16 * c + 8 : 8 * c),
                          fill ? src + row * stride + 16 * c / (FP8 ? 1 : 2) : src, fill);
        }
    }
}
// Row `row` of a K or V tile staged as rf_attn_stage does (fp8: by the threads that copy
// its pieces there).
template <int D, bool FP8>
RF_DEVICE_INLINE void rf_attn_stage_row(uint16_t* dst, const rf_kv_t<FP8>* src, int64_t stride,
                                        int row) {
    constexpr int PER_ROW = D / (FP8 ? 16 : 8);
    const int c = FP8 ? ((int)threadIdx.x - row * PER_ROW % RF_ATTN_THREADS + RF_ATTN_THREADS) %
                            RF_ATTN_THREADS
                      : (int)threadIdx.x;  // fp16: any threads will do
    if (c < PER_ROW) {
        rf_cp_async16(dst + row * (D + 8) + (FP8 ? 16 * c + 8 : 8 * c),
                      src + row * stride + 16 * c / (FP8 ? 1 : 2), true);
    }
}
// The fp8 pieces this thread copied into a tile's rows [0, n) (rf_attn_stage,
// rf_attn_stage_row: done, the caller has waited for them) widened to fp16 in place, and
// zeros in its pieces of the rows past n; the block's barrier after it shows them to the
// others.
template <int D>
RF_DEVICE_INLINE void rf_attn_widen(uint16_t* tile, int n) {
    constexpr int PER_ROW = D / 16, CHUNKS = RF_ATTN_TILE * PER_ROW;
#pragma unroll
    for (int i = (int)threadIdx.x; i < CHUNKS; i += RF_ATTN_THREADS) {
        uint16_t* piece = tile + i / PER_ROW * (D + 8) + 16 * (i % PER_ROW);
        rf_attn_u32x4 lo = {{0u, 0u, 0u, 0u}}, hi = lo;  // elements 0..7, 8..15
        if (i / PER_ROW >= n) {
            *(rf_attn_u32x4*)piece = lo;
            *(rf_attn_u32x4*)(piece + 8) = hi;
            continue;
        }
        const rf_attn_u32x4 raw = *(const rf_attn_u32x4*)(piece + 8);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            rf_e4m3x4_to_half2x2(raw.v[w], lo.v[2 * w], lo.v[2 * w + 1]);
            rf_e4m3x4_to_half2x2(raw.v[2 + w], hi.v[2 * w], hi.v[2 * w + 1]);
        }
        *(rf_attn_u32x4*)piece = lo;
        *(rf_attn_u32x4*)(piece + 8) = hi;
    }
}

// The fp16 parts (hi, lo) of q * qscale for two consecutive dims x0, x1 (see the top), as
// fp16 pairs (A fragment registers). lo's fmaf is explicit so that no compiler contracts
// or splits it differently in one kernel than in another.
RF_DEVICE_INLINE void rf_attn_q_split(float x0, float x1, float qscale, uint32_t& hi,
                                      uint32_t& lo) {
    hi = rf_float2_to_half2(x0 * qscale, x1 * qscale);
    lo = rf_float2_to_half2(fmaf(x0, qscale, -rf_half_to_float((uint16_t)hi)),
                            fmaf(x1, qscale, -rf_half_to_float((uint16_t)(hi >> 16))));
}

// This lane's q fragments (rf_mma_f16_m16n8k16's A; k-step ks = dims 16 ks..16 ks + 15)
// of its rows g and g + 8, the parts hi and lo of q * qscale.
template <int D>
struct rf_attn_qfrag {
    uint32_t hi[D / 16][4];
    uint32_t lo[D / 16][4];
};

// The fragments of q rows row0 and row1 (nullptr: zeros).
template <int D>
RF_DEVICE_INLINE void rf_attn_q(rf_attn_qfrag<D>& qa, const float* row0, const float* row1,
                                float qscale) {
    const int t = (int)(threadIdx.x & 3u);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = 16 * ks + 8 * h + 2 * t;
            rf_attn_f32x2 x0 = {{0.0f, 0.0f}}, x1 = {{0.0f, 0.0f}};
            if (row0 != nullptr) {
                x0 = *(const rf_attn_f32x2*)(row0 + c);
            }
            if (row1 != nullptr) {
                x1 = *(const rf_attn_f32x2*)(row1 + c);
            }
            rf_attn_q_split(x0.v[0], x0.v[1], qscale, qa.hi[ks][2 * h], qa.lo[ks][2 * h]);
            rf_attn_q_split(x1.v[0], x1.v[1], qscale, qa.hi[ks][2 * h + 1], qa.lo[ks][2 * h + 1]);
        }
    }
}

// The steps of a tile's part for this lane's rows g, g + 8 (r = 0, 1), shared by both
// kernels; rf_attn_scores below runs them over a whole tile.
//
// s of the tile's positions 8 nb..8 nb + 7 (rf_mma_f16's C layout: s[2 r + e] is column
// 2t + e of row r).
template <int D>
RF_DEVICE_INLINE void rf_attn_qk(const rf_attn_qfrag<D>& qa, const uint16_t* k_tile, int nb,
                                 float (&s)[4]) {
    const int lane = (int)(threadIdx.x & 31u);
    // Lane 8i + j addresses row j of matrix i: dims 16 ks + 8 i of position 8 nb + j, i.e.
    // b[0..1] of k-step ks and b[2..3] of k-step ks + 1.
    const uint16_t* k_rows = k_tile + (8 * nb + (lane & 7)) * (D + 8) + 8 * (lane >> 3);
    s[0] = s[1] = s[2] = s[3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks += 2) {
        uint32_t b[4];
        rf_ldmatrix_x4(b, k_rows + 16 * ks);
        rf_mma_f16_m16n8k16(s, qa.hi[ks], b);
        rf_mma_f16_m16n8k16(s, qa.lo[ks], b);
        rf_mma_f16_m16n8k16(s, qa.hi[ks + 1], b + 2);
        rf_mma_f16_m16n8k16(s, qa.lo[ks + 1], b + 2);
    }
}
// -inf at the columns of n-block nb past each row's last column last[r] (position -
// tile_start).
RF_DEVICE_INLINE void rf_attn_mask(float (&s)[4], int nb, const int (&last)[2]) {
    const int t = (int)(threadIdx.x & 3u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s[i] = 8 * nb + 2 * t + (i & 1) <= last[i / 2] ? s[i] : -RF_INFINITY;
    }
}
// The maximum over the quad that holds a row (exact: any order gives it).
RF_DEVICE_INLINE float rf_attn_quad_max(float v) {
    v = fmaxf(v, rf_shfl_xor(v, 1));
    return fmaxf(v, rf_shfl_xor(v, 2));
}
// Row r's weights in the n-block s: p = fp16(exp2(s - mx)) as an fp16 pair (an A fragment
// register of the values mma) and w = their sum; 0 unless `any` (the row has a column in
// the tile, so mx is finite).
RF_DEVICE_INLINE uint32_t rf_attn_weights(const float (&s)[4], int r, float mx, bool any,
                                          float& w) {
    const float p0 = any ? rf_exp2(s[2 * r] - mx) : 0.0f;
    const float p1 = any ? rf_exp2(s[2 * r + 1] - mx) : 0.0f;
    const uint32_t ph = rf_float2_to_half2(p0, p1);
    w = rf_half_to_float((uint16_t)ph) + rf_half_to_float((uint16_t)(ph >> 16));
    return ph;
}
// l from a lane's pair sums u_k = w_2k + w_2k+1 of n-blocks 2k, 2k + 1 (see the top).
RF_DEVICE_INLINE float rf_attn_row_sum(float u0, float u1, float u2, float u3) {
    float sum = (u0 + u1) + (u2 + u3);
    sum += rf_shfl_xor(sum, 1);
    return sum + rf_shfl_xor(sum, 2);
}

// A tile's scores and weights for this lane's rows of position pos[r] (-1: no row): m, l
// and p (see the top), p as the A fragments of the values mma (pa[kk]: positions
// 16 kk..16 kk + 15). A row with pos < tile_start gets m = -inf, l = 0, p = 0.
template <int D>
RF_DEVICE_INLINE void rf_attn_scores(const rf_attn_qfrag<D>& qa, const uint16_t* k_tile,
                                     int tile_start, const int (&pos)[2], uint32_t (&pa)[4][4],
                                     float (&m)[2], float (&l)[2]) {
    const int last[2] = {pos[0] - tile_start, pos[1] - tile_start};
    float s[8][4];
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
        rf_attn_qk<D>(qa, k_tile, nb, s[nb]);
        rf_attn_mask(s[nb], nb, last);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            mx[k] = fmaxf(fmaxf(s[2 * k][2 * r], s[2 * k][2 * r + 1]),
                          fmaxf(s[2 * k + 1][2 * r], s[2 * k + 1][2 * r + 1]));
        }
        m[r] = rf_attn_quad_max(fmaxf(fmaxf(mx[0], mx[1]), fmaxf(mx[2], mx[3])));
        float u[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float w0, w1;
            pa[k][r] = rf_attn_weights(s[2 * k], r, m[r], last[r] >= 0, w0);
            pa[k][2 + r] = rf_attn_weights(s[2 * k + 1], r, m[r], last[r] >= 0, w1);
            u[k] = w0 + w1;
        }
        l[r] = rf_attn_row_sum(u[0], u[1], u[2], u[3]);
    }
}

// acc of dims 8 nb0..8 (nb0 + N) - 1 of the tile (N column blocks of 8): p . v.
template <int D, int N>
RF_DEVICE_INLINE void rf_attn_values(const uint32_t (&pa)[4][4], const uint16_t* v_tile, int nb0,
                                     float (&acc)[RF_ATTN_CHUNK][4]) {
    static_assert(N % 2 == 0 && N <= RF_ATTN_CHUNK, "pairs of column blocks");
    const int lane = (int)(threadIdx.x & 31u);
    // Lane 8i + j addresses row j of matrix i: positions 16 kk + 8 (i % 2) + j, dims
    // 8 (nb + i / 2): b[0..1] of column block nb, b[2..3] of nb + 1.
    const uint16_t* v_rows = v_tile + (lane & 15) * (D + 8) + 8 * (nb0 + (lane >> 4));
#pragma unroll
    for (int i = 0; i < N; ++i) {
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < N; i += 2) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            uint32_t b[4];
            rf_ldmatrix_x4_trans(b, v_rows + 16 * kk * (D + 8) + 8 * i);
            rf_mma_f16_m16n8k16(acc[i], pa[kk], b);
            rf_mma_f16_m16n8k16(acc[i + 1], pa[kk], b + 2);
        }
    }
}

// The fold of a part (m, l, acc) into a state (M, Lsum, A) (see the top): rf_attn_fold_ml
// updates (M, Lsum) and gives alpha, beta; rf_attn_fold_a gives an element's new A.
RF_DEVICE_INLINE void rf_attn_fold_ml(float& big_m, float& big_l, float m, float l, float& alpha,
                                      float& beta) {
    const float m_new = fmaxf(big_m, m);
    alpha = rf_exp2(big_m - m_new);
    beta = rf_exp2(m - m_new);
    big_l = fmaf(l, beta, big_l * alpha);
    big_m = m_new;
}
RF_DEVICE_INLINE float rf_attn_fold_a(float a, float acc, float alpha, float beta) {
    return fmaf(acc, beta, a * alpha);
}

// A batch of a folding thread's parts: dims c..c + 3 of the acc, and m, l, of up to
// RF_ATTN_FOLD_BATCH tiles in order.
template <int D>
struct rf_attn_fold_batch {
    rf_attn_f32x4 acc[RF_ATTN_FOLD_BATCH];
    rf_attn_f32x2 ml[RF_ATTN_FOLD_BATCH];

    // The parts of the first n of the tiles from `record` (the first one's part) on.
    RF_DEVICE_MEMBER void load(const float* record, int c, int n) {
        constexpr int RECORD = D + 4;  // a part: acc[D], m, l, 2 unused
#pragma unroll
        for (int b = 0; b < RF_ATTN_FOLD_BATCH; ++b) {
            if (b < n) {
                acc[b] = *(const rf_attn_f32x4*)(record + b * RECORD + c);
                ml[b] = *(const rf_attn_f32x2*)(record + b * RECORD + D);
            }
        }
    }

    // Fold the first n parts into the state (M, Lsum, A of dims c..c + 3), in order: each
    // part's steps are rf_attn_fold_ml's and rf_attn_fold_a's, grouped so that no branch
    // or exponential sits between one part's fmaf and the next's (the running maxima, an
    // exact fmaxf chain, then every alpha and beta, then the Lsum and A chains).
    RF_DEVICE_MEMBER void fold(int n, float& big_m, float& big_l, float a[4]) const {
        float m_before[RF_ATTN_FOLD_BATCH], m_after[RF_ATTN_FOLD_BATCH];
#pragma unroll
        for (int b = 0; b < RF_ATTN_FOLD_BATCH; ++b) {
            m_before[b] = big_m;
            big_m = b < n ? fmaxf(big_m, ml[b].v[0]) : big_m;
            m_after[b] = big_m;
        }
        float alpha[RF_ATTN_FOLD_BATCH], beta[RF_ATTN_FOLD_BATCH];
#pragma unroll
        for (int b = 0; b < RF_ATTN_FOLD_BATCH; ++b) {
            alpha[b] = rf_exp2(m_before[b] - m_after[b]);
            beta[b] = rf_exp2(ml[b].v[0] - m_after[b]);
        }
#pragma unroll
        for (int b = 0; b < RF_ATTN_FOLD_BATCH; ++b) {
            const bool part = b < n;
            big_l = part ? fmaf(ml[b].v[1], beta[b], big_l * alpha[b]) : big_l;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                a[e] = part ? rf_attn_fold_a(a[e], acc[b].v[e], alpha[b], beta[b]) : a[e];
            }
        }
    }
};

// The spans a context of n_tiles tiles folds in (see the top).
RF_DEVICE_INLINE int rf_attn_spans(int n_tiles) {
    return n_tiles > RF_ATTN_ONE_SPAN_TILES ? (n_tiles + RF_ATTN_SPAN - 1) / RF_ATTN_SPAN : 1;
}

// The span states a row of `partial` holds after its max_tiles parts (see the top).
RF_DEVICE_INLINE int rf_attn_max_spans(int max_tiles) {
    return (max_tiles + RF_ATTN_SPAN - 1) / RF_ATTN_SPAN;
}

// Whether this block is the last of `arrivals` blocks to finish (every thread gets the
// answer, through `flag` in shared memory): what each block wrote before the call is
// visible to the last one after it, which also resets the counter for the next launch.
RF_DEVICE_INLINE bool rf_attn_last_to_finish(uint32_t* counter, int arrivals, int& flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // the block's writes (ordered before by the barrier) are visible
        flag = atomicAdd(counter, 1u) == (uint32_t)(arrivals - 1);
        if (flag) {
            *counter = 0u;
            __threadfence();  // ... and so are every other block's, to this block
        }
    }
    __syncthreads();
    return flag != 0;
}

// Fold n records (tiles' parts or spans' states: acc or A[D], m or M, l or Lsum) from
// `record` on, in order, into the state (M, Lsum, A of dims c..c + 3): two batches
// (rf_attn_fold_batch) in turn, the next one loading while this one is folded.
template <int D>
RF_DEVICE_INLINE void rf_attn_fold_chain(const float* record, int n, int c, float& big_m,
                                         float& big_l, float a[4]) {
    constexpr int RECORD = D + 4;
    rf_attn_fold_batch<D> x, y;
    x.load(record, c, n);
    for (int j = 0; j < n; j += 2 * RF_ATTN_FOLD_BATCH) {
        const int k = j + RF_ATTN_FOLD_BATCH;  // y's first record
        if (k < n) {
            y.load(record + k * RECORD, c, n - k);
        }
        x.fold(n - j, big_m, big_l, a);
        if (k >= n) {
            break;
        }
        const int next = k + RF_ATTN_FOLD_BATCH;
        if (next < n) {
            x.load(record + next * RECORD, c, n - next);
        }
        y.fold(n - k, big_m, big_l, a);
    }
}

// A state's dims c..c + 3 to `state`: the output A / Lsum when `normalize`, else a record
// (A, and M, Lsum after dim D - 1 from the thread of dims 0..3).
template <int D>
RF_DEVICE_INLINE void rf_attn_store_state(float* state, int c, float big_m, float big_l,
                                          const float a[4], bool normalize) {
    rf_attn_f32x4 v;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        v.v[e] = normalize ? a[e] / big_l : a[e];
    }
    *(rf_attn_f32x4*)(state + c) = v;
    if (!normalize && c == 0) {
        *(rf_attn_f32x2*)(state + D) = rf_attn_f32x2{{big_m, big_l}};
    }
}

// Fold n records from `records` on, in order, into a state that starts at (-inf, 0, 0),
// for each of the group's heads (head h's records from records + h head_stride): a thread
// per (head, 4 dims), loading straight from global memory (no L1 prefetch first: it held
// the folding block and slowed decode at depth; docs/performance.md). Head h's state goes to dst + h dst_stride (rf_attn_store_state).
template <int D>
RF_DEVICE_INLINE void rf_attn_fold_records(const float* records, int n, int64_t head_stride,
                                           int group, float* dst, int64_t dst_stride,
                                           bool normalize) {
    for (int i = (int)threadIdx.x; i < group * (D / 4); i += RF_ATTN_THREADS) {
        const int h = i / (D / 4), c = 4 * (i % (D / 4));
        float big_m = -RF_INFINITY, big_l = 0.0f, a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        rf_attn_fold_chain<D>(records + h * head_stride, n, c, big_m, big_l, a);
        rf_attn_store_state<D>(dst + h * dst_stride, c, big_m, big_l, a, normalize);
    }
}

// ---------------------------------------------------------------------------------------
// The decode block's K/V stage: two tiles of head dim 64, which holds one of the widest.
#define RF_ATTN_DECODE_STAGE (4 * RF_ATTN_STAGE(64))
static_assert(RF_ATTN_DECODE_STAGE >= 2 * RF_ATTN_STAGE(RF_ATTN_MAX_D), "a tile of any head dim");
// Tiles (K and V) of head dim D the stage holds: a context of up to that many tiles is one
// block per (token, KV head), which folds the parts itself.
#define RF_ATTN_DECODE_TILES(D) (RF_ATTN_DECODE_STAGE / (2 * RF_ATTN_STAGE(D)))
static_assert(RF_ATTN_DECODE_TILES(32) <= RF_ATTN_ONE_SPAN_TILES, "a block's context: one span");
// Tiles a block of a longer context takes (parts it writes): two where the stage holds them.
#define RF_ATTN_DECODE_PART_TILES(D) (RF_ATTN_DECODE_TILES(D) >= 2 ? 2 : 1)
static_assert(RF_ATTN_SPAN % 2 == 0, "a block's tiles: one span's");

// What the decode block's warps exchange: the row maxima of their column blocks, and the
// weights (fragments) and pair sums of them.
struct rf_attn_decode_shared {
    uint16_t kv[RF_ATTN_DECODE_STAGE];  // tile i: K at 2 i stages, V at 2 i + 1
    float max[RF_ATTN_WARPS][16];
    uint32_t pa[RF_ATTN_WARPS][32][4];  // warp w: pa[w] of the tile (positions 16 w..)
    float u[RF_ATTN_WARPS][32][2];      // warp w: u_w of each lane's rows
    int last_block;
};

// A one-row step's output quantized for the O projection (xq: one row in the GEMV's layout,
// rf_q8.h, `width` columns): the block's `group` heads from `out` (this block wrote them
// before the barrier), which start at head `first` of the row; eight threads a 32-block.
template <int D>
RF_DEVICE_INLINE void rf_attn_quantize_out(const float* out, int first, int group, int width,
                                           uint8_t* RF_RESTRICT xq) {
    __syncthreads();
    const rf_q8_rows rows = rf_q8_rows_at(xq, 1, width / RF_QK);
    const int pieces = group * (D / 4);  // whole 8-lane groups: D is a multiple of 32
    const int lane = (int)threadIdx.x % RF_WARP_SIZE;
    for (int base = (int)threadIdx.x - lane; base < pieces; base += RF_ATTN_THREADS) {
        const int i = base + lane;
        const bool active = i < pieces;
        const rf_q8_f32x4 v = active ? *(const rf_q8_f32x4*)(out + 4 * i)
                                     : rf_q8_f32x4{{0.0f, 0.0f, 0.0f, 0.0f}};
        rf_quantize4(v, active, 0, first * D + 4 * i, nullptr, 1.0f, rows);
    }
}

template <int D, bool FP8>
RF_DEVICE_INLINE void rf_attn_decode(rf_attn_decode_shared& sh, const float* RF_RESTRICT q,
                                     const uint8_t* RF_RESTRICT k_pool,
                                     const uint8_t* RF_RESTRICT v_pool,
                                     const int32_t* RF_RESTRICT positions,
                                     const int32_t* RF_RESTRICT slots, int n_ctx, int n_head,
                                     int n_kv, float qscale, int max_tiles,
                                     float* RF_RESTRICT partial, uint32_t* RF_RESTRICT counters,
                                     float* RF_RESTRICT out, uint8_t* RF_RESTRICT xq,
                                     int ahead, int wave, int fold) {
    constexpr int RECORD = D + 4;  // a part in `partial`: acc[D], m, l, 2 unused
    constexpr int PAIRS = (D / 16 + RF_ATTN_WARPS - 1) / RF_ATTN_WARPS;  // value pairs a warp
    const int kvh = blockIdx.x, token = blockIdx.y, tile = blockIdx.z;
    const int group = n_head / n_kv;
    const rf_kv_t<FP8>* k_cache = (const rf_kv_t<FP8>*)k_pool;
    const rf_kv_t<FP8>* v_cache = (const rf_kv_t<FP8>*)v_pool;
    // `ahead` (a one-row step): the cache rows before the token's own position, and the step
    // state, are earlier steps' and complete (this kernel's predecessor, the Q|K|V GEMV, lets
    // it launch only after its own wait, so every kernel before that one has finished), so
    // they are staged before the wait; only the newest row and q are the GEMV's. Other steps
    // (rows of a prompt chunk may read each other's rows) read everything after the wait.
    const bool one_row = ahead != 0;
    if (!one_row) {
        rf_pdl_wait();
    }
    const int length = positions[token] + 1;
    const int n_tiles = (length + RF_ATTN_TILE - 1) / RF_ATTN_TILE;
    const bool alone = n_tiles <= RF_ATTN_DECODE_TILES(D);  // block 0 takes every tile
    // Else a block takes one tile, or two (where the stage holds them) when a tile a block
    // needs more blocks than the device runs at once.
    const int per_block = wave > 0 && (int64_t)n_kv * gridDim.y * n_tiles > wave
                              ? RF_ATTN_DECODE_PART_TILES(D)
                              : 1;
    const int first_tile = alone ? 0 : tile * per_block;
    if (alone ? tile > 0 : first_tile >= n_tiles) {
        return;  // the whole block is past the context, or block 0 takes it
    }
    const int end_tile = alone ? n_tiles : min(first_tile + per_block, n_tiles);
    const int64_t kv_stride = (int64_t)n_kv * D;
    const int64_t base = (int64_t)slots[token] * n_ctx * kv_stride + (int64_t)kvh * D;
    const int newest = one_row ? length - 1 : -1;  // the row staged after the wait
    for (int j = first_tile; j < end_tile; ++j) {
        const int start = j * RF_ATTN_TILE;
        uint16_t* k_tile = sh.kv + 2 * (j - first_tile) * RF_ATTN_STAGE(D);
        rf_attn_stage<D, FP8>(k_tile, k_cache + base + start * kv_stride, kv_stride,
                              length - start, newest - start);
        rf_attn_stage<D, FP8>(k_tile + RF_ATTN_STAGE(D), v_cache + base + start * kv_stride,
                              kv_stride, length - start, newest - start);
    }
    if (one_row) {
        rf_pdl_wait();
        if (end_tile == n_tiles) {  // the newest row is in this block's last tile
            const int start = (n_tiles - 1) * RF_ATTN_TILE;
            uint16_t* k_tile = sh.kv + 2 * (n_tiles - 1 - first_tile) * RF_ATTN_STAGE(D);
            rf_attn_stage_row<D, FP8>(k_tile, k_cache + base + start * kv_stride, kv_stride,
                                      newest - start);
            rf_attn_stage_row<D, FP8>(k_tile + RF_ATTN_STAGE(D),
                                      v_cache + base + start * kv_stride, kv_stride,
                                      newest - start);
        }
    }
    rf_cp_async_commit();
    // Rows: the group's heads (one 16-row block; rows past the group have no position).
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31u);
    const int g = lane >> 2, t = lane & 3;
    const int64_t head0 = (int64_t)token * n_head + (int64_t)kvh * group;  // the group's first
    int pos[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        pos[r] = g + 8 * r < group ? length - 1 : -1;
    }
    rf_attn_qfrag<D> qa;  // loads while the tiles do
    rf_attn_q<D>(qa, pos[0] >= 0 ? q + (head0 + g) * D : nullptr,
                 pos[1] >= 0 ? q + (head0 + g + 8) * D : nullptr, qscale);
    rf_cp_async_wait<0>();
    if constexpr (FP8) {
        for (int jj = 0; jj < end_tile - first_tile; ++jj) {
            const int rows = length - (first_tile + jj) * RF_ATTN_TILE;
            rf_attn_widen<D>(sh.kv + 2 * jj * RF_ATTN_STAGE(D), rows);
            rf_attn_widen<D>(sh.kv + (2 * jj + 1) * RF_ATTN_STAGE(D), rows);
        }
    }
    // The state of this lane's rows and value columns (folded here when alone).
    float big_m[2] = {-RF_INFINITY, -RF_INFINITY}, big_l[2] = {0.0f, 0.0f};
    float a[PAIRS][2][4] = {};
    const int max_spans = rf_attn_max_spans(max_tiles);
    const int64_t head_stride = (int64_t)(max_tiles + max_spans) * RECORD;  // a head's records
    float* parts = partial + head0 * head_stride;  // head h's tile j: h head_stride + j RECORD
    // Per tile, warp w takes the column blocks 2w, 2w + 1 (positions 16 w..16 w + 15) of s
    // and p, then the values' column blocks of pairs w, w + 4, ...: the steps of
    // rf_attn_scores and the fold, with the exact maxima and the pair sums u_w passed
    // between warps.
#pragma unroll
    for (int jj = 0; jj < RF_ATTN_DECODE_TILES(D); ++jj) {
        const int j = first_tile + jj;
        if (j >= end_tile) {
            break;
        }
        const uint16_t* k_tile = sh.kv + 2 * jj * RF_ATTN_STAGE(D);
        const uint16_t* v_tile = k_tile + RF_ATTN_STAGE(D);
        const int tile_start = j * RF_ATTN_TILE;
        const int last[2] = {pos[0] - tile_start, pos[1] - tile_start};
        __syncthreads();  // the tiles are in; the previous tile's exchange is read
        float s[2][4];
        rf_attn_qk<D>(qa, k_tile, 2 * warp, s[0]);
        rf_attn_qk<D>(qa, k_tile, 2 * warp + 1, s[1]);
        rf_attn_mask(s[0], 2 * warp, last);
        rf_attn_mask(s[1], 2 * warp + 1, last);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float mx = rf_attn_quad_max(fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]),
                                                    fmaxf(s[1][2 * r], s[1][2 * r + 1])));
            if (t == 0) {
                sh.max[warp][g + 8 * r] = mx;
            }
        }
        __syncthreads();
        float m[2], l[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float* mx = &sh.max[0][g + 8 * r];
            m[r] = fmaxf(fmaxf(mx[0], mx[16]), fmaxf(mx[32], mx[48]));
            float w0, w1;
            sh.pa[warp][lane][r] = rf_attn_weights(s[0], r, m[r], last[r] >= 0, w0);
            sh.pa[warp][lane][2 + r] = rf_attn_weights(s[1], r, m[r], last[r] >= 0, w1);
            sh.u[warp][lane][r] = w0 + w1;
        }
        __syncthreads();
        uint32_t pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                pa[kk][i] = sh.pa[kk][lane][i];
            }
        }
        float alpha[2] = {1.0f, 1.0f}, beta[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[r] = rf_attn_row_sum(sh.u[0][lane][r], sh.u[1][lane][r], sh.u[2][lane][r],
                                   sh.u[3][lane][r]);
            if (alone && pos[r] >= 0) {
                rf_attn_fold_ml(big_m[r], big_l[r], m[r], l[r], alpha[r], beta[r]);
            }
        }
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) {
            const int pair = warp + p * RF_ATTN_WARPS;
            if (pair >= D / 16) {
                break;
            }
            float acc[RF_ATTN_CHUNK][4];
            rf_attn_values<D, 2>(pa, v_tile, 2 * pair, acc);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                if (alone) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        a[p][i][e] = rf_attn_fold_a(a[p][i][e], acc[i][e], alpha[e / 2],
                                                    beta[e / 2]);
                    }
                    continue;
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (pos[r] >= 0) {
                        const int c = 8 * (2 * pair + i) + 2 * t;
                        const rf_attn_f32x2 v = {{acc[i][2 * r], acc[i][2 * r + 1]}};
                        *(rf_attn_f32x2*)(parts + (g + 8 * r) * head_stride + j * RECORD + c) = v;
                    }
                }
            }
        }
        if (!alone && warp == 0 && t == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if (pos[r] >= 0) {
                    float* record = parts + (g + 8 * r) * head_stride + j * RECORD;
                    record[D] = m[r];
                    record[D + 1] = l[r];
                }
            }
        }
    }
    if (alone) {  // this lane's columns of the output (A / Lsum)
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) {
            const int pair = warp + p * RF_ATTN_WARPS;
            if (pair >= D / 16) {
                break;
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (pos[r] >= 0) {
                        const int c = 8 * (2 * pair + i) + 2 * t, h = g + 8 * r;
                        const rf_attn_f32x2 v = {{a[p][i][2 * r] / big_l[r],
                                                  a[p][i][2 * r + 1] / big_l[r]}};
                        *(rf_attn_f32x2*)(out + (head0 + h) * D + c) = v;
                    }
                }
            }
        }
        if (xq != nullptr) {
            rf_attn_quantize_out<D>(out + head0 * D, kvh * group, group, n_head * D, xq);
        }
        return;
    }
    if (fold == 0) {
        return;  // rf_attention_fold_d<D> folds the parts
    }
    // Fold span by span (see the top): the span's last block to finish folds its parts;
    // with more than one span, into the span's state, and the last span to finish folds
    // every span's state.
    const int n_spans = rf_attn_spans(n_tiles);
    const int span = n_spans == 1 ? 0 : first_tile / RF_ATTN_SPAN;
    const int span_first = span * RF_ATTN_SPAN;
    const int span_tiles = n_spans == 1 ? n_tiles : min(n_tiles - span_first, RF_ATTN_SPAN);
    uint32_t* done = counters + ((int64_t)token * n_kv + kvh) * (1 + max_spans);
    if (!rf_attn_last_to_finish(done + 1 + span, (span_tiles + per_block - 1) / per_block,
                                sh.last_block)) {
        return;
    }
    // One fold a pass: the span's parts, then (more than one span) the spans' states. One
    // call site: three took 129 registers at d = 64 (3 blocks a multiprocessor, not 4).
    float* const outputs = out + head0 * D;
    float* const spans = parts + max_tiles * RECORD;  // head h's span s: h head_stride + s
    const bool one_span = n_spans == 1;
    const float* records = parts + span_first * RECORD;
    int n = span_tiles;
    float* dst = one_span ? outputs : spans + span * RECORD;
    for (bool normalize = one_span;; normalize = true) {
        rf_attn_fold_records<D>(records, n, head_stride, group, dst,
                                normalize ? D : head_stride, normalize);
        if (normalize) {
            break;
        }
        if (!rf_attn_last_to_finish(done, n_spans, sh.last_block)) {
            return;
        }
        records = spans;
        n = n_spans;
        dst = outputs;
    }
    if (xq != nullptr) {
        rf_attn_quantize_out<D>(outputs, kvh * group, group, n_head * D, xq);
    }
}

// One kernel per head dim and pool format: one kernel switching over all four head dims
// took the widest's registers and ran longer at short contexts (docs/performance.md). The
// pools are passed as bytes (either format).
#define RF_ATTN_DECODE_PARAMS                                                              \
    const float *RF_RESTRICT q, const uint8_t *RF_RESTRICT k_cache,                        \
        const uint8_t *RF_RESTRICT v_cache, const int32_t *RF_RESTRICT positions,          \
        const int32_t *RF_RESTRICT slots, int n_ctx, int n_head, int n_kv, float qscale,   \
        int max_tiles, float *RF_RESTRICT partial, uint32_t *RF_RESTRICT counters,         \
        float *RF_RESTRICT out, uint8_t *RF_RESTRICT xq, int ahead, int wave, int fold
#define RF_ATTN_DECODE(D, FP8)                                                             \
    __shared__ __align__(16) rf_attn_decode_shared sh;                                     \
    rf_pdl_launch_dependents(); /* rf_attn_decode waits */                                 \
    rf_attn_decode<D, FP8>(sh, q, k_cache, v_cache, positions, slots, n_ctx, n_head, n_kv, \
                           qscale, max_tiles, partial, counters, out, xq, ahead, wave, fold)
// rf_attention_decode_d<D>[_fp8]: kernel_variants.py ATTENTION_KERNELS.

// ---------------------------------------------------------------------------------------
// The fold kernel's shared memory: the records of a copy (as many whole spans' parts as
// fit 48 KiB of static shared memory beside the states, at least one span's up to
// RF_ATTN_ONE_SPAN_TILES parts) and a round's span states.
template <int D>
struct rf_attn_fold_shared {
    static constexpr int RECORD_BYTES = (D + 4) * 4;
    static constexpr int GROUPS = RF_ATTN_THREADS / (D / 4);  // spans folded at once
    static constexpr int SPANS = (48 * 1024 - GROUPS * RECORD_BYTES) /
                                 (RF_ATTN_SPAN * RECORD_BYTES);  // spans a copy holds
    static_assert(SPANS * RF_ATTN_SPAN >= RF_ATTN_ONE_SPAN_TILES, "a context of one span");
    float records[SPANS * RF_ATTN_SPAN * (D + 4)];
    float states[GROUPS * (D + 4)];
};

template <int D>
RF_DEVICE_INLINE void rf_attn_fold_apart(rf_attn_fold_shared<D>& sh,
                                         const int32_t* RF_RESTRICT positions, int n_head,
                                         int max_tiles, const float* RF_RESTRICT partial,
                                         float* RF_RESTRICT out, uint8_t* RF_RESTRICT xq) {
    constexpr int RECORD = D + 4, GROUPS = rf_attn_fold_shared<D>::GROUPS;
    constexpr int SPANS = rf_attn_fold_shared<D>::SPANS;
    static_assert(RECORD % 4 == 0, "records copied in 16-byte pieces");
    const int head = blockIdx.x, token = blockIdx.y;
    // The step state is read before the wait: the kernels that may still run (this layer's
    // Q|K|V projection and its decode and fold launches) do not write it, and every kernel
    // before the projection has finished (the projection releases its successor only after
    // its own wait).
    const int length = positions[token] + 1;
    const int n_tiles = (length + RF_ATTN_TILE - 1) / RF_ATTN_TILE;
    if (n_tiles <= RF_ATTN_DECODE_TILES(D)) {
        return;  // the decode kernel's block 0 took the context alone and wrote the output
    }
    rf_pdl_wait();
    const int max_spans = rf_attn_max_spans(max_tiles);
    const int64_t row = (int64_t)token * n_head + head;  // the (token, head) this block folds
    const float* parts = partial + row * (max_tiles + max_spans) * RECORD;
    const int n_spans = rf_attn_spans(n_tiles);
    const int group = (int)threadIdx.x / (D / 4), c = 4 * ((int)threadIdx.x % (D / 4));
    float big_m = -RF_INFINITY, big_l = 0.0f, a[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // group 0's
    // Copies of up to SPANS spans' records, each in one round trip; then rounds of up to
    // GROUPS spans, span s0 + g by group g, whose states group 0 folds in order.
    for (int c0 = 0; c0 < n_spans; c0 += SPANS) {
        const int first = c0 * RF_ATTN_SPAN;
        const int count = min(n_tiles - first, SPANS * RF_ATTN_SPAN);
        __syncthreads();  // the previous copy's records and states are folded
        const float* src = parts + first * RECORD;
        for (int i = (int)threadIdx.x; i < count * (RECORD / 4); i += RF_ATTN_THREADS) {
            rf_cp_async16(sh.records + 4 * i, src + 4 * i, true);
        }
        rf_cp_async_commit();
        rf_cp_async_wait<0>();
        __syncthreads();
        if (n_spans == 1) {
            if (group == 0) {
                rf_attn_fold_chain<D>(sh.records, count, c, big_m, big_l, a);
            }
            break;
        }
        const int copied = min(SPANS, n_spans - c0);
        for (int s0 = 0; s0 < copied; s0 += GROUPS) {
            const int spans = min(GROUPS, copied - s0);  // this round's
            if (group < spans) {
                const int span = s0 + group, tiles = min(RF_ATTN_SPAN, count - span * RF_ATTN_SPAN);
                float m = -RF_INFINITY, l = 0.0f, s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                rf_attn_fold_chain<D>(sh.records + span * RF_ATTN_SPAN * RECORD, tiles, c, m, l, s);
                rf_attn_store_state<D>(sh.states + group * RECORD, c, m, l, s, false);
            }
            __syncthreads();
            if (group == 0) {
                rf_attn_fold_chain<D>(sh.states, spans, c, big_m, big_l, a);
            }
            __syncthreads();  // the round's states are folded
        }
    }
    if (threadIdx.x >= RF_WARP_SIZE) {
        return;  // group 0's threads, the first D / 4 of warp 0, hold the output
    }
    rf_q8_f32x4 v;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        v.v[e] = group == 0 ? a[e] / big_l : 0.0f;
    }
    if (group == 0) {
        *(rf_q8_f32x4*)(out + row * D + c) = v;
    }
    if (xq != nullptr) {  // a one-row step (token 0): from registers, as rf_attn_quantize_out
        const rf_q8_rows rows = rf_q8_rows_at(xq, 1, n_head * D / RF_QK);
        rf_quantize4(v, group == 0, 0, head * D + c, nullptr, 1.0f, rows);
    }
}

#define RF_ATTN_FOLD_PARAMS                                                                 \
    const int32_t *RF_RESTRICT positions, int n_head, int max_tiles,                        \
        const float *RF_RESTRICT partial, float *RF_RESTRICT out, uint8_t *RF_RESTRICT xq
#define RF_ATTN_FOLD_ARGS sh, positions, n_head, max_tiles, partial, out, xq
#define RF_ATTN_FOLD(D)                                                                     \
    __shared__ __align__(16) rf_attn_fold_shared<D> sh;                                     \
    rf_pdl_launch_dependents(); /* rf_attn_fold_apart waits */                              \
    rf_attn_fold_apart<D>(RF_ATTN_FOLD_ARGS)
// rf_attention_fold_d<D>: kernel_variants.py ATTENTION_KERNELS.

// ---------------------------------------------------------------------------------------
// Tile buffers (K and V each) a prefill block stages: two where they fit 48 KiB of static
// shared memory, else one.
#define RF_ATTN_STAGES(D) (4 * RF_ATTN_STAGE(D) * 2 <= 48 * 1024 ? 2 : 1)

template <int D, bool FP8, int STAGES = RF_ATTN_STAGES(D)>
RF_DEVICE_INLINE void rf_attn_prefill(uint16_t* s_tiles, const float* RF_RESTRICT q,
                                      const uint8_t* RF_RESTRICT k_pool,
                                      const uint8_t* RF_RESTRICT v_pool,
                                      const int32_t* RF_RESTRICT positions,
                                      const int32_t* RF_RESTRICT slots, int n_tokens, int n_ctx,
                                      int n_head, int n_kv, float qscale, float* RF_RESTRICT out) {
    rf_pdl_wait();
    const rf_kv_t<FP8>* k_cache = (const rf_kv_t<FP8>*)k_pool;
    const rf_kv_t<FP8>* v_cache = (const rf_kv_t<FP8>*)v_pool;
    const int group = n_head / n_kv, tokens = RF_ATTN_PREFILL_ROWS / group;
    const int kvh = blockIdx.x;
    const int first = (int)(gridDim.y - 1u - blockIdx.y) * tokens;  // longest contexts first
    const int n_rows = min(tokens, n_tokens - first) * group;  // rows (token, head) of the block
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31u);
    const int g = lane >> 2, t = lane & 3;
    int pos[2];
    int64_t heads[2];  // the rows' (token, head) index
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 16 * warp + g + 8 * r;
        const int token = first + row / group;
        heads[r] = (int64_t)token * n_head + (int64_t)kvh * group + row % group;
        pos[r] = row < n_rows ? positions[token] : -1;
    }
    // Tiles up to the block's last token's position (positions ascend in a chunk); this
    // warp computes those up to its last row's.
    const int block_length = positions[first + n_rows / group - 1] + 1;
    const int warp_last = min(16 * warp + 15, n_rows - 1);
    const int warp_length = warp_last >= 16 * warp ? positions[first + warp_last / group] + 1 : 0;
    rf_attn_qfrag<D> qa;
    rf_attn_q<D>(qa, pos[0] >= 0 ? q + heads[0] * D : nullptr,
                 pos[1] >= 0 ? q + heads[1] * D : nullptr, qscale);
    float big_m[2] = {-RF_INFINITY, -RF_INFINITY}, big_l[2] = {0.0f, 0.0f};
    float a[D / 8][4];
#pragma unroll
    for (int nb = 0; nb < D / 8; ++nb) {
        a[nb][0] = a[nb][1] = a[nb][2] = a[nb][3] = 0.0f;
    }
    const int64_t kv_stride = (int64_t)n_kv * D;
    const int64_t base = (int64_t)slots[first] * n_ctx * kv_stride + (int64_t)kvh * D;
    const int n_tiles = (block_length + RF_ATTN_TILE - 1) / RF_ATTN_TILE;
    uint32_t pa[4][4];
    float m[2], l[2];
    // The state of the spans before the current one (see the top): its (M, Lsum) in
    // shared memory (spans_ml(r): row 16 warp + g + 8 r, written by the quad's lane t = 0),
    // its A in the row's `out` (this lane's columns) until the end. Rows of one span keep
    // neither.
    __shared__ rf_attn_f32x2 s_spans[RF_ATTN_PREFILL_ROWS];
    const auto spans_ml = [&](int r) -> rf_attn_f32x2& {
        return s_spans[16 * warp + g + 8 * r];
    };
    const bool spanned[2] = {rf_attn_spans(pos[0] / RF_ATTN_TILE + 1) > 1,
                             rf_attn_spans(pos[1] / RF_ATTN_TILE + 1) > 1};
    // The span state (big_m, big_l, a) of each row with closes[r] folded into that state,
    // which starts at (-inf, 0, 0) when `first`; the row's span state starts again. The
    // whole warp calls it.
    const auto close_spans = [&](const bool (&closes)[2], bool first) {
        rf_attn_f32x2 ml[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // Read for every row: loaded only for closing ones, ml took stack at head dims 64
            // and 128, and 38 / 50 more registers at 32 / 96.
            ml[r] = first ? rf_attn_f32x2{{-RF_INFINITY, 0.0f}} : spans_ml(r);
            if (!closes[r]) {
                continue;
            }
            float alpha, beta;
            rf_attn_fold_ml(ml[r].v[0], ml[r].v[1], big_m[r], big_l[r], alpha, beta);
            float* out_row = out + heads[r] * D + 2 * t;
#pragma unroll
            for (int nb = 0; nb < D / 8; ++nb) {
                rf_attn_f32x2 v = first ? rf_attn_f32x2{{0.0f, 0.0f}}
                                        : *(const rf_attn_f32x2*)(out_row + 8 * nb);
                v.v[0] = rf_attn_fold_a(v.v[0], a[nb][2 * r], alpha, beta);
                v.v[1] = rf_attn_fold_a(v.v[1], a[nb][2 * r + 1], alpha, beta);
                *(rf_attn_f32x2*)(out_row + 8 * nb) = v;
                a[nb][2 * r] = a[nb][2 * r + 1] = 0.0f;
            }
            big_m[r] = -RF_INFINITY;
            big_l[r] = 0.0f;
        }
        rf_syncwarp();  // every lane has read (M, Lsum) before it changes
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (closes[r] && t == 0) {
                spans_ml(r) = ml[r];
            }
        }
        rf_syncwarp();
    };
    // Tile j's part of this warp's rows and its fold into their span's state (rows whose
    // context ends before the tile skip the fold).
    const auto scores = [&](const uint16_t* k_tile, int j) {
        rf_attn_scores<D>(qa, k_tile, j * RF_ATTN_TILE, pos, pa, m, l);
    };
    const auto fold_values = [&](const uint16_t* v_tile, int j) {
        // Tile j starts a span: the rows of more than one span that reach it close theirs.
        if (j > 0 && j % RF_ATTN_SPAN == 0) {
            const bool reach[2] = {spanned[0] && pos[0] >= j * RF_ATTN_TILE,
                                   spanned[1] && pos[1] >= j * RF_ATTN_TILE};
            close_spans(reach, j == RF_ATTN_SPAN);
        }
        float alpha[2] = {1.0f, 1.0f}, beta[2] = {0.0f, 0.0f};
        bool folds[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            folds[r] = pos[r] >= j * RF_ATTN_TILE;
            if (folds[r]) {
                rf_attn_fold_ml(big_m[r], big_l[r], m[r], l[r], alpha[r], beta[r]);
            }
        }
#pragma unroll
        for (int nb0 = 0; nb0 < D / 8; nb0 += RF_ATTN_CHUNK) {
            constexpr int REST = D / 8 % RF_ATTN_CHUNK;
            float acc[RF_ATTN_CHUNK][4];
            if (nb0 + RF_ATTN_CHUNK <= D / 8) {
                rf_attn_values<D, RF_ATTN_CHUNK>(pa, v_tile, nb0, acc);
            } else {
                rf_attn_values<D, (REST > 0 ? REST : 2)>(pa, v_tile, nb0, acc);
            }
#pragma unroll
            for (int i = 0; i < RF_ATTN_CHUNK; ++i) {
                if (nb0 + i < D / 8) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (folds[e / 2]) {
                            a[nb0 + i][e] =
                                rf_attn_fold_a(a[nb0 + i][e], acc[i][e], alpha[e / 2], beta[e / 2]);
                        }
                    }
                }
            }
        }
    };
    const auto stage = [&](uint16_t* dst, const rf_kv_t<FP8>* cache, int j) {
        const int start = j * RF_ATTN_TILE;
        rf_attn_stage<D, FP8>(dst, cache + base + start * kv_stride, kv_stride,
                              block_length - start);
    };
    const auto widen = [&](uint16_t* tile, int j) {  // an fp8 pool's tile j, waited for
        if constexpr (FP8) {
            rf_attn_widen<D>(tile, block_length - j * RF_ATTN_TILE);
        }
    };
    uint16_t* s_k = s_tiles;  // K of stage i at s_k + i * RF_ATTN_STAGE(D), V after them
    uint16_t* s_v = s_tiles + STAGES * RF_ATTN_STAGE(D);
    if constexpr (STAGES == 2) {  // tile j in buffers j % 2; tile j + 1 loads while j is used
        stage(s_k, k_cache, 0);
        stage(s_v, v_cache, 0);
        rf_cp_async_commit();
        if (n_tiles > 1) {
            stage(s_k + RF_ATTN_STAGE(D), k_cache, 1);
            stage(s_v + RF_ATTN_STAGE(D), v_cache, 1);
        }
        rf_cp_async_commit();
        for (int j = 0; j < n_tiles; ++j) {
            const int buffer = (j % 2) * RF_ATTN_STAGE(D);
            rf_cp_async_wait<1>();
            widen(s_k + buffer, j);
            widen(s_v + buffer, j);
            __syncthreads();  // tile j is in
            if (j * RF_ATTN_TILE < warp_length) {
                scores(s_k + buffer, j);
                fold_values(s_v + buffer, j);
            }
            __syncthreads();  // ... and no longer read
            if (j + 2 < n_tiles) {
                stage(s_k + buffer, k_cache, j + 2);
                stage(s_v + buffer, v_cache, j + 2);
            }
            rf_cp_async_commit();
        }
    } else {  // K of tile j + 1 loads while the values of j are used, V while its scores are
        stage(s_k, k_cache, 0);
        rf_cp_async_commit();
        stage(s_v, v_cache, 0);
        rf_cp_async_commit();
        for (int j = 0; j < n_tiles; ++j) {
            const bool computes = j * RF_ATTN_TILE < warp_length;
            rf_cp_async_wait<1>();
            widen(s_k, j);
            __syncthreads();  // K of tile j is in
            if (computes) {
                scores(s_k, j);
            }
            __syncthreads();  // ... and no longer read
            if (j + 1 < n_tiles) {
                stage(s_k, k_cache, j + 1);
            }
            rf_cp_async_commit();
            rf_cp_async_wait<1>();
            widen(s_v, j);
            __syncthreads();  // V of tile j is in
            if (computes) {
                fold_values(s_v, j);
            }
            __syncthreads();  // ... and no longer read
            if (j + 1 < n_tiles) {
                stage(s_v, v_cache, j + 1);
            }
            rf_cp_async_commit();
        }
    }
    rf_pdl_launch_dependents();
    close_spans(spanned, false);  // a context of more than one span: its last one
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (pos[r] < 0) {
            continue;
        }
        float* out_row = out + heads[r] * D + 2 * t;
        const float lsum = spanned[r] ? spans_ml(r).v[1] : big_l[r];
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb) {
            rf_attn_f32x2 v = spanned[r] ? *(const rf_attn_f32x2*)(out_row + 8 * nb)
                                       : rf_attn_f32x2{{a[nb][2 * r], a[nb][2 * r + 1]}};
            v.v[0] /= lsum;
            v.v[1] /= lsum;
            *(rf_attn_f32x2*)(out_row + 8 * nb) = v;
        }
    }
}

#define RF_ATTN_PREFILL_PARAMS                                                              \
    const float *RF_RESTRICT q, const uint8_t *RF_RESTRICT k_cache,                         \
        const uint8_t *RF_RESTRICT v_cache, const int32_t *RF_RESTRICT positions,           \
        const int32_t *RF_RESTRICT slots, int n_tokens, int n_ctx, int n_head, int n_kv,    \
        float qscale, float *RF_RESTRICT out
#define RF_ATTN_PREFILL(D, FP8)                                                              \
    __shared__ __align__(16) uint16_t s_tiles[2 * RF_ATTN_STAGES(D) * RF_ATTN_STAGE(D)];     \
    rf_attn_prefill<D, FP8>(s_tiles, q, k_cache, v_cache, positions, slots, n_tokens, n_ctx, \
                            n_head, n_kv, qscale, out)
// rf_attention_prefill_d<D>[_fp8]: kernel_variants.py ATTENTION_KERNELS.
