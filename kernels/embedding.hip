// Token embedding gather: out[t, :] = dequant(table[tokens[t], :]) as fp32.
//
// Shared arguments of every variant:
//   table       embedding rows, row r starts at table + r * row_stride (bytes)
//   row_stride  bytes per row (GGUF rows are packed: n_embd / 32 blocks)
//   n_rows      rows in the table (vocabulary size)
//   n_embd      elements per row (a multiple of 32 for the quantized types)
//   tokens      device array of n_tokens token ids (read on the device, so a
//               captured graph replays unchanged while the ids change)
//   out         fp32 [n_tokens, n_embd], contiguous
// A token id outside [0, n_rows) yields a zero row (padding slots of a batch).
//
// Launch: block (RF_EMBED_THREADS), grid (ceil(n_embd / RF_EMBED_THREADS),
// min(n_tokens, 65535)); each thread writes one element per token and loops
// over tokens in steps of gridDim.y.
#include "rf_portability.h"
#include "rf_constants.h"

// From rf_constants.h: RF_EMBED_THREADS, RF_QK (elements per quant block) and the GGUF
// block sizes RF_Q8_0_BLOCK_BYTES (f16 d + 32 x int8 q; value = d * q) and
// RF_Q4_0_BLOCK_BYTES (f16 d + 16 bytes; value = d * (nibble - 8)).

// Q8_0 element i of a row.
RF_DEVICE_INLINE float rf_q8_0_value(const uint8_t* row, int i) {
    const uint8_t* block = row + (i / RF_QK) * RF_Q8_0_BLOCK_BYTES;
    const int8_t q = (int8_t)block[2 + i % RF_QK];
    return rf_load_half(block) * (float)q;
}

// Q4_0 element i of a row: element j < 16 is the low nibble of byte j,
// element j + 16 the high nibble of byte j.
RF_DEVICE_INLINE float rf_q4_0_value(const uint8_t* row, int i) {
    const uint8_t* block = row + (i / RF_QK) * RF_Q4_0_BLOCK_BYTES;
    const int j = i % RF_QK;
    const uint8_t packed = block[2 + (j & 15)];
    const int q = (j < 16 ? (packed & 0x0F) : (packed >> 4)) - 8;
    return rf_load_half(block) * (float)q;
}

RF_DEVICE_INLINE float rf_f16_value(const uint8_t* row, int i) {
    return rf_load_half(row + 2 * i);
}

// The loop every variant shares; `Value(row, i)` decodes element i of a row.
template <float (*Value)(const uint8_t*, int)>
RF_DEVICE_INLINE void rf_embed_rows(const uint8_t* RF_RESTRICT table, int64_t row_stride,
                                    int n_rows, int n_embd, const int32_t* RF_RESTRICT tokens,
                                    int n_tokens, float* RF_RESTRICT out) {
    rf_pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_embd) {
        return;
    }
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        const int32_t token = tokens[t];
        float v = 0.0f;
        if (token >= 0 && token < n_rows) {
            v = Value(table + (int64_t)token * row_stride, i);
        }
        out[(int64_t)t * n_embd + i] = v;
    }
}

// rf_embed_q8_0, rf_embed_q4_0, rf_embed_f16: kernel_variants.py EmbedKernel.
#define RF_EMBED_PARAMS                                                                    \
    const uint8_t *RF_RESTRICT table, int64_t row_stride, int n_rows, int n_embd,          \
        const int32_t *RF_RESTRICT tokens, int n_tokens, float *RF_RESTRICT out
#define RF_EMBED_ARGS table, row_stride, n_rows, n_embd, tokens, n_tokens, out

// Rows repacked at load as the GEMV kernels read them (kernels/gemv.hip): quants
// qs [n_rows, n_embd * bits / 8] and f16 scales d [n_rows, n_embd / 32] apart.
// The tied LM head and the embedding gather then share one copy of the table.
template <int Bits>
RF_DEVICE_INLINE void rf_embed_split_rows(const uint8_t* RF_RESTRICT qs,
                                          const uint16_t* RF_RESTRICT d, int n_rows, int n_embd,
                                          const int32_t* RF_RESTRICT tokens, int n_tokens,
                                          float* RF_RESTRICT out) {
    rf_pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_embd) {
        return;
    }
    const int64_t row_bytes = (int64_t)n_embd * Bits / 8;
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        const int32_t token = tokens[t];
        float v = 0.0f;
        if (token >= 0 && token < n_rows) {
            const uint8_t* row = qs + (int64_t)token * row_bytes;
            const float scale = rf_half_to_float(d[(int64_t)token * (n_embd / RF_QK) + i / RF_QK]);
            if (Bits == 8) {
                v = scale * (float)(int8_t)row[i];
            } else {
                const int j = i % RF_QK;
                const uint8_t packed = row[(i / RF_QK) * 16 + (j & 15)];
                v = scale * (float)((j < 16 ? (packed & 0x0F) : (packed >> 4)) - 8);
            }
        }
        out[(int64_t)t * n_embd + i] = v;
    }
}

// rf_embed_q8_0_split, rf_embed_q4_0_split: kernel_variants.py EmbedKernel.
#define RF_EMBED_SPLIT_PARAMS                                                              \
    const uint8_t *RF_RESTRICT qs, const uint16_t *RF_RESTRICT d, int n_rows, int n_embd,  \
        const int32_t *RF_RESTRICT tokens, int n_tokens, float *RF_RESTRICT out
#define RF_EMBED_SPLIT_ARGS qs, d, n_rows, n_embd, tokens, n_tokens, out
