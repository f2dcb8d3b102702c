// rf_rope.h - RoPE + KV-append of one (even, odd) pair of a token's fused Q|K|V row,
// shared by the standalone kernel (rope_kv.hip, after a prefill GEMM) and the QKV
// GEMV's epilogue (gemv.hip, decode), so that both write bit-identical q, k and v.
//
// Q|K|V row layout: [n_head * dk | n_kv * dk | n_kv * dv] with dk == dv == head_dim.
// Adjacent-pair ("norm") RoPE: pair i of a head = elements (2i, 2i+1), rotated by
// the angle of (position, i) when i < rope_dims / 2; later pairs pass unrotated.
// q goes to q_out (fp32), k and v to the KV pool (fp16, or fp8: rf_kv.h) at the token's
// slot and position.
#ifndef RF_ROPE_H
#define RF_ROPE_H

#include "rf_portability.h"
#include "rf_kv.h"

struct rf_rope_out {
    const int32_t* positions;  // step state: position of each token
    const int32_t* slots;      // step state: KV slot of each token
    const float* cos_table;    // [n_ctx, rope_dims / 2]
    const float* sin_table;
    float* q_out;        // [n_tokens, q_dim]
    uint8_t* k_cache;    // [n_slots, n_ctx, kv_dim] of this layer (fp16 or fp8 elements)
    uint8_t* v_cache;
    int q_dim, kv_dim, head_dim, rope_dims, n_ctx;
    int kv_fp8;  // 1: the pool holds fp8 E4M3 bytes; 0: fp16 (a constant in every kernel)
};

// What storing a pair of token t's row at element e reads: its position's angle (c, s;
// 1, 0 for a pair past rope_dims / 2 or outside q and k) and its KV-pool row.
struct rf_rope_at {
    float c, s;
    int64_t cache_row;
};

// Whether the pair at element e (even) of a Q|K|V row is rotated: in q or k, and among
// the first rope_dims / 2 pairs of its head.
RF_DEVICE_INLINE bool rf_rope_rotates(const rf_rope_out& r, int e) {
    return e < r.q_dim + r.kv_dim && (e % r.head_dim) / 2 < r.rope_dims / 2;
}

RF_DEVICE_INLINE rf_rope_at rf_rope_fetch(const rf_rope_out& r, int t, int e) {
    const int pos = r.positions[t];
    rf_rope_at at{1.0f, 0.0f, (int64_t)r.slots[t] * r.n_ctx + pos};
    if (rf_rope_rotates(r, e)) {
        const int pair = (e % r.head_dim) / 2, half = r.rope_dims / 2;
        at.c = r.cos_table[(int64_t)pos * half + pair];
        at.s = r.sin_table[(int64_t)pos * half + pair];
    }
    return at;
}

// Store the pair (y0, y1) at elements (e, e + 1) of token t's Q|K|V row (e even), `at`
// being rf_rope_fetch(r, t, e).
RF_DEVICE_INLINE void rf_rope_store_at(const rf_rope_out& r, int t, int e, const rf_rope_at& at,
                                       float y0, float y1) {
    if (rf_rope_rotates(r, e)) {
        const float even = y0, odd = y1;
        y0 = fmaf(even, at.c, -(odd * at.s));
        y1 = fmaf(even, at.s, odd * at.c);
    }
    if (e < r.q_dim) {
        float* q = r.q_out + (int64_t)t * r.q_dim + e;
        q[0] = y0;
        q[1] = y1;
    } else {
        const bool is_k = e < r.q_dim + r.kv_dim;
        const int i = e - r.q_dim - (is_k ? 0 : r.kv_dim);
        rf_kv_store2(is_k ? r.k_cache : r.v_cache, at.cache_row * r.kv_dim + i, y0, y1,
                     r.kv_fp8 != 0);
    }
}

// Store the pair (y0, y1) at elements (e, e + 1) of token t's Q|K|V row (e even).
RF_DEVICE_INLINE void rf_rope_store(const rf_rope_out& r, int t, int e, float y0, float y1) {
    rf_rope_store_at(r, t, e, rf_rope_fetch(r, t, e), y0, y1);
}

#endif  // RF_ROPE_H
