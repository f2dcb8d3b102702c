// Sampling on the device, advancing the step state so that steady decode needs no
// host-to-device copy. Four kernels: rf_argmax_advance (below) serves greedy rows alone;
// rf_sample_candidates and rf_sample_advance (further below) follow it when a row draws
// at random, reports alternatives or is penalized; rf_sample_penalize (at the end) comes
// first when a row is penalized.
//
// rf_argmax_advance: the argmax of every logits row and its log-softmax statistics.
//   logits     fp32 [n_rows, n_vocab]
//   tokens     int32 [n_rows] step state: receives the argmax (the next step's input)
//   positions  int32 [n_rows] step state: incremented by one
//   sampled    int32 [n_rows]: the argmax again, for the host to read back (the host's
//              mapped memory: only written)
//   logprob    fp32 [n_rows]: log-softmax of the chosen token (likewise)
//   stats      [n_rows] (max, log of the sum of exp(x - max), argmax): what
//              rf_sample_advance reads
//   partial    scratch [n_rows, gridDim.x] of (max, index, sum of exp(x - max))
//   counters   uint32 [n_rows], zero before the first launch; the combining block
//              resets its counter, so every launch (and graph replay) starts at 0
//   advance    1: write tokens and positions; 0: leave that to rf_sample_advance
//   Ties go to the lowest index, as numpy's argmax. Each block takes a contiguous slice
//   of a row's vocabulary (its maximum, the maximum's index and the sum of exp(x - max)
//   over the slice); the last block of the row to finish combines the slices, its threads
//   reading them at once and their sums added in slice order.
//   Launch: grid (n_slices, n_rows), block RF_ARGMAX_THREADS.
#include "rf_portability.h"
#include "rf_constants.h"

// From rf_constants.h: RF_ARGMAX_THREADS; RF_SAMPLE_THREADS, RF_SAMPLE_SLICE,
// RF_SAMPLE_CANDIDATES, RF_SAMPLE_MAX_TOP (alternatives a row may report),
// RF_SAMPLE_WEIGHT_SCALE (the integer weights' scale, 2^40) and RF_SAMPLE_PENALTY_WINDOW
// (recent tokens the penalties count), the last three the sampling rules' own
// (rocforge_rt/step/sampling.py MAX_LOGPROBS, WEIGHT_SCALE, PENALTY_WINDOW).
#define RF_ARGMAX_WARPS (RF_ARGMAX_THREADS / RF_WARP_SIZE)

struct rf_argmax_part {
    float max;
    int index;
    float sum;  // of exp(x - max) over the slice
};

struct rf_row_stats {
    float max;
    float log_sum;  // logf of the sum of exp(x - max) over the row
    int index;      // the argmax
};

RF_DEVICE_INLINE void rf_better(float& best, int& index, float v, int i) {
    if (v > best || (v == best && i < index)) {
        best = v;
        index = i;
    }
}

// The block's best (value, index) of every thread's, in every thread: rf_better's order, so
// the same whichever thread held which. Ends with a barrier; s_best and s_index are the
// block's scratch.
RF_DEVICE_INLINE void rf_block_better(float& best, int& index, float* s_best, int* s_index) {
    for (int offset = RF_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        rf_better(best, index, rf_shfl_xor(best, offset), rf_shfl_xor(index, offset));
    }
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    if (lane == 0) {
        s_best[warp] = best;
        s_index[warp] = index;
    }
    __syncthreads();
    best = s_best[0];
    index = s_index[0];
    for (int w = 1; w < RF_ARGMAX_WARPS; ++w) {
        rf_better(best, index, s_best[w], s_index[w]);
    }
    __syncthreads();  // read before the scratch is written again
}

RF_KERNEL_BOUNDS(RF_ARGMAX_THREADS)
void rf_argmax_advance(const float* RF_RESTRICT logits, int n_vocab, int32_t* RF_RESTRICT tokens,
                       int32_t* RF_RESTRICT positions, int32_t* RF_RESTRICT sampled,
                       float* RF_RESTRICT logprob, rf_row_stats* RF_RESTRICT stats,
                       rf_argmax_part* RF_RESTRICT partial, uint32_t* RF_RESTRICT counters,
                       int advance) {
    __shared__ float s_best[RF_ARGMAX_WARPS];
    __shared__ int s_index[RF_ARGMAX_WARPS];
    __shared__ float s_sum[RF_ARGMAX_WARPS];
    __shared__ float s_terms[RF_ARGMAX_THREADS];
    __shared__ bool s_last;
    rf_pdl_begin();
    const int slice = blockIdx.x, row = blockIdx.y, n_slices = gridDim.x;
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int per_slice = (n_vocab + n_slices - 1) / n_slices;
    const int first = slice * per_slice, last = min(first + per_slice, n_vocab);
    const float* x = logits + (int64_t)row * n_vocab;

    float best = -RF_INFINITY;
    int index = 0x7fffffff;
    for (int i = first + threadIdx.x; i < last; i += RF_ARGMAX_THREADS) {
        rf_better(best, index, x[i], i);
    }
    rf_block_better(best, index, s_best, s_index);
    float sum = 0.0f;
    for (int i = first + threadIdx.x; i < last; i += RF_ARGMAX_THREADS) {
        sum += expf(x[i] - best);
    }
    sum = rf_warp_sum(sum);
    if (lane == 0) {
        s_sum[warp] = sum;
    }
    __syncthreads();
    rf_argmax_part* parts = partial + (int64_t)row * n_slices;
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < RF_ARGMAX_WARPS; ++w) {
            total += s_sum[w];
        }
        parts[slice].max = best;
        parts[slice].index = index;
        parts[slice].sum = total;
        __threadfence();
        const uint32_t done = atomicAdd(counters + row, 1u);
        s_last = done == (uint32_t)(n_slices - 1);
        if (s_last) {
            counters[row] = 0u;
        }
    }
    __syncthreads();
    if (!s_last) {
        return;
    }
    // The row's last block to finish combines its slices: each thread reads slices t,
    // t + RF_ARGMAX_THREADS, ... at once; their terms are summed in slice order.
    __threadfence();
    const volatile rf_argmax_part* seen = parts;
    float row_best = -RF_INFINITY;
    int row_index = 0x7fffffff;
    for (int s = threadIdx.x; s < n_slices; s += RF_ARGMAX_THREADS) {
        rf_better(row_best, row_index, seen[s].max, seen[s].index);
    }
    rf_block_better(row_best, row_index, s_best, s_index);
    float total = 0.0f;  // thread 0's
    for (int base = 0; base < n_slices; base += RF_ARGMAX_THREADS) {
        const int s = base + threadIdx.x;
        s_terms[threadIdx.x] = s < n_slices ? seen[s].sum * expf(seen[s].max - row_best) : 0.0f;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int i = 0; i < min(RF_ARGMAX_THREADS, n_slices - base); ++i) {
                total += s_terms[i];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) {
        return;
    }
    const float log_sum = logf(total);
    stats[row].max = row_best;
    stats[row].log_sum = log_sum;
    stats[row].index = row_index;
    sampled[row] = row_index;
    logprob[row] = -log_sum;
    if (advance) {
        tokens[row] = row_index;
        positions[row] += 1;
    }
}


// ---------------------------------------------------------------------------------------
// The sampler, in two kernels after rf_argmax_advance (advance = 0):
//
// rf_sample_candidates: each block takes RF_SAMPLE_SLICE consecutive ids of a row and
//   writes the RF_SAMPLE_CANDIDATES best of their rank keys (a radix select, in no
//   particular order), and the slice's total weight (integers; see below). The best
//   RF_SAMPLE_CANDIDATES tokens of the row are then among the slices' candidates, which
//   rf_sample_advance selects from again and sorts.
//   cand    uint64 [n_rows, n_slices, RF_SAMPLE_CANDIDATES]; slice_sums uint64 [n_rows, n_slices]
//   Launch: grid (n_slices, n_rows), block RF_SAMPLE_THREADS; n_slices = ceil(n_vocab /
//   RF_SAMPLE_SLICE) <= RF_SAMPLE_SLICE / RF_SAMPLE_CANDIDATES (the merged candidates fit
//   one slice's keys).
//
// rf_sample_advance: each row's token under its sampling parameters
//   (rocforge_rt/step/sampling.py states the rules; this is the same computation):
//   greedy rows keep the argmax; other rows rank tokens by (logit desc, id asc), keep the
//   top_k best, weigh each W = floor(rf_exp_f32((x - max) / T) * RF_SAMPLE_WEIGHT_SCALE) as
//   an integer (0 when rf_exp_f32(x - max) < min_p), keep the shortest ranked prefix reaching
//   ceil(top_p * total) and draw from it
//   in id order with 64 hash bits of (seed, position). Rows asking for log-probabilities
//   get their best `logprobs` alternatives, best first. Then it advances the step state
//   as rf_argmax_advance would have.
//   The merged candidates serve the common cases: the alternatives, a top_k up to
//   RF_SAMPLE_CANDIDATES, a nucleus inside the best RF_SAMPLE_CANDIDATES, and (no cut at
//   all) a draw found through the slice totals and one slice. Anything else takes the
//   general path: radix selects on 64-bit rank keys over the whole row (an 11-bit first
//   level, then 8-bit ones, each a pass building a histogram of integer counts or
//   weights, finished among at most RF_SAMPLE_LIST gathered elements) and a draw that
//   walks the row in id order.
//   params     rf_sample_params [n_rows]; stats from rf_argmax_advance
//   first_row  the batch row of logits row 0: row r's drawn token sits at context
//              position positions[first_row + r] + 1
//   n_slices   as rf_sample_candidates was launched (0: it was not; general path only)
//   top_tokens int32 [n_rows, RF_SAMPLE_MAX_TOP], top_logprobs fp32 likewise; these, sampled
//              and logprob in the host's mapped memory (only written)
//   Launch: grid (n_rows), block RF_SAMPLE_THREADS.
#define RF_SAMPLE_WARPS (RF_SAMPLE_THREADS / RF_WARP_SIZE)
#define RF_SAMPLE_FIRST_BITS 11
#define RF_SAMPLE_BITS 8
#define RF_SAMPLE_BINS (1 << RF_SAMPLE_FIRST_BITS)
#define RF_SAMPLE_LIST 1024

struct rf_sample_params {  // rocforge_rt/step/sampling.py ROW_PARAMS_DTYPE
    float temperature;     // 0: greedy
    int top_k;             // 0: no cut; 1: greedy
    float top_p;           // 1: no cut
    int logprobs;          // alternatives to report, <= RF_SAMPLE_MAX_TOP
    uint64_t seed;
    float min_p;  // 0: no cut
    float repetition_penalty;
    float frequency_penalty;
    float presence_penalty;
};

struct rf_sample_entry {
    uint64_t key;
    uint64_t weight;
    int id;
    int id_rank;  // rf_draw_in_list's: the entry's rank by id among those kept
};

// rf_block_top's shared memory.
#define RF_TOP_BINS 256
static_assert(RF_SAMPLE_SLICE % RF_SAMPLE_THREADS == 0, "keys a thread: a whole number");
struct rf_top_scratch {
    uint32_t hist[RF_TOP_BINS];
    int bin;    // the pass's byte
    int want;   // how many of the keys with the bytes chosen so far are among the k largest
    int whole;  // 1: all of them are (the select is done)
    int count;  // keys placed in out
};

struct rf_sample_shared {
    union {
        struct {
            uint64_t amount[RF_SAMPLE_BINS];  // per bin: elements (count mode) or weight
            uint32_t count[RF_SAMPLE_BINS];   // per bin: elements
        } hist;
        rf_sample_entry list[RF_SAMPLE_LIST];
        rf_top_scratch top;  // the select of the row's best among the slices' candidates
    } u;
    uint64_t best[RF_SAMPLE_CANDIDATES];  // the row's best rank keys, best first
    short by_rank[RF_SAMPLE_LIST];        // list entry at each rank (key order, or id order)
    uint64_t warp_sums[RF_SAMPLE_WARPS];
    uint64_t above;  // what the bins above the chosen one hold (with the levels before)
    uint64_t result;
    uint32_t chosen_count;
    int chosen_bin;
    int n_list;
    int token;
};

// The splitmix64 finalizer, and the draw's 64 random bits (sampling.py mix64, draw_bits).
RF_DEVICE_INLINE uint64_t rf_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
RF_DEVICE_INLINE uint64_t rf_draw_bits(uint64_t seed, int position) {
    return rf_mix64(rf_mix64(seed) + (uint64_t)position * 0x9E3779B97F4A7C15ull);
}

// The high 64 bits of a * b.
RF_DEVICE_INLINE uint64_t rf_mulhi64(uint64_t a, uint64_t b) {
    const uint64_t a_lo = (uint32_t)a, a_hi = a >> 32, b_lo = (uint32_t)b, b_hi = b >> 32;
    const uint64_t p0 = a_lo * b_lo, p1 = a_lo * b_hi, p2 = a_hi * b_lo, p3 = a_hi * b_hi;
    const uint64_t mid = (p0 >> 32) + (uint32_t)p1 + (uint32_t)p2;
    return p3 + (p1 >> 32) + (p2 >> 32) + (mid >> 32);
}

// Rank key: larger means earlier in the (logit desc, id asc) order; -0 ranks as +0.
// Every real key is above 0, which pads sorted arrays.
RF_DEVICE_INLINE uint64_t rf_rank_key(float v, int i) {
    uint32_t bits = (uint32_t)rf_float_as_int(v + 0.0f);
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((uint64_t)bits << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)i);
}
RF_DEVICE_INLINE int rf_rank_key_id(uint64_t key) {
    return (int)(0xFFFFFFFFu - (uint32_t)key);
}

// float32 exp(x), rounded from float64 (sampling.py exp_f32): the same bits as the host's,
// where expf's last bit differs from numpy's float32 exp.
RF_DEVICE_INLINE float rf_exp_f32(float x) {
    return (float)exp((double)x);
}

RF_DEVICE_INLINE uint64_t rf_sample_weight(float v, float row_max, float temperature,
                                           float min_p) {
    const float gap = v - row_max;
    if (min_p > 0.0f && rf_exp_f32(gap) < min_p) {
        return 0;
    }
    return (uint64_t)(rf_exp_f32(gap / temperature) * RF_SAMPLE_WEIGHT_SCALE);
}

// ceil(top_p * total), at most total (double arithmetic, as sampling.py's nucleus()).
RF_DEVICE_INLINE uint64_t rf_nucleus_target(float top_p, uint64_t total) {
    const double wanted = ceil((double)top_p * (double)total);
    return wanted >= (double)total ? total : (uint64_t)wanted;
}

RF_DEVICE_INLINE uint64_t rf_shfl_u64(uint64_t v, int src_lane) {
    const int lo = rf_shfl((int)(uint32_t)v, src_lane, RF_WARP_SIZE);
    const int hi = rf_shfl((int)(uint32_t)(v >> 32), src_lane, RF_WARP_SIZE);
    return ((uint64_t)(uint32_t)hi << 32) | (uint32_t)lo;
}

// Inclusive prefix sum over the lanes of a warp, lane 0 first.
RF_DEVICE_INLINE uint64_t rf_warp_scan_u64(uint64_t v) {
    const int lane = threadIdx.x % RF_WARP_SIZE;
#pragma unroll
    for (int offset = 1; offset < RF_WARP_SIZE; offset <<= 1) {
        const uint64_t up = rf_shfl_u64(v, lane >= offset ? lane - offset : 0);
        if (lane >= offset) {
            v += up;
        }
    }
    return v;
}

// Exclusive prefix sum over the block's threads in thread order, and the block's total.
// Every thread of the block calls it; warp_sums holds RF_SAMPLE_WARPS values.
RF_DEVICE_INLINE uint64_t rf_block_scan_u64(uint64_t v, uint64_t& total, uint64_t* warp_sums) {
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const uint64_t inclusive = rf_warp_scan_u64(v);
    if (lane == RF_WARP_SIZE - 1) {
        warp_sums[warp] = inclusive;
    }
    __syncthreads();
    uint64_t before = 0;
    total = 0;
    for (int w = 0; w < RF_SAMPLE_WARPS; ++w) {
        before += w < warp ? warp_sums[w] : 0;
        total += warp_sums[w];
    }
    __syncthreads();  // warp_sums is reused
    return before + inclusive - v;
}

// The k largest of the block's keys (R a thread; several may be equal, as the zeros that
// pad) into out[0..k), in no particular order: an MSB-first radix select, a byte a pass.
// A pass counts the keys that share the bytes chosen so far by their next byte, and keeps
// the byte whose keys hold the k-th largest; it stops once all of that byte's keys are
// among the k. Every thread calls it; k <= R * RF_SAMPLE_THREADS.
template <int R>
RF_DEVICE_INLINE void rf_block_top(const uint64_t (&keys)[R], int k, uint64_t* out,
                                   rf_top_scratch& t) {
    uint64_t prefix = 0, mask = 0;  // the bytes chosen so far, and where they sit
    int want = k;
    bool whole = false;
    for (int shift = 56; shift >= 0 && !whole; shift -= 8) {
        for (int i = threadIdx.x; i < RF_TOP_BINS; i += RF_SAMPLE_THREADS) {
            t.hist[i] = 0;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if ((keys[r] & mask) == prefix) {
                atomicAdd(&t.hist[(int)(keys[r] >> shift) & (RF_TOP_BINS - 1)], 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x < RF_WARP_SIZE) {  // the first warp walks the bins from the top
            constexpr int PER_LANE = RF_TOP_BINS / RF_WARP_SIZE;
            const int top = RF_TOP_BINS - 1 - PER_LANE * (int)threadIdx.x;  // this lane's first
            uint64_t mine = 0;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {
                mine += t.hist[top - j];
            }
            uint64_t above = rf_warp_scan_u64(mine) - mine;  // in the bins above this lane's
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {
                const uint32_t c = t.hist[top - j];
                if (above < (uint64_t)want && above + c >= (uint64_t)want) {
                    t.bin = top - j;
                    t.want = want - (int)above;
                    t.whole = above + c == (uint64_t)want;
                }
                above += c;
            }
        }
        __syncthreads();
        prefix |= (uint64_t)t.bin << shift;
        mask |= (uint64_t)(RF_TOP_BINS - 1) << shift;
        want = t.want;
        whole = t.whole != 0;
    }
    if (threadIdx.x == 0) {
        t.count = 0;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const uint64_t high = keys[r] & mask;
        if (high > prefix || (whole && high == prefix)) {
            out[atomicAdd(&t.count, 1)] = keys[r];
        }
    }
    __syncthreads();
    if (!whole) {  // every byte chosen: the keys equal to prefix are copies of one value
        for (int i = t.count + (int)threadIdx.x; i < k; i += RF_SAMPLE_THREADS) {
            out[i] = prefix;
        }
    }
    __syncthreads();
}

// Ranks are counted by groups of RF_RANK_LANES threads, one entry a group (its lanes take
// every RF_RANK_LANES-th other entry), so RF_RANK_ENTRIES entries at once.
#define RF_RANK_LANES 16
#define RF_RANK_ENTRIES (RF_SAMPLE_THREADS / RF_RANK_LANES)
static_assert(RF_WARP_SIZE % RF_RANK_LANES == 0, "a rank group within one warp");
static_assert(RF_SAMPLE_CANDIDATES <= RF_RANK_ENTRIES, "rf_sort_desc: one pass");
static_assert(RF_SAMPLE_LIST <= RF_SAMPLE_THREADS, "a listed entry a thread");

// Entry e's rank among entries [0, n): how many j come before it (before(j)), in every
// thread of its group (threadIdx.x / RF_RANK_LANES, 0 where e >= n). Every thread calls it.
template <typename Before>
RF_DEVICE_INLINE int rf_group_rank(int e, int n, Before before) {
    int rank = 0;
    if (e < n) {
        for (int j = (int)threadIdx.x % RF_RANK_LANES; j < n; j += RF_RANK_LANES) {
            rank += before(j) ? 1 : 0;
        }
    }
#pragma unroll
    for (int offset = RF_RANK_LANES / 2; offset > 0; offset >>= 1) {
        rank += rf_shfl_xor(rank, offset);
    }
    return rank;
}

// Sort n <= RF_RANK_ENTRIES keys in shared memory, largest first (equal keys keep their
// order). Every thread calls it.
RF_DEVICE_INLINE void rf_sort_desc(uint64_t* keys, int n) {
    const int e = (int)threadIdx.x / RF_RANK_LANES;
    const uint64_t key = e < n ? keys[e] : 0;
    const int rank = rf_group_rank(e, n, [&](int j) {
        const uint64_t other = keys[j];
        return other > key || (other == key && j < e);
    });
    __syncthreads();
    if (e < n && threadIdx.x % RF_RANK_LANES == 0) {
        keys[rank] = key;
    }
    __syncthreads();
}

RF_DEVICE_INLINE bool rf_sample_greedy(const rf_sample_params& p) {
    return p.temperature == 0.0f || p.top_k == 1;
}

RF_KERNEL_BOUNDS_ONE(RF_SAMPLE_THREADS)
void rf_sample_candidates(const float* RF_RESTRICT logits, int n_vocab,
                          const rf_sample_params* RF_RESTRICT params,
                          const rf_row_stats* RF_RESTRICT stats, uint64_t* RF_RESTRICT cand,
                          uint64_t* RF_RESTRICT slice_sums) {
    __shared__ rf_top_scratch s_top;
    __shared__ uint64_t s_warp_sums[RF_SAMPLE_WARPS];
    rf_pdl_begin();
    const int slice = blockIdx.x, row = blockIdx.y, n_slices = gridDim.x;
    const rf_sample_params p = params[row];
    const bool greedy = rf_sample_greedy(p);
    if (greedy && p.logprobs == 0) {
        return;  // this row needs nothing beyond the argmax
    }
    const float* x = logits + (int64_t)row * n_vocab;
    const float row_max = stats[row].max;
    const int first = slice * RF_SAMPLE_SLICE;
    uint64_t mine = 0;
    uint64_t keys[RF_SAMPLE_SLICE / RF_SAMPLE_THREADS];
#pragma unroll
    for (int r = 0; r < RF_SAMPLE_SLICE / RF_SAMPLE_THREADS; ++r) {
        const int id = first + (int)threadIdx.x + r * RF_SAMPLE_THREADS;
        keys[r] = 0;
        if (id < n_vocab) {
            const float v = x[id];
            keys[r] = rf_rank_key(v, id);
            mine += greedy ? 0 : rf_sample_weight(v, row_max, p.temperature, p.min_p);
        }
    }
    uint64_t total;
    rf_block_scan_u64(mine, total, s_warp_sums);
    rf_block_top(keys, RF_SAMPLE_CANDIDATES,
                 cand + ((int64_t)row * n_slices + slice) * RF_SAMPLE_CANDIDATES, s_top);
    if (threadIdx.x == 0) {
        slice_sums[(int64_t)row * n_slices + slice] = total;
    }
}

// What the general path looks at: the row, its statistics and the weights' parameters.
struct rf_sample_row {
    const float* x;
    int n_vocab;
    float row_max;
    float temperature;
    float min_p;
};

RF_DEVICE_INLINE uint64_t rf_row_weight(const rf_sample_row& r, float v) {
    return rf_sample_weight(v, r.row_max, r.temperature, r.min_p);
}

// Order the first n list entries by key, best first, into s.by_rank (distinct keys).
RF_DEVICE_INLINE void rf_rank_list(rf_sample_shared& s, int n) {
    for (int first = 0; first < n; first += RF_RANK_ENTRIES) {
        const int e = first + (int)threadIdx.x / RF_RANK_LANES;
        const uint64_t key = e < n ? s.u.list[e].key : 0;
        const int rank = rf_group_rank(e, n, [&](int j) { return s.u.list[j].key > key; });
        if (e < n && threadIdx.x % RF_RANK_LANES == 0) {
            s.by_rank[rank] = (short)e;
        }
    }
    __syncthreads();
}

// Gather the elements with low <= key <= high into the list; returns the count. The
// caller knows it fits.
RF_DEVICE_INLINE int rf_gather(const rf_sample_row& r, uint64_t low, uint64_t high,
                               bool weighted, rf_sample_shared& s) {
    if (threadIdx.x == 0) {
        s.n_list = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < r.n_vocab; i += RF_SAMPLE_THREADS) {
        const float v = r.x[i];
        const uint64_t key = rf_rank_key(v, i);
        if (key >= low && key <= high) {
            const int slot = atomicAdd(&s.n_list, 1);
            s.u.list[slot].key = key;
            s.u.list[slot].weight = weighted ? rf_row_weight(r, v) : 1;
            s.u.list[slot].id = i;
        }
    }
    __syncthreads();
    return s.n_list;
}

// The list as the n best candidates (s.best), with their weights.
RF_DEVICE_INLINE void rf_list_best(const rf_sample_row& r, int n, rf_sample_shared& s) {
    for (int e = threadIdx.x; e < n; e += RF_SAMPLE_THREADS) {
        const int id = rf_rank_key_id(s.best[e]);
        s.u.list[e].key = s.best[e];
        s.u.list[e].weight = rf_row_weight(r, r.x[id]);
        s.u.list[e].id = id;
    }
    __syncthreads();
}

// Add `amount` to bin `bin` (-1: nothing), one atomic for the lanes that share lane 0's bin.
RF_DEVICE_INLINE void rf_hist_add(rf_sample_shared& s, int bin, uint64_t amount) {
    const int lane = threadIdx.x % RF_WARP_SIZE;
    const int lead = rf_shfl(bin, 0, RF_WARP_SIZE);
    const bool joins = bin == lead && bin >= 0;
    uint64_t total = joins ? amount : 0;
    int count = joins ? 1 : 0;
#pragma unroll
    for (int offset = RF_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        total += rf_shfl_u64(total, lane ^ offset);
        count += rf_shfl_xor(count, offset);
    }
    if (lane == 0 && lead >= 0) {
        atomicAdd(&s.u.hist.amount[lead], total);
        atomicAdd(&s.u.hist.count[lead], (uint32_t)count);
    } else if (bin >= 0 && !joins) {
        atomicAdd(&s.u.hist.amount[bin], amount);
        atomicAdd(&s.u.hist.count[bin], 1u);
    }
}

// The threshold T of the top set {key >= T} among elements with key >= floor_key: the
// fewest best-ranked elements whose count (weighted false) or weight (true) reaches
// `target`, which must be reachable. Every thread of the block calls it.
RF_DEVICE_INLINE uint64_t rf_select(const rf_sample_row& r, bool weighted, uint64_t floor_key,
                                    uint64_t target, rf_sample_shared& s) {
    const int tid = threadIdx.x;
    uint64_t prefix = 0, above = 0, unused;
    int prev_shift = 64;
    for (;;) {
        const int bits = prev_shift == 64 ? RF_SAMPLE_FIRST_BITS : min(RF_SAMPLE_BITS, prev_shift);
        const int shift = prev_shift - bits, n_bins = 1 << bits;
        for (int b = tid; b < n_bins; b += RF_SAMPLE_THREADS) {
            s.u.hist.amount[b] = 0;
            s.u.hist.count[b] = 0;
        }
        __syncthreads();
        for (int base = 0; base < r.n_vocab; base += RF_SAMPLE_THREADS) {
            const int i = base + tid;
            int bin = -1;
            uint64_t amount = 0;
            if (i < r.n_vocab) {
                const float v = r.x[i];
                const uint64_t key = rf_rank_key(v, i);
                if (key >= floor_key && (prev_shift == 64 || (key >> prev_shift) == prefix)) {
                    bin = (int)((key >> shift) & (uint64_t)(n_bins - 1));
                    amount = weighted ? rf_row_weight(r, v) : 1;
                }
            }
            rf_hist_add(s, bin, amount);  // the whole warp takes part
        }
        __syncthreads();
        // The bin where the running amount, from the top bin down, reaches the target.
        uint64_t mine = 0;
        const int top = RF_SAMPLE_BINS - 1 - 2 * tid;  // this thread's two bins, descending
        for (int j = 0; j < 2; ++j) {
            mine += top - j < n_bins ? s.u.hist.amount[top - j] : 0;
        }
        uint64_t reached = above + rf_block_scan_u64(mine, unused, s.warp_sums);
        if (reached < target && reached + mine >= target) {
            for (int j = 0; j < 2; ++j) {
                const int bin = top - j;
                const uint64_t amount = bin < n_bins ? s.u.hist.amount[bin] : 0;
                if (reached + amount >= target) {
                    s.chosen_bin = bin;
                    s.chosen_count = s.u.hist.count[bin];
                    s.above = reached;
                    break;
                }
                reached += amount;
            }
        }
        __syncthreads();
        const int bin = s.chosen_bin;
        const uint32_t in_bin = s.chosen_count;
        above = s.above;
        prefix = (prefix << bits) | (uint64_t)bin;
        __syncthreads();  // the choice is read before anything rewrites it
        const uint64_t low = max(prefix << shift, floor_key);
        if (!weighted && above + in_bin == target) {
            return low;  // all of the bin is in
        }
        if (in_bin <= RF_SAMPLE_LIST) {  // finish among the bin's elements
            const uint64_t high = (prefix << shift) | ((1ull << shift) - 1);
            const int n = rf_gather(r, low, high, weighted, s);
            rf_rank_list(s, n);
            const uint64_t amount = tid < n ? s.u.list[s.by_rank[tid]].weight : 0;
            reached = above + rf_block_scan_u64(amount, unused, s.warp_sums);
            if (tid < n && reached < target && reached + amount >= target) {
                s.result = s.u.list[s.by_rank[tid]].key;
            }
            __syncthreads();
            return s.result;
        }
        prev_shift = shift;
    }
}

// The token at cumulative weight r in id order among the elements with key >= threshold,
// walking the whole row: per-warp id ranges, then the holding warp's lanes.
RF_DEVICE_INLINE void rf_draw_in_row(const rf_sample_row& r, uint64_t threshold, uint64_t bits,
                                     rf_sample_shared& s) {
    const int warp = threadIdx.x / RF_WARP_SIZE, lane = threadIdx.x % RF_WARP_SIZE;
    const int range = (r.n_vocab + RF_SAMPLE_WARPS - 1) / RF_SAMPLE_WARPS;
    const int first = min(warp * range, r.n_vocab), last = min(first + range, r.n_vocab);
    uint64_t mine = 0;
    for (int i = first + lane; i < last; i += RF_WARP_SIZE) {
        const float v = r.x[i];
        if (rf_rank_key(v, i) >= threshold) {
            mine += rf_row_weight(r, v);
        }
    }
#pragma unroll
    for (int offset = RF_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        mine += rf_shfl_u64(mine, lane ^ offset);
    }
    if (lane == 0) {
        s.warp_sums[warp] = mine;
    }
    __syncthreads();
    uint64_t before = 0, mass = 0;
    for (int w = 0; w < RF_SAMPLE_WARPS; ++w) {
        before += w < warp ? s.warp_sums[w] : 0;
        mass += s.warp_sums[w];
    }
    const uint64_t target = rf_mulhi64(bits, mass);  // < mass
    if (before <= target && target < before + mine) {  // this warp holds it
        const int piece = (last - first + RF_WARP_SIZE - 1) / RF_WARP_SIZE;
        const int lo = min(first + lane * piece, last), hi = min(lo + piece, last);
        uint64_t part = 0;
        for (int i = lo; i < hi; ++i) {
            if (rf_rank_key(r.x[i], i) >= threshold) {
                part += rf_row_weight(r, r.x[i]);
            }
        }
        uint64_t reached = before + rf_warp_scan_u64(part) - part;
        if (reached <= target && target < reached + part) {
            for (int i = lo; i < hi; ++i) {
                if (rf_rank_key(r.x[i], i) >= threshold) {
                    reached += rf_row_weight(r, r.x[i]);
                    if (reached > target) {
                        s.token = i;
                        break;
                    }
                }
            }
        }
    }
    __syncthreads();
}

// The draw with no cut at all: the slice holding it from the slice totals (id order),
// then a scan of that slice's ids.
RF_DEVICE_INLINE void rf_draw_in_slices(const rf_sample_row& r, const uint64_t* sums,
                                        int n_slices, uint64_t total, uint64_t bits,
                                        rf_sample_shared& s) {
    const uint64_t target = rf_mulhi64(bits, total);
    if (threadIdx.x == 0) {
        uint64_t reached = 0;
        int slice = 0;
        for (; slice < n_slices - 1 && reached + sums[slice] <= target; ++slice) {
            reached += sums[slice];
        }
        s.chosen_bin = slice;
        s.above = reached;
    }
    __syncthreads();
    constexpr int EACH = RF_SAMPLE_SLICE / RF_SAMPLE_THREADS;
    const int first = s.chosen_bin * RF_SAMPLE_SLICE + threadIdx.x * EACH;
    uint64_t w[EACH], mine = 0, unused;
#pragma unroll
    for (int e = 0; e < EACH; ++e) {
        const int i = first + e;
        w[e] = i < r.n_vocab ? rf_row_weight(r, r.x[i]) : 0;
        mine += w[e];
    }
    uint64_t reached = s.above + rf_block_scan_u64(mine, unused, s.warp_sums);
    if (reached <= target && target < reached + mine) {
#pragma unroll
        for (int e = 0; e < EACH; ++e) {
            reached += w[e];
            if (reached > target) {
                s.token = first + e;
                break;
            }
        }
    }
    __syncthreads();
}

// Cut and draw within the n listed best candidates (a top-k domain, or the best of an
// uncut row): rank them (`in_order`: the list is in key order already, rf_list_best's),
// keep the ranked prefix reaching ceil(top_p * total) (total: the domain's weight, the
// list's own when 0), then find the draw in id order among those kept. Returns false,
// drawing nothing, when the list cannot reach the target.
RF_DEVICE_INLINE bool rf_draw_in_list(int n, bool in_order, float top_p, uint64_t total,
                                      uint64_t bits, rf_sample_shared& s) {
    const int tid = threadIdx.x;
    if (in_order) {
        for (int e = tid; e < n; e += RF_SAMPLE_THREADS) {
            s.by_rank[e] = (short)e;
        }
        __syncthreads();
    } else {
        rf_rank_list(s, n);
    }
    uint64_t listed;
    const uint64_t weight = tid < n ? s.u.list[s.by_rank[tid]].weight : 0;
    const uint64_t before = rf_block_scan_u64(weight, listed, s.warp_sums);
    total = total ? total : listed;
    int kept = n;
    if (top_p < 1.0f) {
        const uint64_t target = rf_nucleus_target(top_p, total);
        if (listed < target) {
            return false;
        }
        if (tid < n && before < target && before + weight >= target) {
            s.n_list = tid + 1;  // ranks 0..tid are kept
        }
        __syncthreads();
        kept = s.n_list;
    } else if (listed < total) {
        return false;
    }
    // Rank the kept entries by id (rank r in key order is entry by_rank[r]) into their
    // id_rank, then rewrite by_rank in id order.
    for (int first = 0; first < kept; first += RF_RANK_ENTRIES) {
        const int r = first + tid / RF_RANK_LANES;
        const int id = r < kept ? s.u.list[s.by_rank[r]].id : 0;
        const int id_rank =
            rf_group_rank(r, kept, [&](int j) { return s.u.list[s.by_rank[j]].id < id; });
        if (r < kept && tid % RF_RANK_LANES == 0) {
            s.u.list[s.by_rank[r]].id_rank = id_rank;
        }
    }
    __syncthreads();
    const int entry = tid < kept ? s.by_rank[tid] : -1;  // kept <= RF_SAMPLE_LIST threads
    const int id_rank = tid < kept ? s.u.list[entry].id_rank : 0;
    __syncthreads();  // by_rank is rewritten in id order
    if (tid < kept) {
        s.by_rank[id_rank] = (short)entry;
    }
    __syncthreads();
    uint64_t mass;
    const uint64_t w = tid < kept ? s.u.list[s.by_rank[tid]].weight : 0;
    const uint64_t reached = rf_block_scan_u64(w, mass, s.warp_sums);
    const uint64_t target = rf_mulhi64(bits, mass);
    if (tid < kept && reached <= target && target < reached + w) {
        s.token = s.u.list[s.by_rank[tid]].id;
    }
    __syncthreads();
    return true;
}

// The general path's draw: top-k cut and nucleus by radix selects over the whole row.
RF_DEVICE_INLINE void rf_draw_general(const rf_sample_row& r, const rf_sample_params& p,
                                      uint64_t bits, rf_sample_shared& s) {
    const bool cut = p.top_k > 0 && p.top_k < r.n_vocab;
    const uint64_t floor_key = cut ? rf_select(r, false, 0, (uint64_t)p.top_k, s) : 0;
    if (cut && p.top_k <= RF_SAMPLE_LIST) {
        rf_draw_in_list(rf_gather(r, floor_key, ~0ull, true, s), false, p.top_p, 0, bits, s);
        return;
    }
    uint64_t threshold = floor_key;
    if (p.top_p < 1.0f) {
        uint64_t mine = 0, total = 0;
        for (int i = threadIdx.x; i < r.n_vocab; i += RF_SAMPLE_THREADS) {
            if (rf_rank_key(r.x[i], i) >= floor_key) {
                mine += rf_row_weight(r, r.x[i]);
            }
        }
        rf_block_scan_u64(mine, total, s.warp_sums);
        threshold = rf_select(r, true, floor_key, rf_nucleus_target(p.top_p, total), s);
    }
    rf_draw_in_row(r, threshold, bits, s);
}

RF_KERNEL_BOUNDS_ONE(RF_SAMPLE_THREADS)
void rf_sample_advance(const float* RF_RESTRICT logits, int n_vocab,
                       const rf_sample_params* RF_RESTRICT params,
                       const rf_row_stats* RF_RESTRICT stats, int first_row, int n_slices,
                       const uint64_t* RF_RESTRICT cand, const uint64_t* RF_RESTRICT slice_sums,
                       int32_t* RF_RESTRICT tokens, int32_t* RF_RESTRICT positions,
                       int32_t* RF_RESTRICT sampled, float* RF_RESTRICT logprob,
                       int32_t* RF_RESTRICT top_tokens, float* RF_RESTRICT top_logprobs) {
    __shared__ rf_sample_shared s;
    rf_pdl_wait();
    const int row = blockIdx.x, tid = threadIdx.x;
    const rf_sample_params p = params[row];
    rf_sample_row r;
    r.x = logits + (int64_t)row * n_vocab;
    r.n_vocab = n_vocab;
    r.row_max = stats[row].max;
    r.temperature = p.temperature;
    r.min_p = p.min_p;
    const float log_sum = stats[row].log_sum;
    const bool greedy = rf_sample_greedy(p);
    if (tid == 0) {
        s.token = stats[row].index;  // the argmax (rf_argmax_advance)
    }

    // The row's best candidates, merged from the slices' (best first).
    int n_best = 0;
    if (n_slices > 0 && !(greedy && p.logprobs == 0)) {
        const int n = n_slices * RF_SAMPLE_CANDIDATES;  // at most RF_SAMPLE_SLICE
        const uint64_t* mine = cand + (int64_t)row * n;
        uint64_t keys[RF_SAMPLE_SLICE / RF_SAMPLE_THREADS];
#pragma unroll
        for (int r = 0; r < RF_SAMPLE_SLICE / RF_SAMPLE_THREADS; ++r) {
            const int i = tid + r * RF_SAMPLE_THREADS;
            keys[r] = i < n ? mine[i] : 0;
        }
        rf_block_top(keys, RF_SAMPLE_CANDIDATES, s.best, s.u.top);
        rf_sort_desc(s.best, RF_SAMPLE_CANDIDATES);
        n_best = min(RF_SAMPLE_CANDIDATES, n_vocab);
    }

    const int n_top = min(p.logprobs, min(n_vocab, RF_SAMPLE_MAX_TOP));
    if (n_top > 0) {  // the best alternatives, best first
        if (n_top > n_best) {  // no merged candidates: select over the row
            const uint64_t threshold = rf_select(r, false, 0, (uint64_t)n_top, s);
            rf_gather(r, threshold, ~0ull, false, s);
            rf_rank_list(s, n_top);
            if (tid < n_top) {
                s.best[tid] = s.u.list[s.by_rank[tid]].key;
            }
            __syncthreads();
        }
        if (tid < n_top) {
            const int t = rf_rank_key_id(s.best[tid]);
            top_tokens[row * RF_SAMPLE_MAX_TOP + tid] = t;
            top_logprobs[row * RF_SAMPLE_MAX_TOP + tid] = (r.x[t] - r.row_max) - log_sum;
        }
        __syncthreads();
    }

    if (!greedy) {
        const uint64_t bits = rf_draw_bits(p.seed, positions[first_row + row] + 1);
        const bool cut = p.top_k > 0 && p.top_k < n_vocab;
        uint64_t total = 0;
        for (int i = 0; !cut && i < n_slices; ++i) {
            total += slice_sums[(int64_t)row * n_slices + i];
        }
        bool drawn = false;
        if (cut && p.top_k <= n_best) {  // a top-k domain among the candidates
            rf_list_best(r, p.top_k, s);
            drawn = rf_draw_in_list(p.top_k, true, p.top_p, 0, bits, s);
        } else if (!cut && n_slices > 0 && p.top_p >= 1.0f) {
            rf_draw_in_slices(r, slice_sums + (int64_t)row * n_slices, n_slices, total, bits, s);
            drawn = true;
        } else if (!cut && n_best > 0) {  // a nucleus inside the best candidates, maybe
            rf_list_best(r, n_best, s);
            drawn = rf_draw_in_list(n_best, true, p.top_p, total, bits, s);
        }
        if (!drawn) {
            rf_draw_general(r, p, bits, s);
        }
    }
    rf_pdl_launch_dependents();
    __syncthreads();
    if (tid == 0) {
        const int token = s.token;
        sampled[row] = token;
        logprob[row] = (r.x[token] - r.row_max) - log_sum;
        tokens[row] = token;
        positions[row] += 1;
    }
}


// ---------------------------------------------------------------------------------------
// rf_sample_penalize: llama.cpp's penalties on each logits row, in place (sampling.py
//   penalize): a token seen c times among the row's recent tokens has its logit x
//   divided by repetition_penalty (multiplied when x <= 0) and kept within float32's
//   finite range, then loses c * frequency_penalty + presence_penalty, each operation
//   rounded as written.
//   recent     int32 [n_rows, RF_SAMPLE_PENALTY_WINDOW]: the token at context position q
//              at entry q % RF_SAMPLE_PENALTY_WINDOW, -1 where none (sampling.py
//              recent_window). The row's input token (tokens[first_row + r], at
//              positions[first_row + r]) is written there first, so that decode steps the
//              device advances keep the window without a copy.
//   Rows without penalties only record their input token.
//   Launch: grid (n_rows), block RF_SAMPLE_PENALTY_WINDOW.
RF_KERNEL_BOUNDS(RF_SAMPLE_PENALTY_WINDOW)
void rf_sample_penalize(float* RF_RESTRICT logits, int n_vocab,
                        const rf_sample_params* RF_RESTRICT params, int32_t* RF_RESTRICT recent,
                        const int32_t* RF_RESTRICT tokens, const int32_t* RF_RESTRICT positions,
                        int first_row) {
    __shared__ int32_t s_recent[RF_SAMPLE_PENALTY_WINDOW];
    rf_pdl_begin();
    const int row = blockIdx.x, i = threadIdx.x;
    int32_t* window = recent + (int64_t)row * RF_SAMPLE_PENALTY_WINDOW;
    int token = window[i];
    if (i == positions[first_row + row] % RF_SAMPLE_PENALTY_WINDOW) {
        token = tokens[first_row + row];
        window[i] = token;
    }
    s_recent[i] = token;
    __syncthreads();
    const rf_sample_params p = params[row];
    const bool penalized = p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f ||
                           p.presence_penalty != 0.0f;
    if (!penalized || token < 0 || token >= n_vocab) {
        return;
    }
    int count = 0;
    bool first = true;  // this entry is the token's first in the window: it applies them
    for (int j = 0; j < RF_SAMPLE_PENALTY_WINDOW; ++j) {
        const bool same = s_recent[j] == token;
        count += same;
        first = first && !(same && j < i);
    }
    if (!first) {
        return;
    }
    float* x = logits + (int64_t)row * n_vocab + token;
    float v = *x;
    v = v <= 0.0f ? __fmul_rn(v, p.repetition_penalty) : __fdiv_rn(v, p.repetition_penalty);
    v = fminf(fmaxf(v, -RF_FLOAT_MAX), RF_FLOAT_MAX);
    *x = __fsub_rn(v, __fadd_rn(__fmul_rn((float)count, p.frequency_penalty), p.presence_penalty));
}
