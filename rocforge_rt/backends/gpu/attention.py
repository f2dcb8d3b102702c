"""Attention over the fp16 KV pool (kernels/attention.hip): decode and prompt-chunk kernels.

Both run one arithmetic on the fp16 matrix units (64-position key tiles folded in
order) and read each K/V row once for a KV head's group of query heads, so a token
gets the same bits from either: a prompt chunk past GEMV_MAX_ROWS tokens takes the
prefill kernel (FlashAttention-2 style, K/V tiles shared by its tokens), anything else
the decode kernel (a block per tile, folded by the last block to finish).
"""

import math
from typing import Any

import numpy as np

from rocforge_rt.backends.gpu.kernel_constants import (
    ATTN_MAX_GROUP,
    ATTN_MAX_HEAD_DIM,
    ATTN_PREFILL_ROWS,
    ATTN_WARPS,
    GEMV_MAX_ROWS,
)
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
    """Each token's query heads over its slot's cache, into the workspace's `attn`."""

    def __init__(
        self, driver: Any, launcher: Launcher, workspace: Workspace, hparams: HParams, *, n_ctx: int
    ) -> None:
        self.driver = driver
        self._launch = launcher.launch
        self.ws = workspace
        self.hparams = hparams
        self.n_ctx = n_ctx

    def __call__(self, q: Activation, layer: int, batch: StepBatch) -> Activation:
        """Each token over its slot's cache: a prompt chunk past GEMV_MAX_ROWS takes the
        prefill kernel, anything else the decode kernel; both give a token the same bits
        (kernels/attention.hip)."""
        hp, ws = self.hparams, self.ws
        qscale = float(np.float32(LOG2_E / math.sqrt(hp.head_dim_k)))
        block = (ATTN_WARPS * 32, 1, 1)  # 32-lane groups, whatever the warp size
        if q.rows > GEMV_MAX_ROWS and batch.is_chunk:
            tokens = ATTN_PREFILL_ROWS // hp.gqa_group  # rows (token, head of the group)
            self._launch(
                ("attention-prefill", layer, q.rows),
                f"rf_attention_prefill_d{hp.head_dim_k}",
                (hp.n_head_kv, math.ceil(q.rows / tokens), 1),
                block,
                (q.ptr, ws.k_cache[layer].ptr, ws.v_cache[layer].ptr, ws.step_positions.ptr,
                 ws.step_slots.ptr, q.rows, self.n_ctx, hp.n_head, hp.n_head_kv, qscale,
                 ws.attn.ptr),
            )  # fmt: skip
            return Activation(ws.attn, q.rows, hp.n_head * hp.head_dim_v)
        if q.rows > ws.attn_decode_rows:
            raise BackendError(
                f"{q.rows} tokens of several sequences in one step; decode attention takes "
                f"{ws.attn_decode_rows}"
            )
        self._launch(
            ("attention", layer, q.rows),
            "rf_attention_decode",
            (hp.n_head_kv, q.rows, ws.attn_tiles),
            block,
            (
                q.ptr,
                ws.k_cache[layer].ptr,
                ws.v_cache[layer].ptr,
                ws.step_positions.ptr,
                ws.step_slots.ptr,
                self.n_ctx,
                hp.n_head,
                hp.n_head_kv,
                hp.head_dim_k,
                qscale,
                ws.attn_tiles,
                ws.attn_partial.ptr,
                ws.attn_counters.ptr,
                ws.attn.ptr,
            ),
        )
        return Activation(ws.attn, q.rows, hp.n_head * hp.head_dim_v)
