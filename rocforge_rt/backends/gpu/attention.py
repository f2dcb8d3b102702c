"""Attention over the KV pool (kernels/attention.hip): decode and prompt-chunk kernels.

Both run one arithmetic on the fp16 matrix units (64-position key tiles folded in
order) and read each K/V row once for a KV head's group of query heads, so a token
gets the same bits from either. A step's rows are split into runs (rows of one slot
at consecutive positions): a run past GEMV_MAX_ROWS tokens (a prompt chunk) takes the
prefill kernel (FlashAttention-2 style, K/V tiles shared by its tokens), the rows
between such runs the decode kernel (a block per tile, or per two tiles in a launch that
would not run in one wave, folded by the last block to finish, or past
FOLD_KERNEL_MIN_TILES tiles by rf_attention_fold launched after it; a context of a tile
or two, by head dim, in one block), in pieces of at most the
workspace's `attn_decode_rows`. Both have one kernel per head dim and pool format (_fp8:
an fp8 pool, widened to fp16 as it is staged: the same arithmetic). Each launch reads
its rows through pointers advanced to its first row, so a ragged step (several
sequences' prompt chunks and decode rows) is one pass; a decode step is one launch. In a
one-row step the kernel that writes the output row (the decode kernel, or the fold
kernel) also quantizes it for the O projection's GEMV (kernels/rf_q8.h's layout, the bits
rf_quantize_q8_gemv would give), which copies it. Whether a step folds apart changes its
launches, so it is part of a decode graph's key (`folds_apart`).
"""

import math
from typing import Any, NamedTuple

import numpy as np

from rocforge_rt.backends.gpu.kernel_constants import (
    ATTN_MAX_GROUP,
    ATTN_MAX_HEAD_DIM,
    ATTN_PREFILL_ROWS,
    ATTN_TILE,
    ATTN_WARPS,
    GEMV_MAX_ROWS,
)
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.workspace import Activation, Workspace
from rocforge_rt.errors import BackendError
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.batch import StepBatch

# A decode step whose longest context has at least this many key tiles leaves the fold of
# its parts to rf_attention_fold, a launch of its own, instead of the decode kernel's last
# blocks (their fences and counters, and a folding block's serial loads). Measured (1B
# shape, one row, H200; fold kernel always against never): 17-18 tiles -1.6% / -1.6%,
# 25-26 +0.5% / +0.8%, 32-34 +3.2% / +2.2%, 65-66 +5.0%, 129-130 +1.0% (docs/bench/
# decode-20261128d/); the 8B shape at 65-66 tiles +1.6%. Since the fold kernel reads the
# step state before its wait and quantizes from registers (docs/bench/decode-20261129c/
# foldmin-*.json): 5-6 tiles -1.3%, 9-10 +0.4%, 17-18 +1.9%.
FOLD_KERNEL_MIN_TILES = 9
HEAD_DIM_STEP = 32  # the kernels are instantiated for head dims 32, 64, 96 and 128
LOG2_E = 1.4426950408889634  # the kernels' scores are in the log2 domain


def check_attention_shapes(hp: HParams) -> None:
    """Raise BackendError unless the attention kernels can run a model of this shape."""
    problems = []
    if hp.head_dim_k != hp.head_dim_v:
        problems.append(f"key length {hp.head_dim_k} != value length {hp.head_dim_v}")
    if hp.head_dim_k % HEAD_DIM_STEP or hp.head_dim_k > ATTN_MAX_HEAD_DIM:
        problems.append(
            f"head dim {hp.head_dim_k} is not a multiple of {HEAD_DIM_STEP} up to "
            f"{ATTN_MAX_HEAD_DIM}"
        )
    if hp.gqa_group > ATTN_MAX_GROUP:
        problems.append(f"{hp.gqa_group} query heads per KV head (at most {ATTN_MAX_GROUP})")
    if problems:
        raise BackendError("the GPU attention kernel cannot run this model: " + "; ".join(problems))


class AttentionRange(NamedTuple):
    """Rows [first, first + rows) of a step, for one attention launch."""

    prefill: bool  # one slot's consecutive positions (the prefill kernel); else decode rows
    first: int
    rows: int


def attention_ranges(
    slots: np.ndarray, positions: np.ndarray, decode_rows: int
) -> list[AttentionRange]:
    """A step's rows as attention launches, in row order: every run (rows of one slot at
    consecutive positions) longer than GEMV_MAX_ROWS a prefill launch; the rows between
    those runs decode launches of at most `decode_rows` rows."""
    n = len(slots)
    breaks = np.flatnonzero((slots[1:] != slots[:-1]) | (positions[1:] != positions[:-1] + 1))
    starts = np.concatenate(([0], breaks + 1))
    lengths = np.diff(np.append(starts, n))
    long = lengths > GEMV_MAX_ROWS
    ranges: list[AttentionRange] = []
    done = 0  # rows placed so far
    for first, rows in zip(starts[long].tolist(), lengths[long].tolist(), strict=True):
        ranges += _decode_pieces(done, first, decode_rows)
        ranges.append(AttentionRange(True, first, rows))
        done = first + rows
    return ranges + _decode_pieces(done, n, decode_rows)


def _decode_pieces(first: int, end: int, decode_rows: int) -> list[AttentionRange]:
    """Rows [first, end) in decode launches of at most `decode_rows` rows."""
    return [
        AttentionRange(False, row, min(decode_rows, end - row))
        for row in range(first, end, decode_rows)
    ]


class Attention:
    """Each token's query heads over its slot's cache, into the workspace's `attn`."""

    def __init__(
        self, driver: Any, launcher: Launcher, workspace: Workspace, hparams: HParams, *, n_ctx: int
    ) -> None:
        self.driver = driver
        self._launch = launcher.launch
        self.ws = workspace
        self.hparams = hparams
        self.n_ctx = n_ctx
        self.qscale = float(np.float32(LOG2_E / math.sqrt(hparams.head_dim_k)))
        # The launches of the step being issued (every layer's are the same) and whether its
        # decode launches fold apart, by (batch, fold_kernel_min_tiles).
        self._ranges: tuple[tuple[StepBatch, int] | None, list[AttentionRange], bool] = (
            None, [], False
        )  # fmt: skip
        # Contexts (key tiles) from which a decode step folds in rf_attention_fold (A/B lever).
        self.fold_kernel_min_tiles = FOLD_KERNEL_MIN_TILES
        # A one-row step's output is also quantized by the decode kernel, in the layout the
        # O projection's GEMV copies (A/B lever).
        self.quantize_out = True
        # The decode blocks the device runs at once: a token whose rows' blocks of one tile
        # each would outnumber them gets blocks of two tiles (where the stage holds them),
        # half the waves. Measured (1B shape): one row on an H200, +3.8% at depth 8192
        # (1,032 one-tile blocks, two waves), while two tiles always lost 3.8% at 4096 (520,
        # one wave already); batches on an H100, the attention kernel 8-18% faster at depth
        # 512-4096 with 8-32 rows. 0: one tile a block always (A/B lever).
        suffix = f"d{hparams.head_dim_k}{workspace.kv_kernel_suffix}"
        self._decode_kernel = f"rf_attention_decode_{suffix}"
        self._prefill_kernel = f"rf_attention_prefill_{suffix}"
        decode = launcher.functions[self._decode_kernel]
        self.decode_wave = driver.info.multiprocessors * driver.blocks_per_multiprocessor(
            decode, ATTN_WARPS * 32
        )

    def __call__(self, q: Activation, layer: int, batch: StepBatch) -> Activation:
        """Each token over its slot's cache: runs of one slot's consecutive positions past
        GEMV_MAX_ROWS rows take the prefill kernel, the other rows the decode kernel; both
        give a token the same bits (kernels/attention.hip)."""
        ranges, fold_apart = self._step_ranges(batch)
        xq = self.ws.gemv_xq.ptr if self.quantize_out and q.rows == 1 else 0
        for index, launch in enumerate(ranges):
            if launch.prefill:
                self._prefill(q, layer, index, launch.first, launch.rows)
            else:
                self._decode(q, layer, index, launch, xq, q.rows == 1, fold_apart)
        hp = self.hparams
        return Activation(self.ws.attn, q.rows, hp.n_head * hp.head_dim_v, q8=xq)

    def folds_apart(self, batch: StepBatch) -> bool:
        """Whether the batch's decode launches leave their fold to rf_attention_fold: its
        longest context has at least `fold_kernel_min_tiles` key tiles."""
        longest = int(batch.positions.max()) + 1 if batch.n_tokens else 0
        return math.ceil(longest / ATTN_TILE) >= self.fold_kernel_min_tiles

    def _step_ranges(self, batch: StepBatch) -> tuple[list[AttentionRange], bool]:
        """The batch's attention launches and whether its decode launches fold apart,
        computed once for all its layers."""
        planned, ranges, fold_apart = self._ranges
        if planned is None or planned[0] is not batch or planned[1] != self.fold_kernel_min_tiles:
            ranges = attention_ranges(batch.slots, batch.positions, self.ws.attn_decode_rows)
            fold_apart = self.folds_apart(batch)
            self._ranges = ((batch, self.fold_kernel_min_tiles), ranges, fold_apart)
        return ranges, fold_apart

    def _row_pointers(self, q: Activation, first: int) -> tuple[int, int, int, int]:
        """q, positions, slots and the output, each advanced to row `first`."""
        hp, ws = self.hparams, self.ws
        out_row = hp.n_head * hp.head_dim_v * 4
        return (q.ptr + first * q.width * 4, ws.step_positions.ptr + first * 4,
                ws.step_slots.ptr + first * 4, ws.attn.ptr + first * out_row)  # fmt: skip

    def _prefill(self, q: Activation, layer: int, index: int, first: int, rows: int) -> None:
        """A prompt chunk's rows (one slot, consecutive positions) on the prefill kernel."""
        hp, ws = self.hparams, self.ws
        q_ptr, positions, slots, out = self._row_pointers(q, first)
        tokens = ATTN_PREFILL_ROWS // hp.gqa_group  # rows (token, head of the group)
        self._launch(
            ("attention-prefill", layer, index),
            self._prefill_kernel,
            (hp.n_head_kv, math.ceil(rows / tokens), 1),
            (ATTN_WARPS * 32, 1, 1),  # 32-lane groups, whatever the warp size
            (q_ptr, ws.k_cache[layer].ptr, ws.v_cache[layer].ptr, positions, slots, rows,
             self.n_ctx, hp.n_head, hp.n_head_kv, self.qscale, out),
        )  # fmt: skip

    def _decode(
        self, q: Activation, layer: int, index: int, launch: AttentionRange, xq: int,
        ahead: bool, fold_apart: bool,
    ) -> None:  # fmt: skip
        """Rows of any slots and positions (at most `attn_decode_rows`) on the decode kernel;
        with `xq` (a one-row step), the output row is also quantized there. `ahead` (a
        one-row step: only the row's own cache entry is this step's) lets the kernel stage the
        rest of the cache before it waits for the Q|K|V projection. `fold_apart`: the kernel
        leaves its parts to rf_attention_fold, launched next (which then quantizes)."""
        hp, ws = self.hparams, self.ws
        q_ptr, positions, slots, out = self._row_pointers(q, launch.first)
        self._launch(
            ("attention", layer, index, fold_apart),
            self._decode_kernel,
            (hp.n_head_kv, launch.rows, ws.attn_tiles),
            (ATTN_WARPS * 32, 1, 1),
            (q_ptr, ws.k_cache[layer].ptr, ws.v_cache[layer].ptr, positions, slots, self.n_ctx,
             hp.n_head, hp.n_head_kv, self.qscale, ws.attn_tiles, ws.attn_partial.ptr,
             ws.attn_counters.ptr, out, xq, int(ahead), self.decode_wave, int(not fold_apart)),
        )  # fmt: skip
        if fold_apart:
            self._launch(
                ("attention-fold", layer, index),
                f"rf_attention_fold_d{hp.head_dim_k}",
                (hp.n_head, launch.rows, 1),
                (ATTN_WARPS * 32, 1, 1),
                (positions, hp.n_head, ws.attn_tiles, ws.attn_partial.ptr, out, xq),
            )
