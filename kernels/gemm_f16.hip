// The operands and epilogue of the vendor GEMM path (backends/gpu/vendor_blas.py): prompt
// chunks multiplied by cuBLAS / hipBLAS in fp16 with fp32 accumulation, when batch
// invariance is not asked for. The weights stay Q4_0/Q8_0 on the device; one matrix at
// a time (or a slab of its rows) is expanded to fp16 just before its GEMM.
//
//   rf_dequant_f16_<fmt>  repacked weights (see gemv.hip: quants [n, k * bits / 8], f16
//                         scales [n, k / 32] apart) of rows [0, n) -> fp16 [n, k], each
//                         element d * q exactly as the CPU backend dequantizes it, rounded
//                         once to fp16. Launch: grid (ceil(n * k / 32 / RF_F16_THREADS)),
//                         block RF_F16_THREADS; one thread per 32-element block.
//   rf_rows_f16           activation rows fp32 [rows, k], RMS-normalized with a gain when
//                         given one (rf_q8.h's normalization, the same bits as the int8
//                         path's), -> fp16 [rows, k]. Launch: grid (rows), block
//                         RF_Q8_NORM_THREADS.
//   rf_swiglu_f16         the gate|up GEMM's fp16 output [rows, 2n] (gate columns [0, n),
//                         up [n, 2n)) -> fp32 [rows, n] = silu(gate) * up. Launch: grid
//                         (ceil(rows * n / RF_F16_THREADS)), block RF_F16_THREADS.
#include "rf_portability.h"
#include "rf_q8.h"

// RF_F16_THREADS (threads per block of the element-wise kernels) is from rf_constants.h.

struct alignas(16) rf_f16_u32x4 {
    uint32_t v[4];
};

struct rf_dequant_q4_0 {
    static constexpr int quant_bytes = RF_QK / 2;
    // Element j of a block: byte j's low nibble (j < 16) or byte j - 16's high nibble.
    static __device__ __forceinline__ int value(const uint8_t* q, int j) {
        return j < RF_QK / 2 ? (q[j] & 0x0F) - 8 : (q[j - RF_QK / 2] >> 4) - 8;
    }
};

struct rf_dequant_q8_0 {
    static constexpr int quant_bytes = RF_QK;
    static __device__ __forceinline__ int value(const uint8_t* q, int j) {
        return (int)(int8_t)q[j];
    }
};

template <typename Fmt>
RF_DEVICE_INLINE void rf_dequant_f16(const uint8_t* RF_RESTRICT qs, const uint16_t* RF_RESTRICT d,
                                     int n, int k, uint16_t* RF_RESTRICT out) {
    rf_pdl_begin();  // w16 may still be read by the previous GEMM
    const int64_t block = (int64_t)blockIdx.x * RF_F16_THREADS + threadIdx.x;
    const int64_t n_blocks = (int64_t)n * (k / RF_QK);
    if (block >= n_blocks) {
        return;
    }
    // 16-byte loads and stores (quants rows are 16-byte aligned, fp16 blocks 64 bytes).
    rf_f16_u32x4 q[Fmt::quant_bytes / 16];
#pragma unroll
    for (int i = 0; i < Fmt::quant_bytes / 16; ++i) {
        q[i] = ((const rf_f16_u32x4*)(qs + block * Fmt::quant_bytes))[i];
    }
    const uint8_t* bytes = (const uint8_t*)q;
    const float scale = rf_half_to_float(d[block]);
    rf_f16_u32x4 packed[RF_QK / 8];
#pragma unroll
    for (int j = 0; j < RF_QK; j += 2) {
        const uint32_t lo = rf_float_to_half(scale * (float)Fmt::value(bytes, j));
        const uint32_t hi = rf_float_to_half(scale * (float)Fmt::value(bytes, j + 1));
        packed[j / 8].v[(j / 2) % 4] = lo | (hi << 16);
    }
#pragma unroll
    for (int i = 0; i < RF_QK / 8; ++i) {
        ((rf_f16_u32x4*)(out + block * RF_QK))[i] = packed[i];
    }
}

RF_KERNEL_BOUNDS(RF_F16_THREADS)
void rf_dequant_f16_q4_0(const uint8_t* RF_RESTRICT qs, const uint16_t* RF_RESTRICT d, int n,
                         int k, uint16_t* RF_RESTRICT out) {
    rf_dequant_f16<rf_dequant_q4_0>(qs, d, n, k, out);
}

RF_KERNEL_BOUNDS(RF_F16_THREADS)
void rf_dequant_f16_q8_0(const uint8_t* RF_RESTRICT qs, const uint16_t* RF_RESTRICT d, int n,
                         int k, uint16_t* RF_RESTRICT out) {
    rf_dequant_f16<rf_dequant_q8_0>(qs, d, n, k, out);
}

RF_KERNEL_BOUNDS(RF_Q8_NORM_THREADS)
void rf_rows_f16(const float* RF_RESTRICT x, int k, const float* RF_RESTRICT gain, float eps,
                 uint16_t* RF_RESTRICT out) {
    __shared__ float s_partial[RF_Q8_NORM_THREADS / RF_WARP_SIZE];
    rf_pdl_begin();
    const int64_t row = blockIdx.x;
    const float* xr = x + row * k;
    const float inv_rms = gain != nullptr ? rf_row_inv_rms(xr, k, eps, s_partial) : 1.0f;
    for (int i = threadIdx.x; i < k; i += RF_Q8_NORM_THREADS) {
        const float v = gain != nullptr ? rf_normalize(xr[i], inv_rms, gain[i]) : xr[i];
        out[row * k + i] = rf_float_to_half(v);
    }
}

RF_KERNEL_BOUNDS(RF_F16_THREADS)
void rf_swiglu_f16(const uint16_t* RF_RESTRICT gate_up, int rows, int n, float* RF_RESTRICT out) {
    rf_pdl_begin();
    const int64_t i = (int64_t)blockIdx.x * RF_F16_THREADS + threadIdx.x;
    if (i >= (int64_t)rows * n) {
        return;
    }
    const int64_t row = i / n;
    const int64_t col = i - row * n;
    const uint16_t* g = gate_up + row * 2 * n;
    out[i] = rf_swiglu(rf_half_to_float(g[col]), rf_half_to_float(g[n + col]));
}
