// Probe kernels of scripts/bench_phase_boundary.py (CUDA sm_90+ only: programmatic
// dependent launch and PTX memory-order instructions; not a runtime kernel).
//
// A phase is one small GEMV-shaped step of a decode layer: each thread's 16 bytes of
// weights load before the wait, then every block reads the activation row x (K floats),
// reduces its sum of squares, and each warp writes one value of the next row y. The
// same phases run as a chain of kernels (one a phase, programmatic dependent launch
// between them, as decode runs now) or inside persistent kernels with a software grid
// barrier between phases. Every variant computes the same bits.
//
// Defines from the script: PB_K (row length), PB_THREADS (block size).

struct pb_f4 {
    float v[4];
};

__device__ __forceinline__ void pb_pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pb_pdl_release() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// This thread's weights of phase p: wstride pb_f4 a phase, PB_THREADS a block.
__device__ __forceinline__ pb_f4 pb_weights(const pb_f4* w, int p, int wstride) {
    return w[(size_t)p * wstride + blockIdx.x * PB_THREADS + threadIdx.x];
}

// One phase: x -> y (warp i of the grid writes y[i], for i < PB_K). `red` is the block's
// scratch for the sum of squares; the block is synchronized on return.
__device__ __forceinline__ void pb_phase(const pb_f4& wv, const float* x, float* y, float* red) {
    constexpr int PER_THREAD = (PB_K + PB_THREADS - 1) / PB_THREADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float ss = 0.0f, xs[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * PB_THREADS;
        xs[i] = c < PB_K ? __ldcg(x + c) : 0.0f;  // L2: another block wrote it
        ss += xs[i] * xs[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    if (lane == 0) {
        red[warp] = ss;
    }
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < PB_THREADS / 32; ++i) {
        total += red[i];
    }
    float d = (wv.v[0] + wv.v[1] + wv.v[2] + wv.v[3]) * xs[0] * rsqrtf(total / PB_K + 1e-5f);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        d += __shfl_xor_sync(0xffffffffu, d, o);
    }
    const int row = blockIdx.x * (PB_THREADS / 32) + warp;
    if (lane == 0 && row < PB_K) {
        y[row] = fmaf(0.5f, d, 1.0f);
    }
    __syncthreads();  // red is reused by the next phase
}

// Phase p of the chain, x -> y; the next kernel may launch right after this one's wait
// (EARLY, as decode's small GEMV grids) or at its end.
template <bool EARLY>
__device__ __forceinline__ void pb_chain(const pb_f4* w, int wstride, int p, const float* x,
                                         float* y) {
    __shared__ float red[PB_THREADS / 32];
    const pb_f4 wv = pb_weights(w, p, wstride);
    pb_pdl_wait();
    if (EARLY) {
        pb_pdl_release();
    }
    pb_phase(wv, x, y, red);
    pb_pdl_release();  // a no-op after the early release
}

extern "C" __global__ void __launch_bounds__(PB_THREADS)
    pb_chain_release_at_end(const pb_f4* w, int wstride, int p, const float* x, float* y) {
    pb_chain<false>(w, wstride, p, x, y);
}
extern "C" __global__ void __launch_bounds__(PB_THREADS)
    pb_chain_release_early(const pb_f4* w, int wstride, int p, const float* x, float* y) {
    pb_chain<true>(w, wstride, p, x, y);
}

// Grid barrier with fences (as cooperative groups' grid sync): the last block to arrive
// resets the count and bumps the generation the others spin on. bar[0]: count, bar[32]:
// generation (another 128-byte line).
__device__ __forceinline__ void pb_barrier_fence(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* gen = bar + 32;
        const unsigned seen = *(volatile unsigned*)gen;
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            *(volatile unsigned*)bar = 0u;
            __threadfence();
            atomicAdd(gen, 1u);
        } else {
            unsigned now;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(gen) : "memory");
            } while (now == seen);
        }
    }
    __syncthreads();
}

// Grid barrier on one monotonic count with release/acquire order (no fences, no last
// arriver's extra step): barrier i of a launch waits for (i + 1) * grid arrivals. The
// last block to exit resets it (bar[32] counts exits) before the next launch may wait.
__device__ __forceinline__ void pb_barrier_acquire(unsigned* bar, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned now;
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
        } while (now < target);
    }
    __syncthreads();
}

// Phases [first, first + n), x of phase p at buf[(p % 2) * PB_K_PAD] and y at the other
// half; BARRIER 0: pb_barrier_fence, 1: pb_barrier_acquire. The next phase's weights load
// before each barrier.
template <int BARRIER>
__device__ __forceinline__ void pb_persistent(const pb_f4* w, int wstride, int first, int n,
                                              float* buf, unsigned* bar) {
    __shared__ float red[PB_THREADS / 32];
    pb_f4 wv = pb_weights(w, first, wstride);
    pb_pdl_wait();
    for (int p = first; p < first + n; ++p) {
        pb_phase(wv, buf + (p % 2) * PB_K_PAD, buf + ((p + 1) % 2) * PB_K_PAD, red);
        if (p + 1 < first + n) {
            wv = pb_weights(w, p + 1, wstride);
            if (BARRIER == 0) {
                pb_barrier_fence(bar);
            } else {
                pb_barrier_acquire(bar, (unsigned)(p - first + 1) * gridDim.x);
            }
        }
    }
    if (BARRIER == 1) {
        __syncthreads();
        if (threadIdx.x == 0 && atomicAdd(bar + 32, 1u) == gridDim.x - 1) {
            bar[0] = 0u;
            bar[32] = 0u;
        }
    }
    pb_pdl_release();
}

extern "C" __global__ void __launch_bounds__(PB_THREADS)
    pb_persistent_fence(const pb_f4* w, int wstride, int first, int n, float* buf, unsigned* bar) {
    pb_persistent<0>(w, wstride, first, n, buf, bar);
}
extern "C" __global__ void __launch_bounds__(PB_THREADS)
    pb_persistent_acquire(const pb_f4* w, int wstride, int first, int n, float* buf,
                          unsigned* bar) {
    pb_persistent<1>(w, wstride, first, n, buf, bar);
}
