"""The KV pool's element formats (step/kv_format.py): fp8 E4M3 is OCP's, a float32 becomes
the nearest fp8 value (ties to even, saturating at +-448, NaN kept), every fp8 byte reads
back as its exact fp16 value; and the pool's bytes follow the format."""

from dataclasses import replace

import numpy as np
import pytest
from gpu_checks import hparams

from rocforge_rt.engine.kv_cache import kv_bytes_per_token, kv_pool_bytes
from rocforge_rt.step.kv_format import (
    E4M3_HALF_BITS,
    KV_DTYPES,
    check_kv_dtype,
    e4m3_to_float16,
    float32_to_e4m3,
    kv_element_bytes,
)

CODES = np.arange(0x7F)  # the positive finite bytes, 0x00 (zero) to 0x7e (448), in value order


def e4m3_value(byte: int) -> float:
    """A byte's value from the E4M3 definition: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m/8 * 2^-6); 0x7f and 0xff are NaN (no infinities)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0x0F, byte & 0x07
    if exponent == 0x0F and mantissa == 0x07:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


VALUES = np.array([e4m3_value(b) for b in CODES])  # float64, ascending


def nearest_e4m3(x: np.ndarray) -> np.ndarray:
    """The fp8 byte of each float32 by brute force: the finite E4M3 value nearest |x| (of
    all 127, distances in float64, exact where two of them are close), on a tie the even
    byte; past 448 (infinity too) 448; NaN 0x7f; the sign bit as x's."""
    magnitude = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    distance = np.abs(magnitude[:, None] - VALUES[None, :])
    nearest = distance == distance.min(axis=1, keepdims=True)  # one value, or a tie of two
    even = nearest & (CODES % 2 == 0)
    byte = np.where(even.any(axis=1), even.argmax(axis=1), nearest.argmax(axis=1))
    byte = np.where(np.isnan(x), 0x7F, byte)
    return (byte | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def ulp_neighbours(x: np.ndarray) -> np.ndarray:
    """x (float32) and the float32s either side of it."""
    bits = x.astype(np.float32).view(np.int32)
    return np.concatenate([bits - 1, bits, bits + 1]).view(np.float32)


def check_against_brute_force(x: np.ndarray) -> None:
    x = np.concatenate([x, -x]).astype(np.float32)
    got, expected = float32_to_e4m3(x), nearest_e4m3(x)
    wrong = np.flatnonzero(got != expected)
    assert wrong.size == 0, [(float(x[i]), hex(got[i]), hex(expected[i])) for i in wrong[:5]]


def test_every_value_and_every_midpoint_between_neighbours_rounds_to_nearest_even():
    """Each finite value, each midpoint between neighbours (a tie: to the even byte, 2^-10
    to zero, 7.5 * 2^-9 up to the smallest normal 2^-6, 432 up to 448), and the float32s
    either side of each."""
    midpoints = (VALUES[:-1] + VALUES[1:]) / 2
    check_against_brute_force(ulp_neighbours(np.concatenate([VALUES[1:], midpoints])))
    tie_to_zero, tie_to_normal, tie_to_max = float32_to_e4m3(np.float32([2**-10, 7.5 * 2**-9, 432]))
    assert (tie_to_zero, tie_to_normal, tie_to_max) == (0x00, 0x08, 0x7E)


def test_random_float32s_of_every_magnitude_round_to_nearest_even():
    """Log-uniform over 2^-24 to 2^12 (below the subnormals to past the largest), and
    float32's own subnormals."""
    rng = np.random.default_rng(0)
    wide = np.exp2(rng.uniform(-24, 12, 20_000))
    subnormals = rng.integers(1, 1 << 23, 1000, dtype=np.uint32).view(np.float32)
    check_against_brute_force(np.concatenate([wide.astype(np.float32), subnormals]))


def test_saturation_infinities_nan_and_signed_zeros():
    specials = np.float32([448, 464, 479.9, 480, 1e6, 3.4e38, np.inf])
    assert float32_to_e4m3(specials).tolist() == [0x7E] * len(specials)  # 448: satfinite
    assert float32_to_e4m3(-specials).tolist() == [0xFE] * len(specials)  # -448
    nan = float32_to_e4m3(np.float32([np.nan, -np.nan]))
    assert (nan & 0x7F).tolist() == [0x7F, 0x7F]
    assert float32_to_e4m3(np.float32([0.0, -0.0, 1e-30, -1e-30])).tolist() == [0, 0x80, 0, 0x80]


def test_the_conversion_keeps_the_shape_of_a_strided_array():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, 1:, ::2]
    got = float32_to_e4m3(x)
    assert got.shape == x.shape and got.dtype == np.uint8
    assert np.array_equal(got, float32_to_e4m3(x.ravel()).reshape(x.shape))


def test_each_bytes_fp16_bits_are_its_exact_value():
    """E4M3_HALF_BITS against each byte's value from the definition, every sign, exponent
    and mantissa (subnormals are fp16 normals; -0 keeps its sign); 0x7f, 0xff are NaN."""
    assert E4M3_HALF_BITS.dtype == np.uint16 and E4M3_HALF_BITS.shape == (256,)
    for byte in range(256):
        value = e4m3_value(byte)
        half = E4M3_HALF_BITS[byte : byte + 1].view(np.float16)
        if np.isnan(value):
            assert np.isnan(half[0]), hex(byte)
        else:
            assert half.astype(np.float64)[0] == value, hex(byte)
            assert np.signbit(half[0]) == bool(byte & 0x80), hex(byte)
    assert np.array_equal(e4m3_to_float16(np.arange(256)).view(np.uint16), E4M3_HALF_BITS)


def test_every_finite_byte_round_trips():
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
    assert np.array_equal(float32_to_e4m3(e4m3_to_float16(finite).astype(np.float32)), finite)


def test_a_kv_dtype_is_checked_by_name():
    assert KV_DTYPES == ("f16", "fp8")
    assert [check_kv_dtype(name) for name in KV_DTYPES] == ["f16", "fp8"]
    for bad in ("fp16", "e4m3", "FP8", ""):
        with pytest.raises(ValueError, match=f"must be one of f16, fp8; got {bad!r}"):
            check_kv_dtype(bad)
    with pytest.raises(ValueError, match="got 'bf16'"):
        kv_element_bytes("bf16")


def test_fp8_halves_the_bytes_per_token_and_the_pool():
    hp = replace(hparams(), n_layer=30)  # SmolLM2-135M's KV: 30 layers of 3 heads of 64
    assert (kv_element_bytes("f16"), kv_element_bytes("fp8")) == (2, 1)
    assert kv_bytes_per_token(hp) == kv_bytes_per_token(hp, "f16") == 30 * (192 + 192) * 2
    assert kv_bytes_per_token(hp, "fp8") == 30 * (192 + 192)
    assert kv_pool_bytes(hp, 4, 2048, "fp8") * 2 == kv_pool_bytes(hp, 4, 2048) == 4 * 2048 * 23040
