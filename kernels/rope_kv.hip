// Fused RoPE + KV-append for one layer, after a prefill chunk's QKV GEMM (decode
// steps do this in the QKV GEMV's epilogue, with the same rf_rope_store).
//
// qkv     fp32 [n_tokens, n_head*dk + n_kv*dk + n_kv*dv] (the fused QKV output)
// the rest: see rf_rope_out in rf_rope.h (q_out, KV pool, step state, cos/sin tables)
//
// rf_rope_kv_append writes an fp16 pool, rf_rope_kv_append_fp8 an fp8 one (rf_kv.h).
// Launch: grid (n_tokens), block RF_ROPE_THREADS; threads stride over the token's pairs.
#include "rf_portability.h"
#include "rf_constants.h"  // RF_ROPE_THREADS
#include "rf_rope.h"

#define RF_ROPE_KV_PARAMS                                                                  \
    const float *RF_RESTRICT qkv, float *RF_RESTRICT q_out, uint8_t *RF_RESTRICT k_cache,  \
        uint8_t *RF_RESTRICT v_cache, const int32_t *RF_RESTRICT positions,               \
        const int32_t *RF_RESTRICT slots, const float *RF_RESTRICT cos_table,             \
        const float *RF_RESTRICT sin_table, int n_head, int n_kv, int dk, int dv,          \
        int rope_dims, int n_ctx

template <bool FP8>
RF_DEVICE_INLINE void rf_rope_kv(RF_ROPE_KV_PARAMS) {
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
    r.kv_fp8 = FP8;
    (void)dv;  // == dk (the host checks)
    const int width = r.q_dim + 2 * r.kv_dim;
    const float* row = qkv + (int64_t)t * width;
    for (int e = 2 * threadIdx.x; e < width; e += 2 * RF_ROPE_THREADS) {
        rf_rope_store(r, t, e, row[e], row[e + 1]);
    }
}

#define RF_ROPE_KV_ARGS                                                                    \
    qkv, q_out, k_cache, v_cache, positions, slots, cos_table, sin_table, n_head, n_kv, dk, \
        dv, rope_dims, n_ctx
// rf_rope_kv_append[_fp8]: kernel_variants.py RopeKvKernel.
