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
// Launch: grid (n_kv, n_tokens, n_splits), block RF_ATTN_THREADS. The grid is
// sized for the whole context: a split past the token's length writes an empty
// partial (m = -inf, l = 0) and still counts toward the combine.
#include "rf_portability.h"

#define RF_ATTN_THREADS 128
#define RF_ATTN_WARPS (RF_ATTN_THREADS / RF_WARP_SIZE)
#define RF_ATTN_MAX_GROUP 8
#define RF_ATTN_MAX_D 128
#define RF_ATTN_PER_LANE (RF_ATTN_MAX_D / 32)

RF_KERNEL_BOUNDS(RF_ATTN_THREADS)
void rf_attention(const float* RF_RESTRICT q, const uint16_t* RF_RESTRICT k_cache,
                  const uint16_t* RF_RESTRICT v_cache, const int32_t* RF_RESTRICT positions,
                  const int32_t* RF_RESTRICT slots, int n_ctx, int n_head, int n_kv, int d,
                  float scale, int split_len, float* RF_RESTRICT partial,
                  uint32_t* RF_RESTRICT counters, float* RF_RESTRICT out) {
    __shared__ float s_m[RF_ATTN_WARPS][RF_ATTN_MAX_GROUP];
    __shared__ float s_l[RF_ATTN_WARPS][RF_ATTN_MAX_GROUP];
    __shared__ float s_acc[RF_ATTN_WARPS][RF_ATTN_MAX_GROUP][RF_ATTN_MAX_D];
    __shared__ bool s_last;

    const int kvh = blockIdx.x, t = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const int group = n_head / n_kv;
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int per_lane = d / RF_WARP_SIZE;  // elements of a head row each lane holds
    const int length = positions[t] + 1;
    const int start = split * split_len;
    const int end = min(start + split_len, length);
    const int64_t kv_stride = (int64_t)n_kv * d;
    const int64_t slot_base = (int64_t)slots[t] * n_ctx * kv_stride + (int64_t)kvh * d;

    float qr[RF_ATTN_MAX_GROUP][RF_ATTN_PER_LANE];
    float m[RF_ATTN_MAX_GROUP], l[RF_ATTN_MAX_GROUP], acc[RF_ATTN_MAX_GROUP][RF_ATTN_PER_LANE];
#pragma unroll
    for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
        m[g] = -RF_INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < RF_ATTN_PER_LANE; ++i) {
            acc[g][i] = 0.0f;
            const bool live = g < group && i < per_lane;
            qr[g][i] = live ? q[((int64_t)t * n_head + kvh * group + g) * d + i * RF_WARP_SIZE + lane]
                            : 0.0f;
        }
    }
    // Each warp walks its own positions with an online softmax per query head.
    for (int p = start + warp; p < end; p += RF_ATTN_WARPS) {
        const uint16_t* krow = k_cache + slot_base + p * kv_stride;
        const uint16_t* vrow = v_cache + slot_base + p * kv_stride;
        float kr[RF_ATTN_PER_LANE], vr[RF_ATTN_PER_LANE];
#pragma unroll
        for (int i = 0; i < RF_ATTN_PER_LANE; ++i) {
            kr[i] = i < per_lane ? rf_half_to_float(krow[i * RF_WARP_SIZE + lane]) : 0.0f;
            vr[i] = i < per_lane ? rf_half_to_float(vrow[i * RF_WARP_SIZE + lane]) : 0.0f;
        }
#pragma unroll
        for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
            if (g < group) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < RF_ATTN_PER_LANE; ++i) {
                    s += qr[g][i] * kr[i];
                }
                s = rf_warp_sum(s) * scale;
                const float m_new = fmaxf(m[g], s);
                const float correction = expf(m[g] - m_new);
                const float w = expf(s - m_new);
                l[g] = l[g] * correction + w;
#pragma unroll
                for (int i = 0; i < RF_ATTN_PER_LANE; ++i) {
                    acc[g][i] = acc[g][i] * correction + w * vr[i];
                }
                m[g] = m_new;
            }
        }
    }
    // Merge the warps of this block.
#pragma unroll
    for (int g = 0; g < RF_ATTN_MAX_GROUP; ++g) {
        if (g < group) {
            if (lane == 0) {
                s_m[warp][g] = m[g];
                s_l[warp][g] = l[g];
            }
#pragma unroll
            for (int i = 0; i < RF_ATTN_PER_LANE; ++i) {
                if (i < per_lane) {
                    s_acc[warp][g][i * RF_WARP_SIZE + lane] = acc[g][i];
                }
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < group * (d + 2); e += blockDim.x) {
        const int g = e / (d + 2), c = e % (d + 2);
        float m_all = -RF_INFINITY;
        for (int w = 0; w < RF_ATTN_WARPS; ++w) {
            m_all = fmaxf(m_all, s_m[w][g]);
        }
        float value = m_all;
        if (c > 0) {
            value = 0.0f;
            for (int w = 0; w < RF_ATTN_WARPS; ++w) {
                const float scale_w = s_m[w][g] == -RF_INFINITY ? 0.0f : expf(s_m[w][g] - m_all);
                value += scale_w * (c == 1 ? s_l[w][g] : s_acc[w][g][c - 2]);
            }
        }
        const int head = kvh * group + g;
        partial[(((int64_t)t * n_head + head) * n_splits + split) * (d + 2) + c] = value;
    }
    // The last block of this (token, kv head) to finish combines every split.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
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
    for (int e = threadIdx.x; e < group * d; e += blockDim.x) {
        const int g = e / d, c = e % d;
        const int head = kvh * group + g;
        const volatile float* parts = partial + ((int64_t)t * n_head + head) * n_splits * (d + 2);
        float m_all = -RF_INFINITY;
        for (int s = 0; s < n_splits; ++s) {
            m_all = fmaxf(m_all, parts[s * (d + 2)]);
        }
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            const float ms = parts[s * (d + 2)];
            const float w = ms == -RF_INFINITY ? 0.0f : expf(ms - m_all);
            den += w * parts[s * (d + 2) + 1];
            num += w * parts[s * (d + 2) + 2 + c];
        }
        out[((int64_t)t * n_head + head) * d + c] = num / den;
    }
}
