"""K-quant encoders (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), written from the block formats.

gguf.quants dequantizes every K type but quantizes none, and the synthetic models need
K-quant files (the mixes most downloaded GGUFs use) to test conversion from them. Each
encoder here takes f32 rows and returns the GGUF block bytes and the values those bytes
stand for, computed from the integers before packing, so a test can check that
gguf.quants.dequantize reads the bytes back to exactly those values.

The scales are chosen plainly, not searched as llama.cpp's quantizer does: a symmetric
type maps each group's largest-magnitude value to its most negative level; an asymmetric
one spans each group's [min(x, 0), max(x)] range. The super-block scales are f16, the
group scales integers of the type's width. The errors are a little above llama.cpp's,
well within what a test model needs.

Every K block covers QK_K = 256 values; the layouts (byte offsets within a block):

- Q2_K (84): scales[16] (low nibble scale, high nibble min, per 16 values), qs[64]
  (2 bits), d f16, dmin f16. value = d * scale * q - dmin * min, q in 0..3.
- Q3_K (110): hmask[32] (high bit), qs[64] (low 2 bits), scales[12] (16 six-bit
  scales, stored + 32), d f16. value = d * scale * q, q in -4..3 (high bit set: q >= 0).
- Q4_K (144): d f16, dmin f16, scales[12] (8 six-bit scales and 8 six-bit mins, per 32
  values), qs[128] (4 bits). value = d * scale * q - dmin * min, q in 0..15.
- Q5_K (176): as Q4_K with qh[32] (the fifth bit) before qs; q in 0..31.
- Q6_K (210): ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, per 16
  values), d f16. value = d * scale * q, q in -32..31.
"""

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType, quants

Q = GGMLQuantizationType
Encoded = tuple[np.ndarray, np.ndarray]  # (uint8 blocks (n, type_size), f32 values (n, 256))


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as f16 bytes (n, 2) and the f32 value those bytes hold."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=np.float32)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _pack_bits(fields: np.ndarray, bits: int) -> np.ndarray:
    """Pack `fields` (..., 8 // bits, m) of `bits`-bit integers into bytes (..., m):
    field s lands at bit s * bits."""
    shifts = (np.arange(fields.shape[-2], dtype=np.uint8) * bits).reshape(-1, 1)
    return np.bitwise_or.reduce(fields.astype(np.uint8) << shifts, axis=-2)


def _symmetric(x: np.ndarray, group: int, q_min: int, q_max: int, sc_max: int, sc_min: int):
    """Group scales, their integer codes under an f16 super-block scale, and the codes q.

    Returns (d bytes, d, integer scales (n, groups), q (n, groups, group), values)."""
    n = x.shape[0]
    xs = x.reshape(n, -1, group)
    at = np.take_along_axis(xs, np.abs(xs).argmax(-1)[..., None], -1)[..., 0]
    scale = at / q_min  # the largest-magnitude value lands on the most negative level
    d_bytes, d = _f16(np.abs(scale).max(-1) / sc_max)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), sc_min, sc_max)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(_ratio(xs, step)), q_min, q_max)
    return d_bytes, sc.astype(np.int16), q.astype(np.int16), (step * q).reshape(n, QK_K)


def _asymmetric(x: np.ndarray, group: int, q_max: int, code_max: int):
    """Group scales and mins (values span [min(x, 0), max(x)]), their integer codes under
    f16 super-block scales, and the codes q.

    Returns (d bytes, dmin bytes, scales, mins (n, groups), q (n, groups, group), values)."""
    n = x.shape[0]
    xs = x.reshape(n, -1, group)
    low = np.minimum(xs.min(-1), 0.0)
    scale = (xs.max(-1) - low) / q_max
    d_bytes, d = _f16(scale.max(-1) / code_max)
    dmin_bytes, dmin = _f16(-low.min(-1) / code_max)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, code_max)
    mn = np.clip(np.rint(_ratio(-low, dmin[:, None])), 0, code_max)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(_ratio(xs + offset, step)), 0, q_max)
    values = (step * q - offset).reshape(n, QK_K)
    return d_bytes, dmin_bytes, sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8), values


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """2-bit codes of 256 values into 64 bytes: value h*128 + s*32 + p at bits 2s of byte
    h*32 + p (Q2_K's qs, Q3_K's qs, Q6_K's qh)."""
    return _pack_bits(q.reshape(-1, 2, 4, 32), 2).reshape(-1, 64)


def _nibbles(q: np.ndarray, span: int) -> np.ndarray:
    """4-bit codes of 256 values into 128 bytes: in each run of 2 * span values, the first
    span take the low nibbles of `span` bytes and the next span the high ones."""
    return _pack_bits(q.reshape(-1, QK_K // (2 * span), 2, span), 4).reshape(-1, 128)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 scale bytes for 8 six-bit scales and 8 six-bit mins:
    bytes 0-3: scale j | (scale j+4 >> 4) << 6; 4-7: the same for mins;
    8-11: scale j+4 & 15 | (min j+4 & 15) << 4."""
    lo_sc, hi_sc, lo_mn, hi_mn = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    return np.concatenate(
        [
            lo_sc | ((hi_sc >> 4) << 6),
            lo_mn | ((hi_mn >> 4) << 6),
            (hi_sc & 0x0F) | ((hi_mn & 0x0F) << 4),
        ],
        axis=1,
    ).astype(np.uint8)


def _q2_k(x: np.ndarray) -> Encoded:
    d, dmin, sc, mn, q, values = _asymmetric(x, 16, 3, 15)
    blocks = np.concatenate([sc | (mn << 4), _two_bit_planes(q), d, dmin], axis=1)
    return blocks, values


def _q3_k(x: np.ndarray) -> Encoded:
    d, sc, q, values = _symmetric(x, 16, -4, 3, 31, -32)
    hmask = _pack_bits((q >= 0).reshape(-1, 8, 32), 1)
    low = _two_bit_planes(np.where(q >= 0, q, q + 4))
    u = (sc + 32).astype(np.uint8)  # 16 six-bit codes
    lows = (u[:, :8] & 0x0F) | ((u[:, 8:] & 0x0F) << 4)
    highs = _pack_bits((u >> 4).reshape(-1, 4, 4), 2)  # code s*4 + b: bits 2s of byte 8 + b
    return np.concatenate([hmask, low, lows, highs, d], axis=1), values


def _q4_k(x: np.ndarray) -> Encoded:
    d, dmin, sc, mn, q, values = _asymmetric(x, 32, 15, 63)
    return np.concatenate([d, dmin, _k_scales(sc, mn), _nibbles(q, 32)], axis=1), values


def _q5_k(x: np.ndarray) -> Encoded:
    d, dmin, sc, mn, q, values = _asymmetric(x, 32, 31, 63)
    qh = _pack_bits((q >> 4).reshape(-1, 8, 32), 1)  # sub-block j's fifth bits: bit j
    ql = _nibbles(q & 0x0F, 32)
    return np.concatenate([d, dmin, _k_scales(sc, mn), qh, ql], axis=1), values


def _q6_k(x: np.ndarray) -> Encoded:
    d, sc, q, values = _symmetric(x, 16, -32, 31, 127, -128)
    u = (q + 32).astype(np.uint8)
    ql = _nibbles(u & 0x0F, 64)
    qh = _two_bit_planes(u >> 4)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d], axis=1), values


ENCODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], Encoded]] = {
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}


def encode_k(values: np.ndarray, qtype: GGMLQuantizationType) -> Encoded:
    """K-quant rows of `values` (..., n with n a multiple of 256): the GGUF bytes
    (..., n / 256 * type_size) and the f32 values they stand for (values' shape)."""
    if qtype not in ENCODERS:
        known = ", ".join(t.name for t in ENCODERS)
        raise ValueError(f"no K-quant encoder for {qtype.name}; known: {known}")
    x = np.asarray(values, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} rows must be a multiple of {QK_K} long, got {x.shape}")
    blocks, decoded = ENCODERS[qtype](x.reshape(-1, QK_K))
    type_size = GGML_QUANT_SIZES[qtype][1]
    assert blocks.shape[1] == type_size and blocks.dtype == np.uint8, (qtype, blocks.shape)
    byte_shape = (*x.shape[:-1], x.shape[-1] // QK_K * type_size)
    return blocks.reshape(byte_shape), decoded.reshape(x.shape)


def quantize_k(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The GGUF bytes of `values` as a K type (see encode_k)."""
    return encode_k(values, qtype)[0]


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf.quants.quantize where gguf implements `qtype`, else this module's K encoders."""
    try:
        return quants.quantize(values, qtype)
    except NotImplementedError:
        if qtype not in ENCODERS:
            raise
        return quantize_k(values, qtype)
