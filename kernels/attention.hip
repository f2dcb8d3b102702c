// Decode/prefill attention over the fp16 KV pool, split across blocks
// (flash-decoding) with grouped-query heads; the last split block to finish
// combines the partial results.
//
// q        fp32 [n_tokens, n_head, d]   (d = head dim, dk == dv here, d <= 128, d % 32 == 0)
// k_cache, v_cache fp16 [n_slots, n_ctx, n_kv, d] of this layer
// positions, slots int32 [n_tokens]: token t attends to cache positions 0..positions[t]
//                  of slot slots[t] (step state, read on the device)
// partial  fp32 [n_tokens, n_head, n_splits, d + 2]: (m, l, acc[d]) per split
// counters uint32 [n_tokens, n_kv], zero before the first launch; the combining
//          block resets its counter, so every launch (and graph replay) starts at 0
// out      fp32 [n_tokens, n_head * d]
//
// One block per (KV head, token, split) serves the KV head's group of query heads,
// so each K and V row is read once per group. Inside a split, positions go in tiles
// of RF_ATTN_THREADS: each thread loads one position's K and V rows (V into shared
// memory) and scores the position against every head of the group (a dot product
// over d, in order); the block takes each head's tile maximum and sum, and each
// thread then accumulates its (head, element) outputs over the tile's positions in
// order, with an online softmax across tiles. Every token's result depends only on
// its own query and cache, in a fixed order, so a token gives the same output in a
// decode step and in a prompt chunk.
//
// Launch: grid (n_kv, n_tokens, n_splits), block RF_ATTN_THREADS. The grid is
// sized for the whole context. A token whose positions fit in the first split
// (a short context) is finished by that split's block alone, and the other blocks
// exit; otherwise a split past the token's length writes an empty partial
// (m = -inf, l = 0) and still counts toward the combine, which gives the same
// result as the single-split path when one split holds every position.
#include "rf_portability.h"

#define RF_ATTN_THREADS 128
#define RF_ATTN_WARPS (RF_ATTN_THREADS / RF_WARP_SIZE)
#define RF_ATTN_MAX_GROUP 8
#define RF_ATTN_MAX_D 128
#define RF_ATTN_OUT_PER_THREAD (RF_ATTN_MAX_GROUP * RF_ATTN_MAX_D / RF_ATTN_THREADS)

struct alignas(16) rf_attn_u32x4 {
    uint32_t v[4];
};

// v[g] for a run-time g, without indexing a register array at run time.
RF_DEVICE_INLINE float rf_attn_pick(const float v[RF_ATTN_MAX_GROUP], int g) {
    float r = v[0];
#pragma unroll
    for (int h = 1; h < RF_ATTN_MAX_GROUP; ++h) {
        r = g == h ? v[h] : r;
    }
    return r;
}

// Per-head maximum (MAX = true) or sum of v[g] over the block, in a fixed order:
// a butterfly in each warp, then the warps in order. Every thread gets the results.
template <bool MAX>
RF_DEVICE_INLINE void rf_attn_block_reduce(float v[RF_ATTN_MAX_GROUP], int group,
                                           float (*scratch)[RF_ATTN_WARPS]) {
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
#pragma unroll
    for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
        if (g < group) {
            const float w = MAX ? rf_warp_max(v[g]) : rf_warp_sum(v[g]);
            if (lane == 0) {
                scratch[g][warp] = w;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
        if (g < group) {
            float r = scratch[g][0];
#pragma unroll
            for (int w = 1; w < RF_ATTN_WARPS; ++w) {
                r = MAX ? fmaxf(r, scratch[g][w]) : r + scratch[g][w];
            }
            v[g] = r;
        }
    }
    __syncthreads();  // scratch is reused by the next reduction
}

RF_KERNEL_BOUNDS(RF_ATTN_THREADS)
void rf_attention(const float* RF_RESTRICT q, const uint16_t* RF_RESTRICT k_cache,
                  const uint16_t* RF_RESTRICT v_cache, const int32_t* RF_RESTRICT positions,
                  const int32_t* RF_RESTRICT slots, int n_ctx, int n_head, int n_kv, int d,
                  float scale, int split_len, float* RF_RESTRICT partial,
                  uint32_t* RF_RESTRICT counters, float* RF_RESTRICT out) {
    __shared__ float s_q[RF_ATTN_MAX_GROUP][RF_ATTN_MAX_D];
    __shared__ float s_p[RF_ATTN_MAX_GROUP][RF_ATTN_THREADS];  // scores, then weights
    __shared__ __align__(16) uint16_t s_v[RF_ATTN_THREADS][RF_ATTN_MAX_D];  // the tile's V rows
    __shared__ float s_reduce[RF_ATTN_MAX_GROUP][RF_ATTN_WARPS];
    __shared__ bool s_last;

    const int kvh = blockIdx.x, t = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const int group = n_head / n_kv;
    const int tid = threadIdx.x;
    const int length = positions[t] + 1;
    const int start = split * split_len;
    const int end = min(start + split_len, length);
    const int64_t kv_stride = (int64_t)n_kv * d;
    const int64_t slot_base = (int64_t)slots[t] * n_ctx * kv_stride + (int64_t)kvh * d;
    const int n_out = group * d;  // this block's outputs: (head g, element c) = g * d + c
    const bool single = length <= split_len;  // the first split holds every position
    if (single && split > 0) {
        return;
    }

    for (int i = tid; i < n_out; i += RF_ATTN_THREADS) {
        s_q[i / d][i % d] = q[((int64_t)t * n_head + kvh * group) * d + i];
    }
    float m[RF_ATTN_MAX_GROUP], l[RF_ATTN_MAX_GROUP], acc[RF_ATTN_OUT_PER_THREAD];
#pragma unroll
    for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
        m[g] = -RF_INFINITY;
        l[g] = 0.0f;
    }
#pragma unroll
    for (int o = 0; o < RF_ATTN_OUT_PER_THREAD; ++o) {
        acc[o] = 0.0f;
    }
    __syncthreads();

    for (int tile = start; tile < end; tile += RF_ATTN_THREADS) {
        const int n_pos = min(RF_ATTN_THREADS, end - tile);
        // Scores of this thread's position, one per head of the group.
        float s[RF_ATTN_MAX_GROUP];
#pragma unroll
        for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
            s[g] = 0.0f;
        }
        if (tid < n_pos) {
            const int64_t row = slot_base + (int64_t)(tile + tid) * kv_stride;
            const uint16_t* krow = k_cache + row;
            const uint16_t* vrow = v_cache + row;
#pragma unroll 4
            for (int c = 0; c < d; c += 8) {
                *(rf_attn_u32x4*)&s_v[tid][c] = *(const rf_attn_u32x4*)(vrow + c);
            }
#pragma unroll 4
            for (int c = 0; c < d; c += 8) {
                const rf_attn_u32x4 raw = *(const rf_attn_u32x4*)(krow + c);  // 8 halves
#pragma unroll
                for (int h = 0; h < 8; ++h) {
                    const float kv = rf_half_to_float((uint16_t)(raw.v[h / 2] >> (16 * (h % 2))));
#pragma unroll
                    for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
                        if (g < group) {
                            s[g] = fmaf(s_q[g][c + h], kv, s[g]);
                        }
                    }
                }
            }
        }
        float tile_max[RF_ATTN_MAX_GROUP];
#pragma unroll
        for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
            s[g] *= scale;
            tile_max[g] = tid < n_pos ? s[g] : -RF_INFINITY;
        }
        rf_attn_block_reduce<true>(tile_max, group, s_reduce);
        float weight_sum[RF_ATTN_MAX_GROUP], correction[RF_ATTN_MAX_GROUP];
#pragma unroll
        for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
            if (g < group) {
                const float m_new = fmaxf(m[g], tile_max[g]);  // finite: the tile has a position
                correction[g] = expf(m[g] - m_new);           // 0 on the first tile
                m[g] = m_new;
                const float w = tid < n_pos ? expf(s[g] - m_new) : 0.0f;
                s_p[g][tid] = w;
                weight_sum[g] = w;
            }
        }
        rf_attn_block_reduce<false>(weight_sum, group, s_reduce);  // also publishes s_p
#pragma unroll
        for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
            if (g < group) {
                l[g] = l[g] * correction[g] + weight_sum[g];
            }
        }
        // This thread's outputs over the tile's positions, in order.
#pragma unroll
        for (int o = 0; o < RF_ATTN_OUT_PER_THREAD; ++o) {
            const int i = tid + o * RF_ATTN_THREADS;
            if (i < n_out) {
                const int g = i / d, c = i % d;
                float a = acc[o] * rf_attn_pick(correction, g);
#pragma unroll 8
                for (int p = 0; p < n_pos; ++p) {
                    a = fmaf(s_p[g][p], rf_half_to_float(s_v[p][c]), a);
                }
                acc[o] = a;
            }
        }
        __syncthreads();  // s_p is rewritten by the next tile
    }

    if (single) {  // what the combine gives for one non-empty split: acc / l
#pragma unroll
        for (int o = 0; o < RF_ATTN_OUT_PER_THREAD; ++o) {
            const int i = tid + o * RF_ATTN_THREADS;
            if (i < n_out) {
                out[((int64_t)t * n_head + kvh * group) * d + i] = acc[o] / rf_attn_pick(l, i / d);
            }
        }
        return;
    }
    // This split's partial: (m, l, acc) per head; an empty split gives (-inf, 0, 0).
#pragma unroll
    for (int o = 0; o < RF_ATTN_OUT_PER_THREAD; ++o) {
        const int i = tid + o * RF_ATTN_THREADS;
        if (i < n_out) {
            const int g = i / d, c = i % d;
            const int head = kvh * group + g;
            float* part = partial + (((int64_t)t * n_head + head) * n_splits + split) * (d + 2);
            part[2 + c] = acc[o];
            if (c == 0) {
                part[0] = rf_attn_pick(m, g);
                part[1] = rf_attn_pick(l, g);
            }
        }
    }
    // The last block of this (token, kv head) to finish combines every split.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        uint32_t* counter = counters + (int64_t)t * n_kv + kvh;
        const uint32_t done = atomicAdd(counter, 1u);
        s_last = done == (uint32_t)(n_splits - 1);
        if (s_last) {
            *counter = 0u;
        }
    }
    __syncthreads();
    if (!s_last) {
        return;
    }
    __threadfence();
    for (int e = tid; e < n_out; e += RF_ATTN_THREADS) {
        const int g = e / d, c = e % d;
        const int head = kvh * group + g;
        const volatile float* parts = partial + ((int64_t)t * n_head + head) * n_splits * (d + 2);
        float m_all = -RF_INFINITY;
        for (int sp = 0; sp < n_splits; ++sp) {
            m_all = fmaxf(m_all, parts[sp * (d + 2)]);
        }
        float num = 0.0f, den = 0.0f;
        for (int sp = 0; sp < n_splits; ++sp) {
            const float ms = parts[sp * (d + 2)];
            const float w = ms == -RF_INFINITY ? 0.0f : expf(ms - m_all);
            den += w * parts[sp * (d + 2) + 1];
            num += w * parts[sp * (d + 2) + 2 + c];
        }
        out[((int64_t)t * n_head + head) * d + c] = num / den;
    }
}
