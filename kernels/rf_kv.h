// rf_kv.h - the KV pool's elements: fp16 bits, or fp8 E4M3 bytes (OCP "e4m3fn": bias 7,
// largest 448, 0x7f / 0xff NaN). rocforge_rt/step/kv_format.py is the reference of both
// conversions below; the tests hold these to it.
//
// Writing: a float32 becomes fp8 by rounding to nearest, ties to even, saturating to +-448
// (infinities too; NaN stays NaN). Reading: every fp8 value is exact in fp16, which the
// attention kernels stage and compute with, whatever the pool holds.
#ifndef RF_KV_H
#define RF_KV_H

#include "rf_portability.h"

// The element of a KV pool: fp16 bits (FP8 false) or fp8 E4M3 bytes.
template <bool FP8>
struct rf_kv_cell {
    using type = uint16_t;
};
template <>
struct rf_kv_cell<true> {
    using type = uint8_t;
};
template <bool FP8>
using rf_kv_t = typename rf_kv_cell<FP8>::type;

// The fp8 E4M3 byte of x. Both roundings are computed and one kept (branch-free: with
// branches the 1B shape's Q|K|V GEMV spilled).
RF_DEVICE_INLINE uint32_t rf_float_to_e4m3(float x) {
    const uint32_t bits = (uint32_t)rf_float_as_int(x);
    const uint32_t sign = (bits >> 24) & 0x80u, mag = bits & 0x7fffffffu;
    // From 2^-6 (the smallest normal) up: 3 of float32's 23 mantissa bits kept, rounded to
    // nearest even, and the exponent rebiased (127 -> 7); past 448 (0x7e) saturates.
    const uint32_t kept = (mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;
    const uint32_t normal = min(kept - ((127u - 7u) << 3), 0x7eu);
    // Below: multiples of 2^-9.
    const uint32_t small = (uint32_t)rintf(rf_int_as_float((int)min(mag, 0x3c800000u)) * 512.0f);
    return sign | (mag > 0x7f800000u ? 0x7fu : mag < 0x3c800000u ? small : normal);
}

// Four fp8 bytes (element i in byte i of w) as two fp16 pairs: lo = elements 0, 1, hi =
// elements 2, 3 (element 0, 2 in bits 0..15).
RF_DEVICE_INLINE void rf_e4m3x4_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if RF_HAS_CVT_E4M3
    lo = rf_cvt_e4m3x2_to_half2(w & 0xffffu);
    hi = rf_cvt_e4m3x2_to_half2(w >> 16);
#else
    // A byte's exponent and mantissa bits, 7 bits up, are an fp16 2^8 times too small (the
    // biases differ by 8), subnormals included: one exact multiply by 256 takes them there.
    constexpr uint32_t TIMES_256 = 0x5c005c00u;
    lo = rf_half2_mul(((w << 7) & 0x3f80u) | ((w << 15) & 0x3f800000u), TIMES_256) |
         ((w << 8) & 0x8000u) | ((w << 16) & 0x80000000u);
    hi = rf_half2_mul(((w >> 9) & 0x3f80u) | ((w >> 1) & 0x3f800000u), TIMES_256) |
         ((w >> 8) & 0x8000u) | (w & 0x80000000u);
#endif
    // A NaN byte (rare): the reference's NaN bits, 0x7e00.
    if ((((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0u) {  // a NaN byte
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (((w >> (8 * i)) & 0x7fu) == 0x7fu) {
                uint32_t& pair = i < 2 ? lo : hi;
                const int shift = 16 * (i % 2);
                pair = (pair & ~(0xffffu << shift)) | (0x7e00u << shift);
            }
        }
    }
}

// Store the pair (y0, y1) at elements (i, i + 1) of a KV pool (i even): fp16, or fp8 when
// `fp8`.
RF_DEVICE_INLINE void rf_kv_store2(uint8_t* pool, int64_t i, float y0, float y1, bool fp8) {
    if (fp8) {
        *(uint16_t*)(pool + i) = (uint16_t)(rf_float_to_e4m3(y0) | (rf_float_to_e4m3(y1) << 8));
    } else {
        *(uint32_t*)(pool + 2 * i) = rf_float2_to_half2(y0, y1);
    }
}

#endif  // RF_KV_H
