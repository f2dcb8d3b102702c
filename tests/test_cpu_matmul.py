"""The CPU backend's matmul is row-independent: a row's outputs are bit-identical alone or
in any batch, so a session's tokens do not depend on who else is generating."""

import threading
from fractions import Fraction

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gpu_checks import hparams, weight

from rocforge_rt.backends.cpu import CpuBackend
from rocforge_rt.backends.cpu_arithmetic import q8_matmul, q8_matmul_reference, quantize_q8
from rocforge_rt.backends.cpu_kernels import PARALLEL_KERNELS
from rocforge_rt.backends.cpu_weights import BlockMatrix, dequantize, held_bytes
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import held_together

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
    """kernels/rf_q8.h: per block the exact integer dot, weighed by d_w * d_x (d_x rounded
    to fp16 after it rounded the integers, as llama.cpp's q8 blocks keep it); in stages of
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
    d_x = d_x.astype(np.float16).astype(np.float32)
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


KERNEL_SHAPES = [(3072, 576, Q.Q4_0), (576, 1536, Q.Q8_0), (10, 160, Q.Q4_0), (10, 160, Q.Q8_0)]


@pytest.mark.parametrize(("n_out", "n_in", "qtype"), KERNEL_SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_compiled_matmul_is_the_numpy_canonical_sum_bit_for_bit(n_out, n_in, qtype, threads):
    """cpu_kernels' numba loops against q8_matmul_reference (the canonical arithmetic in
    numpy), on even and odd block counts (160: a last stage of one block), one row (decode)
    or several (the prompt path), on one thread or two."""
    rng = np.random.default_rng(n_out * n_in + threads)
    backend = CpuBackend(hparams(), 1, 1, threads=threads)
    matrix = backend.linear(weight(rng, n_out, n_in, qtype))
    for rows in (1, 2, 3, 9, 17):
        x = rng.standard_normal((rows, n_in)).astype(np.float32)
        got = backend.matmul_add(x, matrix, np.zeros((rows, n_out), np.float32))
        assert np.array_equal(bits(got), bits(q8_matmul_reference(x, matrix))), rows


def block_matrix(rng, n_out, n_in, nibbles):
    """A BlockMatrix of random quant bytes (every nibble, or int8 from -128) and fp16 scales;
    the bytes and scales it was built from."""
    n_blocks = n_in // 32
    if nibbles:
        quants = rng.integers(0, 256, (n_out, n_blocks, 16), dtype=np.uint8)
    else:
        quants = rng.integers(-128, 128, (n_out, n_blocks, 32), dtype=np.int8)
    scales = rng.random((n_out, n_blocks)).astype(np.float16)
    return BlockMatrix.from_blocks(quants, scales), quants, scales


@pytest.mark.parametrize("nibbles", [True, False])
@pytest.mark.parametrize(("n_out", "n_in"), [(1, 32), (63, 96), (64, 64), (65, 160), (130, 96)])
def test_a_tiled_matrix_gives_back_each_rows_integers_and_scales(n_out, n_in, nibbles):
    """BlockMatrix holds its rows in tiles of LANES (the last one narrower); `integers` reads
    any rows back: element j of a Q4_0 block is byte j's low nibble - 8, element j + 16 its
    high nibble - 8; an int8 block's element j is byte j; the fp16 scales as float32. It
    holds the bytes it was given, the fp16 scales as such."""
    rng = np.random.default_rng(n_out * n_in)
    matrix, quants, scales = block_matrix(rng, n_out, n_in, nibbles)
    assert matrix.nbytes == quants.nbytes + scales.nbytes
    if nibbles:
        low, high = (quants & 15).astype(np.int8) - 8, (quants >> 4).astype(np.int8) - 8
        quants = np.concatenate([low, high], axis=-1)
    ids = rng.permutation(n_out)
    ints, row_scales = matrix.integers(ids)
    assert np.array_equal(ints, quants[ids])
    assert row_scales.dtype == np.float32
    assert np.array_equal(row_scales, scales[ids].astype(np.float32))


@pytest.mark.parametrize("nibbles", [True, False])
@pytest.mark.parametrize(("n_out", "n_in"), [(1, 32), (63, 96), (64, 64), (65, 160), (130, 96)])
def test_the_tiled_kernels_are_the_canonical_sum_whatever_the_tiles_width(n_out, n_in, nibbles):
    """q8_tiled_matmul of both layouts (up to 8 rows: decode) against q8_matmul_reference, bit
    for bit: tiles of LANES rows and a narrower last one, odd block counts (a last stage of
    one block), one to eight rows, and the integer extremes (activations of +-127 against
    Q4_0's -8 or int8's -128: block dots of -32512, at int16's edge)."""
    rng = np.random.default_rng(n_out + n_in)
    matrix = block_matrix(rng, n_out, n_in, nibbles)[0]
    n_blocks = n_in // 32
    if nibbles:  # every integer -8
        lowest, low = np.zeros((n_out, n_blocks, 16), np.uint8), -8
    else:
        lowest, low = np.full((n_out, n_blocks, 32), -128, np.int8), -128
    extreme = BlockMatrix.from_blocks(lowest, np.ones((n_out, n_blocks), np.float16))
    for rows in (1, 2, 3, 8):
        x = rng.standard_normal((rows, n_in)).astype(np.float32)
        x[0] = np.float32(127 / 128)  # every integer 127, d_x = 2^-7 (an fp16)
        for m in (matrix, extreme):
            assert np.array_equal(bits(q8_matmul(x, m)), bits(q8_matmul_reference(x, m))), rows
        assert q8_matmul(x[:1], extreme)[0, 0] == 127 * 32 * low * n_blocks / 128


# fp16 bits of every kind of finite scale: zeros, subnormals (the least, the largest), the
# least normal, 1, the largest (65504), values between; either sign
SPECIAL_SCALES = np.array(
    [0, 0x8000, 1, 0x3FF, 0x8001, 0x83FF, 0x400, 0x3C00, 0x7BFF, 0xFBFF, 0x3555, 0xB2AB], np.uint16
).view(np.float16)


@pytest.mark.parametrize("nibbles", [True, False])
def test_the_kernels_take_every_finite_fp16_scale_exactly(nibbles):
    """The matrix holds the file's fp16 scales; the kernels take them to float32 themselves:
    bit for bit the numpy reference's products (numpy's float16 -> float32) for scales of
    every kind (a kind a row), subnormals included."""
    rng = np.random.default_rng(9)
    quants = block_matrix(rng, 130, 160, nibbles)[1]
    scales = np.resize(SPECIAL_SCALES, 130)[:, None].repeat(5, axis=1)
    matrix = BlockMatrix.from_blocks(quants, scales)
    x = rng.standard_normal((3, 160)).astype(np.float32)
    expected = q8_matmul_reference(x, matrix)
    assert np.count_nonzero(expected) == 3 * 130 - 3 * 2 * 11  # but the rows of zero scales
    assert np.array_equal(bits(q8_matmul(x, matrix)), bits(expected))


@pytest.mark.parametrize("qtypes", [(Q.Q4_0, Q.Q4_0, Q.Q4_0), (Q.Q4_0, Q.Q8_0, Q.Q4_0)])
def test_tensors_stacked_in_one_matrix_keep_their_values_across_tiles(qtypes):
    """Rows of 70, 30 and 5 stacked (as Q|K|V): tiles of LANES rows that take rows of two
    tensors; Q4_0 beside Q8_0 held as int8."""
    rng = np.random.default_rng(6)
    parts = [weight(rng, n, 96, qtype) for n, qtype in zip((70, 30, 5), qtypes, strict=True)]
    matrix = BlockMatrix.from_tensors(*parts)
    assert matrix.nibbles == (Q.Q8_0 not in qtypes)
    dense = np.concatenate([dequantize(t) for t in parts])
    assert np.array_equal(matrix.dense, dense)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    assert np.array_equal(bits(q8_matmul(x, matrix)), bits(q8_matmul_reference(x, matrix)))


@pytest.mark.parametrize(("qtype", "block_bytes"), [(Q.Q4_0, 18), (Q.Q8_0, 34)])
def test_quantized_weights_are_held_in_the_files_bytes(qtype, block_bytes):
    """Q4_0: 16 nibble bytes + the fp16 scale a block of 32, 18 bytes as in the file; Q8_0: 32
    int8 + the scale, 34. The start-up memory check counts as much. No float32 expansion
    until the f32 mode asks for `dense`."""
    tensor = weight(np.random.default_rng(7), 1536, 576, qtype)
    matrix = CpuBackend(hparams(), 1, 1).linear(tensor)
    assert matrix.quants.dtype == (np.uint8 if qtype == Q.Q4_0 else np.int8)
    assert matrix.scales.dtype == np.uint16  # fp16 bits
    assert matrix.nbytes == 1536 * 576 // 32 * block_bytes == tensor.data.nbytes
    assert held_bytes((tensor,)) == matrix.nbytes
    assert "dense" not in vars(matrix)  # the cached float32 expansion was never built


def test_a_mixed_stack_is_counted_as_the_backend_holds_it():
    """The start-up memory check counts a stacked matrix (Q|K|V, gate|up) as `linear` holds
    it: Q4_0 alone in 18-byte blocks; Q4_0 beside Q8_0 all in 34-byte (int8) blocks; any
    other type in the stack makes all of it float32."""
    rng = np.random.default_rng(8)
    q, k = weight(rng, 64, 256), weight(rng, 32, 256, Q.Q8_0)
    v = WeightTensor("v", Q.F32, (32, 256), rng.standard_normal((32, 256)).astype(np.float32))
    backend = CpuBackend(hparams(), 1, 1)
    for stack, block_bytes in (((q,), 18), ((q, k), 34), ((q, k, v), 4 * 32)):
        held = backend.linear(*stack)
        rows = sum(t.shape[0] for t in stack)
        assert held_bytes(stack) == held.nbytes == rows * 256 // 32 * block_bytes, stack


def test_the_start_up_memory_budget_counts_what_the_cpu_backend_holds(tiny_model):
    """weights_memory_bytes('cpu', ...) (server.config.plan's weights figure) is the bytes of
    the arrays the backend built from the model (the tied LM head shares the embedding's)."""
    from rocforge_rt.backends import weights_memory_bytes
    from rocforge_rt.engine.engine import Engine

    engine = Engine.load(tiny_model, backend="cpu", n_ctx=16)
    held: dict[int, int] = {}

    def walk(value) -> None:
        if isinstance(value, BlockMatrix | np.ndarray):
            held[id(value)] = value.nbytes
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif hasattr(value, "__dataclass_fields__"):
            for item in vars(value).values():
                walk(item)

    walk(engine.weights)
    assert sum(held.values()) == weights_memory_bytes("cpu", held_together(engine.model))


RSS_SCRIPT = """
import json, sys
from rocforge_rt.backends import weights_memory_bytes
from rocforge_rt.engine.engine import Engine
from rocforge_rt.model.gguf_file import load_model_file
from rocforge_rt.step.forward import held_together
import rocforge_rt.backends.cpu  # numba and llvmlite: loaded before the first reading

def status(key):
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith(key + ":"))

start = status("VmRSS")
model = load_model_file(sys.argv[1])  # the metadata (vocabulary, merges) as Python objects
before = status("VmRSS")
try:  # VmHWM from here on: the load's peak (reading the metadata has one of its own)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    reset = True
except OSError:
    reset = False
engine = Engine.load(model, backend="cpu", n_ctx=256)
after, peak = status("VmRSS"), status("VmHWM")
tensors = [t.nbytes for t in model.tensors.values()]
print(json.dumps({
    "start": start, "before": before, "after": after, "peak": peak if reset else None,
    "kv": sum(a.nbytes for a in engine.backend.k_cache + engine.backend.v_cache),
    "tensors": sum(tensors), "largest": max(tensors),
    "counted": weights_memory_bytes("cpu", held_together(model)),
}))
"""


@pytest.mark.slow
def test_resident_memory_after_loading_the_default_model_is_what_the_memory_check_counts(
    default_model,
):
    """Over Engine.load of the default model's file (read before: its metadata as Python
    objects, ~50 MiB), VmRSS of a fresh process grows by the start-up memory check's figure
    (the weights as the backend holds them, plus the KV pool) within 10%; by at most 1.2x
    the GGUF's tensor bytes, plus the KV pool, plus 24 MiB (tokenizer, RoPE tables); and
    within 96 MiB more from the start. Its peak during the load is at most that figure plus
    the largest tensor (the file pages of the one being copied) plus 24 MiB: the weights
    stay quantized as in the file, read a tile at a time, and each tensor's mapped pages
    leave the resident set once it is copied. (The float32 expansion made it ~8x; float32
    scales, and the file's pages kept to the upload's end: 1.17x the tensor bytes plus the
    KV pool, the peak 2.65x; now 1.01x and 1.38x.)"""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(default_model)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    m = json.loads(done.stdout.splitlines()[-1])
    grown, counted = m["after"] - m["before"], m["counted"] + m["kv"]
    assert abs(grown - counted) <= 0.1 * counted, m
    assert grown <= 1.2 * m["tensors"] + m["kv"] + (24 << 20), m
    assert m["after"] - m["start"] <= 1.2 * m["tensors"] + m["kv"] + (96 << 20), m
    if m["peak"] is None:
        pytest.skip("VmHWM cannot be reset here (/proc/self/clear_refs)")
    assert m["peak"] - m["before"] <= counted + m["largest"] + (24 << 20), m


NO_CACHE_SCRIPT = """
import numpy as np
from numba.core import caching

caching.CacheImpl._locator_classes = []  # as where no cache directory is writable
from rocforge_rt.backends.cpu_arithmetic import q8_matmul, q8_matmul_reference
from rocforge_rt.backends.cpu_weights import BlockMatrix

quants = np.arange(2 * 3 * 16, dtype=np.uint8).reshape(2, 3, 16)
matrix = BlockMatrix.from_blocks(quants, np.full((2, 3), 0.5, np.float16))
x = np.linspace(-1, 1, 2 * 96, dtype=np.float32).reshape(2, 96)
assert np.array_equal(q8_matmul(x, matrix), q8_matmul_reference(x, matrix))
print("ok")
"""


def test_the_kernels_compile_uncached_where_numba_has_nowhere_to_cache():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", NO_CACHE_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_backends_warm_up_compiles_every_kernel_both_layouts():
    """The daemon's warm-up calls CpuBackend.warm_up before `ready`: every kernel a step
    takes (the matmul of the Q4_0 and int8 layouts, RMSNorm, RoPE of one row and of a
    chunk's strided rows, attention over the fp16 pool) is compiled."""
    from numba import types

    from rocforge_rt.backends import cpu_attention, cpu_kernels

    CpuBackend(hparams(), 1, 1, threads=1).warm_up()
    words = {signature[1].dtype for signature in cpu_kernels.q8_tiled_matmul.signatures}
    assert words == {types.uint16, types.int16}
    for kernel in (cpu_kernels.rms_norm_rows, cpu_attention.attend):
        assert kernel.signatures
    assert len(cpu_kernels.rope_rows.signatures) >= 2


def test_importing_rocforge_rt_before_numpy_shortens_openblas_spinning_unless_told_otherwise():
    """OpenBLAS's idle workers spin ~0.1 s after each call by default, holding a core the
    matmul needs; rocforge_rt sets OPENBLAS_THREAD_TIMEOUT=4 unless the environment has one."""
    import os
    import subprocess
    import sys

    script = "import os, rocforge_rt; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for given, expected in ((None, "4"), ("9", "9")):
        run_env = env if given is None else {**env, "OPENBLAS_THREAD_TIMEOUT": given}
        done = subprocess.run([sys.executable, "-c", script], env=run_env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.stdout.strip() == expected, done.stderr


def test_the_matmul_waits_while_another_thread_runs_a_parallel_kernel():
    """Parallel kernels run one at a time in a process (cpu_kernels.PARALLEL_KERNELS)."""
    rng = np.random.default_rng(7)
    matrix, _, _ = block_matrix(rng, 64, 64, nibbles=True)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (q8_matmul(x, matrix), done.set()))
    with PARALLEL_KERNELS:
        worker.start()
        assert not done.wait(0.3)
    worker.join(timeout=60)
    assert done.is_set()
