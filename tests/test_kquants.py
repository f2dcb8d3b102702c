"""K-quant encoders: the bytes they write are what gguf.quants reads back, value for value,
and the values are as close to the input as the type's bits allow."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from rocforge_rt.model import kquants

Q = GGMLQuantizationType
# relative RMS error on Gaussian values, measured 0.328 / 0.155 / 0.078 / 0.038 / 0.019:
# each bit more halves it, as for any uniform quantizer; the bounds leave ~10%
BOUNDS = {Q.Q2_K: 0.36, Q.Q3_K: 0.17, Q.Q4_K: 0.086, Q.Q5_K: 0.042, Q.Q6_K: 0.021}


def awkward_rows(rng: np.random.Generator) -> np.ndarray:
    """Gaussian rows of many scales and signs, and rows that test the edges: all zero,
    all positive, all negative, constant, a lone outlier, tiny values."""
    x = rng.standard_normal((40, 512)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-3, 2, (40, 1)).astype(np.float32)
    x[0] = 0
    x[1] = np.abs(x[1]) + 1
    x[2] = -np.abs(x[2])
    x[3] = 0.25
    x[4] = 0
    x[4, 300] = 7.0
    x[5] *= np.float32(1e-4)
    return x


@pytest.mark.parametrize("qtype", list(kquants.ENCODERS), ids=lambda q: q.name)
def test_gguf_reads_the_bytes_back_to_exactly_the_values_meant(qtype: Q) -> None:
    x = awkward_rows(np.random.default_rng(int(qtype)))
    blocks, values = kquants.encode_k(x, qtype)
    assert blocks.dtype == np.uint8
    assert blocks.shape == (40, 2 * GGML_QUANT_SIZES[qtype][1])
    np.testing.assert_array_equal(quants.dequantize(blocks, qtype), values)
    assert not values[0].any()  # zeros stay zeros
    np.testing.assert_allclose(values[3], 0.25, rtol=0.02)
    assert values[4, 300] == pytest.approx(7.0, rel=0.01)  # the outlier sets the scale


@pytest.mark.parametrize("qtype", list(kquants.ENCODERS), ids=lambda q: q.name)
def test_values_are_as_close_to_the_input_as_the_type_allows(qtype: Q) -> None:
    x = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32) * 0.03
    _, values = kquants.encode_k(x, qtype)
    rel = np.sqrt(np.mean((values - x) ** 2) / np.mean(x**2))
    assert rel < BOUNDS[qtype], rel
    assert rel > BOUNDS[qtype] / 2, rel  # and the bound is tight


def test_each_bit_more_halves_the_error() -> None:
    x = np.random.default_rng(1).standard_normal((128, 1024)).astype(np.float32)
    errors = []
    for qtype in (Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        values = kquants.encode_k(x, qtype)[1]
        errors.append(np.sqrt(np.mean((values - x) ** 2)))
    ratios = np.array(errors[:-1]) / np.array(errors[1:])
    assert np.all((ratios > 1.8) & (ratios < 2.2)), ratios


def test_quantize_takes_gguf_where_gguf_can_and_the_encoders_where_not() -> None:
    x = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.F16):
        np.testing.assert_array_equal(kquants.quantize(x, qtype), quants.quantize(x, qtype))
    with pytest.raises(NotImplementedError):
        quants.quantize(x, Q.Q4_K)  # gguf 0.19 quantizes no K type: the reason for the module
    np.testing.assert_array_equal(kquants.quantize(x, Q.Q4_K), kquants.encode_k(x, Q.Q4_K)[0])


def test_rows_that_are_not_whole_blocks_and_other_types_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.encode_k(np.zeros((2, 128), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="no K-quant encoder for Q8_0"):
        kquants.encode_k(np.zeros((2, 256), np.float32), Q.Q8_0)
