"""The numbers the kernels and the Python side must agree on, each written once, here.

`KernelLibrary` passes `KERNEL_DEFINES` to every compile as -D defines (so they are
part of each code object's cache key); no file under kernels/ defines them, and
kernels/rf_constants.h stops a compile that lacks them. The launch code sizes its
grids, blocks and buffers from the Python names below. The sampling rules' own
numbers (alternatives a row may ask for, the integer weight scale) come from
rocforge_rt/step/sampling.py, which states those rules.

Numbers used by one side only stay with it: a kernel's private tuning in its
source, a launch heuristic in its launch module.
"""

from rocforge_rt.step.sampling import MAX_LOGPROBS, PENALTY_WINDOW, WEIGHT_SCALE

# Quantized blocks: GGUF Q4_0 (f16 d + 16 bytes of nibbles) and Q8_0 (f16 d + 32 int8).
QK = 32  # elements per quant block
Q4_0_BLOCK_BYTES = 2 + QK // 2
Q8_0_BLOCK_BYTES = 2 + QK
# The int8-activation arithmetic every matmul shares (kernels/rf_q8.h).
Q8_STAGE = 2  # blocks per stage of the canonical matmul sum
Q8_NORM_THREADS = 256  # threads that share a row's sum of squares (it fixes the order)

# Matmuls (kernels/gemv.hip, kernels/gemm.hip).
EPILOGUE_STORE, EPILOGUE_RESIDUAL, EPILOGUE_SWIGLU = 0, 1, 2
GEMV_THREADS = Q8_NORM_THREADS  # a GEMV block normalizes its rows itself
GEMV_MAX_ROWS = 8  # activation rows one GEMV launch takes
GEMV_STAGES_PER_LANE = 1  # canonical-sum stages a GEMV lane takes per chunk (sizes its fold buffer)
GEMV_CLUSTER_MAX_K = 8192  # widest row a cluster's GEMV blocks quantize together (shared memory)
GEMV_CLUSTER_PIECES = 2  # 1024-column pieces a thread of such a cluster quantizes, at most
MMV_MAX_ROWS = 64  # activation rows one rf_mmv launch takes; more take a prompt GEMM
Q8_ROWS_THREADS = Q8_NORM_THREADS  # rf_quantize_q8_rows, the GEMM's and MMV's prologue
Q8_ROWS_BLOCKS = Q8_ROWS_THREADS // 8  # quant blocks of a row one of its blocks takes
GEMM_THREADS, GEMM_TILE_N, GEMM_TILE_M = 128, 128, 64  # SwiGLU tiles hold TILE_N / 2 outputs
F16_THREADS = 256  # kernels/gemm_f16.hip: the vendor GEMM's operand and epilogue kernels
DEQUANT_PART = 8  # fp16 elements one rf_dequant_f16 thread writes (a 16-byte store)

EMBED_THREADS = 256  # kernels/embedding.hip
ROPE_THREADS = 256  # kernels/rope_kv.hip

# Attention (kernels/attention.hip).
ATTN_TILE = 64  # key positions a tile (the arithmetic's unit, aligned at position 0)
# A longer context's tile parts fold in spans, then the spans' states (attention.hip): the
# decode kernel folds the spans in parallel: past 64 tiles the spans win, below they lost
# (docs/performance.md).
ATTN_SPAN = 16  # tiles a span
ATTN_ONE_SPAN_TILES = 4 * ATTN_SPAN  # tiles of the longest context folded as one span
ATTN_WARPS = 4  # 32-lane groups a block of either kernel has
ATTN_PREFILL_ROWS = 16 * ATTN_WARPS  # query rows (token, head) a prefill block takes
ATTN_MAX_GROUP = 8  # query heads per KV head
ATTN_MAX_HEAD_DIM = 128

# Sampling (kernels/sampling.hip).
ARGMAX_THREADS = 256
SAMPLE_THREADS = 1024
SAMPLE_SLICE = 4096  # vocabulary entries per candidates block
SAMPLE_CANDIDATES = 64  # best rank keys a slice keeps
SAMPLE_MAX_SLICES = SAMPLE_SLICE // SAMPLE_CANDIDATES  # the merged candidates fit one slice
SAMPLE_MAX_TOP = MAX_LOGPROBS  # alternatives a row may report
SAMPLE_PENALTY_WINDOW = PENALTY_WINDOW  # recent tokens a row's penalties count (its block)

# Sizes of the kernels' own records in device buffers (tests/test_kernel_abi.py parses
# the structs); the host sizes buffers from them but passes none to a compile.
ARGMAX_PART_BYTES = 12  # rf_argmax_part: (max, index, sum) per slice
ROW_STATS_BYTES = 12  # rf_row_stats: (max, log of the sum of exp, argmax) per logits row


KERNEL_DEFINES: dict[str, int | str] = {
    "RF_QK": QK,
    "RF_Q4_0_BLOCK_BYTES": Q4_0_BLOCK_BYTES,
    "RF_Q8_0_BLOCK_BYTES": Q8_0_BLOCK_BYTES,
    "RF_Q8_STAGE": Q8_STAGE,
    "RF_Q8_NORM_THREADS": Q8_NORM_THREADS,
    "RF_EPILOGUE_STORE": EPILOGUE_STORE,
    "RF_EPILOGUE_RESIDUAL": EPILOGUE_RESIDUAL,
    "RF_EPILOGUE_SWIGLU": EPILOGUE_SWIGLU,
    "RF_GEMV_MAX_ROWS": GEMV_MAX_ROWS,
    "RF_GEMV_STAGES_PER_LANE": GEMV_STAGES_PER_LANE,
    "RF_GEMV_CLUSTER_MAX_K": GEMV_CLUSTER_MAX_K,
    "RF_GEMV_CLUSTER_PIECES": GEMV_CLUSTER_PIECES,
    "RF_Q8_ROWS_BLOCKS": Q8_ROWS_BLOCKS,
    "RF_GEMM_THREADS": GEMM_THREADS,
    "RF_GEMM_TILE_N": GEMM_TILE_N,
    "RF_GEMM_TILE_M": GEMM_TILE_M,
    "RF_F16_THREADS": F16_THREADS,
    "RF_DEQUANT_PART": DEQUANT_PART,
    "RF_EMBED_THREADS": EMBED_THREADS,
    "RF_ROPE_THREADS": ROPE_THREADS,
    "RF_ATTN_TILE": ATTN_TILE,
    "RF_ATTN_SPAN": ATTN_SPAN,
    "RF_ATTN_ONE_SPAN_TILES": ATTN_ONE_SPAN_TILES,
    "RF_ATTN_WARPS": ATTN_WARPS,
    "RF_ATTN_PREFILL_ROWS": ATTN_PREFILL_ROWS,
    "RF_ATTN_MAX_GROUP": ATTN_MAX_GROUP,
    "RF_ATTN_MAX_D": ATTN_MAX_HEAD_DIM,
    "RF_ARGMAX_THREADS": ARGMAX_THREADS,
    "RF_SAMPLE_THREADS": SAMPLE_THREADS,
    "RF_SAMPLE_SLICE": SAMPLE_SLICE,
    "RF_SAMPLE_CANDIDATES": SAMPLE_CANDIDATES,
    "RF_SAMPLE_MAX_TOP": SAMPLE_MAX_TOP,
    "RF_SAMPLE_WEIGHT_SCALE": f"{float(WEIGHT_SCALE)!r}f",  # a float32: exact as a C float
    "RF_SAMPLE_PENALTY_WINDOW": SAMPLE_PENALTY_WINDOW,
}
"""What every kernel compile gets as -D defines (with RF_WARP_SIZE from the target)."""
