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

The weights are tiled (`cpu.BlockMatrix`): LANES output rows side by side, so that one
vector operation advances a block's dot of every row of a tile (the loops over lanes are
independent sums, which LLVM vectorizes without reordering any), exactly in int16 (Q4_0)
or int32, and the fold advances the tile's outputs as vectors too (`_fold_lanes`), block
by block in the canonical order. A tile's words are 16-bit, a Q4_0 word four nibbles of
one row, so that a vector shift and mask unpack the same element of every lane. Against
the element-major layout before it (a row's blocks side by side, its dots in int16 or
int32, folded one output at a time): a 3072 x 576 Q4_0 call 355 -> 72 us, the 49152 x 576
Q8_0 output head 7,950 -> 1,400 us, SmolLM2 decode 26.2 -> 77.9 tok/s (one thread; A/B in
one process, the same tokens). Sixty-four lanes: with 32, LLVM's vectorized loop (by 128)
never runs and the lanes go 8 at a time (163 against 86 us). Every row count takes these
kernels, a prompt chunk's as well: against a kernel of its own (rows innermost, float32
block dots, four weight rows a pass) a 128-row 3072 x 576 call 10.8 -> 8.0 ms and a
128-token SmolLM2 prefill 765 -> 537 ms (one thread, A/B in one process).

A block's integer dots are x86's byte multiply-adds, which numba does not emit from loops
(nor from a plain-numba int16 variant, 3x slower), written in LLVM IR (`_block_dots`, an
@intrinsic) for the CPU numba compiles for, as `single` is: pmaddubsw (unsigned by signed
bytes, adjacent products summed in int16) at the CPU's widest (AVX-512BW, AVX2, SSSE3),
AVX-512 VNNI's vpdpbusd (four such products summed into an int32), LLVM's generic vectors
elsewhere. Q4_0's nibbles are the unsigned bytes, their -8 taken once as -8 * the block's
activation sum; int8 weights go to vpdpbusd offset by 128 (-128 * the sum), or as |w|
against x by the sign of w. A Q4_0 tile serving several rows (a prompt chunk) has its
nibbles expanded once, four elements to a lane's int32 (`_nibble_quads`), so that a row's
block is 8 vpdpbusd per 16 lanes. Integer sums are exact in any order: the same bits.
Against the loops before (one thread, A/B in one process, medians): 3072 x 576 Q4_0 60 ->
48 us (one row), 7.07 -> 3.86 ms (128 rows); the 49152 x 576 Q8_0 output head 1.52 -> 1.29
ms, 166 -> 80 ms; a 128-token SmolLM2 prefill 310 -> 189 ms (two threads). The fold, as it
was, is now a third of a prompt's matmul (3072 x 576, 128 rows: 3.3 ms, 2.2 without it).

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
import platform
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, overload

LANES = 64  # weight rows the matmul takes side by side (a tile: the vector lanes)
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
    fastmath=False as they are): 72 vs 81 us a 3072 x 576 Q4_0 call compiled apart."""
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


def _cpu_features() -> set[str]:
    """The features of the CPU numba compiles for (NUMBA_CPU_FEATURES, else the host's)."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return {name[1:] for name in features.split(",") if name.startswith("+")}


def _converts_halves() -> bool:
    """Whether the CPU numba compiles for converts fp16 to float32 in an instruction (x86's
    F16C: vcvtph2ps; AArch64): elsewhere LLVM's fpext from half calls a runtime function
    that numba's JIT does not link (x86 without F16C: a crash)."""
    return platform.machine().lower() in ("aarch64", "arm64") or "f16c" in _cpu_features()


def _single_in_integers(builder: ir.IRBuilder, half: ir.Value) -> ir.Value:
    """fp16 bits (i16) as float32 in integer operations, exactly (numpy's `astype`): the
    exponent rebiased by 112 (inf and nan: to 255, the payload kept), a zero or subnormal
    as its mantissa * 2^-24 (a normal float32), the sign moved over."""
    i32 = ir.IntType(32)
    h = builder.zext(half, i32)
    moved = builder.shl(builder.and_(h, i32(0x7FFF)), i32(13))
    exponent = builder.and_(h, i32(0x7C00))
    mantissa = builder.uitofp(builder.and_(h, i32(0x3FF)), ir.FloatType())
    tiny = builder.bitcast(builder.fmul(mantissa, ir.FloatType()(2.0**-24)), i32)
    field = builder.select(builder.icmp_unsigned("==", exponent, i32(0)), tiny,
                           builder.add(moved, i32(112 << 23)))  # fmt: skip
    field = builder.select(builder.icmp_unsigned("==", exponent, i32(0x7C00)),
                           builder.add(moved, i32(224 << 23)), field)  # fmt: skip
    sign = builder.shl(builder.and_(h, i32(0x8000)), i32(16))
    return builder.bitcast(builder.or_(field, sign), ir.FloatType())


@intrinsic
def single(typingctx, half):
    """fp16 bits (uint16) as float32: LLVM's fpext where the CPU converts halves (F16C's
    vcvtph2ps: a 3072 x 576 Q4_0 matmul 75.4 us against 81.6 by `_single_in_integers`,
    which takes the other CPUs). Exact, as numpy's `astype`, but that F16C returns a
    signalling nan quiet (its payload kept), as a product with it would anyway."""
    if half != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        if _converts_halves():
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return _single_in_integers(builder, args[0])

    return types.float32(types.uint16), codegen


@compiled(inline="always")
def halves_as_singles(halves, out):  # pragma: no cover - compiled
    """out (float32) = halves (fp16 bits, uint16) by `single`: exactly numpy's `astype`, but
    that F16C returns a signalling nan quiet (the matmul kernels' weight scales, a tile's)."""
    for i in range(halves.shape[0]):
        out[i] = single(halves[i])


@compiled(inline="always")
def _tile(quants, scales, n_out, n_blocks, t):  # pragma: no cover - compiled
    """Tile t of a tiled matrix (`cpu.BlockMatrix`): its first row, its width (LANES, fewer
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


I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)

# x86's multiply-add of unsigned by signed bytes, adjacent products summed into int16 (pmaddubsw):
# the feature, the bytes an instruction takes, its LLVM intrinsic; the CPU's widest is taken
_BYTE_PAIRS = (
    ("avx512bw", 64, "llvm.x86.avx512.pmaddubs.w.512"),
    ("avx2", 32, "llvm.x86.avx2.pmadd.ub.sw"),
    ("ssse3", 16, "llvm.x86.ssse3.pmadd.ub.sw.128"),
)


def _has_vnni() -> bool:
    """Whether the CPU has AVX-512 VNNI's vpdpbusd (and AVX-512BW's byte operations)."""
    return {"avx512vnni", "avx512bw"} <= _cpu_features()


def _vector(element: ir.IntType, value: int, n: int) -> ir.Constant:
    return ir.Constant(ir.VectorType(element, n), [value] * n)


def _shuffle(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, mask: list[int]) -> ir.Value:
    """Elements of a, then of b, at `mask`'s indices (LLVM's shufflevector)."""
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(mask)), mask))


def _splat(builder: ir.IRBuilder, vector: ir.Value, index: int, n: int) -> ir.Value:
    """Element `index` of vector, n times."""
    return _shuffle(builder, vector, ir.Constant(vector.type, ir.Undefined), [index] * n)


def _parts(builder: ir.IRBuilder, vector: ir.Value, n: int) -> list[ir.Value]:
    """vector in parts of n elements."""
    count = vector.type.count
    return [_shuffle(builder, vector, vector, list(range(i, i + n))) for i in range(0, count, n)]


def _joined(builder: ir.IRBuilder, parts: list[ir.Value]) -> ir.Value:
    """The parts (a power of two of them, of one type) as one vector, in order."""
    while len(parts) > 1:
        mask = list(range(2 * parts[0].type.count))
        parts = [
            _shuffle(builder, a, b, mask) for a, b in zip(parts[::2], parts[1::2], strict=True)
        ]
    return parts[0]


def _x86(builder: ir.IRBuilder, name: str, result: ir.Type, *args: ir.Value) -> ir.Value:
    """A call of LLVM's x86 intrinsic `name`."""
    function = ir.FunctionType(result, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, function, name), args)


def _byte_pairs(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """<n x i16>: element i = a[2i] * b[2i] + a[2i + 1] * b[2i + 1] of <2n x i8> a (unsigned)
    and b (signed), each such sum within int16: pmaddubsw (which saturates) at the CPU's
    widest, else LLVM's generic vector operations."""
    features = _cpu_features()
    for feature, width, name in _BYTE_PAIRS:
        if feature in features:
            pairs = zip(_parts(builder, a, width), _parts(builder, b, width), strict=True)
            result = ir.VectorType(I16, width // 2)
            return _joined(builder, [_x86(builder, name, result, p, q) for p, q in pairs])
    n = a.type.count
    products = builder.mul(
        builder.zext(a, ir.VectorType(I16, n)), builder.sext(b, ir.VectorType(I16, n))
    )
    even, odd = (_shuffle(builder, products, products, list(range(j, n, 2))) for j in (0, 1))
    return builder.add(even, odd)


def _lanes(builder: ir.IRBuilder, block: ir.Value, k: int) -> ir.Value:
    """Word k of every lane of a block (<LANES x the pointer's type>)."""
    element = block.type.pointee
    pointer = builder.bitcast(
        builder.gep(block, [I32(k * LANES)]), ir.VectorType(element, LANES).as_pointer()
    )
    return builder.load(pointer, align=element.width // 8)


def _add_byte_quads(builder: ir.IRBuilder, total: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    """total (<n x i32>) + element i's a[4i + j] * b[4i + j], j < 4, of <4n x i8> a (unsigned)
    and b (signed), where the sum of each two is within int16: vpdpbusd where the CPU has
    VNNI; else `_byte_pairs`, the two pairs' sums widened."""
    n = total.type.count
    if _has_vnni():
        quads = ir.VectorType(I32, 16)
        operands = (
            _parts(builder, v, 16)
            for v in (total, *(builder.bitcast(v, total.type) for v in (a, b)))
        )
        return _joined(
            builder,
            [
                _x86(builder, "llvm.x86.avx512.vpdpbusd.512", quads, *o)
                for o in zip(*operands, strict=True)
            ],
        )
    pairs = _byte_pairs(builder, a, b)
    even, odd = (
        builder.sext(_shuffle(builder, pairs, pairs, list(range(j, 2 * n, 2))), total.type)
        for j in (0, 1)
    )
    return builder.add(total, builder.add(even, odd))


def _start(builder: ir.IRBuilder, value: ir.Value, n: int) -> ir.Value:
    """value, n times."""
    vector = builder.insert_element(
        ir.Constant(ir.VectorType(value.type, n), ir.Undefined), value, I32(0)
    )
    return _splat(builder, vector, 0, n)


def _nibble_dots(
    builder: ir.IRBuilder, words: ir.Value, pairs: ir.Value, x_sum: ir.Value
) -> ir.Value:
    """A Q4_0 block's dots (<LANES x i32>) of its 8 words (word k of a lane: its elements 2k,
    2k + 16, 2k + 1, 2k + 17, a nibble each from bit 0; integer = nibble - 8): a word's
    nibbles as bytes [2k, 2k + 1] (the mask 0x0F0F) and [2k + 16, 2k + 17] (shifted by 4),
    each against x's pair (`_byte_pairs`: at most 2 * 15 * 127), summed from -8 * x_sum in
    int16, wrapping: the dot itself is within 32 * 8 * 127."""
    nibbles = ir.VectorType(I8, 2 * LANES)
    total = _start(builder, builder.trunc(builder.mul(x_sum, I32(-8)), I16), LANES)
    for k in range(8):
        word = _lanes(builder, words, k)
        for pair, shifted in ((k, word), (k + 8, builder.lshr(word, _vector(I16, 4, LANES)))):
            split = builder.bitcast(builder.and_(shifted, _vector(I16, 0x0F0F, LANES)), nibbles)
            x_pair = builder.bitcast(_splat(builder, pairs, pair, LANES), nibbles)
            total = builder.add(total, _byte_pairs(builder, split, x_pair))
    return builder.sext(total, ir.VectorType(I32, LANES))


def _quad_dots(
    builder: ir.IRBuilder, quads: ir.Value, pairs: ir.Value, x_sum: ir.Value
) -> ir.Value:
    """A Q4_0 block's dots (<LANES x i32>) of its nibbles as bytes (`_nibble_quads`: quad k
    of a lane its elements 2k, 2k + 1, 2k + 16, 2k + 17) against x's same four, summed from
    -8 * x_sum (`_add_byte_quads`)."""
    x_quads = builder.bitcast(
        _shuffle(builder, pairs, pairs, [i // 2 + 8 * (i % 2) for i in range(16)]),
        ir.VectorType(I32, 8),
    )
    total = _start(builder, builder.mul(x_sum, I32(-8)), LANES)
    nibbles = ir.VectorType(I8, 4 * LANES)
    for k in range(8):
        quad = builder.bitcast(_lanes(builder, quads, k), nibbles)
        total = _add_byte_quads(
            builder, total, quad, builder.bitcast(_splat(builder, x_quads, k, LANES), nibbles)
        )
    return total


def _vnni_pair_dots(
    builder: ir.IRBuilder, words: ir.Value, pairs: ir.Value, x_sum: ir.Value
) -> ir.Value:
    """An int8 block's dots (<LANES x i32>) of its 16 words (word k of a lane: its elements 2k
    and 2k + 1, a byte each) by vpdpbusd (`_add_byte_quads`): the weights offset to unsigned
    (+128: xor 0x80; the sums start from -128 * x_sum), a dword holding a word of lanes 2m
    and 2m + 1, against x's pair in the low half (lane 2m's sum) and in the high half (2m +
    1's), the two sums interleaved at the end."""
    low = builder.zext(pairs, ir.VectorType(I32, 16))
    x_halves = (low, builder.shl(low, _vector(I32, 16, 16)))
    start = _start(builder, builder.mul(x_sum, I32(-128)), LANES // 2)
    sums = [start, start]  # lanes 2m, 2m + 1
    weights = ir.VectorType(I8, 2 * LANES)
    for k in range(16):
        word = builder.xor(_lanes(builder, words, k), _vector(I16, 0x8080, LANES))
        for h, x_half in enumerate(x_halves):
            x_pair = builder.bitcast(_splat(builder, x_half, k, LANES // 2), weights)
            sums[h] = _add_byte_quads(builder, sums[h], builder.bitcast(word, weights), x_pair)
    interleave = [i // 2 + LANES // 2 * (i % 2) for i in range(LANES)]
    return _shuffle(builder, sums[0], sums[1], interleave)


def _pair_dots(
    builder: ir.IRBuilder, words: ir.Value, pairs: ir.Value, x_sum: ir.Value
) -> ir.Value:
    """An int8 block's dots (<LANES x i32>) of its 16 words (word k of a lane: its elements 2k
    and 2k + 1, a byte each): `_vnni_pair_dots` where the CPU has VNNI; else word by word |w|
    against x by the sign of w (`_byte_pairs`: at most 2 * 128 * 127), widened to int32."""
    if _has_vnni():
        return _vnni_pair_dots(builder, words, pairs, x_sum)
    lanes, weights = ir.VectorType(I32, LANES), ir.VectorType(I8, 2 * LANES)
    zero = ir.Constant(weights, None)
    total = ir.Constant(lanes, None)
    for k in range(16):
        w = builder.bitcast(_lanes(builder, words, k), weights)
        x_pair = builder.bitcast(_splat(builder, pairs, k, LANES), weights)
        negative = builder.icmp_signed("<", w, zero)
        magnitude = builder.select(negative, builder.sub(zero, w), w)  # -128: 128 unsigned
        signed = builder.select(negative, builder.sub(zero, x_pair), x_pair)
        total = builder.add(total, builder.sext(_byte_pairs(builder, magnitude, signed), lanes))
    return total


# a tile's words: Q4_0's (uint16), their nibbles as bytes (uint32), int8 pairs (int16)
_DOTS = {types.uint16: _nibble_dots, types.uint32: _quad_dots, types.int16: _pair_dots}


@intrinsic
def _block_dots(typingctx, tile, qx, sums, r, b, dots):
    """dots (int32 [LANES]) = block b's integer dots, lane by lane, of a tile's words (tile:
    [n_blocks, words a block, LANES], `_DOTS`) and activation row r's (qx: int16 [rows,
    n_blocks, 32], |x| <= 127; sums: their sums, int32 [rows, n_blocks]). Arrays
    C-contiguous; indices in range."""
    arrays = ((tile, tuple(_DOTS), 3), (qx, (types.int16,), 3),
              (sums, (types.int32,), 2), (dots, (types.int32,), 1))  # fmt: skip
    for array, dtypes, ndim in arrays:
        if not isinstance(array, types.Array) or (array.ndim, array.layout) != (ndim, "C"):
            return None
        if array.dtype not in dtypes:
            return None
    if not (isinstance(r, types.Integer) and isinstance(b, types.Integer)):
        return None
    dot = _DOTS[tile.dtype]

    def codegen(context, builder, signature, args):
        tile, qx, sums, r, b, dots = (
            context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else
            context.cast(builder, a, t, types.intp)
            for t, a in zip(signature.args, args, strict=True)
        )  # fmt: skip

        def pointer(index: int, array: Any, *indices: ir.Value) -> ir.Value:
            return cgutils.get_item_pointer(context, builder, signature.args[index], array, indices)

        zero = ir.Constant(r.type, 0)
        x = builder.bitcast(pointer(1, qx, r, b, zero), ir.VectorType(I16, 32).as_pointer())
        x_bytes = builder.trunc(builder.load(x, align=2), ir.VectorType(I8, 32))
        pairs = builder.bitcast(x_bytes, ir.VectorType(I16, 16))  # pair k: x[2k], x[2k + 1]
        x_sum = builder.load(pointer(2, sums, r, b))
        total = dot(builder, pointer(0, tile, b, zero, zero), pairs, x_sum)
        builder.store(total, builder.bitcast(dots.data, total.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(tile, qx, sums, r, b, dots), codegen


@compiled()
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


@compiled()
def _kept_scale(d):  # pragma: no cover - compiled
    """`cpu.kept_scales` of one scale d >= 0: d rounded to the nearest fp16 (even on a tie),
    saturating at 65504, as float32. Rounded as a multiple of fp16's step at d's binade
    (2^-24 at the least: its subnormals), in float64, where the quotient and the product
    are exact (numba has no float16)."""
    d = min(d, np.float32(65504.0))
    step = math.ldexp(1.0, max(math.frexp(d)[1] - 11, -24))
    return np.float32(np.rint(np.float64(d) / step) * step)


@compiled()
def _q8_rows(x):  # pragma: no cover - compiled
    """`cpu.q8_blocks` of x [rows, k] (float32), for the tile kernels: the integers (int16
    [rows, k / 32, 32]) and the kept scales [rows, k / 32]."""
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
    (`_q8_rows`, in the same call: 15 -> 14 us a 576 x 576 call), times tiled weights
    (`cpu.BlockMatrix`: Q4_0's uint16 words, or int8 pairs' int16: Q8_0, or Q4_0 rows
    stacked beside Q8_0 ones). A tile's LANES outputs advance together (lane i = output row
    first + i), a block's integer dots by `_block_dots`, its scales taken to float32 once
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
                    _block_dots(quads, qx, sums, r, b, dots)
                else:
                    _block_dots(tile, qx, sums, r, b, dots)
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
    """out = `cpu.rms_normalize(x, gain, eps)` for float32 x [rows, n] and gain [n], numpy's
    operations in numpy's order: mean = pairwise sum of x * x / n, r = 1 / sqrt(mean + eps),
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
