"""The CPU kernels' LLVM IR intrinsics, for the CPU numba compiles for: fp16 bits to float32
(`single`) and the integer dots of a tile's block (`block_dots`), for the kernels of
cpu_kernels.py. numba's disk cache notices a change to a cached kernel's own file, not to
this one: after changing this file, clear the cache folder's numba/.

A block's integer dots are x86's byte multiply-adds, which numba does not emit from loops
(nor from a plain-numba int16 variant, far slower), written in LLVM IR (`block_dots`, an
@intrinsic) for the CPU numba compiles for, as `single` is: pmaddubsw (unsigned by signed
bytes, adjacent products summed in int16) at the CPU's widest (AVX-512BW, AVX2, SSSE3),
AVX-512 VNNI's vpdpbusd (four such products summed into an int32), LLVM's generic vectors
elsewhere. Q4_0's nibbles are the unsigned bytes, their -8 taken once as -8 * the block's
activation sum; int8 weights go to vpdpbusd offset by 128 (-128 * the sum), or as |w|
against x by the sign of w. A Q4_0 tile serving several rows (a prompt chunk) has its
nibbles expanded once, four elements to a lane's int32 (cpu_kernels' `_nibble_quads`), so
that a row's block is 8 vpdpbusd per 16 lanes. Integer sums are exact in any order: the same bits.
They beat the loops before on one row and on a prompt chunk's rows; the fold, as it was, is
now a large share of a prompt's matmul (docs/performance.md).
"""

import platform
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

LANES = 64  # weight rows the matmul takes side by side (a tile: the vector lanes)


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
    vcvtph2ps, faster than `_single_in_integers`, which takes the other CPUs;
    docs/performance.md). Exact, as numpy's `astype`, but that F16C returns a
    signalling nan quiet (its payload kept), as a product with it would anyway."""
    if half != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        if _converts_halves():
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return _single_in_integers(builder, args[0])

    return types.float32(types.uint16), codegen


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
def block_dots(typingctx, tile, qx, sums, r, b, dots):
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
