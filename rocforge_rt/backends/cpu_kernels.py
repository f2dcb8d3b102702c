"""The CPU backend's compiled matmul: int8 activations times Q4_0/Q8_0 weights, in numba.

Every output is the float32 arithmetic of `cpu._q8_fold`, in its order (the GPU's
canonical sum, `kernels/rf_q8.h`): per block the exact integer dot of the activation's and
the weight's integers; the scale d = d_x * d_w in float32; per stage of two blocks
s = fma(d_1, dot_1, d_0 * dot_0), the fused multiply-add taken through float64 as `cpu._fma`
does (d * dot is exact there, so the sum is rounded once: to float32); the stage sums added
left to right in float32. `fastmath=False`: LLVM keeps every float operation as written
(no reassociation, no contraction).

The block dots are exact integers: summed in int16 or int32 for up to DECODE_ROWS rows
(decode), in float32 for more (|product| <= 127 * 128, |dot| < 2^19: every partial sum is
exact). Operands are laid out element-major ([32, n_blocks] per row: element j of every
block side by side), so that the dots of all of a row's blocks advance together, element
by element: a loop over blocks of independent sums, which LLVM vectorizes without
reordering any sum.

A prompt chunk's rows (`q8_matmul_rows`) go the other way round: activations row-major
innermost ([n_blocks, 32, rows]), so that one weight integer multiplies every row's at once
and every loop over rows is independent sums (vectorized), _TILE weight rows at a time
(each activation value read once for them). Same operations, same order, per output; its
block dots may be contracted to fused multiply-adds (`fastmath={"contract"}`: products
and sums of integers below 2^24, exact either way), its fold (`_fold_block`, compiled
apart) is not: a 128-token SmolLM2 prefill 467 -> 439 ms (A/B in one process, 2 cores).

The parallel loops run over chunks of output rows, and an output's value depends only
on its own activation row and weight row: the result is the same whatever the rows beside
it and whatever the thread count.

Compiled on first use and cached on disk (`cache=True`: in NUMBA_CACHE_DIR, which
rocforge_rt/__init__.py points at the cache folder's numba/ unless the user set it).
Where numba finds no writable place at all it refuses `cache=True` when the function is
decorated (a RuntimeError at import): `_compiled` then takes the kernels uncached, compiled
on every start.
"""

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, prange

_CHUNK = 16  # output rows per parallel iteration (each iteration's buffers are its own)
DECODE_ROWS = 2  # up to this many rows a call sums each block in integers (int16 activations)
_TILE = 4  # weight rows a prompt chunk's iteration takes together (unrolled in q8_matmul_rows)


def _compiled(fastmath: bool | set[str] = False, **options: Any) -> Callable[..., Any]:
    """njit(cache=True, fastmath=fastmath, **options), or uncached where numba has no cache
    directory it can write."""

    def decorate(function: Callable[..., Any]) -> Any:
        try:
            return njit(cache=True, fastmath=fastmath, **options)(function)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(cache=False, fastmath=fastmath, **options)(function)

    return decorate


@_compiled()
def _fold(dots, sx, sw, r, o):  # pragma: no cover - compiled
    """The canonical sum of row r's and output o's block dots (float32 integers)."""
    n_blocks = dots.shape[0]
    total = np.float32(0.0)
    for b in range(0, n_blocks, 2):
        stage = (sx[r, b] * sw[o, b]) * dots[b]  # fmaf(d, dot, 0)
        if b + 1 < n_blocks:  # fmaf(d, dot, stage), rounded once (d * dot exact in float64)
            d = np.float64(sx[r, b + 1] * sw[o, b + 1])
            stage = np.float32(d * np.float64(dots[b + 1]) + np.float64(stage))
        if b == 0:
            total = stage
        else:
            total += stage
    return total


@_compiled()
def _fold_ints(acc, dots, sx, sw, r, o):  # pragma: no cover - compiled
    """`_fold` of integer block dots acc (int16 or int32), through dots (float32: exact)."""
    for b in range(acc.shape[0]):
        dots[b] = np.float32(acc[b])
    return _fold(dots, sx, sw, r, o)


@_compiled()
def _unpacked_rows(qx, w, sx, sw, o, dots, out):  # pragma: no cover - compiled
    """out[:, o] for every activation row (qx float32), from weight row o's integers w [32,
    n_blocks] (float32): a few rows share the one unpacking."""
    n_blocks = w.shape[1]
    for r in range(qx.shape[0]):
        dots[:] = 0
        for j in range(32):
            for b in range(n_blocks):
                dots[b] = dots[b] + qx[r, j, b] * w[j, b]
        out[r, o] = _fold(dots, sx, sw, r, o)


@_compiled(parallel=True)
def q8_q4_matmul(qx, sx, nibbles, sw, out):  # pragma: no cover - compiled
    """out[r, o] for int8 activations qx ([rows, 32, n_blocks], each in [-127, 127]: int16
    for up to DECODE_ROWS rows, else float32) with scales sx [rows, n_blocks], and Q4_0
    weights: nibbles uint8 [n_out, 16, n_blocks] (byte j of each block: element j in the low
    nibble, j + 16 in the high; integer = nibble - 8) with scales sw [n_out, n_blocks]. Up to
    DECODE_ROWS rows sum a block in int16: its 32 products and every partial sum lie within
    32 * 127 * 8 < 2^15 (SmolLM2 decode 39.6/40.1 -> 40.8/44.0 tok/s against float32 sums,
    alternating runs on 2 cores); more rows share each weight row's integers unpacked to
    float32."""
    rows, n_blocks = sx.shape
    n_out = sw.shape[0]
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        dots = np.empty(n_blocks, dtype=np.float32)
        acc = np.empty(n_blocks, dtype=np.int16)
        w = np.empty((32, n_blocks), dtype=np.float32)
        eight = np.int16(8)
        for o in range(c * _CHUNK, min(n_out, (c + 1) * _CHUNK)):
            if rows <= DECODE_ROWS:  # the nibbles read as they are used
                for r in range(rows):
                    acc[:] = 0
                    for j in range(16):
                        for b in range(n_blocks):
                            byte = nibbles[o, j, b]
                            low = np.int16(byte & 15) - eight
                            high = np.int16(byte >> 4) - eight
                            part = np.int16(qx[r, j, b] * low) + np.int16(qx[r, j + 16, b] * high)
                            acc[b] = np.int16(acc[b] + part)
                    out[r, o] = _fold_ints(acc, dots, sx, sw, r, o)
            else:  # a prompt chunk: the weight row's integers unpacked once
                for j in range(16):
                    for b in range(n_blocks):
                        byte = np.int32(nibbles[o, j, b])
                        w[j, b] = np.float32((byte & 15) - 8)
                        w[j + 16, b] = np.float32((byte >> 4) - 8)
                _unpacked_rows(qx, w, sx, sw, o, dots, out)


@_compiled(parallel=True)
def q8_q8_matmul(qx, sx, ints, sw, out):  # pragma: no cover - compiled
    """As q8_q4_matmul for int8 weights ints [n_out, 32, n_blocks] (Q8_0, or Q4_0 rows
    stacked beside Q8_0 ones)."""
    rows, n_blocks = sx.shape
    n_out = sw.shape[0]
    for c in prange((n_out + _CHUNK - 1) // _CHUNK):
        dots = np.empty(n_blocks, dtype=np.float32)
        acc = np.empty(n_blocks, dtype=np.int32)
        w = np.empty((32, n_blocks), dtype=np.float32)
        for o in range(c * _CHUNK, min(n_out, (c + 1) * _CHUNK)):
            if rows <= DECODE_ROWS:  # a block's sum in int32 (products within 127 * 128 < 2^15)
                for r in range(rows):
                    acc[:] = 0
                    for j in range(32):
                        for b in range(n_blocks):
                            acc[b] += np.int16(qx[r, j, b] * np.int16(ints[o, j, b]))
                    out[r, o] = _fold_ints(acc, dots, sx, sw, r, o)
            else:
                for j in range(32):
                    for b in range(n_blocks):
                        w[j, b] = np.float32(ints[o, j, b])
                _unpacked_rows(qx, w, sx, sw, o, dots, out)


@_compiled()
def _q8_block(x, r, first, values):  # pragma: no cover - compiled
    """`cpu.q8_blocks` of x[r, first : first + 32]: its 32 integers into values (float32),
    trunc(x / d + copysign(0.5, x / d)) with d = amax / 127 (1 where amax is 0), in float32;
    returns d."""
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[r, first + j]))
    scale = amax / np.float32(127)
    divisor = scale if scale > 0 else np.float32(1)
    for j in range(32):
        q = x[r, first + j] / divisor
        values[j] = np.trunc(q + np.copysign(np.float32(0.5), q))
    return scale


@_compiled(parallel=True)
def q8_rows_inner(x, qx, sx):  # pragma: no cover - compiled
    """`cpu.q8_blocks` of x [rows, k] (float32), rows innermost, for q8_matmul_rows: the
    integers into qx [k / 32, 32, rows] (float32), the scales into sx [k / 32, rows]."""
    for b in prange(qx.shape[0]):
        values = np.empty(32, dtype=np.float32)
        for r in range(qx.shape[2]):
            sx[b, r] = _q8_block(x, r, b * 32, values)
            qx[b, :, r] = values


@_compiled()
def q8_rows_elements(x, qx, sx):  # pragma: no cover - compiled
    """`cpu.q8_blocks` of x [rows, k] (float32) element-major, for q8_q4_matmul and
    q8_q8_matmul: the integers into qx [rows, 32, k / 32] (int16 or float32), the scales
    into sx [rows, k / 32]."""
    values = np.empty(32, dtype=np.float32)
    for r in range(qx.shape[0]):
        for b in range(qx.shape[2]):
            sx[r, b] = _q8_block(x, r, b * 32, values)
            qx[r, :, b] = values


@_compiled()
def _weight_pair(quants, o, j, b):  # pragma: no cover - compiled
    """Weight row o's integers of elements j and j + 16 of block b, as float32 (0, 0 past the
    last row): Q4_0 nibbles uint8 [n_out, 16, n_blocks] or int8 [n_out, 32, n_blocks]."""
    if o >= quants.shape[0]:
        return np.float32(0.0), np.float32(0.0)
    if quants.shape[1] == 16:
        byte = np.int32(quants[o, j, b])
        return np.float32((byte & 15) - 8), np.float32((byte >> 4) - 8)
    return np.float32(quants[o, j, b]), np.float32(quants[o, j + 16, b])


@_compiled()
def _fold_block(b, n_blocks, d_w, sx_b, dots, stage, total):  # pragma: no cover - compiled
    """Block b of `_fold`'s canonical sum for every row at once: dots [rows] the block's
    dots, sx_b [rows] its activation scales, d_w the weight row's; stage and total [rows]."""
    rows = dots.shape[0]
    if b % 2 == 0:
        for r in range(rows):
            stage[r] = (sx_b[r] * d_w) * dots[r]  # fmaf(d, dot, 0)
    else:
        for r in range(rows):  # fmaf(d, dot, stage), rounded once
            d = np.float64(sx_b[r] * d_w)
            stage[r] = np.float32(d * np.float64(dots[r]) + np.float64(stage[r]))
    if b % 2 == 1 or b == n_blocks - 1:  # the stage is complete
        for r in range(rows):
            total[r] = stage[r] if b < 2 else total[r] + stage[r]


@_compiled(fastmath={"contract"}, parallel=True)
def q8_matmul_rows(qx, sx, quants, sw, out):  # pragma: no cover - compiled
    """out[r, o] for a prompt chunk: int8 activations qx (float32 integers [n_blocks, 32,
    rows], rows innermost) with scales sx [n_blocks, rows], times Q4_0 or int8 weights
    (`_weight_pair`'s layouts) with scales sw [n_out, n_blocks]; _TILE weight rows a pass."""
    n_blocks, _, rows = qx.shape
    n_out = sw.shape[0]
    for c in prange((n_out + _TILE - 1) // _TILE):
        o = c * _TILE
        tile = min(_TILE, n_out - o)
        dots = np.empty((_TILE, rows), dtype=np.float32)
        stage = np.empty((_TILE, rows), dtype=np.float32)
        total = np.empty((_TILE, rows), dtype=np.float32)
        for b in range(n_blocks):
            dots[:, :] = 0
            for j in range(16):
                l0, h0 = _weight_pair(quants, o, j, b)
                l1, h1 = _weight_pair(quants, o + 1, j, b)
                l2, h2 = _weight_pair(quants, o + 2, j, b)
                l3, h3 = _weight_pair(quants, o + 3, j, b)
                for r in range(rows):
                    xl, xh = qx[b, j, r], qx[b, j + 16, r]
                    dots[0, r] = dots[0, r] + xl * l0 + xh * h0
                    dots[1, r] = dots[1, r] + xl * l1 + xh * h1
                    dots[2, r] = dots[2, r] + xl * l2 + xh * h2
                    dots[3, r] = dots[3, r] + xl * l3 + xh * h3
            for t in range(tile):
                _fold_block(b, n_blocks, sw[o + t, b], sx[b], dots[t], stage[t], total[t])
        for t in range(tile):
            for r in range(rows):
                out[r, o + t] = total[t, r]
