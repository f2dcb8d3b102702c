"""The attention's tuning as data, and a pure planner from a step's rows to its launches.

`AttentionTuning` holds what picks the attention's launches (frozen: an A/B run builds one
with `dataclasses.replace` and hands it to the backend at construction, as it does a
`MatmulTuning`). `plan_attention` turns a step's slots and positions, the model's
`AttentionShape` and a tuning into launches (kernel_variants.py's kernels and their grids);
attention.py issues them. Pure, so tested without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rocforge_rt.backends.gpu.kernel_constants import (
    ATTN_PREFILL_ROWS,
    ATTN_TILE,
    ATTN_WARPS,
    GEMV_MAX_ROWS,
)
from rocforge_rt.backends.gpu.kernel_variants import AttentionKernel

ATTN_BLOCK = (ATTN_WARPS * 32, 1, 1)  # 32-lane groups, whatever the warp size


@dataclass(frozen=True)
class AttentionTuning:
    """What picks the attention's launches; each choice's measurements are in
    docs/performance.md."""

    # A decode step whose longest context has at least this many key tiles leaves the fold
    # of its parts to rf_attention_fold, a launch of its own, instead of the decode kernel's
    # last blocks (their fences and counters, and a folding block's serial loads): a launch
    # of its own wins from about 9 tiles on and loses below.
    fold_kernel_min_tiles: int = 9
    # A one-row step's output is also quantized by the kernel that writes it, in the layout
    # the O projection's GEMV copies.
    quantize_out: bool = True
    # The decode blocks the device runs at once: a token whose rows' blocks of one tile each
    # would outnumber them gets blocks of two tiles (where the stage holds them), half the
    # waves: faster where one-tile blocks would take two waves, slower where they fit one.
    # None: the device's (`decode_wave`); 0: one tile a block always.
    decode_wave: int | None = None


DEFAULT_ATTENTION_TUNING = AttentionTuning()  # the measured best (docs/performance.md)


def decode_wave(multiprocessors: int, decode_blocks_per_sm: int, tuning: AttentionTuning) -> int:
    """The decode kernel's wave: the tuning's, else the device's multiprocessors times the
    decode blocks each runs at once."""
    if tuning.decode_wave is not None:
        return tuning.decode_wave
    return multiprocessors * decode_blocks_per_sm


def folds_apart(longest_context: int, tuning: AttentionTuning) -> bool:
    """Whether a decode step whose longest context is this many positions leaves its fold to
    rf_attention_fold: it has at least `fold_kernel_min_tiles` key tiles."""
    return math.ceil(longest_context / ATTN_TILE) >= tuning.fold_kernel_min_tiles


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention over a KV pool: head dim, query and KV heads, whether the pool is
    fp8, key tiles of a slot's whole context (the decode grid's depth) and the most rows of
    one decode launch."""

    head_dim: int
    n_head: int
    n_head_kv: int
    kv_fp8: bool
    key_tiles: int
    decode_rows: int


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


class AttentionLaunch(NamedTuple):
    """A launch of a step's attention over rows [first, first + rows): the prefill kernel,
    or the decode kernel, followed where the step folds apart by rf_attention_fold (`fold`:
    its kernel and grid). Every launch's block is ATTN_BLOCK."""

    prefill: bool
    first: int
    rows: int
    kernel: str
    grid: tuple[int, int, int]
    fold: tuple[str, tuple[int, int, int]] | None = None


class AttentionPlan(NamedTuple):
    """A step's attention launches, in row order; whether its decode launches fold apart
    (part of a decode graph's key); whether the output row is also quantized (`quantize_out`
    in a one-row step)."""

    launches: tuple[AttentionLaunch, ...]
    fold_apart: bool
    quantize_out: bool


def plan_attention(
    slots: np.ndarray, positions: np.ndarray, shape: AttentionShape, tuning: AttentionTuning
) -> AttentionPlan:
    """A step's attention launches (`attention_ranges`): a prefill launch's blocks take
    ATTN_PREFILL_ROWS rows (token, head of the group) of a KV head each; a decode launch a
    block per KV head, row and key tile; a fold launch a block per query head and row."""
    longest = int(positions.max()) + 1 if len(positions) else 0
    fold_apart = folds_apart(longest, tuning)
    group = shape.n_head // shape.n_head_kv
    tokens = ATTN_PREFILL_ROWS // group  # tokens a prefill block takes
    prefill = AttentionKernel("prefill", shape.head_dim, shape.kv_fp8).name
    decode = AttentionKernel("decode", shape.head_dim, shape.kv_fp8).name
    fold = AttentionKernel("fold", shape.head_dim).name
    launches = tuple(
        AttentionLaunch(True, first, rows, prefill, (shape.n_head_kv, math.ceil(rows / tokens), 1))
        if is_prefill
        else AttentionLaunch(False, first, rows, decode, (shape.n_head_kv, rows, shape.key_tiles),
                             (fold, (shape.n_head, rows, 1)) if fold_apart else None)
        for is_prefill, first, rows in attention_ranges(slots, positions, shape.decode_rows)
    )  # fmt: skip
    return AttentionPlan(launches, fold_apart, tuning.quantize_out and len(slots) == 1)
