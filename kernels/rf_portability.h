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
//   RF_DEVICE_MEMBER T method(...)            the same for a member function
#define RF_KERNEL extern "C" __global__
#define RF_KERNEL_BOUNDS(max_threads) extern "C" __global__ __launch_bounds__(max_threads)
#define RF_KERNEL_BOUNDS_ONE(max_threads) \
    extern "C" __global__ __launch_bounds__(max_threads, 1)
#define RF_DEVICE_INLINE static __device__ __forceinline__
#define RF_DEVICE_MEMBER __device__ __forceinline__  // member functions (no `static`)
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
#define RF_FLOAT_MAX 3.40282347e+38f  // the largest finite float32

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

// No matrix instruction is used on AMD yet: rf_mma_s8_m16n8k32 and rf_mma_f16_m16n8k16
// below are emulated with shuffles and dp4a / fp32 FMAs (MFMA/WMMA versions are future
// work), as are rf_ldmatrix_x4* and rf_cp_async16 (a plain copy).
#define RF_HAS_MMA_S8 0
#define RF_HAS_MMA_F16 0
#define RF_HAS_LDMATRIX 0
#define RF_HAS_CP_ASYNC 0
#define RF_HAS_CVT_E4M3 0  // no fp8 conversion instruction is used on AMD (rf_kv.h)

// 2^x (the attention softmax's exponential).
RF_DEVICE_INLINE float rf_exp2(float x) {
    return exp2f(x);
}
// Two floats as an fp16 pair, each rounded to nearest even: lo in bits 0..15.
RF_DEVICE_INLINE uint32_t rf_float2_to_half2(float lo, float hi) {
    return (uint32_t)rf_float_to_half(lo) | ((uint32_t)rf_float_to_half(hi) << 16);
}
// The fp16 pairs a * b, each rounded to nearest even (subnormals kept).
RF_DEVICE_INLINE uint32_t rf_half2_mul(uint32_t a, uint32_t b) {
    typedef _Float16 rf_f16x2 __attribute__((ext_vector_type(2)));
    return __builtin_bit_cast(uint32_t,
                              __builtin_bit_cast(rf_f16x2, a) * __builtin_bit_cast(rf_f16x2, b));
}

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
#define RF_FLOAT_MAX __int_as_float(0x7f7fffff)  // the largest finite float32

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

// c += A * B on the fp16 tensor cores (sm_80+), fp32 accumulation, over one warp: see
// rf_mma_f16_m16n8k16 below for the fragment layout.
#define RF_HAS_MMA_F16 1
RF_DEVICE_INLINE void rf_mma_f16_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// rf_dp4a(a, b, c) = c + sum of the four signed-byte products of a and b.
RF_DEVICE_INLINE int rf_dp4a(int a, int b, int c) {
    return __dp4a(a, b, c);
}

// 2^x (the attention softmax's exponential): one MUFU.EX2, denormal results flushed.
RF_DEVICE_INLINE float rf_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// Two floats as an fp16 pair, each rounded to nearest even: lo in bits 0..15.
RF_DEVICE_INLINE uint32_t rf_float2_to_half2(float lo, float hi) {
    uint32_t bits;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(hi), "f"(lo));
    return bits;
}
// The fp16 pairs a * b, each rounded to nearest even (subnormals kept).
RF_DEVICE_INLINE uint32_t rf_half2_mul(uint32_t a, uint32_t b) {
    uint32_t bits;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(bits) : "r"(a), "r"(b));
    return bits;
}

// Shared-memory address of a generic pointer into shared memory.
RF_DEVICE_INLINE uint32_t rf_shared_address(const void* p) {
    uint32_t address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
        : "=r"(address)
        : "l"(p));
    return address;
}

// ldmatrix (sm_75+) and cp.async (sm_80+): see the portable definitions below.
#define RF_HAS_LDMATRIX 1
RF_DEVICE_INLINE void rf_ldmatrix_x4(uint32_t r[4], const uint16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(rf_shared_address(row))
                 : "memory");
}
RF_DEVICE_INLINE void rf_ldmatrix_x4_trans(uint32_t r[4], const uint16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(rf_shared_address(row))
                 : "memory");
}
// Two fp8 E4M3 values (bytes 0 and 1 of `pair`) as an fp16 pair (byte 0 in bits 0..15),
// exactly, in one instruction (sm_89+; rf_kv.h widens in integer arithmetic elsewhere).
#if __CUDA_ARCH__ >= 890
#define RF_HAS_CVT_E4M3 1
RF_DEVICE_INLINE uint32_t rf_cvt_e4m3x2_to_half2(uint32_t pair) {
    uint32_t bits;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(bits) : "h"((uint16_t)pair));
    return bits;
}
#else
#define RF_HAS_CVT_E4M3 0
#endif
#define RF_HAS_CP_ASYNC 1
RF_DEVICE_INLINE void rf_cp_async16(void* dst, const void* src, bool fill) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(rf_shared_address(dst)),
                 "l"(src), "r"(fill ? 16 : 0)
                 : "memory");
}
RF_DEVICE_INLINE void rf_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int PENDING>
RF_DEVICE_INLINE void rf_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
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
//                              it writes anything; before it, only weights may be read,
//                              and what kernels known to have finished wrote (the decode
//                              attention's one-row stage: attention.hip says why).
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

// ---------------------------------------------------------------------------
// Bulk copies from global into shared memory, each lane group (threadIdx.x / 32) its own
// (NVIDIA sm_90 and newer: the copy engine moves the bytes, with no thread's loads in
// flight; elsewhere the calling thread copies them at once). A copy completes on a
// barrier in shared memory (8 bytes, 8-byte aligned) whose phases 0, 1, 0, ... each take
// one arrival and the bytes announced with it:
//   rf_bulk_init(bar)                one thread sets a barrier up; then
//                                    rf_bulk_init_done() in that thread, and an
//                                    rf_syncwarp() before any lane uses it
//   rf_bulk_expect(bar, bytes)       the phase's arrival: it completes once `bytes` more
//                                    have landed
//   rf_bulk_copy(dst, src, bytes, bar)  `bytes` (a multiple of 16, both addresses 16-byte
//                                    aligned) from global src to shared dst
//   rf_bulk_wait(bar, parity)        every lane of the group: until phase `parity`
//                                    completed, the bytes then visible to all of them
//   rf_bulk_reads_done()             in a copying thread, after an rf_syncwarp(): the
//                                    group's reads of shared memory come before its later
//                                    copies into it
#if defined(__CUDACC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
RF_DEVICE_INLINE void rf_bulk_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(rf_shared_address(bar))
                 : "memory");
}
RF_DEVICE_INLINE void rf_bulk_init_done() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
RF_DEVICE_INLINE void rf_bulk_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                     rf_shared_address(bar)),
                 "r"(bytes)
                 : "memory");
}
RF_DEVICE_INLINE void rf_bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];" ::"r"(rf_shared_address(dst)),
        "l"(src), "r"(bytes), "r"(rf_shared_address(bar))
        : "memory");
}
RF_DEVICE_INLINE void rf_bulk_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(rf_shared_address(bar)), "r"(parity)
            : "memory");
    } while (!done);
}
RF_DEVICE_INLINE void rf_bulk_reads_done() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#else
struct alignas(16) rf_bulk_piece {
    uint32_t v[4];
};
RF_DEVICE_INLINE void rf_bulk_init(uint64_t*) {}
RF_DEVICE_INLINE void rf_bulk_init_done() {}
RF_DEVICE_INLINE void rf_bulk_expect(uint64_t*, uint32_t) {}
RF_DEVICE_INLINE void rf_bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t*) {
    for (uint32_t i = 0; i < bytes; i += 16) {
        *(rf_bulk_piece*)((uint8_t*)dst + i) = *(const rf_bulk_piece*)((const uint8_t*)src + i);
    }
}
RF_DEVICE_INLINE void rf_bulk_wait(uint64_t*, uint32_t) {
    rf_syncwarp();
}
RF_DEVICE_INLINE void rf_bulk_reads_done() {}
#endif

// ---------------------------------------------------------------------------
// Thread block clusters (NVIDIA sm_90 and newer; elsewhere every block is a cluster of one):
//   rf_cluster_rank(), rf_cluster_size()  this block's rank in its cluster, the cluster's blocks
//   rf_cluster_peer(p, rank)              where shared-memory address p of this block is in
//                                         block `rank` of the cluster (a generic address:
//                                         plain loads and stores reach it)
//   rf_cluster_sync()                     every thread of every block of the cluster: the
//                                         shared-memory writes before it, peers' included,
//                                         are visible to all after it
//   rf_cluster_arrive(), rf_cluster_wait()  the same in two halves (no ordering of memory):
//                                         arrive as the kernel starts and wait before a
//                                         block's first access to a peer's shared memory,
//                                         so that every block of the cluster has started
#if defined(__CUDACC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
RF_DEVICE_INLINE uint32_t rf_cluster_rank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}
RF_DEVICE_INLINE uint32_t rf_cluster_size() {
    uint32_t size;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
    return size;
}
template <typename T>
RF_DEVICE_INLINE T* rf_cluster_peer(T* p, uint32_t rank) {
    uint64_t peer;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(peer) : "l"((uint64_t)p), "r"(rank));
    return (T*)peer;
}
RF_DEVICE_INLINE void rf_cluster_sync() {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n\t"
        "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
RF_DEVICE_INLINE void rf_cluster_arrive() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
RF_DEVICE_INLINE void rf_cluster_wait() {
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
#else
RF_DEVICE_INLINE uint32_t rf_cluster_rank() {
    return 0;
}
RF_DEVICE_INLINE uint32_t rf_cluster_size() {
    return 1;
}
template <typename T>
RF_DEVICE_INLINE T* rf_cluster_peer(T* p, uint32_t) {
    return p;
}
RF_DEVICE_INLINE void rf_cluster_sync() {
    __syncthreads();
}
RF_DEVICE_INLINE void rf_cluster_arrive() {}
RF_DEVICE_INLINE void rf_cluster_wait() {}
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

#if !RF_HAS_MMA_S8 || !RF_HAS_MMA_F16
// The emulation both mma forms share: their fragments hold the same (row, k-register)
// layout, 4 int8 or 2 fp16 consecutive k a 32-bit register; `dot(a, b, c)` adds one
// register pair's products to c (exactly, in a fixed order).
template <typename C, typename Dot>
RF_DEVICE_INLINE void rf_mma_emulated(C c[4], const uint32_t a[4], const uint32_t b[2], Dot dot) {
    const int lane = (int)(threadIdx.x & 31u);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const int row_lane = 4 * g + s;         // holds k register s of rows g and g + 8
        const int col0_lane = 4 * (2 * t) + s;  // k register s of column 2t
        const int col1_lane = col0_lane + 4;    // ... of column 2t + 1
        const uint32_t a0 = (uint32_t)rf_shfl((int)a[0], row_lane, 32);
        const uint32_t a1 = (uint32_t)rf_shfl((int)a[1], row_lane, 32);
        const uint32_t a2 = (uint32_t)rf_shfl((int)a[2], row_lane, 32);
        const uint32_t a3 = (uint32_t)rf_shfl((int)a[3], row_lane, 32);
        const uint32_t b00 = (uint32_t)rf_shfl((int)b[0], col0_lane, 32);
        const uint32_t b01 = (uint32_t)rf_shfl((int)b[1], col0_lane, 32);
        const uint32_t b10 = (uint32_t)rf_shfl((int)b[0], col1_lane, 32);
        const uint32_t b11 = (uint32_t)rf_shfl((int)b[1], col1_lane, 32);
        c[0] = dot(a2, b01, dot(a0, b00, c[0]));
        c[1] = dot(a2, b11, dot(a0, b10, c[1]));
        c[2] = dot(a3, b01, dot(a1, b00, c[2]));
        c[3] = dot(a3, b11, dot(a1, b10, c[3]));
    }
}
#endif

// rf_mma_s8_m16n8k32(c, a, b): c[4] += A * B for a 16x32 int8 A and a 32x8 int8 B
// held by the 32 lanes of an aligned lane group (threadIdx.x / 32; a CUDA warp,
// half a CDNA wavefront), int32 C 16x8, in the layout of PTX mma.m16n8k32.s8.
// With g = lane / 4 and t = lane % 4, each register packs 4 consecutive k:
//   a[0] = A[g][4t..],  a[1] = A[g+8][4t..],  a[2] = A[g][16+4t..],  a[3] = A[g+8][16+4t..]
//   b[0] = B[4t..][g],  b[1] = B[16+4t..][g]
//   c[0] = C[g][2t],  c[1] = C[g][2t+1],  c[2] = C[g+8][2t],  c[3] = C[g+8][2t+1]
// Every lane of the group must call it together (1-D blocks, multiple of 32).
#if !RF_HAS_MMA_S8
struct rf_dot4_s8 {
    __device__ int operator()(uint32_t a, uint32_t b, int c) const {
        return rf_dp4a((int)a, (int)b, c);
    }
};
RF_DEVICE_INLINE void rf_mma_s8_m16n8k32(int c[4], const uint32_t a[4], const uint32_t b[2]) {
    rf_mma_emulated(c, a, b, rf_dot4_s8());
}
#endif

// rf_mma_f16_m16n8k16(c, a, b): c[4] += A * B for a 16x16 fp16 A and a 16x8 fp16 B held
// by the 32 lanes of an aligned lane group (threadIdx.x / 32; a CUDA warp, half a CDNA
// wavefront), fp32 C 16x8, in the layout of PTX mma.m16n8k16.row.col.f32.f16.f16.f32.
// With g = lane / 4 and t = lane % 4, each register packs 2 consecutive k (lower k in
// bits 0..15):
//   a[0] = A[g][2t..],  a[1] = A[g+8][2t..],  a[2] = A[g][8+2t..],  a[3] = A[g+8][8+2t..]
//   b[0] = B[2t..][g],  b[1] = B[8+2t..][g]
//   c[0] = C[g][2t],  c[1] = C[g][2t+1],  c[2] = C[g+8][2t],  c[3] = C[g+8][2t+1]
// An element of C depends on its row of A and column of B only. Every lane of the group
// must call it together (1-D blocks, multiple of 32). The AMD emulation sums each
// element's 16 exact products in a fixed order, in fp32.
#if !RF_HAS_MMA_F16
struct rf_dot2_f16 {
    __device__ float operator()(uint32_t a, uint32_t b, float c) const {
        c = fmaf(rf_half_to_float((uint16_t)a), rf_half_to_float((uint16_t)b), c);
        return fmaf(rf_half_to_float((uint16_t)(a >> 16)), rf_half_to_float((uint16_t)(b >> 16)),
                    c);
    }
};
RF_DEVICE_INLINE void rf_mma_f16_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    rf_mma_emulated(c, a, b, rf_dot2_f16());
}
#endif

// rf_ldmatrix_x4(r, row) / rf_ldmatrix_x4_trans(r, row): four 8x8 fp16 matrices from
// shared memory into mma fragments, over one 32-lane group (all lanes call it). Lane
// 8i + j gives `row`, the address of row j of matrix i (8 consecutive halves, 16-byte
// aligned); with g = lane / 4 and t = lane % 4, r[i] gets matrix i's elements
// (g, 2t) and (g, 2t+1), or with _trans (2t, g) and (2t+1, g) (the first in bits 0..15).
// cp.async: rf_cp_async16(dst, src, fill) copies 16 bytes from global to shared memory
// (zeros if !fill) in the background; rf_cp_async_commit() closes a group of them and
// rf_cp_async_wait<N>() waits until at most N groups are pending (then a barrier makes
// the data visible to the other threads). Elsewhere the copy is done at once.
#if !RF_HAS_LDMATRIX
RF_DEVICE_INLINE const uint16_t* rf_lane_pointer(const uint16_t* p, int src_lane) {
    const uint64_t bits = (uint64_t)p;
    const uint32_t lo = (uint32_t)rf_shfl((int)(uint32_t)bits, src_lane, 32);
    const uint32_t hi = (uint32_t)rf_shfl((int)(uint32_t)(bits >> 32), src_lane, 32);
    return (const uint16_t*)(((uint64_t)hi << 32) | lo);
}
RF_DEVICE_INLINE void rf_ldmatrix_x4(uint32_t r[4], const uint16_t* row) {
    const int lane = (int)(threadIdx.x & 31u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint16_t* p = rf_lane_pointer(row, 8 * i + (lane >> 2));
        r[i] = (uint32_t)p[2 * (lane & 3)] | ((uint32_t)p[2 * (lane & 3) + 1] << 16);
    }
}
RF_DEVICE_INLINE void rf_ldmatrix_x4_trans(uint32_t r[4], const uint16_t* row) {
    const int lane = (int)(threadIdx.x & 31u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint16_t* p0 = rf_lane_pointer(row, 8 * i + 2 * (lane & 3));
        const uint16_t* p1 = rf_lane_pointer(row, 8 * i + 2 * (lane & 3) + 1);
        r[i] = (uint32_t)p0[lane >> 2] | ((uint32_t)p1[lane >> 2] << 16);
    }
}
#endif
#if !RF_HAS_CP_ASYNC
struct alignas(16) rf_cp_async_chunk {
    uint32_t v[4];
};
RF_DEVICE_INLINE void rf_cp_async16(void* dst, const void* src, bool fill) {
    rf_cp_async_chunk chunk = {{0u, 0u, 0u, 0u}};
    if (fill) {
        chunk = *(const rf_cp_async_chunk*)src;
    }
    *(rf_cp_async_chunk*)dst = chunk;
}
RF_DEVICE_INLINE void rf_cp_async_commit() {}
template <int PENDING>
RF_DEVICE_INLINE void rf_cp_async_wait() {}
#endif

#endif  // RF_PORTABILITY_H
