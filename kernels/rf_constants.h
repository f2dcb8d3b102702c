// rf_constants.h - the numbers the kernels share with the host code.
//
// Each is written once, in rocforge_rt/backends/gpu/kernel_constants.py, and reaches
// every compile as a -D define from the kernel library (so it is part of each code
// object's cache key); no kernel file defines one. This header only stops a compile
// that lacks them. tests/test_kernel_abi.py checks that this list is the module's.
//
//   RF_QK                  elements per quant block
//   RF_Q4_0_BLOCK_BYTES    bytes of a GGUF Q4_0 block (f16 d + 16 bytes of nibbles)
//   RF_Q8_0_BLOCK_BYTES    bytes of a GGUF Q8_0 block (f16 d + 32 int8)
//   RF_Q8_STAGE            blocks per stage of the canonical matmul sum (rf_q8.h)
//   RF_Q8_NORM_THREADS     threads that share a row's sum of squares (rf_q8.h)
//   RF_EPILOGUE_*          matmul epilogues: STORE, RESIDUAL, SWIGLU (gemv.hip, gemm.hip)
//   RF_GEMV_MAX_ROWS       activation rows one GEMV launch takes
//   RF_GEMV_STAGES_PER_LANE  canonical-sum stages a GEMV lane takes per chunk (gemv.hip)
//   RF_GEMV_CLUSTER_MAX_K  widest row a cluster's GEMV blocks quantize together (gemv.hip)
//   RF_GEMV_CLUSTER_PIECES 1024-column pieces a thread of that cluster quantizes, at most
//   RF_Q8_ROWS_BLOCKS      quant blocks of a row one rf_quantize_q8_rows block takes
//   RF_GEMM_THREADS, RF_GEMM_TILE_N, RF_GEMM_TILE_M   the prefill GEMM's block and tile
//   RF_EMBED_THREADS, RF_ROPE_THREADS                 block sizes
//   RF_F16_THREADS, RF_DEQUANT_PART   the vendor GEMM's element-wise kernels: block size,
//                          elements one expanding thread writes (gemm_f16.hip)
//   RF_ATTN_TILE, RF_ATTN_SPAN, RF_ATTN_ONE_SPAN_TILES, RF_ATTN_WARPS,
//   RF_ATTN_PREFILL_ROWS, RF_ATTN_MAX_GROUP, RF_ATTN_MAX_D   attention's key tile, the
//                          fold's spans, block, work split and limits (attention.hip)
//   RF_ARGMAX_THREADS, RF_SAMPLE_THREADS, RF_SAMPLE_SLICE, RF_SAMPLE_CANDIDATES,
//   RF_SAMPLE_MAX_TOP, RF_SAMPLE_WEIGHT_SCALE, RF_SAMPLE_PENALTY_WINDOW   sampling
//                          (sampling.hip)
#ifndef RF_CONSTANTS_H
#define RF_CONSTANTS_H

#include "rf_portability.h"

#if !defined(RF_QK) || !defined(RF_Q4_0_BLOCK_BYTES) || !defined(RF_Q8_0_BLOCK_BYTES) ||   \
    !defined(RF_Q8_STAGE) || !defined(RF_Q8_NORM_THREADS) || !defined(RF_EPILOGUE_STORE) || \
    !defined(RF_EPILOGUE_RESIDUAL) || !defined(RF_EPILOGUE_SWIGLU) ||                       \
    !defined(RF_GEMV_MAX_ROWS) || !defined(RF_GEMV_STAGES_PER_LANE) ||                       \
    !defined(RF_GEMV_CLUSTER_MAX_K) || !defined(RF_GEMV_CLUSTER_PIECES) ||                 \
    !defined(RF_Q8_ROWS_BLOCKS) || !defined(RF_GEMM_THREADS) ||    \
    !defined(RF_GEMM_TILE_N) || !defined(RF_GEMM_TILE_M) || !defined(RF_EMBED_THREADS) ||  \
    !defined(RF_ROPE_THREADS) ||                                                            \
    !defined(RF_F16_THREADS) || !defined(RF_DEQUANT_PART) ||                                \
    !defined(RF_ATTN_TILE) || !defined(RF_ATTN_SPAN) || !defined(RF_ATTN_ONE_SPAN_TILES) ||  \
    !defined(RF_ATTN_WARPS) || !defined(RF_ATTN_PREFILL_ROWS) ||                            \
    !defined(RF_ATTN_MAX_GROUP) || !defined(RF_ATTN_MAX_D) || !defined(RF_ARGMAX_THREADS) ||  \
    !defined(RF_SAMPLE_THREADS) || !defined(RF_SAMPLE_SLICE) ||                             \
    !defined(RF_SAMPLE_CANDIDATES) || !defined(RF_SAMPLE_MAX_TOP) ||                        \
    !defined(RF_SAMPLE_WEIGHT_SCALE) || !defined(RF_SAMPLE_PENALTY_WINDOW)
#error "kernel constants missing: compile through KernelLibrary (kernel_constants.py)"
#endif

#endif  // RF_CONSTANTS_H
