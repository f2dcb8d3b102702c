"""Attention over the KV pool (kernels/attention.hip): decode and prompt-chunk kernels.

Both run one arithmetic on the fp16 matrix units (64-position key tiles folded in
order) and read each K/V row once for a KV head's group of query heads, so a token
gets the same bits from either. A step's rows are split into runs (rows of one slot
at consecutive positions): a run past GEMV_MAX_ROWS tokens (a prompt chunk) takes the
prefill kernel (FlashAttention-2 style, K/V tiles shared by its tokens), the rows
between such runs the decode kernel (a block per tile, or per two tiles in a launch that
would not run in one wave, folded by the last block to finish, or from
`AttentionTuning.fold_kernel_min_tiles` tiles on by rf_attention_fold launched after it; a
context of a tile or two, by head dim, in one block), in pieces of at most the
workspace's `attn_decode_rows`. Which launches a step takes is planned in
attention_plan.py. Both have one kernel per head dim and pool format (_fp8:
an fp8 pool, widened to fp16 as it is staged: the same arithmetic). Each launch reads
its rows through pointers advanced to its first row, so a ragged step (several
sequences' prompt chunks and decode rows) is one pass; a decode step is one launch. In a
one-row step the kernel that writes the output row (the decode kernel, or the fold
kernel) also quantizes it for the O projection's GEMV (kernels/rf_q8.h's layout, the bits
rf_quantize_q8_gemv would give), which copies it. Whether a step folds apart changes its
launches, so it is part of a decode graph's key (`folds_apart`).
"""

import math

import numpy as np

from rocforge_rt.backends.gpu.attention_plan import (
    ATTN_BLOCK,
    AttentionLaunch,
    AttentionPlan,
    AttentionShape,
    AttentionTuning,
    decode_wave,
    plan_attention,
)
from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.kernel_constants import ATTN_MAX_GROUP, ATTN_MAX_HEAD_DIM
from rocforge_rt.backends.gpu.kernel_variants import AttentionKernel
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.workspace import Activation, Workspace
from rocforge_rt.errors import BackendError
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.batch import StepBatch

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


class Attention:
    """Each token's query heads over its slot's cache, into the workspace's `attn`; its
    launches planned by attention_plan.py from an `AttentionTuning`, fixed at construction."""

    def __init__(
        self,
        driver: Driver,
        launcher: Launcher,
        workspace: Workspace,
        hparams: HParams,
        *,
        n_ctx: int,
        tuning: AttentionTuning,
    ) -> None:
        self.driver = driver
        self.launcher = launcher
        self._launch = launcher.launch
        self.ws = workspace
        self.hparams = hparams
        self.n_ctx = n_ctx
        self.tuning = tuning
        self.qscale = float(np.float32(LOG2_E / math.sqrt(hparams.head_dim_k)))
        self.shape = AttentionShape(
            hparams.head_dim_k,
            hparams.n_head,
            hparams.n_head_kv,
            workspace.kv_fp8,
            workspace.attn_tiles,
            workspace.attn_decode_rows,
        )
        # The plan of the step being issued (every layer's is the same), by its batch.
        self._planned: tuple[StepBatch | None, AttentionPlan | None] = (None, None)
        decode_kernel = AttentionKernel("decode", hparams.head_dim_k, workspace.kv_fp8).name
        decode = launcher.functions[decode_kernel]
        # The decode blocks the device runs at once (AttentionTuning.decode_wave).
        self.decode_wave = decode_wave(
            driver.info.multiprocessors,
            driver.blocks_per_multiprocessor(decode, ATTN_BLOCK[0]),
            tuning,
        )

    def retuned(self, tuning: AttentionTuning) -> "Attention":
        """This attention planned with another tuning: a new object over the same launcher
        and workspace (for A/B runs and tests; this one keeps its own)."""
        return Attention(self.driver, self.launcher, self.ws, self.hparams, n_ctx=self.n_ctx,
                         tuning=tuning)  # fmt: skip

    def __call__(self, q: Activation, layer: int, batch: StepBatch) -> Activation:
        """Each token over its slot's cache: runs of one slot's consecutive positions past
        GEMV_MAX_ROWS rows take the prefill kernel, the other rows the decode kernel; both
        give a token the same bits (kernels/attention.hip)."""
        plan = self._step_plan(batch)
        xq = self.ws.gemv_xq.ptr if plan.quantize_out else 0
        for index, launch in enumerate(plan.launches):
            pointers = self._row_pointers(q, launch.first)
            if launch.prefill:
                self._prefill(layer, index, launch, pointers)
            else:
                self._decode(layer, index, launch, pointers, xq, q.rows == 1, plan.fold_apart)
        hp = self.hparams
        return Activation(self.ws.attn, q.rows, hp.n_head * hp.head_dim_v, q8=xq)

    def folds_apart(self, batch: StepBatch) -> bool:
        """Whether the batch's decode launches leave their fold to rf_attention_fold (part of
        a decode graph's key: it changes the step's launches)."""
        return self._step_plan(batch).fold_apart

    def _step_plan(self, batch: StepBatch) -> AttentionPlan:
        """The batch's attention launches, planned once for all its layers."""
        planned, plan = self._planned
        if planned is not batch or plan is None:
            plan = plan_attention(batch.slots, batch.positions, self.shape, self.tuning)
            self._planned = (batch, plan)
        return plan

    def _row_pointers(self, q: Activation, first: int) -> tuple[int, int, int, int]:
        """q, positions, slots and the output, each advanced to row `first`."""
        hp, ws = self.hparams, self.ws
        out_row = hp.n_head * hp.head_dim_v * 4
        return (q.ptr + first * q.width * 4, ws.step_positions.ptr + first * 4,
                ws.step_slots.ptr + first * 4, ws.attn.ptr + first * out_row)  # fmt: skip

    def _prefill(
        self, layer: int, index: int, launch: AttentionLaunch, pointers: tuple[int, int, int, int]
    ) -> None:
        """A prompt chunk's rows (one slot, consecutive positions) on the prefill kernel;
        `pointers` as `_row_pointers` gives them."""
        hp, ws = self.hparams, self.ws
        q_ptr, positions, slots, out = pointers
        self._launch(
            ("attention-prefill", layer, index),
            launch.kernel,
            launch.grid,
            ATTN_BLOCK,
            (q_ptr, ws.k_cache[layer].ptr, ws.v_cache[layer].ptr, positions, slots, launch.rows,
             self.n_ctx, hp.n_head, hp.n_head_kv, self.qscale, out),
        )  # fmt: skip

    def _decode(
        self, layer: int, index: int, launch: AttentionLaunch,
        pointers: tuple[int, int, int, int], xq: int, ahead: bool, fold_apart: bool,
    ) -> None:  # fmt: skip
        """Rows of any slots and positions (at most `attn_decode_rows`) on the decode kernel;
        with `xq` (a one-row step), the output row is also quantized there. `ahead` (a
        one-row step: only the row's own cache entry is this step's) lets the kernel stage the
        rest of the cache before it waits for the Q|K|V projection. `fold_apart`: the kernel
        leaves its parts to rf_attention_fold, launched next (which then quantizes)."""
        hp, ws = self.hparams, self.ws
        q_ptr, positions, slots, out = pointers
        self._launch(
            ("attention", layer, index, fold_apart),
            launch.kernel,
            launch.grid,
            ATTN_BLOCK,
            (q_ptr, ws.k_cache[layer].ptr, ws.v_cache[layer].ptr, positions, slots, self.n_ctx,
             hp.n_head, hp.n_head_kv, self.qscale, ws.attn_tiles, ws.attn_partial.ptr,
             ws.attn_counters.ptr, out, xq, int(ahead), self.decode_wave, int(not fold_apart)),
        )  # fmt: skip
        if launch.fold is not None:
            fold_kernel, fold_grid = launch.fold
            self._launch(
                ("attention-fold", layer, index),
                fold_kernel,
                fold_grid,
                ATTN_BLOCK,
                (positions, hp.n_head, ws.attn_tiles, ws.attn_partial.ptr, out, xq),
            )
