// Quantized GEMV for decode and small batches: out[t, :] = W x[t, :] for up to
// RF_GEMV_MAX_ROWS activation rows t, with the activation quantized to int8 per
// 32-element block (scale d and integer sum kept, as llama.cpp's q8_1) and dp4a
// dot products against repacked weights.
//
// Weights, repacked at load (same bytes as GGUF, scales moved apart so the
// quants are 16-byte aligned for wide loads):
//   Q4_0: w_qs uint8 [n, k/2]: block b of a row is 16 bytes; byte j holds
//         element j (low nibble) and j+16 (high nibble); value = d * (q - 8)
//   Q8_0: w_qs int8 [n, k]: value = d * q
//   w_d   f16 [n, k/32]: the block scales
//
// Prologue (every block): optionally RMS-normalize each activation row with
// gain g (y = x / rms(x) * g), then quantize it into shared memory.
// Epilogues: 0 store; 1 add the residual (out may alias residual);
//            2 SwiGLU: rows [0, n) are gate, [n, 2n) up; out = silu(gate) * up.
//
// Launch: block RF_GEMV_THREADS, grid ceil(n / (RF_GEMV_WARPS * rows_per_warp)),
// dynamic shared rf_gemv_shared_bytes(n_rows, k) (see host code).
#include "rf_portability.h"

#define RF_GEMV_THREADS 256
#define RF_GEMV_WARPS (RF_GEMV_THREADS / RF_WARP_SIZE)
#define RF_GEMV_MAX_ROWS 8
#define RF_QK 32

#define RF_EPILOGUE_STORE 0
#define RF_EPILOGUE_RESIDUAL 1
#define RF_EPILOGUE_SWIGLU 2

struct alignas(16) rf_u32x4 {
    uint32_t v[4];
};

// Quantized activation rows in shared memory.
struct rf_q8_rows {
    int8_t* qs;     // [n_rows][k]
    float* d;       // [n_rows][k / 32]
    int32_t* sum;   // [n_rows][k / 32]: sum of the block's int8 values
};

// Normalize (optional) and quantize x[n_rows][k] into shared memory.
RF_DEVICE_INLINE void rf_quantize_rows(const float* RF_RESTRICT x, int n_rows, int k,
                                       const float* RF_RESTRICT gain, float eps,
                                       rf_q8_rows rows, float* scratch) {
    const int n_blocks = k / RF_QK;
    for (int t = 0; t < n_rows; ++t) {
        const float* xr = x + (int64_t)t * k;
        float inv_rms = 1.0f;
        if (gain != nullptr) {
            float ss = 0.0f;
            for (int i = threadIdx.x; i < k; i += blockDim.x) {
                ss += xr[i] * xr[i];
            }
            ss = rf_warp_sum(ss);
            const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
            if (lane == 0) {
                scratch[warp] = ss;
            }
            __syncthreads();
            float total = 0.0f;
            for (int w = 0; w < RF_GEMV_WARPS; ++w) {
                total += scratch[w];
            }
            inv_rms = 1.0f / sqrtf(total / (float)k + eps);
            __syncthreads();
        }
        // One thread per 32-element block: amax, scale, quantize (roundf: half away from 0).
        for (int b = threadIdx.x; b < n_blocks; b += blockDim.x) {
            float v[RF_QK];
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < RF_QK; ++i) {
                float xi = xr[b * RF_QK + i];
                if (gain != nullptr) {
                    xi = xi * inv_rms * gain[b * RF_QK + i];
                }
                v[i] = xi;
                amax = fmaxf(amax, fabsf(xi));
            }
            const float d = amax / 127.0f;
            int sum = 0;
#pragma unroll
            for (int i = 0; i < RF_QK; ++i) {
                const int q = amax == 0.0f ? 0 : (int)roundf(v[i] / d);
                rows.qs[(int64_t)t * k + b * RF_QK + i] = (int8_t)q;
                sum += q;
            }
            rows.d[t * n_blocks + b] = d;
            rows.sum[t * n_blocks + b] = sum;
        }
    }
    __syncthreads();
}

// Integer dot of one Q4_0 weight block with one q8 activation block, as
// sum(nibble * q) - 8 * sum(q), times the weight scale.
struct rf_q4_0_format {
    static constexpr int block_bytes = 16;
    RF_DEVICE_INLINE float dot(const uint8_t* w_block, float w_d, const int8_t* x_q, int x_sum) {
        const rf_u32x4 w = *(const rf_u32x4*)w_block;
        const int* xi = (const int*)x_q;
        int acc = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc = rf_dp4a((int)(w.v[i] & 0x0F0F0F0Fu), xi[i], acc);
            acc = rf_dp4a((int)((w.v[i] >> 4) & 0x0F0F0F0Fu), xi[4 + i], acc);
        }
        return w_d * (float)(acc - 8 * x_sum);
    }
};

struct rf_q8_0_format {
    static constexpr int block_bytes = 32;
    RF_DEVICE_INLINE float dot(const uint8_t* w_block, float w_d, const int8_t* x_q, int x_sum) {
        const rf_u32x4 lo = *(const rf_u32x4*)w_block;
        const rf_u32x4 hi = *(const rf_u32x4*)(w_block + 16);
        const int* xi = (const int*)x_q;
        int acc = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc = rf_dp4a((int)lo.v[i], xi[i], acc);
            acc = rf_dp4a((int)hi.v[i], xi[4 + i], acc);
        }
        (void)x_sum;
        return w_d * (float)acc;
    }
};

// Dot of weight row `row` with every activation row; results in acc[0..n_rows).
template <typename Format>
RF_DEVICE_INLINE void rf_row_dots(const uint8_t* RF_RESTRICT w_qs, const uint16_t* RF_RESTRICT w_d,
                                  int row, int k, int n_rows, rf_q8_rows x,
                                  float acc[RF_GEMV_MAX_ROWS]) {
    const int n_blocks = k / RF_QK;
    const int lane = threadIdx.x % RF_WARP_SIZE;
    const uint8_t* qs = w_qs + (int64_t)row * n_blocks * Format::block_bytes;
    const uint16_t* ds = w_d + (int64_t)row * n_blocks;
#pragma unroll
    for (int t = 0; t < RF_GEMV_MAX_ROWS; ++t) {
        acc[t] = 0.0f;
    }
    for (int b = lane; b < n_blocks; b += RF_WARP_SIZE) {
        const float wd = rf_half_to_float(ds[b]);
#pragma unroll
        for (int t = 0; t < RF_GEMV_MAX_ROWS; ++t) {
            if (t < n_rows) {
                const int xb = t * n_blocks + b;
                acc[t] += x.d[xb] * Format().dot(qs + b * Format::block_bytes, wd,
                                                 x.qs + (int64_t)xb * RF_QK, x.sum[xb]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < RF_GEMV_MAX_ROWS; ++t) {
        acc[t] = rf_warp_sum(acc[t]);
    }
}

template <typename Format>
RF_DEVICE_INLINE void rf_gemv(const uint8_t* RF_RESTRICT w_qs, const uint16_t* RF_RESTRICT w_d,
                              int n, int k, const float* RF_RESTRICT x, int n_rows,
                              const float* RF_RESTRICT gain, float eps, int rows_per_warp,
                              int epilogue, const float* residual, float* out) {
    extern __shared__ __align__(16) uint8_t rf_shared[];
    const int n_blocks = k / RF_QK;
    rf_q8_rows rows;
    rows.qs = (int8_t*)rf_shared;
    rows.d = (float*)(rf_shared + n_rows * k);
    rows.sum = (int32_t*)(rows.d + n_rows * n_blocks);
    float* scratch = (float*)(rows.sum + n_rows * n_blocks);
    rf_quantize_rows(x, n_rows, k, gain, eps, rows, scratch);

    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int first = (blockIdx.x * RF_GEMV_WARPS + warp) * rows_per_warp;
    for (int row = first; row < first + rows_per_warp && row < n; ++row) {
        float acc[RF_GEMV_MAX_ROWS];
        rf_row_dots<Format>(w_qs, w_d, row, k, n_rows, rows, acc);
        float up[RF_GEMV_MAX_ROWS];
        if (epilogue == RF_EPILOGUE_SWIGLU) {
            rf_row_dots<Format>(w_qs, w_d, row + n, k, n_rows, rows, up);
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < RF_GEMV_MAX_ROWS; ++t) {
                if (t < n_rows) {
                    const int64_t o = (int64_t)t * n + row;
                    float y = acc[t];
                    if (epilogue == RF_EPILOGUE_RESIDUAL) {
                        y += residual[o];
                    } else if (epilogue == RF_EPILOGUE_SWIGLU) {
                        y = y / (1.0f + expf(-y)) * up[t];
                    }
                    out[o] = y;
                }
            }
        }
    }
}

RF_KERNEL_BOUNDS(RF_GEMV_THREADS)
void rf_gemv_q4_0(const uint8_t* RF_RESTRICT w_qs, const uint16_t* RF_RESTRICT w_d, int n, int k,
                  const float* RF_RESTRICT x, int n_rows, const float* RF_RESTRICT gain, float eps,
                  int rows_per_warp, int epilogue, const float* residual, float* out) {
    rf_gemv<rf_q4_0_format>(w_qs, w_d, n, k, x, n_rows, gain, eps, rows_per_warp, epilogue,
                            residual, out);
}

RF_KERNEL_BOUNDS(RF_GEMV_THREADS)
void rf_gemv_q8_0(const uint8_t* RF_RESTRICT w_qs, const uint16_t* RF_RESTRICT w_d, int n, int k,
                  const float* RF_RESTRICT x, int n_rows, const float* RF_RESTRICT gain, float eps,
                  int rows_per_warp, int epilogue, const float* residual, float* out) {
    rf_gemv<rf_q8_0_format>(w_qs, w_d, n, k, x, n_rows, gain, eps, rows_per_warp, epilogue,
                            residual, out);
}
