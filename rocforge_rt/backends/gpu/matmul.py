"""Quantized matmuls: weights repacked at load, the decode GEMV and MMV, the prompt GEMMs.

By activation rows:
- one row (batch-1 decode): kernels/gemv.hip, dp4a dot products; its blocks copy the
  row quantized by the kernel that wrote it (the attention's output: `Activation.q8`), else
  from GEMV_PREQUANT_MIN_K columns by rf_quantize_q8_gemv first, else quantize it themselves;
- 2 to MMV_MAX_ROWS rows (a decode batch, short chunks): rf_mmv (kernels/gemm.hip), the
  rows quantized once, then each weight block loaded once for all rows and multiplied on
  the int8 matrix units;
- more rows take one of two GEMMs:
  - the vendor GEMM (the default for matmuls of VENDOR_MIN_FLOP or more): the matrix, or a
    slab of its rows, expanded to fp16 and multiplied by cuBLAS / hipBLAS
    (vendor_blas.py) with fp32 accumulation (kernels/gemm_f16.hip holds the operand and
    SwiGLU kernels). Measured on an H100 it is 1.3-2x faster than the int8 GEMM on the
    1B and 8B shapes from 16 rows on; smaller matmuls are bound by the host's launches,
    of which it takes more (README.md, "Measured");
  - the int8 GEMM (kernels/gemm.hip): with `batch_invariant` every row count takes it.
The GEMV, the MMV and the int8 GEMM share one arithmetic (kernels/rf_q8.h), so a row's
outputs do not depend on the rows computed beside it. All RMS-normalize their rows with a
gain when given one and end in an epilogue (store, residual add, SwiGLU); the GEMV's and
MMV's epilogue can instead rotate q, k, v and append k, v to the KV pool (kernels/rf_rope.h).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from rocforge_rt.backends.gpu.kernel_constants import (
    DEQUANT_PART,
    EPILOGUE_RESIDUAL,
    EPILOGUE_STORE,
    EPILOGUE_SWIGLU,
    F16_THREADS,
    GEMM_THREADS,
    GEMM_TILE_M,
    GEMM_TILE_N,
    GEMV_CLUSTER_MAX_K,
    GEMV_CLUSTER_PIECES,
    GEMV_MAX_ROWS,
    GEMV_STAGES_PER_LANE,
    GEMV_THREADS,
    MMV_MAX_ROWS,
    Q4_0_BLOCK_BYTES,
    Q8_0_BLOCK_BYTES,
    Q8_NORM_THREADS,
    Q8_ROWS_BLOCKS,
    Q8_ROWS_THREADS,
    Q8_STAGE,
    QK,
)
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.vendor_blas import VendorGemm
from rocforge_rt.backends.gpu.workspace import Activation, Workspace
from rocforge_rt.errors import BackendError
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams

GEMV_SHARED_LIMIT = 48 * 1024  # portable without opt-in (AMD LDS is 64 KiB)
# Output rows one warp computes together, per (format, variant), for one activation row:
# the rf_gemv_<fmt>_b1_n<NO><variant> kernels; more activation rows take the
# rf_gemv_<fmt>_b8_n<NO><variant> ones, NO from GEMV_MULTI_ROW_NO. The variants: plain
# (store or add the residual), _swiglu, and _rope (the QKV projection: RoPE + KV-append).
GEMV_ROWS_PER_WARP = {
    ("q4_0", ""): (1, 2, 4),
    ("q4_0", "_swiglu"): (1, 2),
    ("q4_0", "_rope"): (2, 4),
    ("q8_0", ""): (1, 2),
    ("q8_0", "_swiglu"): (1,),
}
GEMV_MULTI_ROW_NO = {"": 1, "_swiglu": 1, "_rope": 2}
GEMV_MIN_BLOCKS_PER_SM = 1  # widest row groups that still give every multiprocessor a block
# Grid cap of the one-row GEMVs: warps stride over the rest (fewer prologues). Decode A/B
# against 4 (H200, two runs each; docs/bench/decode-20261128g/cap*.json): the 8B shape +1.9%
# and +1.6% (its gate|up GEMV 264 blocks instead of 528), the SmolLM2 shape +1.9% (its LM
# head), the 1B shape +0.1% and -0.3%, at depth 4096 +0.4%; 3 gave -0.3% on the 8B shape,
# 1 lost 27% (too few loads in flight). An H100 once measured 8 0.6-0.8% slower than 4.
GEMV_MAX_BLOCKS_PER_SM = 2
# A GEMV whose grid has fewer blocks than this many a multiprocessor lets its successor
# launch right after its own wait, not at its end (kernels/gemv.hip, release_early). Every
# one-row GEMV kernel fits two blocks a multiprocessor at once (registers), so such a grid
# runs in one wave: the successor's blocks, waiting, take only room it leaves. A grid at
# the cap (GEMV_MAX_BLOCKS_PER_SM: the gate|up and LM head GEMVs) fills the device and
# keeps its release at its end. Decode A/B (H200, three runs; from 1 to 2): SmolLM2
# +1.3% to +3.7%, 1B +0.5% to +1.4%, 8B +4.0% to +4.6% (README.md, "Single-stream decode").
GEMV_EARLY_RELEASE_BLOCKS_PER_SM = 2
# From this many columns a one-row GEMV's activation is quantized once, by
# rf_quantize_q8_gemv, and its blocks copy it (one launch more) instead of each
# quantizing it. Measured on an H100 (decode tok/s): 1B 1,404 with 2048, 1,301 with 4096
# (the down projection alone), 1,194 with none; 8B 438 with 2048, 340 with none.
# SmolLM2's 576 and 1536 columns stay below it (it is bound by its launches).
GEMV_PREQUANT_MIN_K = 2048
# Blocks of a thread block cluster that normalize and quantize a one-row gate|up GEMV's row
# together, in place of its rf_quantize_q8_gemv launch (kernels/gemv.hip, the _cl kernels;
# 1: none). Decode A/B against 1 (H200, one run each beside llama.cpp, README "Single-stream
# decode"): 1B shape +0.4%, at depth 4096 +4.4%, at 8192 +5.3%, 8B +1.1%. The Q|K|V GEMV
# doing the same lost (1B -1.8%, -1.6% at depth 4096, 8B -1.8%), as did clusters of 4 (8B -10%).
GEMV_CLUSTER_BLOCKS = 2
# A one-row gate|up GEMV whose blocks own 32-blocks of outputs quantizes them for the down
# projection (kernels/gemv.hip), saving its rf_quantize_q8_gemv launch, where no
# multiprocessor holds more than this many times the mean of 32-blocks (their blocks do
# not split further). Measured (decode, H200, A/B in one run each): 1B shape (256 32-blocks
# on 132 multiprocessors, 1.03x) +2.2% and +4.7%; 8B shape (448, 1.18x) -1.9%.
SWIGLU_Q8_IMBALANCE = 1.05
# One-row Q4_0 GEMVs of at least GEMV_BULK_MIN_N outputs without an epilogue of their own
# (the LM head) take the _bulk kernels where the device has bulk copies
# (Driver.supports_bulk_copy) and k is a multiple of GEMV_BULK_K_MULTIPLE (each row's chunk
# of scales then a multiple of 16 bytes): each warp's weight chunks come through a ring in
# shared memory (kernels/gemv.hip, rf_weight_ring), the first ones before the wait, as many
# slots as fit GEMV_BULK_SHARED bytes a block (or the device's limit), with the grid capped
# at GEMV_BULK_BLOCKS_PER_SM blocks a multiprocessor (as many as hold such a ring at once).
# Measured (H200, README "The LM head through bulk copies"): the 8B shape's LM head 83.9
# -> 74.3 us (3.52 -> 3.98 TB/s), decode +0.2% to +0.9% (three runs). The layer GEMVs were
# faster through rings in a chain of their own kind (Q|K|V 7.8 -> 7.1 us, O 5.4 -> 4.9,
# gate|up 22.4 -> 21.8; down 15.1 -> 15.6), but a ring kernel takes longer from launch to
# its last chunk (O 6.2 -> 7.0 us without overlap) and decode lost about 4% for each kind
# that took them (-11% all), so they keep registers; a Q8_0 LM head (the 1B shape's) lost
# alone, 70 -> 101 us.
GEMV_BULK_MIN_N = 32768
GEMV_BULK_K_MULTIPLE = 256
GEMV_BULK_SHARED = 100 << 10
GEMV_BULK_BLOCKS_PER_SM = 2

# rf_mmv_<fmt>_t<TW>_k<KS>_m<MS> kernels (kernels/gemm.hip): a block's KS * MS warps split
# k KS ways and its 8-row tiles MS ways, TW each; by the block's tiles (TW * MS), the
# shapes declared, fewest warps first. A launch takes the first that gives each
# multiprocessor MMV_WARPS_PER_SM warps, else the last. Measured on an H100 (Llama-1B
# shape, every shape forced on every matmul of a decode step): few blocks (Q|K|V, O,
# down) want 8 or more warps along k, many blocks (gate|up, the LM head) few. With these,
# each matmul at 8, 16, 32 and 64 rows gets the fastest shape of the sweep or one within
# 17% of it (Q|K|V at 64 rows, the LM head at 32): 64 rows 3.42 ms a step, 32 rows 2.24.
MMV_SHAPES = {
    1: ((1, 2, 1), (1, 8, 1)),
    2: ((2, 2, 1), (2, 8, 1), (1, 8, 2)),
    4: ((4, 1, 1), (4, 8, 1), (2, 8, 2)),
    8: ((8, 1, 1), (4, 8, 2)),
}
MMV_TILE = 16  # weight rows of a block: the mma's M (outputs: 16, or 8 gate|up pairs)
MMV_MIN_ROWS = 2  # fewer rows take the GEMV
MMV_WARPS_PER_SM = 7


def mmv_tiles(rows: int) -> int:
    """The 8-row tiles of the narrowest rf_mmv kernels that take `rows` rows."""
    return next(tiles for tiles in MMV_SHAPES if 8 * tiles >= rows)


# Multiply-adds x 2 from which a matmul takes the vendor GEMM when not batch invariant
# (below, the int8 GEMM's two launches cost the host less than the vendor path's three or
# four). Measured on an H100 (TTFT, all-vendor / this / int8 only): SmolLM2 128 tokens
# 7.0 / 4.6 / 4.6 ms, 512: 8.4 / 6.3 / 5.2 ms; Llama-1B shape 128: 3.3 / 3.2 / 8.0 ms,
# 512: 4.4 / 4.3 / 12.0 ms; 8B chunks are far above it.
VENDOR_MIN_FLOP = 1e9

_BLOCK_LAYOUT = {
    # type: (bytes per GGUF block, bytes of quants per block, format name)
    GGMLQuantizationType.Q4_0: (Q4_0_BLOCK_BYTES, QK // 2, "q4_0"),
    GGMLQuantizationType.Q8_0: (Q8_0_BLOCK_BYTES, QK, "q8_0"),
}


@dataclass(frozen=True)
class DeviceMatrix:
    """A quantized weight matrix on the device, quants and f16 scales stored apart."""

    fmt: str  # "q4_0" | "q8_0"
    n: int  # output rows
    k: int  # input columns
    qs: Any
    d: Any

    @property
    def row_quant_bytes(self) -> int:
        return self.k // QK * (QK // 2 if self.fmt == "q4_0" else QK)


def gemv_shared_bytes(k: int, rows: int, warp_size: int, sums: int) -> int:
    """Dynamic shared memory of a GEMV launch over `rows` activation rows of width k, for
    a kernel whose warps fold `sums` sums at a time (`gemv_sums`).

    Per row: block slots (k / 32 rounded up to whole sum stages) of int8 quants and a
    (f32 scale, i32 sum) each; then the per-warp sums of squares; then each warp's fold
    buffer: a chunk's stage sums, GEMV_STAGES_PER_LANE * warp_size + 1 floats per sum
    (kernels/gemv.hip).
    """
    padded_blocks = math.ceil(k // QK / Q8_STAGE) * Q8_STAGE
    warps = GEMV_THREADS // warp_size
    fold = warps * sums * (GEMV_STAGES_PER_LANE * warp_size + 1)
    return rows * padded_blocks * (QK + 8) + (GEMV_MAX_ROWS * warps + fold) * 4


def gemv_ring_slot_bytes(fmt: str, no: int, warp_size: int) -> int:
    """Shared memory one chunk slot a warp takes in a _bulk GEMV's weight rings (NO rows a
    warp): each row's blocks of a chunk, quants and f16 scales, and the slot's 8-byte
    barrier (kernels/gemv.hip, rf_weight_ring)."""
    quant_bytes = QK // 2 if fmt == "q4_0" else QK
    blocks = warp_size * GEMV_STAGES_PER_LANE * Q8_STAGE
    return GEMV_THREADS // warp_size * (no * blocks * (quant_bytes + 2) + 8)


def gemv_ring(
    fmt: str, no: int, k: int, n_out: int, grid: int, warp_size: int, shared: int, budget: int
) -> tuple[int, int]:
    """A _bulk GEMV's ring: chunk slots a warp, and the block's shared memory with them.
    Past `shared` (the fold buffers, rounded up to 16 bytes) go as many slots as fit
    `budget` bytes a block, at least one and no more than the chunks a warp takes (its row
    groups of n_out over `grid` blocks, each ceil(stages / (warp_size x stages a lane))
    chunks of k / QK blocks)."""
    shared = math.ceil(shared / 16) * 16
    slot = gemv_ring_slot_bytes(fmt, no, warp_size)
    stages = math.ceil(k // QK / Q8_STAGE)
    chunks = math.ceil(stages / (warp_size * GEMV_STAGES_PER_LANE))
    warps = GEMV_THREADS // warp_size
    taken = chunks * math.ceil(math.ceil(n_out / no) / (grid * warps))
    slots = max(1, min(taken, (budget - shared) // slot))
    return slots, shared + slots * slot


def gemv_sums(no: int, variant: str, row_cap: int) -> int:
    """Sums a GEMV warp folds at once: its weight rows (2 * NO with SwiGLU) x the
    kernel's activation rows (1 for the b1 kernels, GEMV_MAX_ROWS for the b8 ones)."""
    return (2 * no if variant == "_swiglu" else no) * row_cap


def kernel_variant(epilogue: int, rope_layer: int | None) -> str:
    """The GEMV / MMV kernel name's suffix: _swiglu, _rope (the QKV projection) or none."""
    if epilogue == EPILOGUE_SWIGLU:
        return "_swiglu"
    return "" if rope_layer is None else "_rope"


def repack_rows(tensors: Sequence[WeightTensor]) -> tuple[str, np.ndarray, np.ndarray]:
    """Row-stack GGUF Q4_0/Q8_0 tensors and split each block into quants and scale.

    Returns (format, quants uint8 [n, k * bits / 8], scales uint16 [n, k / 32]):
    the same bytes as the GGUF, scales moved apart so quants are 16-byte aligned.
    """
    types = {t.ggml_type for t in tensors}
    if len(types) != 1 or next(iter(types)) not in _BLOCK_LAYOUT:
        names = ", ".join(f"{t.name} ({t.ggml_type.name})" for t in tensors)
        raise BackendError(f"the GPU backend reads Q4_0 or Q8_0 matrices only; got {names}")
    block_bytes, quant_bytes, fmt = _BLOCK_LAYOUT[types.pop()]
    raw = np.concatenate([np.asarray(t.data, dtype=np.uint8) for t in tensors], axis=0)
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.uint16).reshape(raw.shape[0], -1)
    quants = np.ascontiguousarray(blocks[:, :, 2:]).reshape(raw.shape[0], -1)
    assert quants.shape[1] == blocks.shape[1] * quant_bytes
    return fmt, quants, scales


class Matmul:
    """out = W x over activation rows: the GEMV for one, the MMV for a few, else a GEMM."""

    def __init__(
        self,
        driver: Any,
        launcher: Launcher,
        workspace: Workspace,
        hparams: HParams,
        *,
        n_ctx: int,
        max_tokens: int,
        vendor_gemm: VendorGemm | None,
    ) -> None:
        self.driver = driver
        self.launcher = launcher
        self._launch = launcher.launch
        self.ws = workspace
        self.hparams = hparams
        self.n_ctx = n_ctx
        self.max_tokens = max_tokens
        self.vendor_gemm = vendor_gemm
        self.vendor_min_flop = VENDOR_MIN_FLOP
        self.mmv_min_rows = MMV_MIN_ROWS
        self.gemv_prequant_min_k = GEMV_PREQUANT_MIN_K  # A/B levers
        self.gemv_cluster_blocks = GEMV_CLUSTER_BLOCKS if driver.supports_clusters else 1
        self.quantize_swiglu = True
        self.swiglu_q8_imbalance = SWIGLU_Q8_IMBALANCE
        self.gemv_max_blocks_per_sm = GEMV_MAX_BLOCKS_PER_SM
        self.gemv_early_release_blocks_per_sm = GEMV_EARLY_RELEASE_BLOCKS_PER_SM
        self.gemv_bulk_shared = GEMV_BULK_SHARED if driver.supports_bulk_copy else 0
        self.gemv_bulk_min_n = GEMV_BULK_MIN_N
        self.mmv_warps_per_sm = MMV_WARPS_PER_SM
        self.use_prefill_gemm = True
        self.batch_invariant = vendor_gemm is None

    @property
    def batch_invariant(self) -> bool:
        """Whether every row count takes the GEMV's arithmetic (the int8 GEMM past the GEMV):
        a token's outputs then do not depend on the rows computed beside it."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, value: bool) -> None:
        if not value and self.vendor_gemm is None:
            raise BackendError("no vendor GEMM on this backend: it is batch invariant only")
        self._batch_invariant = value

    @property
    def use_prefill_gemm(self) -> bool:
        """Whether prompt chunks take the GEMM (False: every row count takes the GEMV, A/B)."""
        return self._use_prefill_gemm

    @use_prefill_gemm.setter
    def use_prefill_gemm(self, value: bool) -> None:
        self._use_prefill_gemm = value
        # The fewest activation rows that take the GEMM (compared on the hot path).
        self.gemm_min_rows = MMV_MAX_ROWS + 1 if value else math.inf

    def __call__(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int,
        *,
        gain: Any = None,
        epilogue: int = EPILOGUE_STORE,
        residual_ptr: int = 0,
        rope_layer: int | None = None,
    ) -> int:
        """out = W x: the GEMV for one row, the MMV for up to MMV_MAX_ROWS, else a GEMM.

        `rope_layer` (fewer than `gemm_min_rows` rows): the outputs are that layer's
        Q|K|V rows, rotated into the workspace's `q` and the KV pool (see `gemv`).
        Returns where the outputs' q8 form was written as well (`Activation.q8`), else 0.
        """
        if x.rows >= self.gemm_min_rows:
            if rope_layer is not None:
                raise BackendError("the prompt GEMMs do not rotate: run the rope kernel after")
            vendor = not self._batch_invariant and (
                2 * x.rows * matrix.n * matrix.k >= self.vendor_min_flop
            )
            gemm = self.vendor if vendor else self.gemm
            gemm(matrix, x, n_out, out_ptr, gain, epilogue, residual_ptr)
            return 0
        if x.rows >= self.mmv_min_rows:
            self.mmv(matrix, x, n_out, out_ptr, gain=gain, epilogue=epilogue,
                     residual_ptr=residual_ptr, rope_layer=rope_layer)  # fmt: skip
            return 0
        return self.gemv(matrix, x, n_out, out_ptr, gain=gain, epilogue=epilogue,
                         residual_ptr=residual_ptr, rope_layer=rope_layer)  # fmt: skip

    def gemv(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int = 0,
        *,
        gain: Any = None,
        epilogue: int = EPILOGUE_STORE,
        residual_ptr: int = 0,
        rope_layer: int | None = None,
    ) -> int:
        """out = W x for every activation row, GEMV_MAX_ROWS (or fewer, to fit) per launch.

        One activation row (decode) takes the widest row group per warp that still gives
        each multiprocessor a block, and at most GEMV_MAX_BLOCKS_PER_SM blocks per
        multiprocessor (the warps stride over the rest); its blocks copy the row's `q8`
        form when its writer made one, else from `gemv_prequant_min_k` columns
        rf_quantize_q8_gemv quantizes it once into the workspace's `gemv_xq` first.
        Several rows take the b8 kernels, whose blocks quantize them. A grid of fewer
        than `gemv_early_release_blocks_per_sm` blocks a multiprocessor lets the next
        kernel launch once its own wait is over.
        With `rope_layer`, the outputs are the Q|K|V rows of that layer: the kernel rotates
        q into the workspace's `q` and k, v into the layer's KV pool instead of storing to
        `out_ptr`. One row's SwiGLU outputs are also quantized by the kernel into the
        workspace's `ffn_xq` where `swiglu_blocks_spread` (with `quantize_swiglu`): its
        blocks then own whole 32-blocks of outputs. A one-row Q4_0 GEMV of `gemv_bulk_min_n`
        or more outputs and no epilogue (the LM head) takes the _bulk kernel where
        `gemv_bulk_shared` > 0 (GEMV_BULK_MIN_N). Returns where the q8 row went, else 0.
        """
        k = matrix.k
        info = self.driver.info
        warps = GEMV_THREADS // info.warp_size
        variant = kernel_variant(epilogue, rope_layer)
        multi_no = GEMV_MULTI_ROW_NO[variant]
        multi_sums = gemv_sums(multi_no, variant, GEMV_MAX_ROWS)
        fixed = gemv_shared_bytes(k, 0, info.warp_size, multi_sums)
        per_row = gemv_shared_bytes(k, 1, info.warp_size, multi_sums) - fixed
        max_rows = max(1, min(GEMV_MAX_ROWS, (GEMV_SHARED_LIMIT - fixed) // per_row))
        gain_ptr = gain.ptr if gain is not None else 0
        q8_out = 0
        for first in range(0, x.rows, max_rows):
            rows = min(max_rows, x.rows - first)
            if rows == 1:
                choices = GEMV_ROWS_PER_WARP[(matrix.fmt, variant)]
                min_blocks = GEMV_MIN_BLOCKS_PER_SM * info.multiprocessors
                wide = [no for no in choices if math.ceil(n_out / no / warps) >= min_blocks]
                no = max(wide, default=choices[0])
                kernel = f"rf_gemv_{matrix.fmt}_b1_n{no}{variant}"
                sums = gemv_sums(no, variant, 1)
            else:
                no, sums = multi_no, multi_sums
                kernel = f"rf_gemv_{matrix.fmt}_b{GEMV_MAX_ROWS}_n{no}{variant}"
            kernel += self._pool_suffix(rope_layer)
            blocks = math.ceil(math.ceil(n_out / no) / warps)
            quantize_out = variant == "_swiglu" and self.quantize_swiglu
            if rows == 1 and quantize_out and self.swiglu_blocks_spread(n_out):
                q8_out = self.ws.ffn_xq.ptr
                kernel += "_q8"
                blocks = n_out // QK  # a block per 32-block of outputs
            bulk = (
                rows == 1
                and variant == ""
                and matrix.fmt == "q4_0"
                and n_out >= self.gemv_bulk_min_n
                and self.gemv_bulk_shared > 0
                and k % GEMV_BULK_K_MULTIPLE == 0
            )
            per_sm = GEMV_BULK_BLOCKS_PER_SM if bulk else self.gemv_max_blocks_per_sm
            grid = (max(1, min(blocks, per_sm * info.multiprocessors)), 1, 1)
            shared = gemv_shared_bytes(k, rows, info.warp_size, sums)
            ring: tuple[int, ...] = ()
            if bulk:
                kernel += "_bulk"
                budget = min(self.gemv_bulk_shared, info.max_shared_per_block)
                slots, shared = gemv_ring(
                    matrix.fmt, no, k, n_out, grid[0], info.warp_size, shared, budget
                )
                ring = (slots,)
            release_early = int(
                grid[0] < self.gemv_early_release_blocks_per_sm * info.multiprocessors
            )
            x_ptr = x.ptr + first * k * 4
            xq_ptr = x.q8 if rows == 1 and gain is None else 0  # quantized by its writer
            cluster = 1
            if rows == 1 and not xq_ptr and k >= self.gemv_prequant_min_k:
                if gain is not None:
                    cluster = self.quantize_cluster(matrix.fmt, variant, k, grid[0])
                if cluster > 1:
                    kernel += "_cl"  # its cluster's blocks quantize the row together
                else:
                    xq_ptr = self.ws.gemv_xq.ptr
                    self._launch(
                        ("rf_quantize_q8_gemv", x_ptr, k, gain_ptr),
                        "rf_quantize_q8_gemv",
                        (math.ceil(k // 4 / GEMV_THREADS), 1, 1),
                        (GEMV_THREADS, 1, 1),
                        (x_ptr, k, gain_ptr, self.hparams.rms_eps, xq_ptr),
                    )
            head = (matrix.qs.ptr, matrix.d.ptr, n_out, k, x_ptr, rows, xq_ptr, gain_ptr,
                    self.hparams.rms_eps, release_early)  # fmt: skip
            tail = self._store_args(first, n_out, out_ptr, epilogue, residual_ptr, rope_layer)
            if q8_out:
                tail += (q8_out,)
            self._launch(
                ("gemv", matrix.qs.ptr, epilogue, rope_layer, first, rows, x.ptr),
                kernel,
                grid,
                (GEMV_THREADS, 1, 1),
                head + tail + ring,
                shared,
                cluster,
            )
        return q8_out

    def quantize_cluster(self, fmt: str, variant: str, k: int, grid: int) -> int:
        """Blocks of the thread block cluster whose one-row gate|up GEMV blocks normalize
        and quantize their row of `k` columns together (the Q4_0 `_swiglu[_q8]_cl` kernels,
        through each other's shared memory), in place of an rf_quantize_q8_gemv launch:
        `gemv_cluster_blocks` where that applies, else 1 (no clusters on the device; another
        format or epilogue; a row not whole 1024-column pieces a block, up to
        GEMV_CLUSTER_PIECES of them, or wider than GEMV_CLUSTER_MAX_K; a grid of partial
        clusters)."""
        blocks = self.gemv_cluster_blocks
        pieces, part = divmod(k, 4 * GEMV_THREADS * blocks)
        if (
            blocks < 2
            or fmt != "q4_0"
            or variant != "_swiglu"
            or part
            or not 1 <= pieces <= GEMV_CLUSTER_PIECES
            or k > GEMV_CLUSTER_MAX_K
            or grid % blocks
        ):
            return 1
        return blocks

    def _pool_suffix(self, rope_layer: int | None) -> str:
        """The GEMV / MMV kernel name's last suffix: a Q|K|V kernel (`rope_layer`) writes
        the KV pool, so it is named for the pool's format (`kv_kernel_suffix`)."""
        return "" if rope_layer is None else self.ws.kv_kernel_suffix

    def swiglu_blocks_spread(self, n_out: int) -> bool:
        """Whether a one-row gate|up GEMV of `n_out` outputs quantizes them for the down
        projection, its blocks owning whole 32-blocks: where the down projection would
        otherwise quantize them once first (`gemv_prequant_min_k`), and the busiest
        multiprocessor gets at most `swiglu_q8_imbalance` (SWIGLU_Q8_IMBALANCE) x the mean
        of 32-blocks (below one a multiprocessor, the mean leaves some idle)."""
        per_sm = n_out // QK / self.driver.info.multiprocessors
        return (
            n_out >= self.gemv_prequant_min_k
            and math.ceil(per_sm) <= self.swiglu_q8_imbalance * per_sm
        )

    def _store_args(
        self,
        first: int,
        n_out: int,
        out_ptr: int,
        epilogue: int,
        residual_ptr: int,
        rope_layer: int | None,
    ) -> tuple[int, ...]:
        """A GEMV's or MMV's epilogue arguments from activation row `first` on: (epilogue,
        residual, out), or with `rope_layer` where RoPE + KV-append writes."""
        if rope_layer is not None:
            return self._rope_args(rope_layer, first)
        offset = first * n_out * 4
        return (epilogue, residual_ptr + offset if residual_ptr else 0, out_ptr + offset)

    def _rope_args(self, layer: int, first: int) -> tuple[int, ...]:
        """Where RoPE + KV-append (kernels/rf_rope.h) writes, from activation row `first` on."""
        hp, ws = self.hparams, self.ws
        return (
            ws.step_positions.ptr + first * 4,
            ws.step_slots.ptr + first * 4,
            ws.rope_cos.ptr,
            ws.rope_sin.ptr,
            ws.q.ptr + first * hp.q_dim * 4,
            ws.k_cache[layer].ptr,
            ws.v_cache[layer].ptr,
            hp.q_dim,
            hp.kv_dim_k,
            hp.head_dim_k,
            hp.rope_dims,
            self.n_ctx,
        )

    def _check_fits(self, rows: int, k: int) -> None:
        if rows > self.max_tokens or k > self.ws.gemm_max_k:
            raise BackendError(
                f"GEMM of {rows} rows x {k} columns exceeds the prefill buffers "
                f"({self.max_tokens} x {self.ws.gemm_max_k})"
            )

    def _quantize_rows(
        self, x_ptr: int, rows: int, k: int, gain: Any, kernel: str, xq_ptr: int, xd_ptr: int
    ) -> None:
        """Normalize (with a gain) and quantize rows to q8: rf_quantize_q8_rows (the GEMM's
        layout) or rf_quantize_q8_tiles (the MMV's) into xq_ptr / xd_ptr."""
        gain_ptr = gain.ptr if gain is not None else 0
        self._launch(
            (kernel, x_ptr, rows, k, gain_ptr),
            kernel,
            (rows, math.ceil(k // QK / Q8_ROWS_BLOCKS), 1),
            (Q8_ROWS_THREADS, 1, 1),
            (x_ptr, k, gain_ptr, self.hparams.rms_eps, xq_ptr, xd_ptr),
        )

    def mmv(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int = 0,
        *,
        gain: Any = None,
        epilogue: int = EPILOGUE_STORE,
        residual_ptr: int = 0,
        rope_layer: int | None = None,
    ) -> None:
        """out = W x for a few activation rows (rf_mmv, kernels/gemm.hip), the GEMV's
        arithmetic: MMV_MAX_ROWS rows per launch, each quantized once into the workspace's
        `mmv_xq`/`mmv_xq_d` first (the tiles layout); the shape from `mmv_shape`.
        `rope_layer` as in `gemv`."""
        k = matrix.k
        self._check_fits(min(x.rows, MMV_MAX_ROWS), k)
        variant = kernel_variant(epilogue, rope_layer)
        outputs_per_block = MMV_TILE // 2 if epilogue == EPILOGUE_SWIGLU else MMV_TILE
        blocks = math.ceil(n_out / outputs_per_block)
        ws = self.ws
        for first in range(0, x.rows, MMV_MAX_ROWS):
            rows = min(MMV_MAX_ROWS, x.rows - first)
            self._quantize_rows(x.ptr + first * k * 4, rows, k, gain, "rf_quantize_q8_tiles",
                                ws.mmv_xq.ptr, ws.mmv_xq_d.ptr)  # fmt: skip
            tw, ks, ms = self.mmv_shape(mmv_tiles(rows), blocks)
            head = (matrix.qs.ptr, matrix.d.ptr, n_out, k, ws.mmv_xq.ptr, ws.mmv_xq_d.ptr, rows)
            tail = self._store_args(first, n_out, out_ptr, epilogue, residual_ptr, rope_layer)
            self._launch(
                ("mmv", matrix.qs.ptr, epilogue, rope_layer, first, rows, x.ptr),
                f"rf_mmv_{matrix.fmt}_t{tw}_k{ks}_m{ms}{variant}{self._pool_suffix(rope_layer)}",
                (blocks, 1, 1),
                (32 * ks * ms, 1, 1),
                head + tail,
            )

    def mmv_shape(self, tiles: int, blocks: int) -> tuple[int, int, int]:
        """(TW, KS, MS) of an rf_mmv launch of `blocks` blocks of `tiles` 8-row tiles: the
        fewest warps declared that give each multiprocessor `mmv_warps_per_sm`, else the most."""
        target = self.mmv_warps_per_sm * self.driver.info.multiprocessors
        shapes = MMV_SHAPES[tiles]
        return next((s for s in shapes if blocks * s[1] * s[2] >= target), shapes[-1])

    def gemm(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int,
        gain: Any,
        epilogue: int,
        residual_ptr: int,
    ) -> None:
        """out = W x for many activation rows (kernels/gemm.hip), the GEMV's arithmetic.

        The rows are normalized (with a gain) and quantized to q8 once, into the
        workspace's `xq`/`xq_d`; then one int8 GEMM reads every weight once per
        GEMM_TILE_M rows and applies the epilogue.
        """
        k = matrix.k
        ws = self.ws
        self._check_fits(x.rows, k)
        self._quantize_rows(x.ptr, x.rows, k, gain, "rf_quantize_q8_rows", ws.xq.ptr, ws.xq_d.ptr)
        tile_n = GEMM_TILE_N // 2 if epilogue == EPILOGUE_SWIGLU else GEMM_TILE_N
        self._launch(
            ("gemm", matrix.qs.ptr, epilogue, x.rows, out_ptr),
            f"rf_gemm_{matrix.fmt}",
            (math.ceil(x.rows / GEMM_TILE_M), math.ceil(n_out / tile_n), 1),
            (GEMM_THREADS, 1, 1),
            (
                matrix.qs.ptr,
                matrix.d.ptr,
                n_out,
                k,
                ws.xq.ptr,
                ws.xq_d.ptr,
                x.rows,
                epilogue,
                residual_ptr,
                out_ptr,
            ),
        )

    def vendor(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int,
        gain: Any,
        epilogue: int,
        residual_ptr: int,
    ) -> None:
        """out = W x through the vendor GEMM in fp16 (kernels/gemm_f16.hip, vendor_blas.py).

        The rows are normalized (with a gain) into fp16 once; then W is expanded to fp16
        a slab of rows at a time (the whole matrix when it fits the workspace's `w16`)
        and each slab multiplied into its band of output columns. The residual
        epilogue accumulates into out, which must be the residual; SwiGLU keeps gate|up
        in fp16 and combines them in one more kernel.
        """
        k, ws, rows = matrix.k, self.ws, x.rows
        self._check_fits(rows, k)
        if epilogue == EPILOGUE_RESIDUAL and residual_ptr != out_ptr:
            raise BackendError("the vendor GEMM adds the residual in place: out must be it")
        gain_ptr = gain.ptr if gain is not None else 0
        self._launch(
            ("rows_f16", x.ptr, rows, k, gain_ptr),
            "rf_rows_f16",
            (rows, 1, 1),
            (Q8_NORM_THREADS, 1, 1),
            (x.ptr, k, gain_ptr, self.hparams.rms_eps, ws.x16.ptr),
        )
        swiglu = epilogue == EPILOGUE_SWIGLU
        target, pitch, elem = (ws.gate_up16.ptr, matrix.n, 2) if swiglu else (out_ptr, n_out, 4)
        slab = ws.w16.nbytes // (2 * k)
        for first in range(0, matrix.n, slab):
            n = min(slab, matrix.n - first)
            self._launch(
                ("dequant_f16", matrix.qs.ptr, first),
                f"rf_dequant_f16_{matrix.fmt}",
                (math.ceil(n * k // DEQUANT_PART / F16_THREADS), 1, 1),
                (F16_THREADS, 1, 1),
                (
                    matrix.qs.ptr + first * matrix.row_quant_bytes,
                    matrix.d.ptr + first * (k // QK) * 2,
                    n,
                    k,
                    ws.w16.ptr,
                ),
            )
            self.launcher.call_library(
                f"{self.vendor_gemm.library}_gemm",
                lambda n=n, first=first: self.vendor_gemm.gemm(
                    n=n,
                    rows=rows,
                    k=k,
                    w_ptr=ws.w16.ptr,
                    x_ptr=ws.x16.ptr,
                    out_ptr=target + first * elem,
                    out_pitch=pitch,
                    accumulate=epilogue == EPILOGUE_RESIDUAL,
                    out_f16=swiglu,
                ),
            )
        if swiglu:
            self._launch(
                ("swiglu_f16", rows, n_out, out_ptr),
                "rf_swiglu_f16",
                (math.ceil(rows * n_out / F16_THREADS), 1, 1),
                (F16_THREADS, 1, 1),
                (ws.gate_up16.ptr, rows, n_out, out_ptr),
            )
