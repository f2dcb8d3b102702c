// Fused RoPE + KV-append for one layer.
//
// qkv     fp32 [n_tokens, n_head*dk + n_kv*dk + n_kv*dv] (the fused QKV GEMV output)
// q_out   fp32 [n_tokens, n_head*dk]: q rotated
// k_cache, v_cache  fp16 [n_slots, n_ctx, n_kv, dk|dv] of this layer
// positions, slots  int32 [n_tokens] from the step state (read on the device)
// cos, sin fp32 [n_ctx, rope_dims/2]
// Adjacent-pair ("norm") RoPE: pair i = elements (2i, 2i+1), i < rope_dims/2;
// elements past rope_dims pass through unrotated.
//
// Launch: grid (n_tokens), block RF_ROPE_THREADS; threads stride over the
// token's q pairs, k pairs and v elements.
#include "rf_portability.h"

#define RF_ROPE_THREADS 256

RF_DEVICE_INLINE void rf_rotate_pair(const float* in, float* out, int pair, int rope_half,
                                     const float* cos_row, const float* sin_row) {
    const float e = in[2 * pair], o = in[2 * pair + 1];
    if (pair < rope_half) {
        const float c = cos_row[pair], s = sin_row[pair];
        out[0] = e * c - o * s;
        out[1] = e * s + o * c;
    } else {
        out[0] = e;
        out[1] = o;
    }
}

RF_KERNEL_BOUNDS(RF_ROPE_THREADS)
void rf_rope_kv_append(const float* RF_RESTRICT qkv, float* RF_RESTRICT q_out,
                       uint16_t* RF_RESTRICT k_cache, uint16_t* RF_RESTRICT v_cache,
                       const int32_t* RF_RESTRICT positions, const int32_t* RF_RESTRICT slots,
                       const float* RF_RESTRICT cos_table, const float* RF_RESTRICT sin_table,
                       int n_head, int n_kv, int dk, int dv, int rope_dims, int n_ctx) {
    const int t = blockIdx.x;
    const int pos = positions[t];
    const int slot = slots[t];
    const int rope_half = rope_dims / 2;
    const float* cos_row = cos_table + (int64_t)pos * rope_half;
    const float* sin_row = sin_table + (int64_t)pos * rope_half;
    const int q_dim = n_head * dk, k_dim = n_kv * dk, v_dim = n_kv * dv;
    const float* row = qkv + (int64_t)t * (q_dim + k_dim + v_dim);
    const int64_t cache_row = ((int64_t)slot * n_ctx + pos);

    const int half_dk = dk / 2;
    for (int p = threadIdx.x; p < n_head * half_dk; p += blockDim.x) {
        const int head = p / half_dk, pair = p % half_dk;
        float r[2];
        rf_rotate_pair(row + head * dk, r, pair, rope_half, cos_row, sin_row);
        q_out[(int64_t)t * q_dim + head * dk + 2 * pair] = r[0];
        q_out[(int64_t)t * q_dim + head * dk + 2 * pair + 1] = r[1];
    }
    for (int p = threadIdx.x; p < n_kv * half_dk; p += blockDim.x) {
        const int head = p / half_dk, pair = p % half_dk;
        float r[2];
        rf_rotate_pair(row + q_dim + head * dk, r, pair, rope_half, cos_row, sin_row);
        uint16_t* dst = k_cache + cache_row * k_dim + head * dk + 2 * pair;
        dst[0] = rf_float_to_half(r[0]);
        dst[1] = rf_float_to_half(r[1]);
    }
    for (int i = threadIdx.x; i < v_dim; i += blockDim.x) {
        v_cache[cache_row * v_dim + i] = rf_float_to_half(row[q_dim + k_dim + i]);
    }
}
