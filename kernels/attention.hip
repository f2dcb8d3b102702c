// Attention over the fp16 KV pool with grouped-query heads: a decode kernel (few tokens,
// any slots, split across blocks) and a prefill kernel (a prompt chunk of one slot, each
// K/V row read once for several queries and heads). Both compute every (token, head)
// output with the same arithmetic, so a token gives bit-identical results through either:
//
//   The context 0..L-1 (L = position + 1) goes in pieces of RF_ATTN_PIECE = 32 positions,
//   lane j of a warp holding position 32 p + j of piece p. Lane j scores its position:
//   four chains a_e = fmaf(q[c], k[c], a_e) over c = e, e + 4, ... (from 0), and
//   score = ((a_0 + a_1) + (a_2 + a_3)) * scale; m_p = the warp maximum of the scores,
//   w_j = expf(score_j - m_p) (0 past L), l_p = the butterfly sum of w over the lanes
//   (rf_warp_sum); acc_p[c] = b_0 + b_1 with chains b_i = fmaf(w_j, v_j[c], b_i) over the
//   piece's positions j = i, i + 2, ... (from 0). A state (M, Lsum, A) starts at
//   (-inf, 0, 0) and takes in a part (m, l, acc) by the fold
//     M' = fmaxf(M, m), alpha = expf(M - M'), beta = expf(m - M'),
//     Lsum = fmaf(l, beta, Lsum * alpha), A[c] = fmaf(acc[c], beta, A[c] * alpha).
//   Pieces fold in order into their segment's state (RF_ATTN_SEGMENT pieces a segment);
//   segment states fold in order into the total, and the output is A[c] / Lsum. (A fold
//   into the start state gives the part itself: one piece is acc / l.)
//
// q        fp32 [n_tokens, n_head, d]   (d = head dim, dk == dv here, d <= 128, d % 32 == 0)
// k_cache, v_cache fp16 [n_slots, n_ctx, n_kv, d] of this layer
// positions, slots int32 [n_tokens]: token t attends to cache positions 0..positions[t]
//                  of slot slots[t] (step state, read on the device)
// out      fp32 [n_tokens, n_head * d]
//
// rf_attention_decode: a block a segment of one (KV head, token), a warp a (head of the
//   group, piece): the block stages the segment's K and V rows in shared memory once for
//   the whole group, and each head's first warp folds the head's pieces. A context of one
//   segment is finished there; otherwise each block writes its heads' segment states to
//   `partial` [n_tokens, n_head, max_segments, d + 2] (M, Lsum, A) and the last block of
//   the (token, KV head) to finish folds them all (counters uint32 [n_tokens, n_kv], zero
//   before the first launch, reset by that block). The grid is sized for the whole
//   context; blocks past the token's last segment exit.
//   Launch: grid (n_kv, n_tokens, max_segments), block RF_ATTN_SEGMENT * group * warp size.
// rf_attention_prefill: the tokens of one slot (a prompt chunk); a block takes one KV
//   head and RF_ATTN_PREFILL_TOKENS tokens, a warp one (token, head of the group). The
//   block stages each piece's K and V rows in shared memory once for all its warps; each
//   warp folds its pieces into the segment state and each finished segment into the
//   total, whose A it keeps in `out` until the end.
//   Launch: grid (n_kv, ceil(n_tokens / RF_ATTN_PREFILL_TOKENS)),
//           block RF_ATTN_PREFILL_TOKENS * group * warp size.
#include "rf_portability.h"
#include "rf_constants.h"

// From rf_constants.h: RF_ATTN_PIECE (positions a piece: lanes 0..31; a wave64 leaves
// 32..63 idle), RF_ATTN_SEGMENT (pieces a segment), RF_ATTN_PREFILL_LANES (warp size x
// tokens a prefill block takes), RF_ATTN_MAX_GROUP (query heads per KV head) and
// RF_ATTN_MAX_D (head dim).
#define RF_ATTN_PREFILL_TOKENS (RF_ATTN_PREFILL_LANES / RF_WARP_SIZE)  // 1024 threads, group 8
#define RF_ATTN_MAX_PER_LANE (RF_ATTN_MAX_D / RF_ATTN_PIECE)  // output elements a lane holds
#define RF_ATTN_PITCH (RF_ATTN_MAX_D + 8)  // staged key row pitch in halves (16-byte aligned)

static_assert(RF_WARP_SIZE % RF_ATTN_PIECE == 0, "a piece fits in a warp");

struct alignas(16) rf_attn_u32x4 {
    uint32_t v[4];
};
struct alignas(16) rf_attn_f32x4 {
    float v[4];
};

// One piece's value rows (and, for the prefill kernel, key rows) in shared memory, fp16.
struct rf_attn_values {
    uint16_t v[RF_ATTN_PIECE][RF_ATTN_MAX_D];
};
struct rf_attn_tile {
    uint16_t k[RF_ATTN_PIECE][RF_ATTN_PITCH];
    rf_attn_values values;
};

// A fold state (or a part to fold in) of one head: this lane's share of (M, Lsum, A).
struct rf_attn_state {
    float m;
    float l;
    float a[RF_ATTN_MAX_PER_LANE];
};

RF_DEVICE_INLINE void rf_attn_start(rf_attn_state& s) {
    s.m = -RF_INFINITY;
    s.l = 0.0f;
#pragma unroll
    for (int e = 0; e < RF_ATTN_MAX_PER_LANE; ++e) {
        s.a[e] = 0.0f;
    }
}

// The fold of a part into a state (see the top).
RF_DEVICE_INLINE void rf_attn_fold(rf_attn_state& s, const rf_attn_state& part) {
    const float m_new = fmaxf(s.m, part.m);
    const float alpha = expf(s.m - m_new), beta = expf(part.m - m_new);
    s.l = fmaf(part.l, beta, s.l * alpha);
#pragma unroll
    for (int e = 0; e < RF_ATTN_MAX_PER_LANE; ++e) {
        s.a[e] = fmaf(part.a[e], beta, s.a[e] * alpha);
    }
    s.m = m_new;
}

// Copy rows [0, rows) (rows <= RF_ATTN_PIECE) of fp16 (`stride` halves apart from `src`)
// into shared rows of `pitch` halves; threads first .. first + n_threads - 1 take part,
// every load issued before the first store. d <= RF_ATTN_MAX_D; n_threads is at least
// RF_ATTN_PIECE * RF_ATTN_MAX_D / 8 / MAX_EACH.
template <int MAX_EACH>
RF_DEVICE_INLINE void rf_attn_copy_rows(uint16_t* dst, int pitch, const uint16_t* src,
                                        int64_t stride, int rows, int d, int first,
                                        int n_threads) {
    const int per_row = d / 8, n = rows * per_row;
    rf_attn_u32x4 raw[MAX_EACH];
#pragma unroll
    for (int u = 0; u < MAX_EACH; ++u) {
        const int i = (int)threadIdx.x - first + u * n_threads;
        if (i < n) {
            raw[u] = *(const rf_attn_u32x4*)(src + (int64_t)(i / per_row) * stride +
                                             (i % per_row) * 8);
        }
    }
#pragma unroll
    for (int u = 0; u < MAX_EACH; ++u) {
        const int i = (int)threadIdx.x - first + u * n_threads;
        if (i < n) {
            *(rf_attn_u32x4*)(dst + (i / per_row) * pitch + (i % per_row) * 8) = raw[u];
        }
    }
}

// One piece of one (token, head) (the arithmetic at the top): this lane's part of
// (m, l, acc). `key8(c)` gives keys c..c+7 of this lane's position as a raw 16-byte
// load; `values` holds the piece's rows, the first n_valid the token's; q_head holds the
// head's q (shared memory, 16-byte aligned).
template <typename Key8>
RF_DEVICE_INLINE void rf_attn_piece(Key8 key8, const rf_attn_values& values, int n_valid,
                                    const float* q_head, int d, float scale,
                                    rf_attn_state& part) {
    const int lane = threadIdx.x % RF_WARP_SIZE, per_lane = d / RF_ATTN_PIECE;
    const bool valid = lane < n_valid;
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < RF_ATTN_MAX_D; c += 8) {
        if (c < d) {
            const rf_attn_u32x4 raw = key8(c);
            const rf_attn_f32x4 q0 = *(const rf_attn_f32x4*)(q_head + c);
            const rf_attn_f32x4 q1 = *(const rf_attn_f32x4*)(q_head + c + 4);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float k = rf_half_to_float((uint16_t)(raw.v[e / 2] >> (16 * (e % 2))));
                a[e % 4] = fmaf(e < 4 ? q0.v[e] : q1.v[e - 4], k, a[e % 4]);
            }
        }
    }
    const float score = ((a[0] + a[1]) + (a[2] + a[3])) * scale;
    part.m = rf_warp_max(valid ? score : -RF_INFINITY);
    const float w = valid ? expf(score - part.m) : 0.0f;
    part.l = rf_warp_sum(w);
    float b[2][RF_ATTN_MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < RF_ATTN_MAX_PER_LANE; ++e) {
        b[0][e] = 0.0f;
        b[1][e] = 0.0f;
    }
    const uint16_t* v_col = &values.v[0][lane < RF_ATTN_PIECE ? lane * per_lane : 0];
#pragma unroll 2
    for (int j = 0; j < n_valid; j += 2) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (j + i < n_valid) {
                const float wj = rf_shfl(w, j + i, RF_WARP_SIZE);
#pragma unroll
                for (int e = 0; e < RF_ATTN_MAX_PER_LANE; ++e) {
                    if (e < per_lane) {
                        const float v = rf_half_to_float(v_col[(j + i) * RF_ATTN_MAX_D + e]);
                        b[i][e] = fmaf(wj, v, b[i][e]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int e = 0; e < RF_ATTN_MAX_PER_LANE; ++e) {
        part.a[e] = b[0][e] + b[1][e];
    }
}

// This lane's A elements <-> a head's d floats (an output row), or A / Lsum into them.
RF_DEVICE_INLINE void rf_attn_save_a(float* head, const rf_attn_state& s, int d, int lane,
                                     bool divide) {
    const int per_lane = d / RF_ATTN_PIECE;
#pragma unroll
    for (int e = 0; e < RF_ATTN_MAX_PER_LANE; ++e) {
        if (lane < RF_ATTN_PIECE && e < per_lane) {
            head[lane * per_lane + e] = divide ? s.a[e] / s.l : s.a[e];
        }
    }
}
RF_DEVICE_INLINE void rf_attn_load_a(const float* head, rf_attn_state& s, int d, int lane) {
    const int per_lane = d / RF_ATTN_PIECE;
#pragma unroll
    for (int e = 0; e < RF_ATTN_MAX_PER_LANE; ++e) {
        s.a[e] = lane < RF_ATTN_PIECE && e < per_lane ? head[lane * per_lane + e] : 0.0f;
    }
}

// A whole state's share for this lane <-> (M, Lsum, A[d]) in memory.
RF_DEVICE_INLINE void rf_attn_save(float* dst, const rf_attn_state& s, int d, int lane) {
    rf_attn_save_a(dst + 2, s, d, lane, false);
    if (lane == 0) {
        dst[0] = s.m;
        dst[1] = s.l;
    }
}
RF_DEVICE_INLINE void rf_attn_load(const float* src, rf_attn_state& s, int d, int lane) {
    s.m = src[0];
    s.l = src[1];
    rf_attn_load_a(src + 2, s, d, lane);
}

RF_KERNEL_BOUNDS(RF_ATTN_SEGMENT* RF_ATTN_MAX_GROUP* RF_WARP_SIZE)
void rf_attention_decode(const float* RF_RESTRICT q, const uint16_t* RF_RESTRICT k_cache,
                         const uint16_t* RF_RESTRICT v_cache, const int32_t* RF_RESTRICT positions,
                         const int32_t* RF_RESTRICT slots, int n_ctx, int n_head, int n_kv, int d,
                         float scale, int max_segments, float* RF_RESTRICT partial,
                         uint32_t* RF_RESTRICT counters, float* RF_RESTRICT out) {
    __shared__ __align__(16) float s_q[RF_ATTN_MAX_GROUP][RF_ATTN_MAX_D];
    __shared__ __align__(16) rf_attn_tile s_tiles[RF_ATTN_SEGMENT];
    __shared__ __align__(16) float s_parts[RF_ATTN_MAX_GROUP][RF_ATTN_SEGMENT][RF_ATTN_MAX_D + 2];
    __shared__ int s_last;
    rf_pdl_begin();
    const int kvh = blockIdx.x, t = blockIdx.y, segment = blockIdx.z;
    const int group = n_head / n_kv, n_threads = (int)blockDim.x;
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int g = warp / RF_ATTN_SEGMENT, piece = warp % RF_ATTN_SEGMENT;  // this warp's work
    const int length = positions[t] + 1;
    const int segment_len = RF_ATTN_SEGMENT * RF_ATTN_PIECE;
    const int n_segments = (length + segment_len - 1) / segment_len;
    if (segment >= n_segments) {
        return;  // the whole block is past the context
    }
    const int first = segment * segment_len;
    const int n_pieces = min(RF_ATTN_SEGMENT, (length - first + RF_ATTN_PIECE - 1) / RF_ATTN_PIECE);
    const int64_t kv_stride = (int64_t)n_kv * d;
    const int64_t rows = (int64_t)slots[t] * n_ctx * kv_stride + (int64_t)first * kv_stride +
                         (int64_t)kvh * d;
    // The segment's K and V rows, read once for the whole group, and the group's q.
    for (int p = 0; p < n_pieces; ++p) {
        const int64_t at = rows + (int64_t)p * RF_ATTN_PIECE * kv_stride;
        const int n_rows = min(RF_ATTN_PIECE, length - first - p * RF_ATTN_PIECE);
        // At least 2 warps: eight 16-byte pieces a thread at most.
        rf_attn_copy_rows<8>(&s_tiles[p].k[0][0], RF_ATTN_PITCH, k_cache + at, kv_stride, n_rows,
                             d, 0, n_threads);
        rf_attn_copy_rows<8>(&s_tiles[p].values.v[0][0], RF_ATTN_MAX_D, v_cache + at, kv_stride,
                             n_rows, d, 0, n_threads);
    }
    const float* q_group = q + ((int64_t)t * n_head + (int64_t)kvh * group) * d;
    for (int i = threadIdx.x; i < group * d; i += n_threads) {
        s_q[i / d][i % d] = q_group[i];
    }
    __syncthreads();
    rf_attn_state part;
    if (piece < n_pieces) {
        const int n_valid = min(RF_ATTN_PIECE, length - first - piece * RF_ATTN_PIECE);
        const uint16_t* k_row = s_tiles[piece].k[lane < n_valid ? lane : 0];
        rf_attn_piece([&](int c) { return *(const rf_attn_u32x4*)(k_row + c); },
                      s_tiles[piece].values, n_valid, s_q[g], d, scale, part);
        rf_attn_save(s_parts[g][piece], part, d, lane);
    }
    __syncthreads();
    // The first warp of each head folds the head's pieces of the segment in order.
    const bool folds = piece == 0;
    rf_attn_state state;
    rf_attn_start(state);
    if (folds) {
        for (int p = 0; p < n_pieces; ++p) {
            rf_attn_load(s_parts[g][p], part, d, lane);
            rf_attn_fold(state, part);
        }
    }
    const int head = kvh * group + g;
    float* out_head = out + ((int64_t)t * n_head + head) * d;
    if (n_segments == 1) {  // the total is this segment's state
        if (folds) {
            rf_attn_save_a(out_head, state, d, lane, true);
        }
        return;
    }
    float* parts = partial + ((int64_t)t * n_head + head) * max_segments * (d + 2);
    if (folds) {
        rf_attn_save(parts + (int64_t)segment * (d + 2), state, d, lane);
    }
    // The last block of this (token, KV head) to finish folds every segment in order.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t* counter = counters + (int64_t)t * n_kv + kvh;
        s_last = atomicAdd(counter, 1u) == (uint32_t)(n_segments - 1);
        if (s_last) {
            *counter = 0u;
        }
    }
    __syncthreads();
    if (!s_last || !folds) {
        return;
    }
    __threadfence();
    rf_attn_start(state);
    for (int sg = 0; sg < n_segments; ++sg) {
        rf_attn_load(parts + (int64_t)sg * (d + 2), part, d, lane);
        rf_attn_fold(state, part);
    }
    rf_attn_save_a(out_head, state, d, lane, true);
}

RF_KERNEL_BOUNDS_ONE(RF_ATTN_PREFILL_TOKENS* RF_ATTN_MAX_GROUP* RF_WARP_SIZE)  // 1024
void rf_attention_prefill(const float* RF_RESTRICT q, const uint16_t* RF_RESTRICT k_cache,
                          const uint16_t* RF_RESTRICT v_cache, const int32_t* RF_RESTRICT positions,
                          const int32_t* RF_RESTRICT slots, int n_tokens, int n_ctx, int n_head,
                          int n_kv, int d, float scale, float* RF_RESTRICT out) {
    __shared__ __align__(16) float s_q[RF_ATTN_PREFILL_TOKENS * RF_ATTN_MAX_GROUP][RF_ATTN_MAX_D];
    __shared__ __align__(16) rf_attn_tile s_tile;
    rf_pdl_wait();
    const int group = n_head / n_kv, n_threads = (int)blockDim.x;
    const int kvh = blockIdx.x, first_token = blockIdx.y * RF_ATTN_PREFILL_TOKENS;
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int t = first_token + warp / group, head = kvh * group + warp % group;
    const bool active = t < n_tokens;
    const int length = active ? positions[t] + 1 : 0;
    const int64_t kv_stride = (int64_t)n_kv * d;
    const int64_t base = (int64_t)slots[first_token] * n_ctx * kv_stride + (int64_t)kvh * d;
    // The tile's longest context: its last token's (a chunk's positions ascend).
    const int last_token = min(first_token + RF_ATTN_PREFILL_TOKENS, n_tokens) - 1;
    const int tile_length = positions[last_token] + 1;
    if (active) {
        for (int i = lane; i < d; i += RF_WARP_SIZE) {
            s_q[warp][i] = q[((int64_t)t * n_head + head) * d + i];
        }
    }
    // The total's A lives in this (token, head)'s output row until the end.
    float* out_head = out + ((int64_t)t * n_head + head) * d;
    rf_attn_state segment, part, total;
    rf_attn_start(segment);
    rf_attn_start(total);
    for (int start = 0; start < tile_length; start += RF_ATTN_PIECE) {
        __syncthreads();  // the previous piece's rows are no longer read
        const int64_t rows = base + (int64_t)start * kv_stride;
        const int staged = min(RF_ATTN_PIECE, tile_length - start);
        // A block has at least 4 warps: four 16-byte pieces a thread at most.
        rf_attn_copy_rows<4>(&s_tile.k[0][0], RF_ATTN_PITCH, k_cache + rows, kv_stride, staged, d,
                             0, n_threads);
        rf_attn_copy_rows<4>(&s_tile.values.v[0][0], RF_ATTN_MAX_D, v_cache + rows, kv_stride,
                             staged, d, 0, n_threads);
        __syncthreads();
        if (!active || start >= length) {
            continue;  // this token's context ends before the piece
        }
        const int n_valid = min(RF_ATTN_PIECE, length - start);
        const uint16_t* k_row = s_tile.k[lane < n_valid ? lane : 0];
        rf_attn_piece([&](int c) { return *(const rf_attn_u32x4*)(k_row + c); }, s_tile.values,
                      n_valid, s_q[warp], d, scale, part);
        rf_attn_fold(segment, part);
        const int piece = start / RF_ATTN_PIECE;
        if ((piece + 1) % RF_ATTN_SEGMENT == 0 || start + RF_ATTN_PIECE >= length) {
            if (piece >= RF_ATTN_SEGMENT) {  // a total exists: its A is in out_head
                rf_attn_load_a(out_head, total, d, lane);
            }
            rf_attn_fold(total, segment);
            rf_attn_save_a(out_head, total, d, lane, false);
            rf_attn_start(segment);
        }
    }
    rf_pdl_launch_dependents();
    if (active) {
        rf_attn_load_a(out_head, total, d, lane);
        rf_attn_save_a(out_head, total, d, lane, true);
    }
}
