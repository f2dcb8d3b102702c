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
//   RF_KERNEL_BOUNDS_ONE(1024) void name(...) same, and registers for one such block a
//                                             multiprocessor (not a guess of two)
//   RF_DEVICE_INLINE T helper(...)            device-only inline helper
#define RF_KERNEL extern "C" __global__
#define RF_KERNEL_BOUNDS(max_threads) extern "C" __global__ __launch_bounds__(max_threads)
#define RF_KERNEL_BOUNDS_ONE(max_threads) \
    extern "C" __global__ __launch_bounds__(max_threads, 1)
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

// rf_shfl(v, src, width): v of lane `src` of this lane's aligned group of `width` lanes.
RF_DEVICE_INLINE int rf_shfl(int v, int src_lane, int width) {
    return __shfl(v, src_lane, width);
}
RF_DEVICE_INLINE float rf_int_as_float(int v) {
    return __builtin_bit_cast(float, v);
}
RF_DEVICE_INLINE int rf_float_as_int(float v) {
    return __builtin_bit_cast(int, v);
}

// Idle the calling wave for a few microseconds (polling loops).
RF_DEVICE_INLINE void rf_sleep_briefly() {
    __builtin_amdgcn_s_sleep(127);
}

// Every lane of the wavefront reaches this point before any goes on (lanes run in
// lockstep on AMD: this keeps the compiler from moving memory accesses across it).
RF_DEVICE_INLINE void rf_syncwarp() {
    __builtin_amdgcn_wave_barrier();
}

// No int8 matrix instruction is used on AMD yet: rf_mma_s8_m16n8k32 below is
// emulated with shuffles and dp4a (MFMA/WMMA versions are future work).
#define RF_HAS_MMA_S8 0

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

// rf_shfl(v, src, width): v of lane `src` of this lane's aligned group of `width` lanes.
RF_DEVICE_INLINE int rf_shfl(int v, int src_lane, int width) {
    return __shfl_sync(0xffffffffu, v, src_lane, width);
}
RF_DEVICE_INLINE float rf_int_as_float(int v) {
    return __int_as_float(v);
}
RF_DEVICE_INLINE int rf_float_as_int(float v) {
    return __float_as_int(v);
}

// Idle the calling warp for a few microseconds (polling loops).
RF_DEVICE_INLINE void rf_sleep_briefly() {
    __nanosleep(2000);
}

// Every lane of the warp reaches this point (and its memory accesses before it are
// ordered for the warp) before any goes on.
RF_DEVICE_INLINE void rf_syncwarp() {
    __syncwarp();
}

// c += A * B on the int8 tensor cores (sm_80+), over one warp: see
// rf_mma_s8_m16n8k32 below for the fragment layout.
#define RF_HAS_MMA_S8 1
RF_DEVICE_INLINE void rf_mma_s8_m16n8k32(int c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// rf_dp4a(a, b, c) = c + sum of the four signed-byte products of a and b.
RF_DEVICE_INLINE int rf_dp4a(int a, int b, int c) {
    return __dp4a(a, b, c);
}

#else
#error "rf_portability.h: unsupported compiler (expected hiprtc/HIP-Clang or NVRTC)"
#endif

// ---------------------------------------------------------------------------
// Programmatic dependent launch (NVIDIA sm_90 and newer; nothing elsewhere).
//
// A kernel the host launches with the overlap attribute (Driver.prepare_launch,
// overlap=True) may start while the kernel before it in the stream still runs, so
// that its launch and its first weight loads hide behind that kernel's tail.
//   rf_pdl_wait()              blocks until the previous kernel has finished and its
//                              writes are visible. Every kernel calls it before it reads
//                              anything an earlier kernel of the step writes, and before
//                              it writes anything; before it, only weights may be read.
//   rf_pdl_launch_dependents() lets the next kernel in the stream start launching.
// Without the attribute (and on AMD) both are no-ops and stream order holds as usual.
#if defined(__CUDACC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
RF_DEVICE_INLINE void rf_pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
RF_DEVICE_INLINE void rf_pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
#else
RF_DEVICE_INLINE void rf_pdl_wait() {}
RF_DEVICE_INLINE void rf_pdl_launch_dependents() {}
#endif

// The prologue of a kernel that reads nothing before waiting: let the next kernel
// launch, then wait for the previous one.
RF_DEVICE_INLINE void rf_pdl_begin() {
    rf_pdl_launch_dependents();
    rf_pdl_wait();
}

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
RF_DEVICE_INLINE float rf_shfl(float v, int src_lane, int width) {
    return rf_int_as_float(rf_shfl(rf_float_as_int(v), src_lane, width));
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

// rf_mma_s8_m16n8k32(c, a, b): c[4] += A * B for a 16x32 int8 A and a 32x8 int8 B
// held by the 32 lanes of an aligned lane group (threadIdx.x / 32; a CUDA warp,
// half a CDNA wavefront), int32 C 16x8, in the layout of PTX mma.m16n8k32.s8.
// With g = lane / 4 and t = lane % 4, each register packs 4 consecutive k:
//   a[0] = A[g][4t..],  a[1] = A[g+8][4t..],  a[2] = A[g][16+4t..],  a[3] = A[g+8][16+4t..]
//   b[0] = B[4t..][g],  b[1] = B[16+4t..][g]
//   c[0] = C[g][2t],  c[1] = C[g][2t+1],  c[2] = C[g+8][2t],  c[3] = C[g+8][2t+1]
// Every lane of the group must call it together (1-D blocks, multiple of 32).
#if !RF_HAS_MMA_S8
RF_DEVICE_INLINE void rf_mma_s8_m16n8k32(int c[4], const uint32_t a[4], const uint32_t b[2]) {
    const int lane = (int)(threadIdx.x & 31u);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const int row_lane = 4 * g + s;        // holds k chunk s of rows g and g + 8
        const int col0_lane = 4 * (2 * t) + s;  // k chunk s of column 2t
        const int col1_lane = col0_lane + 4;    // ... of column 2t + 1
        const int a0 = rf_shfl((int)a[0], row_lane, 32), a1 = rf_shfl((int)a[1], row_lane, 32);
        const int a2 = rf_shfl((int)a[2], row_lane, 32), a3 = rf_shfl((int)a[3], row_lane, 32);
        const int b00 = rf_shfl((int)b[0], col0_lane, 32), b01 = rf_shfl((int)b[1], col0_lane, 32);
        const int b10 = rf_shfl((int)b[0], col1_lane, 32), b11 = rf_shfl((int)b[1], col1_lane, 32);
        c[0] = rf_dp4a(a2, b01, rf_dp4a(a0, b00, c[0]));
        c[1] = rf_dp4a(a2, b11, rf_dp4a(a0, b10, c[1]));
        c[2] = rf_dp4a(a3, b01, rf_dp4a(a1, b00, c[2]));
        c[3] = rf_dp4a(a3, b11, rf_dp4a(a1, b10, c[3]));
    }
}
#endif

#endif  // RF_PORTABILITY_H
