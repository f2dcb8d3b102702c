"""The KV pool's element formats, and fp8's conversions as every backend must do them.

- "f16": IEEE half, the default (llama.cpp's and the reference outputs').
- "fp8": OCP FP8 E4M3 ("e4m3fn", vLLM's `kv_cache_dtype=fp8` without scales): 1 sign, 4
  exponent (bias 7) and 3 mantissa bits; no infinities, 0x7f / 0xff NaN, largest 448. Half
  the bytes of f16 (twice the tokens in the same memory, half the bytes a decode step reads
  at depth), for three mantissa bits instead of ten: lossy, off by default.

A float32 becomes fp8 by rounding to the nearest value, ties to even, saturating to +-448
(infinities too; NaN stays NaN), as CUDA's `cvt.rn.satfinite.e4m3x2.f32`. Every fp8 value
is exact in fp16, which is how the attention kernels (kernels/rf_kv.h) and the CPU backend
read it. Both sides implement these two functions; tests hold them to this module.
"""

import numpy as np

# Each format's element as numpy holds it: fp16 values, or fp8 E4M3 bytes.
KV_ELEMENT_DTYPES = {"f16": np.dtype(np.float16), "fp8": np.dtype(np.uint8)}
KV_DTYPES = tuple(KV_ELEMENT_DTYPES)


def check_kv_dtype(name: str) -> str:
    """`name` if it is a KV element format, else ValueError naming the choices."""
    if name not in KV_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {', '.join(KV_DTYPES)}; got {name!r}")
    return name


def kv_element_bytes(kv_dtype: str) -> int:
    """Bytes of one K or V element in the pool."""
    return KV_ELEMENT_DTYPES[check_kv_dtype(kv_dtype)].itemsize


def float32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """fp8 E4M3 bytes (uint8) of float32 values: nearest, ties to even, saturating."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    mag = bits & 0x7FFFFFFF
    # Normal results (|x| >= 2^-6): drop 20 of float32's 23 mantissa bits, rounding to nearest
    # even, then rebias the exponent (127 -> 7); past 448 (0x7e) saturates.
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = np.minimum(rounded.astype(np.int64) - ((127 - 7) << 3), 0x7E)
    # Below 2^-6: multiples of 2^-9, rounded to nearest even (8 * 2^-9 is the smallest normal).
    below = np.minimum(mag, 0x3C800000).view(np.float32)  # finite, whatever x is
    small = np.rint(below * np.float32(512.0)).astype(np.int64)
    out = np.where(mag < 0x3C800000, small, normal)
    out = np.where(mag > 0x7F800000, 0x7F, out)  # NaN
    return (out.astype(np.uint8) | sign).reshape(np.shape(x))


def _e4m3_half_bits() -> np.ndarray:
    """The fp16 bits (uint16) of each of the 256 fp8 E4M3 bytes."""
    byte = np.arange(256, dtype=np.uint16)
    sign, mag = (byte & 0x80) << 8, byte & 0x7F
    # A normal byte's exponent and mantissa bits sit 7 bits up in fp16, exponent + 8; below
    # 0x08 the value is mag * 2^-9, an fp16 normal.
    normal = (mag << 7) + 0x2000
    small = (mag.astype(np.float32) * np.float32(2.0**-9)).astype(np.float16).view(np.uint16)
    half = np.where(mag >= 0x08, normal, small) | sign
    half[0x7F] = half[0xFF] = np.float16(np.nan).view(np.uint16)
    return half.astype(np.uint16)


E4M3_HALF_BITS = _e4m3_half_bits()


def e4m3_to_float16(b: np.ndarray) -> np.ndarray:
    """The float16 values of fp8 E4M3 bytes (exact)."""
    return E4M3_HALF_BITS[np.asarray(b, dtype=np.uint8)].view(np.float16)
