"""The CPU backend's compiled kernels, in numba: the matmul of int8 activations and Q4_0/Q8_0
weights; and a step's elementwise passes (RMSNorm, RoPE), numpy's arithmetic bit for bit
without its per-call overhead; fp16 to float32 (`single`, which the attention uses too).

Every matmul output is the float32 arithmetic of `cpu._q8_fold`, in its order (the GPU's
canonical sum, `kernels/rf_q8.h`): per block the exact integer dot of the activation's and
the weight's integers; the scale d = d_x * d_w in float32; per stage of two blocks
s = fma(d_1, dot_1, d_0 * dot_0), the fused multiply-add taken through float64 as `cpu._fma`
does (d * dot is exact there, so the sum is rounded once: to float32); the stage sums added
left to right in float32. `fastmath=False`: LLVM keeps every float operation as written
(no reassociation, no contraction).

The weights are tiled (`cpu_weights.BlockMatrix`): LANES output rows side by side, so that one
vector operation advances a block's dot of every row of a tile (the loops over lanes are
independent sums, which LLVM vectorizes without reordering any), exactly in int16 (Q4_0)
or int32, and the fold advances the tile's outputs as vectors too (`_fold_lanes`), block
by block in the canonical order. A tile's words are 16-bit, a Q4_0 word four nibbles of
one row, so that a vector shift and mask unpack the same element of every lane. Tiles beat
the element-major layout before them (a row's blocks side by side, folded one output at a
time) several times over. Sixty-four lanes: with 32, LLVM's vectorized loop (by 128) never
runs and the lanes go 8 at a time. Every row count takes these kernels, a prompt chunk's as
well: a kernel of its own (rows innermost, float32 block dots) was slower
(docs/performance.md).

A block's integer dots are x86's byte multiply-adds, written in LLVM IR (`block_dots`,
cpu_intrinsics.py), as fp16 to float32 is (`single`).

The parallel loops run over tiles of output rows, and an output's value depends only
on its own activation row and weight row: the result is the same whatever the rows beside
it and whatever the thread count.

Their parallel loops run one at a time in a process (`PARALLEL_KERNELS`, held by each
caller of a parallel kernel): numba's threading layers differ in whether several threads
may start parallel regions at once (workqueue aborts; the GNU OpenMP layer that pip's
numba takes on Linux is documented thread safe, yet an engine thread crashed with SIGSEGV
inside q8_tiled_matmul in CI, other daemons' engine threads running in the same test
process). A daemon has one engine thread, so in service the lock is never contended.

Compiled on first use and cached on disk (`cache=True`: in NUMBA_CACHE_DIR, which
rocforge_rt/__init__.py points at the cache folder's numba/ unless the user set it).
Where numba finds no writable place at all it refuses `cache=True` when the function is
decorated (a RuntimeError at import): `compiled` then takes the kernels uncached, compiled
on every start.
"""

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from rocforge_rt.backends.cpu_intrinsics import LANES, block_dots, single

PARALLEL_KERNELS = threading.Lock()  # held while a parallel kernel runs (module docstring)


def compiled(**options: Any) -> Callable[..., Any]:
    """njit(cache=True, fastmath=False, **options), or uncached where numba has no cache
    directory it can write."""

    def decorate(function: Callable[..., Any]) -> Any:
        try:
            return njit(cache=True, fastmath=False, **options)(function)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(cache=False, fastmath=False, **options)(function)

    return decorate


@compiled(inline="always")
def _fold_lanes(b, n_blocks, d, scales, dots, stage, total):  # pragma: no cover - compiled
    """Block b of the canonical sum for a tile's outputs at once (lane i: dots[i], the
    block's integer dot, weighed by d * scales[i], d the activation's scale); stage and
    total hold the lanes' running stage and total. Inlined into the kernels (numba IR,
    fastmath=False as they are): faster than compiled apart (docs/performance.md)."""
    lanes = dots.shape[0]
    if b % 2 == 0:
        for i in range(lanes):
            stage[i] = (d * scales[i]) * np.float32(dots[i])  # fmaf(d, dot, 0)
    else:
        for i in range(lanes):  # fmaf(d, dot, stage), rounded once (d * dot exact in float64)
            scale = np.float64(d * scales[i])
            stage[i] = np.float32(scale * np.float64(dots[i]) + np.float64(stage[i]))
    if b % 2 == 1 or b == n_blocks - 1:  # the stage is complete
        for i in range(lanes):
            total[i] = stage[i] if b < 2 else total[i] + stage[i]


@compiled(inline="always")
def halves_as_singles(halves, out):  # pragma: no cover - compiled
    """out (float32) = halves (fp16 bits, uint16) by `single`: exactly numpy's `astype`, but
    that F16C returns a signalling nan quiet (the matmul kernels' weight scales, a tile's)."""
    for i in range(halves.shape[0]):
        out[i] = single(halves[i])


@compiled(inline="always")
def _tile(quants, scales, n_out, n_blocks, t):  # pragma: no cover - compiled
    """Tile t of a tiled matrix (`cpu_weights.BlockMatrix`): its first row, its width (LANES, fewer
    in the last tile), its words [n_blocks, words a block, LANES] (a narrow tile's copied
    into a full one's, zeros beside them) and its scales as float32 [n_blocks, width]
    (`halves_as_singles` of its fp16 bits)."""
    first = t * LANES
    width = min(LANES, n_out - first)
    per_block = quants.shape[0] // (n_out * n_blocks)
    words = quants[first * n_blocks * per_block : (first + width) * n_blocks * per_block]
    words = words.reshape((n_blocks, per_block, width))
    if width < LANES:
        full = np.zeros((n_blocks, per_block, LANES), dtype=quants.dtype)
        full[:, :, :width] = words
        words = full
    d_w = np.empty(n_blocks * width, dtype=np.float32)
    halves_as_singles(scales[first * n_blocks : (first + width) * n_blocks], d_w)
    return first, width, words, d_w.reshape((n_blocks, width))


@compiled()
def _q8_block(x, r, first, values):  # pragma: no cover - compiled
    """`cpu_arithmetic.q8_blocks` of x[r, first : first + 32]: its 32 integers into values
    (float32), trunc(x / d + copysign(0.5, x / d)) with d = amax / 127 (1 where amax is 0),
    in float32; returns d."""
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[r, first + j]))
    scale = amax / np.float32(127)
    divisor = scale if scale > 0 else np.float32(1)
    for j in range(32):
        q = x[r, first + j] / divisor
        values[j] = np.trunc(q + np.copysign(np.float32(0.5), q))
    return scale


@compiled()
def _kept_scale(d):  # pragma: no cover - compiled
    """`cpu_arithmetic.kept_scales` of one scale d >= 0: d rounded to the nearest fp16 (even on
    a tie), saturating at 65504, as float32. Rounded as a multiple of fp16's step at d's binade
    (2^-24 at the least: its subnormals), in float64, where the quotient and the product
    are exact (numba has no float16)."""
    d = min(d, np.float32(65504.0))
    step = math.ldexp(1.0, max(math.frexp(d)[1] - 11, -24))
    return np.float32(np.rint(np.float64(d) / step) * step)


@compiled()
def _q8_rows(x):  # pragma: no cover - compiled
    """`cpu_arithmetic.q8_blocks` of x [rows, k] (float32), for the tile kernels: the integers
    (int16 [rows, k / 32, 32]) and the kept scales [rows, k / 32]."""
    rows, n_blocks = x.shape[0], x.shape[1] // 32
    qx = np.empty((rows, n_blocks, 32), dtype=np.int16)
    sx = np.empty((rows, n_blocks), dtype=np.float32)
    values = np.empty(32, dtype=np.float32)
    for r in range(rows):
        for b in range(n_blocks):
            sx[r, b] = _kept_scale(_q8_block(x, r, b * 32, values))
            qx[r, b, :] = values
    return qx, sx


@compiled(inline="always")
def _block_sums(qx):  # pragma: no cover - compiled
    """The sum of each block's activation integers (int32 [rows, n_blocks])."""
    sums = np.zeros(qx.shape[:2], dtype=np.int32)
    for r in range(qx.shape[0]):
        for b in range(qx.shape[1]):
            for j in range(32):
                sums[r, b] += qx[r, b, j]
    return sums


def _nibble_quads(tile, rows):
    """A tile's words as `_quad_dots` takes them where they serve several activation rows
    (uint32 [n_blocks, 8, LANES]: a Q4_0 word's nibbles, elements 2k, 2k + 16, 2k + 1, 2k +
    17 from bit 0, as the bytes of 2k, 2k + 1, 2k + 16, 2k + 17: (w | w << 12) & 0x0F0F0F0F);
    none (an empty array) for one row or int8 words."""


@overload(_nibble_quads)
def _nibble_quads_of(tile, rows):
    """`_nibble_quads` compiled for the tile's word type."""
    if tile.dtype != types.uint16:
        return lambda tile, rows: np.empty((0, 8, LANES), dtype=np.uint32)

    def expand(tile, rows):  # pragma: no cover - compiled
        quads = np.empty((tile.shape[0] if rows > 1 else 0, 8, LANES), dtype=np.uint32)
        for b in range(quads.shape[0]):
            for k in range(8):
                for i in range(LANES):
                    w = np.uint32(tile[b, k, i])
                    quads[b, k, i] = (w | (w << 12)) & 0x0F0F0F0F
        return quads

    return expand


@compiled(parallel=True)
def q8_tiled_matmul(x, words, scales, out):  # pragma: no cover - compiled
    """out[r, o] for rows x (float32 [rows, k]), quantized to int8 per block first
    (`_q8_rows`, in the same call: no numpy buffers between), times tiled weights
    (`cpu_weights.BlockMatrix`: Q4_0's uint16 words, or int8 pairs' int16: Q8_0, or Q4_0 rows
    stacked beside Q8_0 ones). A tile's LANES outputs advance together (lane i = output row
    first + i), a block's integer dots by `block_dots`, its scales taken to float32 once
    (`_tile`)."""
    qx, sx = _q8_rows(x)
    rows, n_blocks = sx.shape
    sums = _block_sums(qx)
    n_out = out.shape[1]
    for t in prange((n_out + LANES - 1) // LANES):
        first, width, tile, d_w = _tile(words, scales, n_out, n_blocks, t)
        dots = np.empty(LANES, dtype=np.int32)
        lanes = np.empty((2, width), dtype=np.float32)
        stage, total, lane_dots = lanes[0], lanes[1], dots[:width]
        quads = _nibble_quads(tile, rows)
        for r in range(rows):
            for b in range(n_blocks):
                if quads.shape[0] > 0:
                    block_dots(quads, qx, sums, r, b, dots)
                else:
                    block_dots(tile, qx, sums, r, b, dots)
                _fold_lanes(b, n_blocks, sx[r, b], d_w[b], lane_dots, stage, total)
            out[r, first : first + width] = total


@compiled()
def rope_rows(x, positions, cos, sin, out):  # pragma: no cover - compiled
    """out = x (float32 [rows, heads, head_dim]) with each head's adjacent pairs (2i, 2i + 1),
    i < cos.shape[1], rotated by row r's angles cos[positions[r], i], sin[...]: (e * c - o *
    s, e * s + o * c), each product and sum rounded to float32 as numpy's are (no
    contraction); the dimensions past the rotated ones copied."""
    rows, heads, head_dim = x.shape
    pairs = cos.shape[1]
    for r in range(rows):
        p = positions[r]
        for h in range(heads):
            for i in range(pairs):
                even, odd = x[r, h, 2 * i], x[r, h, 2 * i + 1]
                out[r, h, 2 * i] = even * cos[p, i] - odd * sin[p, i]
                out[r, h, 2 * i + 1] = even * sin[p, i] + odd * cos[p, i]
            out[r, h, 2 * pairs :] = x[r, h, 2 * pairs :]


@compiled()
def _block_sum(a, start, n):  # pragma: no cover - compiled
    """numpy's float32 sum of up to 128 values a[start : start + n] (a leaf of its pairwise
    summation): under 8 one by one; else 8 interleaved sums, combined as ((0 + 1) + (2 + 3))
    + ((4 + 5) + (6 + 7)), then the rest one by one."""
    if n < 8:
        total = np.float32(0.0)
        for i in range(start, start + n):
            total += a[i]
        return total
    r0, r1, r2, r3 = a[start], a[start + 1], a[start + 2], a[start + 3]
    r4, r5, r6, r7 = a[start + 4], a[start + 5], a[start + 6], a[start + 7]
    end = start + n - n % 8
    for i in range(start + 8, end, 8):
        r0, r1, r2, r3 = r0 + a[i], r1 + a[i + 1], r2 + a[i + 2], r3 + a[i + 3]
        r4, r5, r6, r7 = r4 + a[i + 4], r5 + a[i + 5], r6 + a[i + 6], r7 + a[i + 7]
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(end, start + n):
        total += a[i]
    return total


@compiled()
def _pairwise_sum(a):  # pragma: no cover - compiled
    """numpy's float32 sum of a (`add.reduce`'s pairwise summation, in its order): over 128
    values, the sum of its two halves' sums (the first half a multiple of 8 long), down to
    `_block_sum`s. Numpy's recursion walked with a stack of frames (numba cannot load a
    self-recursive function from its cache): a frame's length, and its left half's sum
    once that is done."""
    starts = np.empty(64, dtype=np.int64)
    lengths = np.empty(64, dtype=np.int64)
    lefts = np.empty(64, dtype=np.float32)
    done = np.zeros(64, dtype=np.bool_)  # whether the frame's left half is summed
    depth, starts[0], lengths[0] = 0, 0, a.shape[0]
    while True:
        while lengths[depth] > 128:  # down the left halves
            half = lengths[depth] // 2 - lengths[depth] // 2 % 8
            depth += 1
            starts[depth], lengths[depth], done[depth] = starts[depth - 1], half, False
        total = _block_sum(a, starts[depth], lengths[depth])
        while depth > 0 and done[depth - 1]:  # a right half: its frame's sum is complete
            depth -= 1
            total = lefts[depth] + total
        if depth == 0:
            return total
        parent = depth - 1  # a left half: on to the right one
        half = lengths[depth]
        lefts[parent], done[parent] = total, True
        starts[depth], lengths[depth] = starts[parent] + half, lengths[parent] - half
        done[depth] = False


@compiled()
def rms_norm_rows(x, gain, eps, out):  # pragma: no cover - compiled
    """out = `cpu_arithmetic.rms_normalize(x, gain, eps)` for float32 x [rows, n] and gain [n],
    numpy's operations in numpy's order: mean = pairwise sum of x * x / n, r = 1 / sqrt(mean + eps),
    out = x * r * gain, each rounded to float32."""
    rows, n = x.shape
    squares = np.empty(n, dtype=np.float32)
    for row in range(rows):
        for i in range(n):
            squares[i] = x[row, i] * x[row, i]
        mean = _pairwise_sum(squares) / np.float32(n)
        scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
        for i in range(n):
            out[row, i] = (x[row, i] * scale) * gain[i]
