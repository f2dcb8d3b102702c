"""The CPU backend's attention, compiled (numba): one fixed order of operations per query row.

A row's output depends only on its query and on its slot's K/V positions [0, position]:
the same float32 operations in the same order whether the row is decoded alone, beside
other sessions' rows, or inside a prompt chunk (BLAS products over a chunk's rows round
differently from one row's, and over 30 layers the int8 roundings that follow turned
such last-bit differences into 0.7 on SmolLM2's logits).

Per (row, query head): score_j = (sum over d, in order, of q_d * k_jd) * scale; m = the
largest score; w_j = exp(score_j - m); l = sum of w_j in position order; out_e = (sum of
w_j * v_je in position order) / l. No fused multiply-adds (`fastmath=False`); the loops
that LLVM vectorizes (over positions for the scores, over dims for the values) keep each
sum's order.

The pool's elements are read as float32 by `widen`, compiled for the pool's element type:
fp16 bits (uint16) by `single`; fp8 E4M3 bytes (uint8) through their exact fp16 bits
(`kv_format.E4M3_HALF_BITS`, a constant of the compiled code), then `single`. One `attend`
serves both formats.
"""

import numpy as np
from numba import prange, types
from numba.extending import overload

from rocforge_rt.backends.cpu_kernels import compiled, single
from rocforge_rt.step.kv_format import E4M3_HALF_BITS


def widen(element):
    """A KV pool element as float32, exactly: fp16 bits (uint16), or an fp8 E4M3 byte
    (uint8)."""


@overload(widen, inline="always")
def _widen_of(element):
    """`widen` compiled for the element's type."""
    if element == types.uint16:
        return lambda element: single(element)
    if element == types.uint8:
        return lambda element: single(E4M3_HALF_BITS[element])
    return None


@compiled(parallel=True)
def attend(q, keys_t, values, positions, scale, out):  # pragma: no cover - compiled
    """out [rows, n_head, dv] for queries q [rows, n_head, dk] (float32) of one slot over its
    cache: keys_t [n_kv, dk, n_ctx] (positions innermost) and values [n_ctx, n_kv, dv], both
    the KV pool's elements (fp16 bits, uint16; or fp8 bytes, uint8), taken to float32 as
    they are read (`widen`: exact);
    row r attends to positions [0, positions[r]]; query head h reads KV head
    h // (n_head // n_kv)."""
    rows, n_head, dk = q.shape
    n_kv, dv = keys_t.shape[0], values.shape[2]
    group = n_head // n_kv
    for task in prange(rows * n_head):
        r, h = task // n_head, task % n_head
        kv = h // group
        length = positions[r] + 1
        scores = np.zeros(length, dtype=np.float32)
        for d in range(dk):
            qd = q[r, h, d]
            for j in range(length):
                scores[j] += qd * widen(keys_t[kv, d, j])
        top = np.float32(-np.inf)
        for j in range(length):
            scores[j] *= scale
            top = max(top, scores[j])
        total = np.float32(0.0)
        acc = np.zeros(dv, dtype=np.float32)
        for j in range(length):
            w = np.exp(scores[j] - top)
            total += w
            for e in range(dv):
                acc[e] += w * widen(values[j, kv, e])
        for e in range(dv):
            out[r, h, e] = acc[e] / total
