"""The CPU backend's matmul is row-independent: a row's outputs are bit-identical alone or
in any batch, so a session's tokens do not depend on who else is generating."""

from fractions import Fraction

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gpu_checks import hparams, weight

from rocforge_rt.backends.cpu import CpuBackend, dequantize, quantize_q8
from rocforge_rt.step.batch import StepBatch

BATCHES = (2, 7, 64)
SHAPES = [(3072, 576, Q.Q4_0), (576, 1536, Q.Q4_0), (1024, 576, Q.Q8_0)]  # n_out, n_in, type


def bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("activations", ["q8", "f32"])
@pytest.mark.parametrize(("n_out", "n_in", "qtype"), SHAPES)
def test_a_row_is_bit_identical_alone_and_in_batches_of_2_7_64(activations, n_out, n_in, qtype):
    rng = np.random.default_rng(n_out + n_in)
    backend = CpuBackend(hparams(), 1, 1, activations=activations)
    matrix = backend.linear(weight(rng, n_out, n_in, qtype))
    x = rng.standard_normal((max(BATCHES), n_in)).astype(np.float32)
    zero = np.zeros((1, n_out), dtype=np.float32)
    for row in (0, 1, 5):
        alone = bits(backend.matmul_add(x[row : row + 1], matrix, zero))
        for n in BATCHES:
            batched = backend.matmul_add(x[:n], matrix, np.zeros((n, n_out), np.float32))
            if row < n:
                assert np.array_equal(bits(batched[row : row + 1]), alone), (row, n)


@pytest.mark.parametrize("activations", ["q8", "f32"])
def test_the_matmul_computes_the_product_of_its_activations_and_the_weights(activations):
    rng = np.random.default_rng(3)
    tensor = weight(rng, 960, 576)
    backend = CpuBackend(hparams(), 1, 1, activations=activations)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    inputs = quantize_q8(x) if activations == "q8" else x
    expected = inputs.astype(np.float64) @ dequantize(tensor).T.astype(np.float64)
    got = backend.matmul_add(x, backend.linear(tensor), np.zeros((9, 960), np.float32))
    assert np.max(np.abs(got - expected)) <= 1e-5 * np.max(np.abs(expected))


def test_q8_outputs_are_summed_in_the_gpus_canonical_order():
    """kernels/rf_q8.h: per block the exact integer dot, weighed by d_w * d_x; in stages of
    two blocks, each added by a fused multiply-add (fmaf) to the stage sum from 0; the
    stage sums folded left to right."""
    rng = np.random.default_rng(4)
    tensor = weight(rng, 8, 160)  # 5 blocks: stages of 2, 2 and 1
    backend = CpuBackend(hparams(), 1, 1)
    x = rng.standard_normal((3, 160)).astype(np.float32)
    got = backend.matmul_add(x, backend.linear(tensor), np.zeros((3, 8), np.float32))
    blocks = x.reshape(3, 5, 32)
    d_x = np.abs(blocks).max(axis=-1) / np.float32(127)  # int8 per block, rounding half away
    scaled = blocks / d_x[..., None]
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int64)
    d_w = np.frombuffer(tensor.data.tobytes(), np.uint8).reshape(8, 5, 18)[..., :2]
    d_w = np.ascontiguousarray(d_w).view(np.float16)[..., 0].astype(np.float32)
    w = (dequantize(tensor).reshape(8, 5, 32) / d_w[..., None]).astype(np.int64)  # nibble - 8
    for r in range(3):
        for o in range(8):
            total = np.float32(0)
            for stage in ((0, 1), (2, 3), (4,)):
                part = np.float32(0)
                for b in stage:
                    part = fmaf(d_w[o, b] * d_x[r, b], int(np.dot(q[r, b], w[o, b])), part)
                total = np.float32(total + part)
            assert got[r, o] == total, (r, o)


def fmaf(a: np.float32, b: int, c: np.float32) -> np.float32:
    """a * b + c rounded once to float32 (float64 holds it exactly here: checked)."""
    fused = float(a) * b + float(c)
    assert Fraction(fused) == Fraction(float(a)) * b + Fraction(float(c))
    return np.float32(fused)


def test_a_quantized_embedding_looks_up_the_dequantized_rows():
    rng = np.random.default_rng(5)
    backend = CpuBackend(hparams(), 1, 1)
    batch = StepBatch.prefill([0, 299, 17, 17], 0, 0, "none")
    for qtype in (Q.Q4_0, Q.Q8_0):
        tensor = weight(rng, 300, 64, qtype)
        looked_up = backend.embed(backend.embedding(tensor), batch)
        assert np.array_equal(looked_up, dequantize(tensor)[batch.tokens])
