// rf_portability.h - the one place where CUDA (NVRTC) and HIP (hiprtc) differ.
//
// Every kernels/*.hip file includes this header and nothing else. Vendor
// conditionals (__HIP__, __CUDACC__, __gfx*, ...) appear here only; kernels use
// the rf_* functions and RF_* macros below.
//
// Self-contained on purpose: the NVRTC wheel ships no toolkit headers and CI has
// no CUDA toolkit, so nothing is #included (no <cstdint>, no <cuda_fp16.h>).
//
// Required define:
//   RF_WARP_SIZE  lanes per warp/wavefront of the target (32 on NVIDIA and RDNA,
//                 64 on CDNA). The kernel library passes it from the device
//                 properties or the compile target; it is never guessed here.
#ifndef RF_PORTABILITY_H
#define RF_PORTABILITY_H

#ifndef RF_WARP_SIZE
#error "RF_WARP_SIZE must be defined (-DRF_WARP_SIZE=32|64, from the device or target)"
#endif
#if RF_WARP_SIZE != 32 && RF_WARP_SIZE != 64
#error "RF_WARP_SIZE must be 32 or 64"
#endif

// ---------------------------------------------------------------------------
// Fixed-width integers. These are exactly the types hiprtc's own typedefs use
// (HIP 5.2 predefines some of them globally), so redeclaring them is harmless.
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

// ---------------------------------------------------------------------------
// Declaration macros.
//   RF_KERNEL void name(...)                  unmangled kernel entry point
//   RF_KERNEL_BOUNDS(256) void name(...)      same, with a max block size
//   RF_DEVICE_INLINE T helper(...)            device-only inline helper
#define RF_KERNEL extern "C" __global__
#define RF_KERNEL_BOUNDS(max_threads) extern "C" __global__ __launch_bounds__(max_threads)
#define RF_DEVICE_INLINE static __device__ __forceinline__
#define RF_RESTRICT __restrict__

#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
// ============================ AMD: HIP / hiprtc ============================

#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != RF_WARP_SIZE
#error "RF_WARP_SIZE does not match the target's wavefront size"
#endif

RF_DEVICE_INLINE float rf_shfl_xor(float v, int lane_mask) {
    return __shfl_xor(v, lane_mask, RF_WARP_SIZE);
}
RF_DEVICE_INLINE int rf_shfl_xor(int v, int lane_mask) {
    return __shfl_xor(v, lane_mask, RF_WARP_SIZE);
}

RF_DEVICE_INLINE float rf_half_to_float(uint16_t bits) {
    return (float)__builtin_bit_cast(_Float16, bits);
}
RF_DEVICE_INLINE uint16_t rf_float_to_half(float v) {  // round to nearest even
    return __builtin_bit_cast(uint16_t, (_Float16)v);
}

#define RF_INFINITY __builtin_huge_valf()

// rf_dp4a(a, b, c) = c + sum of the four signed-byte products of a and b.
#if defined(__GFX11__) || defined(__GFX12__)
// RDNA3/4: the mixed-signedness dot product, both operands signed.
RF_DEVICE_INLINE int rf_dp4a(int a, int b, int c) {
    return __builtin_amdgcn_sudot4(true, a, true, b, c, false);
}
#elif defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) ||  \
    defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) ||    \
    defined(__gfx950__) || defined(__gfx1030__) || defined(__gfx1031__) ||  \
    defined(__gfx1032__) || defined(__gfx1033__) || defined(__gfx1034__) || \
    defined(__gfx1035__) || defined(__gfx1036__)
// CDNA (and gfx906) and RDNA2: v_dot4_i32_i8.
RF_DEVICE_INLINE int rf_dp4a(int a, int b, int c) {
    return __builtin_amdgcn_sdot4(a, b, c, false);
}
#else
// Targets without an int8 dot instruction (gfx900, RDNA1).
RF_DEVICE_INLINE int rf_dp4a(int a, int b, int c) {
    c += (int)(int8_t)(a) * (int)(int8_t)(b);
    c += (int)(int8_t)(a >> 8) * (int)(int8_t)(b >> 8);
    c += (int)(int8_t)(a >> 16) * (int)(int8_t)(b >> 16);
    c += (int)(int8_t)(a >> 24) * (int)(int8_t)(b >> 24);
    return c;
}
#endif

#elif defined(__CUDACC__)
// ============================ NVIDIA: NVRTC ================================

#if RF_WARP_SIZE != 32
#error "NVIDIA warps have 32 lanes: RF_WARP_SIZE must be 32"
#endif

RF_DEVICE_INLINE float rf_shfl_xor(float v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask, RF_WARP_SIZE);
}
RF_DEVICE_INLINE int rf_shfl_xor(int v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask, RF_WARP_SIZE);
}

// cuda_fp16.h is not available to NVRTC here: convert with PTX directly.
RF_DEVICE_INLINE float rf_half_to_float(uint16_t bits) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(bits));
    return v;
}
RF_DEVICE_INLINE uint16_t rf_float_to_half(float v) {  // round to nearest even
    uint16_t bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(v));
    return bits;
}

#define RF_INFINITY __int_as_float(0x7f800000)

// rf_dp4a(a, b, c) = c + sum of the four signed-byte products of a and b.
RF_DEVICE_INLINE int rf_dp4a(int a, int b, int c) {
    return __dp4a(a, b, c);
}

#else
#error "rf_portability.h: unsupported compiler (expected hiprtc/HIP-Clang or NVRTC)"
#endif

// ---------------------------------------------------------------------------
// Vendor-neutral helpers built on the primitives above.

// Butterfly reductions over one warp/wavefront; every lane gets the result.
RF_DEVICE_INLINE float rf_warp_sum(float v) {
#pragma unroll
    for (int offset = RF_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v += rf_shfl_xor(v, offset);
    }
    return v;
}
RF_DEVICE_INLINE int rf_warp_sum(int v) {
#pragma unroll
    for (int offset = RF_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v += rf_shfl_xor(v, offset);
    }
    return v;
}
RF_DEVICE_INLINE float rf_warp_max(float v) {
#pragma unroll
    for (int offset = RF_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = fmaxf(v, rf_shfl_xor(v, offset));
    }
    return v;
}

// Little-endian f16 stored as raw bits at a 2-byte aligned address.
RF_DEVICE_INLINE float rf_load_half(const uint8_t* p) {
    return rf_half_to_float(*(const uint16_t*)p);
}

#endif  // RF_PORTABILITY_H
