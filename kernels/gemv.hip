// Quantized GEMV for decode and small batches: out[t, :] = W x[t, :] for up to
// RF_GEMV_MAX_ROWS activation rows t, with the activation quantized to int8 per
// 32-element block (scale d kept, as llama.cpp's q8_1) and dp4a dot products
// against repacked weights. The arithmetic is rf_q8.h's, shared with the prefill
// GEMM (gemm.hip): the same row gives bit-identical outputs through either.
//
// Weights, repacked at load (same bytes as GGUF, scales moved apart so the
// quants are 16-byte aligned for wide loads):
//   Q4_0: w_qs uint8 [n, k/2]: block b of a row is 16 bytes; byte j holds
//         element j (low nibble) and j+16 (high nibble); value = d * (q - 8)
//   Q8_0: w_qs int8 [n, k]: value = d * q
//   w_d   f16 [n, k/32]: the block scales
//
// Prologue (every block), one of two:
//   - xq given (one activation row): copy the row, quantized once in rf_q8.h's layout
//     (rf_q8_rows) by rf_quantize_q8_gemv or by the kernel that wrote it (the decode
//     attention kernel), into shared memory;
//   - else: optionally RMS-normalize each activation row with gain g, then quantize it
//     into shared memory (rf_q8.h). Eight lanes quantize one 32-block (four elements
//     each, 16-byte loads), so a warp covers four blocks per step and the reductions
//     are three shuffles.
// The weight loads of each warp's first chunk are issued before the prologue, so their
// latency overlaps it. Quantizing in every block costs wide rows the most, hence the
// row quantized once upstream from some width on (docs/performance.md).
// The _bulk kernels (plain one-row GEMVs) take each warp's chunks through a ring of
// `ring` slots in shared memory instead (rf_weight_ring: bulk copies, its first `ring`
// chunks fetched before the wait), and copy each into registers as it is multiplied; the
// arithmetic, so the bits, are the register kernels'. Shared memory past the fold buffers,
// rounded up to 16 bytes: RF_GEMV_WARPS * ring * (NO * Chunk::BLOCKS * (block bytes + 2) + 8)
// (Chunk::BLOCKS = RF_WARP_SIZE * RF_GEMV_UNROLL blocks of a row a chunk).
//
// Main loop: one warp per group of NO output rows (2 * NO weight rows with the
// SwiGLU epilogue: gate row r and up row r + n, loaded together). Lane l takes the
// canonical sum's stages l, l + 32, ... (RF_Q8_STAGE consecutive blocks each),
// RF_GEMV_STAGES_PER_LANE of them per chunk, in two register sets: the one-row kernels
// of 1 or 2 rows a warp load both before the wait and each set again with the chunk two
// on once its products are taken (two chunks in flight: faster O and down GEMVs,
// docs/performance.md); the others load the next chunk as
// a step begins (one in flight). Each chunk's stage sums go through a
// per-warp fold buffer in shared memory, from which lane v folds sum v (one per
// weight row and activation row) in stage order. Warps walk the row groups with a
// grid stride, so the host may launch fewer blocks than groups.
// Successor launch (programmatic dependent launch): with release_early the next kernel
// may launch as soon as this one's wait is over, else only at its end. A grid that leaves
// multiprocessors idle (the host decides: matmul_plan.plan_gemv) gains from the early release, since
// the next kernel's blocks start loading on them; a grid that fills the device loses, its
// successor's blocks crowding onto the first multiprocessors to free up.
// Epilogues: RF_EPILOGUE_STORE; RF_EPILOGUE_RESIDUAL adds the residual (out may alias it);
//            RF_EPILOGUE_SWIGLU: rows [0, n) are gate, [n, 2n) up; out = silu(gate) * up.
// The one-row _swiglu_q8 kernels also write out quantized for the down projection to
// copy, at xq_out (rf_q8_rows_at(xq_out, 1, n / 32); n a multiple of 32), with the
// bits of rf_quantize_q8_gemv (rf_quantize4). Their blocks then own whole 32-blocks of
// outputs (block b the 32-blocks b, b + grid, ..., its warps the row groups w, w + warps,
// ... of each): the outputs are staged in shared memory, and after a barrier the first
// warp quantizes the 32-block. No other block is waited for, nothing is read back.
//
// Kernels: rf_gemv_<fmt>_b<R>_n<NO>[_swiglu|_swiglu_q8|_rope|_bulk]: R = 1 takes one
// activation row (decode), R = 8 up to RF_GEMV_MAX_ROWS. The epilogue argument must be
// RF_EPILOGUE_SWIGLU exactly for the _swiglu kernels; the _rope kernels (the QKV
// projection) store through rf_rope_store instead (rf_rope.h) and take its arguments.
//
// Launch: block RF_GEMV_THREADS, any grid >= 1 (grid-stride over
// ceil(n / NO) row groups of one warp each), dynamic shared bytes
//   n_rows * padded_blocks * 40 + (RF_GEMV_MAX_ROWS * RF_GEMV_WARPS
//   + RF_GEMV_WARPS * NV * RF_GEMV_FOLD_STRIDE) * 4,
// padded_blocks = k / 32 rounded up to a multiple of RF_Q8_STAGE, NV = the sums a warp
// folds (weight rows of a group x activation rows of the kernel).
#include "rf_portability.h"
#include "rf_q8.h"
#include "rf_rope.h"

// RF_GEMV_MAX_ROWS and the RF_EPILOGUE_* codes come from rf_constants.h.
#define RF_GEMV_THREADS RF_Q8_NORM_THREADS
#define RF_GEMV_WARPS (RF_GEMV_THREADS / RF_WARP_SIZE)
// RF_GEMV_STAGES_PER_LANE (canonical-sum stages a lane takes per chunk) comes from
// rf_constants.h: the host sizes the fold buffer by it.
#define RF_GEMV_UNROLL (RF_GEMV_STAGES_PER_LANE * RF_Q8_STAGE)  // blocks per lane per row and chunk
#define RF_GEMV_FOLD_STRIDE (RF_GEMV_STAGES_PER_LANE * RF_WARP_SIZE + 1)  // odd: no bank conflicts
#define RF_GEMV_X_REGS 4  // 16-byte activation pieces per thread kept in registers

struct alignas(16) rf_u32x4 {
    uint32_t v[4];
};

typedef rf_q8_f32x4 rf_f32x4;

RF_DEVICE_INLINE float rf_sum_squares(const rf_f32x4& v) {
    return rf_sum_squares4(v.v[0], v.v[1], v.v[2], v.v[3]);
}

// Normalize (optional) and quantize x[n_rows][k] (rows contiguous) into shared
// memory; ends with a barrier. One global read of x when it fits in registers
// (one row, k <= 4 * RF_GEMV_X_REGS * RF_GEMV_THREADS), its gains loaded with it, else two.
template <int RCAP>
RF_DEVICE_INLINE void rf_quantize_rows(const float* RF_RESTRICT x, int n_rows, int k,
                                       const float* RF_RESTRICT gain, float eps,
                                       rf_q8_rows rows, float* scratch) {
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int k4 = k / 4;
    const rf_f32x4* x4 = (const rf_f32x4*)x;
    if ((RCAP == 1 || n_rows == 1) && k4 <= RF_GEMV_X_REGS * RF_GEMV_THREADS) {
        constexpr rf_f32x4 zero{{0.0f, 0.0f, 0.0f, 0.0f}};
        rf_f32x4 v[RF_GEMV_X_REGS], g[RF_GEMV_X_REGS];
        float ss = 0.0f;
#pragma unroll
        for (int p = 0; p < RF_GEMV_X_REGS; ++p) {
            const int i = p * RF_GEMV_THREADS + threadIdx.x;
            v[p] = i < k4 ? x4[i] : zero;
            g[p] = i < k4 && gain != nullptr ? ((const rf_f32x4*)gain)[i] : zero;
            if (i < k4) {
                ss += rf_sum_squares(v[p]);
            }
        }
        const float inv_rms = gain != nullptr ? rf_block_inv_rms(ss, k, eps, scratch) : 1.0f;
#pragma unroll
        for (int p = 0; p < RF_GEMV_X_REGS; ++p) {
            const int base = p * RF_GEMV_THREADS + warp * RF_WARP_SIZE;
            if (base < k4) {  // warp-uniform
                const int i = base + lane;
                const rf_f32x4 y = gain != nullptr ? rf_normalize4(v[p], inv_rms, g[p]) : v[p];
                rf_quantize4(y, i < k4, 0, i * 4, nullptr, 1.0f, rows);
            }
        }
        __syncthreads();
        return;
    }
    // Several rows, or one too wide for registers: rounds of RF_GEMV_X_REGS pieces a
    // thread, each round's loads issued before any is used.
    const int total = n_rows * k4;
    if (gain != nullptr) {
        for (int t = 0; t < n_rows; ++t) {
            float ss = 0.0f;
            for (int base = threadIdx.x; base < k4; base += RF_GEMV_X_REGS * RF_GEMV_THREADS) {
                rf_f32x4 v[RF_GEMV_X_REGS];
#pragma unroll
                for (int p = 0; p < RF_GEMV_X_REGS; ++p) {
                    const int i = base + p * RF_GEMV_THREADS;
                    v[p] = i < k4 ? x4[t * k4 + i] : rf_f32x4{{0.0f, 0.0f, 0.0f, 0.0f}};
                }
#pragma unroll
                for (int p = 0; p < RF_GEMV_X_REGS; ++p) {
                    if (base + p * RF_GEMV_THREADS < k4) {
                        ss += rf_sum_squares(v[p]);  // pieces in the canonical order
                    }
                }
            }
            ss = rf_warp_sum(ss);
            if (lane == 0) {
                scratch[t * RF_GEMV_WARPS + warp] = ss;
            }
        }
        __syncthreads();
    }
    int cached_t = -1;
    float inv_rms = 1.0f;
    for (int base = warp * RF_WARP_SIZE; base < total;
         base += RF_GEMV_X_REGS * RF_GEMV_THREADS) {
        rf_f32x4 v[RF_GEMV_X_REGS];
#pragma unroll
        for (int p = 0; p < RF_GEMV_X_REGS; ++p) {
            const int i = base + p * RF_GEMV_THREADS + lane;
            v[p] = i < total ? x4[i] : rf_f32x4{{0.0f, 0.0f, 0.0f, 0.0f}};
        }
#pragma unroll
        for (int p = 0; p < RF_GEMV_X_REGS; ++p) {
            const int first = base + p * RF_GEMV_THREADS;
            if (first < total) {  // warp-uniform
                const int i = first + lane;
                const bool active = i < total;
                const int t = active ? i / k4 : 0;
                const int col = active ? (i - t * k4) * 4 : 0;
                if (active && gain != nullptr && t != cached_t) {
                    inv_rms = rf_warps_inv_rms(scratch + t * RF_GEMV_WARPS, k, eps);
                    cached_t = t;
                }
                rf_quantize4(v[p], active, t, col, gain, inv_rms, rows);
            }
        }
    }
    __syncthreads();
}

// `rows` as block `rank` of the cluster sees them (rf_cluster_peer).
RF_DEVICE_INLINE rf_q8_rows rf_cluster_rows(rf_q8_rows rows, uint32_t rank) {
    rows.lo = rf_cluster_peer(rows.lo, rank);
    rows.hi = rf_cluster_peer(rows.hi, rank);
    rows.meta = rf_cluster_peer(rows.meta, rank);
    return rows;
}

// One row normalized (gain) and quantized by the blocks of a cluster together, the bits of
// rf_quantize_rows: with k = 4 * RF_GEMV_THREADS * C * P for a cluster of C blocks, block r's
// thread t loads pieces (r * P + p) * RF_GEMV_THREADS + t, p < P <= RF_GEMV_CLUSTER_PIECES, and
// hands their square sums to every block (`squares`, k / 4 floats of shared memory), so
// that each adds thread t's canonical sum (pieces t, t + RF_GEMV_THREADS, ... in order);
// then each quantizes its pieces into every block's rows. The kernel arrived at the
// cluster's barrier as it started (rf_cluster_arrive). Ends with the whole row in this
// block's `rows` and no block touching another's shared memory any more.
RF_DEVICE_INLINE void rf_quantize_row_cluster(const float* RF_RESTRICT x, int k,
                                              const float* RF_RESTRICT gain, float eps,
                                              rf_q8_rows rows, float* scratch, float* squares) {
    const uint32_t rank = rf_cluster_rank(), blocks = rf_cluster_size();
    const int pieces = k / (4 * RF_GEMV_THREADS), mine = pieces / (int)blocks;
    const int first = (int)rank * mine;
    rf_f32x4 v[RF_GEMV_CLUSTER_PIECES], g[RF_GEMV_CLUSTER_PIECES];
#pragma unroll
    for (int p = 0; p < RF_GEMV_CLUSTER_PIECES; ++p) {
        if (p < mine) {
            const int i = (first + p) * RF_GEMV_THREADS + threadIdx.x;
            v[p] = ((const rf_f32x4*)x)[i];
            g[p] = ((const rf_f32x4*)gain)[i];
        }
    }
    rf_cluster_wait();  // every block of the cluster has started
    for (uint32_t r = 0; r < blocks; ++r) {
        float* theirs = rf_cluster_peer(squares, r);
#pragma unroll
        for (int p = 0; p < RF_GEMV_CLUSTER_PIECES; ++p) {
            if (p < mine) {
                theirs[(first + p) * RF_GEMV_THREADS + threadIdx.x] = rf_sum_squares(v[p]);
            }
        }
    }
    rf_cluster_sync();
    float ss = 0.0f;
    for (int j = 0; j < pieces; ++j) {
        ss += squares[j * RF_GEMV_THREADS + threadIdx.x];
    }
    const float inv_rms = rf_block_inv_rms(ss, k, eps, scratch);
#pragma unroll
    for (int p = 0; p < RF_GEMV_CLUSTER_PIECES; ++p) {
        if (p < mine) {
            const int i = (first + p) * RF_GEMV_THREADS + threadIdx.x;
            const rf_q8_piece piece = rf_quantize4_piece(rf_normalize4(v[p], inv_rms, g[p]));
            for (uint32_t r = 0; r < blocks; ++r) {
                rf_q8_store4(rf_cluster_rows(rows, r), 0, i * 4, piece);
            }
        }
    }
    rf_cluster_sync();
}

// Integer dot of one weight block (as signed values) with one q8 activation block
// (halves xl, xh): Q4_0 subtracts the offset 8 * sum(q) from the nibbles' dot.
struct rf_q4_0_format {
    static constexpr int block_bytes = RF_QK / 2;
    struct raw {
        rf_u32x4 q;
    };
    static RF_DEVICE_MEMBER void load(raw& w, const uint8_t* p) {
        w.q = *(const rf_u32x4*)p;
    }
    static RF_DEVICE_MEMBER void zero(raw& w) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w.q.v[i] = 0u;
        }
    }
    static RF_DEVICE_MEMBER int dot(const raw& w, const rf_u32x4& xl, const rf_u32x4& xh,
                                      int x_sum) {
        int acc = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc = rf_dp4a((int)(w.q.v[i] & 0x0F0F0F0Fu), (int)xl.v[i], acc);
            acc = rf_dp4a((int)((w.q.v[i] >> 4) & 0x0F0F0F0Fu), (int)xh.v[i], acc);
        }
        return acc - 8 * x_sum;
    }
};

struct rf_q8_0_format {
    static constexpr int block_bytes = RF_QK;
    struct raw {
        rf_u32x4 lo, hi;
    };
    static RF_DEVICE_MEMBER void load(raw& w, const uint8_t* p) {
        w.lo = *(const rf_u32x4*)p;
        w.hi = *(const rf_u32x4*)(p + 16);
    }
    static RF_DEVICE_MEMBER void zero(raw& w) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w.lo.v[i] = 0u;
            w.hi.v[i] = 0u;
        }
    }
    static RF_DEVICE_MEMBER int dot(const raw& w, const rf_u32x4& xl, const rf_u32x4& xh,
                                      int x_sum) {
        int acc = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc = rf_dp4a((int)w.lo.v[i], (int)xl.v[i], acc);
            acc = rf_dp4a((int)w.hi.v[i], (int)xh.v[i], acc);
        }
        (void)x_sum;
        return acc;
    }
};

// Block u of lane `lane` in chunk c: stage (c * RF_GEMV_STAGES_PER_LANE + u / RF_Q8_STAGE)
// * WARP + lane, its block u % RF_Q8_STAGE.
RF_DEVICE_INLINE int rf_gemv_block(int c, int u, int lane) {
    const int stage = (c * RF_GEMV_STAGES_PER_LANE + u / RF_Q8_STAGE) * RF_WARP_SIZE + lane;
    return stage * RF_Q8_STAGE + u % RF_Q8_STAGE;
}

// Weight rows and blocks one lane holds in registers: NW rows x RF_GEMV_UNROLL blocks.
template <typename Format, int NO, bool SWIGLU>
struct rf_weight_chunk {
    using format = Format;
    static constexpr int GROUP = NO;  // output rows
    static constexpr int NW = SWIGLU ? 2 * NO : NO;
    // A chunk's blocks of one row, and one row's chunk in shared memory (the _bulk
    // kernels): its quants, then its f16 scales.
    static constexpr int BLOCKS = RF_WARP_SIZE * RF_GEMV_UNROLL;
    static constexpr int PIECE = BLOCKS * (Format::block_bytes + 2);
    typename Format::raw q[NW][RF_GEMV_UNROLL];
    float d[NW][RF_GEMV_UNROLL];

    // Load chunk c of row group g: blocks rf_gemv_block(c, u, lane) of each row (zeros
    // past the row's end or past n).
    RF_DEVICE_MEMBER void load(const uint8_t* RF_RESTRICT w_qs, const uint16_t* RF_RESTRICT w_d,
                                 int n, int n_blocks, int g, int c, int lane) {
        const uint8_t* quants[NW];
        const uint16_t* scales[NW];
#pragma unroll
        for (int j = 0; j < NW; ++j) {
            const int64_t row_block = (int64_t)(g * NO + (j % NO) + (j >= NO ? n : 0)) * n_blocks;
            quants[j] = w_qs + row_block * Format::block_bytes;
            scales[j] = w_d + row_block;
        }
        load_rows(quants, scales, 0, n, n_blocks, g, c, lane);
    }

    // The same from `slot`, where rf_weight_ring put chunk c of row group g.
    RF_DEVICE_MEMBER void load_shared(const uint8_t* slot, int n, int n_blocks, int g, int c,
                                        int lane) {
        const uint8_t* quants[NW];
        const uint16_t* scales[NW];
#pragma unroll
        for (int j = 0; j < NW; ++j) {
            quants[j] = slot + j * PIECE;
            scales[j] = (const uint16_t*)(quants[j] + BLOCKS * Format::block_bytes);
        }
        load_rows(quants, scales, c * BLOCKS, n, n_blocks, g, c, lane);
    }

    // Chunk c of row group g from row j's blocks at quants[j] and scales[j], the first of
    // them block `first` of the row.
    RF_DEVICE_MEMBER void load_rows(const uint8_t* const (&quants)[NW],
                                      const uint16_t* const (&scales)[NW], int first, int n,
                                      int n_blocks, int g, int c, int lane) {
#pragma unroll
        for (int j = 0; j < NW; ++j) {
            const bool row_in = g * NO + (j % NO) < n;
#pragma unroll
            for (int u = 0; u < RF_GEMV_UNROLL; ++u) {
                const int b = rf_gemv_block(c, u, lane);
                if (row_in && b < n_blocks) {
                    Format::load(q[j][u], quants[j] + (b - first) * Format::block_bytes);
                    d[j][u] = rf_half_to_float(scales[j][b - first]);
                } else {
                    Format::zero(q[j][u]);
                    d[j][u] = 0.0f;
                }
            }
        }
    }
};

// A warp's place in its work: chunk c of row group g.
struct rf_gemv_item {
    int g, c;

    // With blocks owning `per_block` row groups (a 32-block of outputs): whether group g is
    // its warp's last of the 32-block.
    RF_DEVICE_MEMBER bool last_of_block(int per_block) const {
        return g % per_block + RF_GEMV_WARPS >= per_block;
    }

    // The next chunk of this group, else the first of the warp's next group: g + stride, or
    // with blocks owning `per_block` groups (a 32-block of outputs; 0: they do not) the next
    // of this block's groups, then the first of its next 32-block.
    RF_DEVICE_MEMBER rf_gemv_item next(int n_chunks, int stride, int per_block) const {
        if (c + 1 < n_chunks) {
            return rf_gemv_item{g, c + 1};
        }
        if (per_block == 0) {
            return rf_gemv_item{g + stride, 0};
        }
        // past the other blocks' 32-blocks after this warp's last group of its own
        const int skip = last_of_block(per_block) ? ((int)gridDim.x - 1) * per_block : 0;
        return rf_gemv_item{g + RF_GEMV_WARPS + skip, 0};
    }
};

// A warp's weight chunks on their way through shared memory (the _bulk kernels, no SwiGLU):
// a ring of `n_slots` chunk slots, each of NO row pieces (Chunk::PIECE: a row's blocks of
// the chunk, quants then scales) and completing on its own barrier. Lane j copies row j's
// piece (bulk copies, rf_portability.h); the chunks are taken in the warp's order, each
// slot refilled with the chunk n_slots on once every lane has read it.
template <typename Chunk>
struct rf_weight_ring {
    static constexpr int SLOT = Chunk::NW * Chunk::PIECE;
    const uint8_t* w_qs;
    const uint16_t* w_d;
    int n, n_blocks, n_groups, n_chunks, stride, per_block, lane;  // the warp's walk (rf_gemv)
    uint8_t* slots;
    uint64_t* bars;
    int n_slots;
    int taken;           // chunks taken: the next in slot taken % n_slots, phase
                         // (taken / n_slots) % 2
    rf_gemv_item ahead;  // the next chunk to fetch

    // Chunk `it` into slot s.
    RF_DEVICE_MEMBER void fetch(int s, rf_gemv_item it) {
        constexpr int NO = Chunk::GROUP, BB = Chunk::format::block_bytes;
        const int first = it.c * Chunk::BLOCKS;
        const int blocks = min(Chunk::BLOCKS, n_blocks - first);
        if (lane == 0) {
            rf_bulk_expect(&bars[s], min(NO, n - it.g * NO) * blocks * (BB + 2));
        }
        const int row = it.g * NO + lane;
        if (lane < NO && row < n) {
            const int64_t at = (int64_t)row * n_blocks + first;
            uint8_t* piece = slots + s * SLOT + lane * Chunk::PIECE;
            rf_bulk_reads_done();
            rf_bulk_copy(piece, w_qs + at * BB, blocks * BB, &bars[s]);
            rf_bulk_copy(piece + Chunk::BLOCKS * BB, w_d + at, blocks * 2, &bars[s]);
        }
    }

    // Fetch the chunk `ahead` into slot s, then move `ahead` on.
    RF_DEVICE_MEMBER void fetch_ahead(int s) {
        fetch(s, ahead);
        ahead = ahead.next(n_chunks, stride, per_block);
    }

    // Set the ring up at `base` (after the fold buffers) with `slots_a_warp` slots a warp,
    // and fetch the warp's first n_slots chunks from its chunk `first` on.
    RF_DEVICE_MEMBER void start(uint8_t* base, int slots_a_warp, rf_gemv_item first, int warp) {
        n_slots = slots_a_warp;
        slots = base + warp * n_slots * SLOT;
        bars = (uint64_t*)(base + RF_GEMV_WARPS * n_slots * SLOT) + warp * n_slots;
        if (lane == 0) {
            for (int s = 0; s < n_slots; ++s) {
                rf_bulk_init(&bars[s]);
            }
            rf_bulk_init_done();
        }
        rf_syncwarp();
        taken = 0;
        ahead = first;
        for (int s = 0; s < n_slots && ahead.g < n_groups; ++s) {
            fetch_ahead(s);
        }
    }

    // The next chunk in order (`it`, of row group it.g) into w; its slot then fetches the
    // chunk n_slots on.
    RF_DEVICE_MEMBER void take(Chunk& w, rf_gemv_item it) {
        const int s = taken % n_slots;
        rf_bulk_wait(&bars[s], (uint32_t)(taken / n_slots) & 1u);
        w.load_shared(slots + s * SLOT, n, n_blocks, it.g, it.c, lane);
        ++taken;
        if (ahead.g < n_groups) {
            rf_syncwarp();  // every lane has read the slot
            fetch_ahead(s);
        }
    }
};

// Quantize the SwiGLU outputs of 32-block `block`, staged in shared memory, into xq (one
// row, no gain), as rf_quantize_q8_gemv would: eight lanes of the calling warp.
RF_DEVICE_INLINE void rf_gemv_quantize_staged(const float* staged, int block, int n,
                                              uint8_t* xq, int lane) {
    const bool active = lane < RF_QK / 4;
    rf_f32x4 v{{0.0f, 0.0f, 0.0f, 0.0f}};
    if (active) {
        v = *(const rf_f32x4*)(staged + 4 * lane);
    }
    rf_quantize4(v, active, 0, block * RF_QK + 4 * (active ? lane : 0), nullptr, 1.0f,
                 rf_q8_rows_at(xq, 1, n / RF_QK));
}

template <typename Format, int NO, bool SWIGLU, int RCAP, bool ROPE = false, bool Q8OUT = false,
          bool BULK = false, bool CLUSTER = false>
RF_DEVICE_INLINE void rf_gemv(const uint8_t* RF_RESTRICT w_qs, const uint16_t* RF_RESTRICT w_d,
                              int n, int k, const float* RF_RESTRICT x, int n_rows,
                              const uint8_t* RF_RESTRICT xq, const float* RF_RESTRICT gain,
                              float eps, int release_early, int epilogue, const float* residual,
                              float* out, const rf_rope_out& rope, uint8_t* xq_out,
                              int ring_slots) {
    static_assert(!ROPE || (NO % 2 == 0 && !SWIGLU), "RoPE takes (even, odd) row pairs");
    constexpr int NW = SWIGLU ? 2 * NO : NO;
    constexpr int NV = NW * RCAP;  // sums of a row group: lane v folds (row v / RCAP, x row v % RCAP)
    static_assert(NV <= RF_WARP_SIZE, "one folding lane per sum");
    constexpr int SPL = RF_GEMV_STAGES_PER_LANE;
    using Chunk = rf_weight_chunk<Format, NO, SWIGLU>;
    static_assert(!BULK || (RCAP == 1 && !SWIGLU && !ROPE), "the ring serves plain one-row GEMVs");
    static_assert(!CLUSTER || RCAP == 1, "a cluster quantizes one row");
    extern __shared__ __align__(16) uint8_t rf_shared[];
    const int n_blocks = k / RF_QK;
    const int n_stages = (n_blocks + RF_Q8_STAGE - 1) / RF_Q8_STAGE;
    const rf_q8_rows rows = rf_q8_rows_at(rf_shared, n_rows, n_blocks);
    float* scratch = (float*)(rows.meta + n_rows * rows.padded);

    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    // This warp's stage sums of a chunk, one row of RF_GEMV_FOLD_STRIDE per sum.
    float* fold = scratch + RF_GEMV_MAX_ROWS * RF_GEMV_WARPS + warp * NV * RF_GEMV_FOLD_STRIDE;
    const int n_groups = (n + NO - 1) / NO;
    const int n_chunks = (n_stages + RF_WARP_SIZE * SPL - 1) / (RF_WARP_SIZE * SPL);
    const int stride = gridDim.x * RF_GEMV_WARPS;
    const int mine_j = lane / RCAP, mine_t = lane % RCAP;  // the sum this lane folds (lane < NV)
    // With a q8 output, blocks own 32-blocks of outputs, staged here (two, alternating).
    static_assert(!Q8OUT || (SWIGLU && RCAP == 1 && RF_QK / NO % RF_GEMV_WARPS == 0),
                  "one row's SwiGLU outputs, a 32-block filling whole rounds of the warps");
    constexpr int per_block = Q8OUT ? RF_QK / NO : 0;
    __shared__ __align__(16) float staged[2][Q8OUT ? RF_QK : 1];
    int staging = 0;
    rf_gemv_item item{(int)blockIdx.x * (per_block ? per_block : RF_GEMV_WARPS) + warp, 0};
    if (CLUSTER && xq == nullptr) {
        rf_cluster_arrive();  // rf_quantize_row_cluster waits for the others
    }

    Chunk w_a, w_b;
    rf_weight_ring<Chunk> ring{w_qs,     w_d,    n,         n_blocks, n_groups,
                               n_chunks, stride, per_block, lane};
    // The register kernels' next chunk to load. TWO_AHEAD: two are in flight during the
    // wait and prologue (w_a, w_b), and each set is loaded again with the chunk two on as
    // soon as its products are taken; else one, the other set loaded as a step begins:
    // kernels of 4 rows a warp (two ahead took more registers and was slower), of several
    // activation rows, and the _swiglu_q8 ones (two ahead took 154 registers, one block a
    // multiprocessor; docs/performance.md).
    constexpr bool TWO_AHEAD = NO <= 2 && RCAP == 1 && !Q8OUT;
    rf_gemv_item ahead = item;
    auto load_ahead = [&](Chunk& w) {
        if (ahead.g < n_groups) {
            w.load(w_qs, w_d, n, n_blocks, ahead.g, ahead.c, lane);
            ahead = ahead.next(n_chunks, stride, per_block);
        }
    };
    if (item.g < n_groups) {  // in flight during the wait and prologue
        if (BULK) {
            const int fold_end = (int)((uint8_t*)(scratch + RF_GEMV_MAX_ROWS * RF_GEMV_WARPS +
                                                  RF_GEMV_WARPS * NV * RF_GEMV_FOLD_STRIDE) -
                                       rf_shared);
            ring.start(rf_shared + (fold_end + 15) / 16 * 16, ring_slots, item, warp);
        } else {
            load_ahead(w_a);
            if (TWO_AHEAD) {
                load_ahead(w_b);
            }
        }
    }
    // CLUSTER: each piece's square sum, from every block of the cluster (rf_quantize_row_cluster).
    __shared__ __align__(16) float squares[CLUSTER ? RF_GEMV_CLUSTER_MAX_K / 4 : 1];
    rf_pdl_wait();  // the previous kernel wrote x (weights alone are read before this)
    if (release_early) {
        rf_pdl_launch_dependents();
    }
    // What lane v < NV's epilogue reads for its row group (RF_EPILOGUE_RESIDUAL: the
    // residual; RoPE: rf_rope_fetch's), loaded a group ahead (the first group's beside the
    // prologue's loads), so that no epilogue waits on a load. Not in the kernels of 4 rows
    // a warp, which sit at the 128-register cap (the 8B shape's Q|K|V GEMV lost with it;
    // docs/performance.md).
    constexpr bool AHEAD = NO <= 2;
    float res = 0.0f;
    rf_rope_at rope_at{};
    auto load_epilogue = [&](int g) {
        const int row = g * NO + mine_j;
        if (!AHEAD || lane >= NV || mine_t >= n_rows || row >= n) {
            return;
        }
        if (ROPE) {
            if (mine_j % 2 == 0) {
                rope_at = rf_rope_fetch(rope, mine_t, row);
            }
        } else if (!SWIGLU && epilogue == RF_EPILOGUE_RESIDUAL) {
            res = residual[(int64_t)mine_t * n + row];
        }
    };
    if (item.g < n_groups) {
        load_epilogue(item.g);
    }
    if (xq != nullptr) {  // quantized once by rf_quantize_q8_gemv, in this layout
        const int pieces = rf_q8_rows_bytes(rows, n_rows) / 16;
        for (int i = threadIdx.x; i < pieces; i += RF_GEMV_THREADS) {
            rf_cp_async16(rf_shared + 16 * i, xq + 16 * i, true);
        }
        rf_cp_async_commit();
        rf_cp_async_wait<0>();
        __syncthreads();
    } else if (CLUSTER) {
        rf_quantize_row_cluster(x, k, gain, eps, rows, scratch, squares);
    } else {
        rf_quantize_rows<RCAP>(x, n_rows, k, gain, eps, rows, scratch);
    }

    float total = 0.0f;  // lane v < NV: sum v of the current row group, folded so far
    // Chunk `item` from `use`, `other` holding or loading the next; false when done.
    auto step = [&](Chunk& use, Chunk& other) -> bool {
        const rf_gemv_item next = item.next(n_chunks, stride, per_block);
        if (BULK) {
            ring.take(use, item);
        } else if (!TWO_AHEAD) {
            load_ahead(other);
        }
        // This lane's stage sums of the chunk (zero for stages past the row).
        float part[NW][RCAP][SPL];
#pragma unroll
        for (int j = 0; j < NW; ++j) {
#pragma unroll
            for (int t = 0; t < RCAP; ++t) {
#pragma unroll
                for (int st = 0; st < SPL; ++st) {
                    part[j][t][st] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < RF_GEMV_UNROLL; ++u) {
            const int b = rf_gemv_block(item.c, u, lane);
            if (b < n_blocks) {
#pragma unroll
                for (int t = 0; t < RCAP; ++t) {
                    if (t < n_rows) {
                        const int slot = rf_q8_slot(rows, t, b);
                        const rf_u32x4 xl = *(const rf_u32x4*)(rows.lo + slot * 16);
                        const rf_u32x4 xh = *(const rf_u32x4*)(rows.hi + slot * 16);
                        const rf_q8_meta m = rows.meta[slot];
#pragma unroll
                        for (int j = 0; j < NW; ++j) {
                            float& p = part[j][t][u / RF_Q8_STAGE];
                            const int dot = Format::dot(use.q[j][u], xl, xh, m.sum);
                            p = rf_q8_stage_add(p, use.d[j][u], m.d, (float)dot);
                        }
                    }
                }
            }
        }
        if (!BULK && TWO_AHEAD) {
            load_ahead(use);  // the chunk two on
        }
        // Fold the chunk's stages in stage order: stage (c * SPL + st) * WARP + l sits in
        // lane l, so each sum's lane reads them back through shared memory in that order.
        rf_syncwarp();  // the folding lanes have read the previous chunk's stage sums
#pragma unroll
        for (int j = 0; j < NW; ++j) {
#pragma unroll
            for (int t = 0; t < RCAP; ++t) {
#pragma unroll
                for (int st = 0; st < SPL; ++st) {
                    fold[(j * RCAP + t) * RF_GEMV_FOLD_STRIDE + st * RF_WARP_SIZE + lane] =
                        part[j][t][st];
                }
            }
        }
        rf_syncwarp();
        if (lane < NV) {
            const float* sums = fold + lane * RF_GEMV_FOLD_STRIDE;
#pragma unroll
            for (int st = 0; st < SPL; ++st) {
                const int count =
                    min(RF_WARP_SIZE, n_stages - (item.c * SPL + st) * RF_WARP_SIZE);
                for (int l = 0; l < count; ++l) {
                    total += sums[st * RF_WARP_SIZE + l];
                }
            }
        }
        if (item.c == n_chunks - 1) {  // the group's sums are complete: its epilogue
            const int row = item.g * NO + mine_j;
            const bool mine = lane < NV && mine_t < n_rows && row < n;
            if (SWIGLU) {  // gate j and up j + NO of the same x row
                const float up = rf_shfl(total, (lane + NO * RCAP) % RF_WARP_SIZE, RF_WARP_SIZE);
                if (mine && mine_j < NO) {
                    const float h = rf_swiglu(total, up);
                    out[(int64_t)mine_t * n + row] = h;
                    if (per_block) {
                        staged[staging][row % RF_QK] = h;
                    }
                }
                if (per_block && item.last_of_block(per_block)) {
                    // every warp's last group of the 32-block: its outputs are staged
                    __syncthreads();
                    if (warp == 0) {
                        rf_gemv_quantize_staged(staged[staging], item.g / per_block, n, xq_out,
                                                lane);
                    }
                    staging ^= 1;  // the next 32-block's outputs go to the other buffer
                }
            } else if (ROPE) {  // q, k, v of each (even, odd) pair of rows
                const float odd = rf_shfl(total, (lane + RCAP) % RF_WARP_SIZE, RF_WARP_SIZE);
                if (mine && mine_j % 2 == 0) {
                    rf_rope_store_at(rope, mine_t, row,
                                     AHEAD ? rope_at : rf_rope_fetch(rope, mine_t, row), total,
                                     odd);
                }
            } else if (mine) {
                const int64_t o = (int64_t)mine_t * n + row;
                out[o] = epilogue == RF_EPILOGUE_RESIDUAL ? total + (AHEAD ? res : residual[o])
                                                          : total;
            }
            total = 0.0f;
            if (next.g < n_groups) {
                load_epilogue(next.g);  // rows of one group belong to this warp alone
            }
        }
        item = next;
        return item.g < n_groups;
    };
    if (item.g < n_groups) {
        while (step(w_a, w_b) && step(w_b, w_a)) {
        }
    }
    rf_pdl_launch_dependents();  // a no-op after the early release
}

#define RF_GEMV_PARAMS                                                                   \
    const uint8_t *RF_RESTRICT w_qs, const uint16_t *RF_RESTRICT w_d, int n, int k,     \
        const float *RF_RESTRICT x, int n_rows, const uint8_t *RF_RESTRICT xq,           \
        const float *RF_RESTRICT gain, float eps, int release_early, int epilogue,      \
        const float *residual, float *out
#define RF_GEMV_CALL(format, no, swiglu, rcap)                                               \
    rf_gemv<format, no, swiglu, rcap>(w_qs, w_d, n, k, x, n_rows, xq, gain, eps, release_early, \
                                      epilogue, residual, out, rf_rope_out{}, nullptr, 0)
// The one-row kernels with their weights through rf_weight_ring (_bulk): `ring` chunk slots
// a warp.
#define RF_GEMV_BULK_PARAMS RF_GEMV_PARAMS, int ring
#define RF_GEMV_BULK_CALL(format, no)                                                         \
    rf_gemv<format, no, false, 1, false, false, true>(w_qs, w_d, n, k, x, n_rows, xq, gain, eps, \
                                                      release_early, epilogue, residual, out,  \
                                                      rf_rope_out{}, nullptr, ring)
// The one-row gate|up GEMV that also writes the down projection's q8 row at xq_out.
#define RF_GEMV_SWIGLU_Q8_PARAMS RF_GEMV_PARAMS, uint8_t *xq_out
#define RF_GEMV_SWIGLU_Q8_CALL(format, no)                                                      \
    rf_gemv<format, no, true, 1, false, true>(w_qs, w_d, n, k, x, n_rows, xq, gain, eps,        \
                                              release_early, epilogue, residual, out,           \
                                              rf_rope_out{}, xq_out, 0)

// The QKV GEMV with RoPE + KV-append in its epilogue (rf_rope.h): q to q_out, k and v
// into the KV pool at each token's slot and position (step state).
#define RF_GEMV_ROPE_PARAMS                                                              \
    const uint8_t *RF_RESTRICT w_qs, const uint16_t *RF_RESTRICT w_d, int n, int k,     \
        const float *RF_RESTRICT x, int n_rows, const uint8_t *RF_RESTRICT xq,           \
        const float *RF_RESTRICT gain, float eps, int release_early,                     \
        const int32_t *positions, const int32_t *slots, const float *cos_table,          \
        const float *sin_table, float *q_out,                                            \
        uint8_t *k_cache, uint8_t *v_cache, int q_dim, int kv_dim, int head_dim,         \
        int rope_dims, int n_ctx
#define RF_GEMV_ROPE_CALL(format, no, rcap, fp8)                                                    \
    rf_gemv<format, no, false, rcap, true>(                                                      \
        w_qs, w_d, n, k, x, n_rows, xq, gain, eps, release_early, RF_EPILOGUE_STORE, nullptr,    \
        nullptr,                                                                                 \
        rf_rope_out{positions, slots, cos_table, sin_table, q_out, k_cache, v_cache, q_dim, kv_dim, \
                    head_dim, rope_dims, n_ctx, fp8},                                            \
        nullptr, 0)

// One activation row x[k] normalized (with a gain g) and quantized once, into the GEMV
// layout at xq (rf_q8_rows_at(xq, 1, k / 32)), for a GEMV launched with xq to copy.
// Block b quantizes pieces [b * RF_GEMV_THREADS, (b + 1) * RF_GEMV_THREADS) of four
// elements; with a gain, every block first takes the whole row's sum of squares in the
// canonical order (rf_row_inv_rms), so the bits are those of the GEMV's own prologue. A
// thread loads its gains before the wait (weights) and its piece with the row's sum.
// Launch: block RF_GEMV_THREADS, grid ceil(k / (4 * RF_GEMV_THREADS)).
RF_KERNEL_BOUNDS(RF_GEMV_THREADS) void rf_quantize_q8_gemv(const float* RF_RESTRICT x, int k,
                                                           const float* RF_RESTRICT gain,
                                                           float eps, uint8_t* xq) {
    __shared__ float partial[RF_GEMV_WARPS];
    const int k4 = k / 4;
    const int i = blockIdx.x * RF_GEMV_THREADS + threadIdx.x;  // this thread's piece
    const bool active = i < k4;
    constexpr rf_f32x4 zero{{0.0f, 0.0f, 0.0f, 0.0f}};
    const rf_f32x4 g = active && gain != nullptr ? ((const rf_f32x4*)gain)[i] : zero;
    rf_pdl_begin();  // the GEMV may launch and load its first weights meanwhile
    const rf_q8_rows rows = rf_q8_rows_at(xq, 1, k / RF_QK);
    const rf_f32x4 v = active ? ((const rf_f32x4*)x)[i] : zero;
    const float inv_rms = gain != nullptr ? rf_row_inv_rms(x, k, eps, partial) : 1.0f;
    // warp-uniform; lanes past k4 sit in whole 8-lane groups (k % 32 == 0)
    if (i - (int)threadIdx.x % RF_WARP_SIZE < k4) {
        rf_quantize4(gain != nullptr ? rf_normalize4(v, inv_rms, g) : v, active, 0, i * 4,
                     nullptr, 1.0f, rows);
    }
}

// Q4_0, the one-row gate|up GEMVs (with or without the down projection's q8 row) whose
// blocks normalize and quantize their row together, a cluster at a time
// (rf_quantize_row_cluster), with no rf_quantize_q8_gemv launch before them. Launched in
// clusters of C blocks (a grid of whole clusters), k a multiple of 1024 * C, at most
// 1024 * C * RF_GEMV_CLUSTER_PIECES and RF_GEMV_CLUSTER_MAX_K.
#define RF_GEMV_SWIGLU_CL_CALL(format, no, q8, xq_out)                                         \
    rf_gemv<format, no, true, 1, false, q8, false, true>(w_qs, w_d, n, k, x, n_rows, xq, gain, \
                                                         eps, release_early, epilogue,         \
                                                         residual, out, rf_rope_out{}, xq_out, 0)

// The kernels (rf_gemv_<fmt>_b<rows>_n<NO>...): kernel_variants.py GEMV_KERNELS, appended
// when the source is compiled.
