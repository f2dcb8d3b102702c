// Fused RoPE + KV-append for one layer, after a prefill chunk's QKV GEMM (decode
// steps do this in the QKV GEMV's epilogue, with the same rf_rope_store).
//
// qkv     fp32 [n_tokens, n_head*dk + n_kv*dk + n_kv*dv] (the fused QKV output)
// the rest: see rf_rope_out in rf_rope.h (q_out, KV pool, step state, cos/sin tables)
//
// Launch: grid (n_tokens), block RF_ROPE_THREADS; threads stride over the token's pairs.
#include "rf_portability.h"
#include "rf_constants.h"  // RF_ROPE_THREADS
#include "rf_rope.h"

RF_KERNEL_BOUNDS(RF_ROPE_THREADS)
void rf_rope_kv_append(const float* RF_RESTRICT qkv, float* RF_RESTRICT q_out,
                       uint16_t* RF_RESTRICT k_cache, uint16_t* RF_RESTRICT v_cache,
                       const int32_t* RF_RESTRICT positions, const int32_t* RF_RESTRICT slots,
                       const float* RF_RESTRICT cos_table, const float* RF_RESTRICT sin_table,
                       int n_head, int n_kv, int dk, int dv, int rope_dims, int n_ctx) {
    rf_pdl_begin();
    const int t = blockIdx.x;
    rf_rope_out r;
    r.positions = positions;
    r.slots = slots;
    r.cos_table = cos_table;
    r.sin_table = sin_table;
    r.q_out = q_out;
    r.k_cache = k_cache;
    r.v_cache = v_cache;
    r.q_dim = n_head * dk;
    r.kv_dim = n_kv * dk;
    r.head_dim = dk;
    r.rope_dims = rope_dims;
    r.n_ctx = n_ctx;
    (void)dv;  // == dk (the host checks)
    const int width = r.q_dim + 2 * r.kv_dim;
    const float* row = qkv + (int64_t)t * width;
    for (int e = 2 * threadIdx.x; e < width; e += 2 * RF_ROPE_THREADS) {
        rf_rope_store(r, t, e, row[e], row[e + 1]);
    }
}
