"""The matmuls' tuning as data, and pure planners from a shape to its launches.

`MatmulTuning` holds every number that picks a matmul's kernels and launch shapes
(frozen: an A/B run builds one with `dataclasses.replace` and hands it to the backend
at construction). `plan_gemv` and `mmv_shape` turn a matmul's shape, the device's
capabilities (`DeviceCaps`) and a tuning into kernels (kernel_variants.py rows) and
launch geometry; matmul.py issues them. Each is pure and cached, so it is tested
without a GPU and costs the hot path a dictionary lookup.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rocforge_rt.backends.gpu.kernel_constants import (
    EPILOGUE_SWIGLU,
    GEMV_CLUSTER_MAX_K,
    GEMV_CLUSTER_PIECES,
    GEMV_MAX_ROWS,
    GEMV_STAGES_PER_LANE,
    GEMV_THREADS,
    Q8_STAGE,
    QK,
)
from rocforge_rt.backends.gpu.kernel_variants import (
    GEMV_KERNELS,
    GemvKernel,
    MmvShape,
    gemv_kernel,
    gemv_rows_per_warp,
    mmv_shapes,
)
from rocforge_rt.errors import BackendError

if TYPE_CHECKING:  # annotations only: the planners run without a driver
    from rocforge_rt.backends.gpu.driver import Driver

GEMV_SHARED_LIMIT = 48 * 1024  # portable without opt-in (AMD LDS is 64 KiB)
# A _bulk GEMV's k is a multiple of this: each row's chunk of scales then a multiple of
# 16 bytes, as bulk copies need.
GEMV_BULK_K_MULTIPLE = 256


@dataclass(frozen=True)
class MatmulTuning:
    """What picks the matmuls' kernels and launch shapes; each choice's measurements are
    in docs/performance.md."""

    # Prompt chunks (past MMV_MAX_ROWS rows) take a GEMM; False: every row count the GEMV
    # or the MMV (an A/B of the prompt path).
    use_prefill_gemm: bool = True
    # Multiply-adds x 2 from which a prompt chunk's matmul takes the vendor GEMM when not
    # batch invariant: below it, the int8 GEMM's two launches cost the host less than the
    # vendor path's three or four.
    vendor_min_flop: float = 1e9
    mmv_min_rows: int = 2  # fewer activation rows take the GEMV
    # MMV warps a multiprocessor: a launch takes the first shape of its tiles that gives
    # each this many (kernel_variants.py MMV_SHAPES), else the last.
    mmv_warps_per_sm: int = 7
    # Set: every MMV launch takes that shape of its tiles' (the last past them), whatever
    # its warps (a test or an A/B of each declared shape).
    mmv_shape_index: int | None = None
    # One-row GEMVs take the widest row group a warp that still gives every multiprocessor
    # this many blocks.
    gemv_min_blocks_per_sm: int = 1
    # Grid cap of the one-row GEMVs: warps stride over the rest (fewer prologues); more
    # or fewer lost decode speed.
    gemv_max_blocks_per_sm: int = 2
    # A GEMV grid of fewer blocks than this many a multiprocessor lets its successor launch
    # right after its own wait (kernels/gemv.hip, release_early): such a grid runs in one
    # wave, so the waiting blocks take only room it leaves.
    gemv_early_release_blocks_per_sm: int = 2
    # From this many columns a one-row GEMV's activation is quantized once (by
    # rf_quantize_q8_gemv, or its cluster) instead of by each block; SmolLM2's columns stay
    # below it, its decode being bound by launches.
    gemv_prequant_min_k: int = 2048
    # Blocks of a cluster that quantize a one-row gate|up GEMV's row together in place of
    # its rf_quantize_q8_gemv launch (1: none); the Q|K|V GEMV doing so lost, as did 4.
    gemv_cluster_blocks: int = 2
    # A one-row gate|up GEMV quantizes its outputs for the down projection where its blocks
    # own whole 32-blocks (`quantize_swiglu`) and no multiprocessor holds more than this
    # many times their mean (the 8B shape's 1.18 lost, the 1B's 1.03 won).
    quantize_swiglu: bool = True
    swiglu_q8_imbalance: float = 1.05
    # One-row Q4_0 GEMVs of at least `gemv_bulk_min_n` outputs and no epilogue (the LM head)
    # take their weights through rings in shared memory (the _bulk kernels) of up to
    # `gemv_bulk_shared` bytes a block (0: never), grids capped at
    # `gemv_bulk_blocks_per_sm` (as many as hold such a ring at once). The layer GEMVs lost
    # through rings (a longer launch-to-last-chunk), as did a Q8_0 LM head.
    gemv_bulk_min_n: int = 32768
    gemv_bulk_shared: int = 100 << 10
    gemv_bulk_blocks_per_sm: int = 2


DEFAULT_MATMUL_TUNING = MatmulTuning()  # the measured best (docs/performance.md)


@dataclass(frozen=True)
class DeviceCaps:
    """What the matmul planners read of a device."""

    warp_size: int
    multiprocessors: int
    max_shared_per_block: int
    clusters: bool  # thread block clusters (the _cl GEMVs)
    bulk_copy: bool  # bulk copies into shared memory (the _bulk GEMVs)

    @classmethod
    def of(cls, driver: Driver) -> DeviceCaps:
        info = driver.info
        return cls(info.warp_size, info.multiprocessors, info.max_shared_per_block,
                   driver.supports_clusters, driver.supports_bulk_copy)  # fmt: skip


def epilogue_variant(epilogue: int, rope_layer: int | None) -> str:
    """The GEMV / MMV kernels' epilogue: "swiglu", "rope" (the QKV projection) or ""."""
    if epilogue == EPILOGUE_SWIGLU:
        return "swiglu"
    return "" if rope_layer is None else "rope"


def gemv_shared_bytes(k: int, rows: int, warp_size: int, sums: int) -> int:
    """Dynamic shared memory of a GEMV launch over `rows` activation rows of width k, for
    a kernel whose warps fold `sums` sums at a time (`GemvKernel.sums`).

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


def swiglu_blocks_spread(n_out: int, caps: DeviceCaps, tuning: MatmulTuning) -> bool:
    """Whether a one-row gate|up GEMV of `n_out` outputs quantizes them for the down
    projection, its blocks owning whole 32-blocks: where the down projection would
    otherwise quantize them once first (`gemv_prequant_min_k`), and the busiest
    multiprocessor gets at most `swiglu_q8_imbalance` x the mean of 32-blocks (below one a
    multiprocessor, the mean leaves some idle)."""
    per_sm = n_out // QK / caps.multiprocessors
    return (
        n_out >= tuning.gemv_prequant_min_k
        and math.ceil(per_sm) <= tuning.swiglu_q8_imbalance * per_sm
    )


def quantize_cluster(
    fmt: str, epilogue: str, k: int, grid: int, caps: DeviceCaps, tuning: MatmulTuning
) -> int:
    """Blocks of the thread block cluster whose one-row gate|up GEMV blocks normalize
    and quantize their row of `k` columns together (the Q4_0 `_swiglu[_q8]_cl` kernels,
    through each other's shared memory), in place of an rf_quantize_q8_gemv launch:
    `gemv_cluster_blocks` where that applies, else 1 (no clusters on the device; another
    format or epilogue; a row not whole 1024-column pieces a block, up to
    GEMV_CLUSTER_PIECES of them, or wider than GEMV_CLUSTER_MAX_K; a grid of partial
    clusters)."""
    blocks = tuning.gemv_cluster_blocks if caps.clusters else 1
    pieces, part = divmod(k, 4 * GEMV_THREADS * blocks)
    if (
        blocks < 2
        or fmt != "q4_0"
        or epilogue != "swiglu"
        or part
        or not 1 <= pieces <= GEMV_CLUSTER_PIECES
        or k > GEMV_CLUSTER_MAX_K
        or grid % blocks
    ):
        return 1
    return blocks


@dataclass(frozen=True)
class GemvShape:
    """A GEMV: `n_out` outputs of a `fmt` matrix of k columns over `rows` activation rows;
    `epilogue` as `epilogue_variant` (`kv_fp8`: a Q|K|V GEMV's pool is fp8); `gain`: the
    kernel normalizes its rows; `row_q8`: the row's writer also quantized it."""

    fmt: str
    n_out: int
    k: int
    rows: int = 1
    epilogue: str = ""
    gain: bool = False
    row_q8: bool = False
    kv_fp8: bool = False


@dataclass(frozen=True)
class GemvLaunch:
    """One GEMV launch of a plan: activation rows [first, first + rows) on `kernel`."""

    first: int
    rows: int
    kernel: GemvKernel
    grid: int
    shared_bytes: int
    cluster: int  # blocks a thread block cluster (1: none)
    release_early: bool  # its successor may launch once its own wait is over
    ring_slots: int  # chunk slots a warp of a _bulk kernel's rings (0: not _bulk)
    copies_writer_q8: bool  # its blocks copy the row's q8 form from its writer
    prequantize: bool  # rf_quantize_q8_gemv quantizes its row first
    k: int  # the row's columns

    block = GEMV_THREADS

    @property
    def prequantize_grid(self) -> int:
        """Blocks of the rf_quantize_q8_gemv launch before it (four columns a thread)."""
        return math.ceil(self.k // 4 / GEMV_THREADS)


@functools.lru_cache(maxsize=4096)
def plan_gemv(shape: GemvShape, caps: DeviceCaps, tuning: MatmulTuning) -> tuple[GemvLaunch, ...]:
    """The launches of a GEMV: GEMV_MAX_ROWS (or fewer, to fit GEMV_SHARED_LIMIT) activation
    rows each.

    One row takes the widest row group a warp that still gives each multiprocessor
    `gemv_min_blocks_per_sm` blocks, at most `gemv_max_blocks_per_sm` blocks a
    multiprocessor (the warps stride over the rest); its blocks copy the row's q8 form
    when its writer made one, else from `gemv_prequant_min_k` columns it is quantized once
    first (`quantize_cluster`'s cluster, else an rf_quantize_q8_gemv launch). One row's
    SwiGLU outputs are also quantized for the down projection where
    `swiglu_blocks_spread` (with `quantize_swiglu`); a one-row plain Q4_0 GEMV of
    `gemv_bulk_min_n` or more outputs takes the _bulk kernel where the device has bulk
    copies. Several rows take the b8 kernels, whose blocks quantize them.
    """
    fmt, k, n_out, epilogue = shape.fmt, shape.k, shape.n_out, shape.epilogue
    warp_size, multiprocessors = caps.warp_size, caps.multiprocessors
    max_rows = 1
    if shape.rows > 1:
        multi = next(
            (g for g in GEMV_KERNELS if (g.fmt, g.rows, g.epilogue, g.kv_fp8)
             == (fmt, GEMV_MAX_ROWS, epilogue, shape.kv_fp8)), None
        )  # fmt: skip
        if multi is None:
            raise BackendError(f"no {GEMV_MAX_ROWS}-row GEMV kernel for {fmt} {epilogue!r}")
        fixed = gemv_shared_bytes(k, 0, warp_size, multi.sums)
        per_row = gemv_shared_bytes(k, 1, warp_size, multi.sums) - fixed
        max_rows = max(1, min(GEMV_MAX_ROWS, (GEMV_SHARED_LIMIT - fixed) // per_row))
    bulk_shared = tuning.gemv_bulk_shared if caps.bulk_copy else 0
    launches = []
    for first in range(0, shape.rows, max_rows):
        rows = min(max_rows, shape.rows - first)
        one = rows == 1
        if one:
            choices = gemv_rows_per_warp(fmt, epilogue, 1)
            warps = GEMV_THREADS // warp_size
            min_blocks = tuning.gemv_min_blocks_per_sm * multiprocessors
            wide = [no for no in choices if math.ceil(n_out / no / warps) >= min_blocks]
            no = max(wide, default=choices[0])
        else:
            no = multi.no
        q8_out = (
            one
            and epilogue == "swiglu"
            and tuning.quantize_swiglu
            and swiglu_blocks_spread(n_out, caps, tuning)
        )
        bulk = (
            one
            and epilogue == ""
            and fmt == "q4_0"
            and n_out >= tuning.gemv_bulk_min_n
            and bulk_shared > 0
            and k % GEMV_BULK_K_MULTIPLE == 0
        )
        row_cap = 1 if one else GEMV_MAX_ROWS
        plain = GemvKernel(fmt, row_cap, no, epilogue, q8_out=q8_out, kv_fp8=shape.kv_fp8)
        per_sm = tuning.gemv_bulk_blocks_per_sm if bulk else tuning.gemv_max_blocks_per_sm
        grid = max(1, min(plain.blocks(n_out, warp_size), per_sm * multiprocessors))
        shared = gemv_shared_bytes(k, rows, warp_size, plain.sums)
        ring_slots = 0
        if bulk:
            budget = min(bulk_shared, caps.max_shared_per_block)
            ring_slots, shared = gemv_ring(fmt, no, k, n_out, grid, warp_size, shared, budget)
        copies_writer_q8 = one and not shape.gain and shape.row_q8
        cluster, prequantize = 1, False
        if one and not copies_writer_q8 and k >= tuning.gemv_prequant_min_k:
            if shape.gain:
                cluster = quantize_cluster(fmt, epilogue, k, grid, caps, tuning)
            prequantize = cluster == 1
        kernel = gemv_kernel(fmt, row_cap, no, epilogue, q8_out=q8_out, bulk=bulk,
                             cluster=cluster > 1, kv_fp8=shape.kv_fp8)  # fmt: skip
        release_early = grid < tuning.gemv_early_release_blocks_per_sm * multiprocessors
        launches.append(GemvLaunch(first, rows, kernel, grid, shared, cluster, release_early,
                                   ring_slots, copies_writer_q8, prequantize, k))  # fmt: skip
    return tuple(launches)


@functools.lru_cache(maxsize=1024)
def mmv_shape(tiles: int, blocks: int, caps: DeviceCaps, tuning: MatmulTuning) -> MmvShape:
    """The MMV shape of a launch of `blocks` blocks of `tiles` 8-row tiles: the fewest warps
    declared that give each multiprocessor `mmv_warps_per_sm`, else the most (or the one
    `mmv_shape_index` names)."""
    shapes = mmv_shapes(tiles)
    if tuning.mmv_shape_index is not None:
        return shapes[min(tuning.mmv_shape_index, len(shapes) - 1)]
    target = tuning.mmv_warps_per_sm * caps.multiprocessors
    return next((s for s in shapes if blocks * s.warps >= target), shapes[-1])
