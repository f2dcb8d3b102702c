// The operands and epilogue of the vendor GEMM path (backends/gpu/vendor_blas.py): prompt
// chunks multiplied by cuBLAS / hipBLAS in fp16 with fp32 accumulation, when batch
// invariance is not asked for. The weights stay Q4_0/Q8_0 on the device; one matrix at
// a time (or a slab of its rows) is expanded to fp16 just before its GEMM.
//
//   rf_dequant_f16_<fmt>  repacked weights (see gemv.hip: quants [n, k * bits / 8], f16
//                         scales [n, k / 32] apart) of rows [0, n) -> fp16 [n, k], each
//                         element d * q exactly as the CPU backend dequantizes it, rounded
//                         once to fp16. Launch: grid (ceil(n * k / RF_DEQUANT_PART /
//                         RF_F16_THREADS)), block RF_F16_THREADS; one thread per
//                         RF_DEQUANT_PART elements.
//   rf_rows_f16           activation rows fp32 [rows, k], RMS-normalized with a gain when
//                         given one (rf_q8.h's normalization, the same bits as the int8
//                         path's), -> fp16 [rows, k]. Launch: grid (rows), block
//                         RF_Q8_NORM_THREADS.
//   rf_swiglu_f16         the gate|up GEMM's fp16 output [rows, 2n] (gate columns [0, n),
//                         up [n, 2n)) -> fp32 [rows, n] = silu(gate) * up. Launch: grid
//                         (ceil(rows * n / RF_F16_THREADS)), block RF_F16_THREADS.
#include "rf_portability.h"
#include "rf_q8.h"

// RF_F16_THREADS (threads per block of the element-wise kernels) and RF_DEQUANT_PART
// (elements one dequantizing thread writes) are from rf_constants.h.

struct alignas(16) rf_f16_u32x4 {
    uint32_t v[4];
};

struct alignas(8) rf_f16_u32x2 {
    uint32_t v[2];
};

// Where the quants of elements 8p .. 8p + 7 of a block start (8 bytes), and element
// 8p + i of them.
struct rf_dequant_q4_0 {
    static constexpr int quant_bytes = RF_QK / 2;
    // Element j < 16: byte j's low nibble; j >= 16: byte j - 16's high nibble.
    static __device__ __forceinline__ int offset(int p) {
        return 8 * (p % 2);
    }
    static __device__ __forceinline__ int value(const uint8_t* q, int p, int i) {
        return p < 2 ? (q[i] & 0x0F) - 8 : (q[i] >> 4) - 8;
    }
};

struct rf_dequant_q8_0 {
    static constexpr int quant_bytes = RF_QK;
    static __device__ __forceinline__ int offset(int p) {
        return 8 * p;
    }
    static __device__ __forceinline__ int value(const uint8_t* q, int, int i) {
        return (int)(int8_t)q[i];
    }
};

// One thread per RF_DEQUANT_PART (8) elements: the threads of a block write its 64 bytes
// side by side, so a warp stores 512 contiguous bytes at once.
template <typename Fmt>
RF_DEVICE_INLINE void rf_dequant_f16(const uint8_t* RF_RESTRICT qs, const uint16_t* RF_RESTRICT d,
                                     int n, int k, uint16_t* RF_RESTRICT out) {
    static_assert(RF_DEQUANT_PART == 8, "a part is one 8-byte load and one 16-byte store");
    constexpr int parts = RF_QK / RF_DEQUANT_PART;
    rf_pdl_begin();  // w16 may still be read by the previous GEMM
    const int64_t part = (int64_t)blockIdx.x * RF_F16_THREADS + threadIdx.x;
    const int64_t block = part / parts;
    const int p = (int)(part % parts);
    if (block >= (int64_t)n * (k / RF_QK)) {
        return;
    }
    const rf_f16_u32x2 raw =
        *(const rf_f16_u32x2*)(qs + block * Fmt::quant_bytes + Fmt::offset(p));
    const uint8_t* bytes = (const uint8_t*)&raw;
    const float scale = rf_half_to_float(d[block]);
    rf_f16_u32x4 packed;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = rf_float_to_half(scale * (float)Fmt::value(bytes, p, 2 * i));
        const uint32_t hi = rf_float_to_half(scale * (float)Fmt::value(bytes, p, 2 * i + 1));
        packed.v[i] = lo | (hi << 16);
    }
    ((rf_f16_u32x4*)(out + block * RF_QK))[p] = packed;
}

// rf_dequant_f16_q4_0, rf_dequant_f16_q8_0: kernel_variants.py DequantF16Kernel.
#define RF_DEQUANT_F16_PARAMS                                                              \
    const uint8_t *RF_RESTRICT qs, const uint16_t *RF_RESTRICT d, int n, int k,            \
        uint16_t *RF_RESTRICT out
#define RF_DEQUANT_F16_ARGS qs, d, n, k, out

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
