"""The prompt GEMMs against the CPU reference (run on a GPU machine).

More than MMV_MAX_ROWS activation rows take a GEMM instead of the decode GEMV / MMV: the int8 GEMM
(kernels/gemm.hip) when batch invariant, else the vendor GEMM in fp16
(kernels/gemm_f16.hip + cuBLAS). Every op is compared with a
reference of its own arithmetic (int8: the CPU backend's q8 activations; vendor: weights
and activations rounded to fp16) to a max relative error of 1e-3, and with float32
activations to 2e-2; relative error is max |gpu - ref| / max |ref|. End to end, a
batch-invariant prompt's last logits from one prefill chunk equal those of the same
prompt finished by a decode step, and both GEMMs follow the CPU engine.
"""

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gpu_checks import hparams, rel_error, weight

from rocforge_rt.backends import BackendOptions, create_backend
from rocforge_rt.backends.cpu import CpuBackend
from rocforge_rt.backends.cpu_arithmetic import quantize_q8, rms_normalize, silu
from rocforge_rt.backends.gpu import cuda
from rocforge_rt.backends.gpu.backend import GpuBackend
from rocforge_rt.backends.gpu.kernel_constants import GEMV_MAX_ROWS, MMV_MAX_ROWS
from rocforge_rt.backends.gpu.kernel_variants import mmv_shapes
from rocforge_rt.backends.gpu.matmul_plan import MatmulTuning
from rocforge_rt.backends.gpu.workspace import Activation
from rocforge_rt.engine.engine import Engine
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.kv_format import (
    E4M3_HALF_BITS,
    KV_DTYPES,
    KV_ELEMENT_DTYPES,
    float32_to_e4m3,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device"),
]

KS = [576, 1536, 2048, 4096, 14336]
NS = [192, 576, 960, 3072]
MAX_ROWS = 4096  # the backends' buffers; the epilogue tests take up to 128 rows
GEMMS = ("int8", "vendor")


def row_counts(k: int, n: int) -> tuple[int, int]:
    """An odd count past the MMV's rows (past one 64-row tile, or just past the MMV) and 128."""
    odd = MMV_MAX_ROWS + 1 + (k + 3 * n) % 119
    return odd, 128


# Every matmul of a prompt chunk on the GEMM (the vendor one unless batch invariant), the
# small shapes here too.
EVERY_SIZE_ON_THE_GEMM = MatmulTuning(vendor_min_flop=0)


def make_gpu(gemm: str):
    # Buffers sized for the largest shapes below: K up to 14336, N up to 3 * 3072.
    shapes = hparams(n_embd=14336, n_ff=14336, n_head=48, n_head_kv=48)
    gpu = create_backend(
        "cuda", shapes, n_slots=1, n_ctx=64,
        options=BackendOptions(max_tokens=MAX_ROWS, batch_invariant=gemm == "int8",
                               matmul_tuning=EVERY_SIZE_ON_THE_GEMM),
    )  # fmt: skip
    return gpu


@pytest.fixture(scope="module", params=GEMMS)
def gpu(request):
    return make_gpu(request.param)


@pytest.fixture(scope="module")
def invariant_gpu():
    return make_gpu("int8")


@pytest.fixture(scope="module")
def cpu():
    return CpuBackend(hparams(), 1, 1)


def as_f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def references(gpu, activations: np.ndarray, dense) -> list[tuple[np.ndarray, float]]:
    """(activations @ dense.T as the GEMM in use computes it, 1e-3), (in float32, 2e-2)."""
    own = (
        quantize_q8(activations) @ dense.T
        if gpu.batch_invariant
        else as_f16(activations) @ as_f16(dense.dense).T
    )
    return [(own, 1e-3), (activations @ dense.T, 2e-2)]


def upload(gpu, values: np.ndarray) -> Activation:
    """Rows in a buffer of their own (the backend's own buffers are the ops' outputs)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    return Activation(gpu.workspace.upload(values), values.shape[0], values.shape[1])


def poison(gpu, buf) -> None:
    gpu.driver.memset(buf, 0xFF, gpu.stream)  # NaN everywhere: unwritten outputs fail


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
def test_gemm_with_fused_rmsnorm_matches_the_cpu(gpu, cpu, k, n):
    rng = np.random.default_rng(k * 7 + n * 3)
    w = weight(rng, n, k)
    gain_tensor = WeightTensor("g", Q.F32, (k,), rng.uniform(0.5, 1.5, k).astype(np.float32))
    matrix, gain, dense = gpu.linear(w), gpu.vector(gain_tensor), cpu.linear(w)
    for rows in row_counts(k, n):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        poison(gpu, gpu.workspace.qkv)
        got = gpu.to_host(gpu.norm_matmul(gpu.load_activation(x), gain, matrix))
        normed = rms_normalize(x, gain_tensor.data, 1e-5)
        for expected, tolerance in references(gpu, normed, dense):
            assert rel_error(got, expected) <= tolerance, (rows, tolerance)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
def test_gemm_residual_epilogue_matches_the_cpu(gpu, cpu, k, n):
    rng = np.random.default_rng(k * 5 + n)
    w = weight(rng, n, k)
    matrix, dense = gpu.linear(w), cpu.linear(w)
    for rows in row_counts(k, n):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        residual = rng.standard_normal((rows, n)).astype(np.float32)
        res = upload(gpu, residual)
        out = gpu.matmul_add(upload(gpu, x), matrix, res)
        assert out.ptr == res.ptr  # written in place, as the forward uses it
        got = gpu.to_host(out)
        for expected, tolerance in references(gpu, x, dense):
            assert rel_error(got, residual + expected) <= tolerance, (rows, tolerance)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n_ff", NS)
def test_gemm_swiglu_epilogue_matches_the_cpu(gpu, cpu, k, n_ff):
    rng = np.random.default_rng(k * 11 + n_ff)
    gate, up = weight(rng, n_ff, k, name="gate"), weight(rng, n_ff, k, name="up")
    gain_tensor = WeightTensor("g", Q.F32, (k,), rng.uniform(0.5, 1.5, k).astype(np.float32))
    matrix, gain = gpu.linear(gate, up), gpu.vector(gain_tensor)
    dense = cpu.linear(gate, up)
    for rows in row_counts(k, n_ff):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        poison(gpu, gpu.workspace.h)
        got = gpu.to_host(gpu.norm_gate_up_swiglu(gpu.load_activation(x), gain, matrix))
        normed = rms_normalize(x, gain_tensor.data, 1e-5)
        for gate_up, tolerance in references(gpu, normed, dense):
            if not gpu.batch_invariant:
                gate_up = as_f16(gate_up)  # the vendor path keeps gate|up in fp16
            expected = silu(gate_up[:, :n_ff]) * gate_up[:, n_ff:]
            assert rel_error(got, expected) <= tolerance, (rows, tolerance)


@pytest.mark.parametrize("k", [576, 2048, 4096, 14336])
@pytest.mark.parametrize("rows", [MMV_MAX_ROWS + 1, 512, 4096])
def test_gemm_at_prompt_chunk_sizes_matches_the_cpu(gpu, cpu, k, rows):
    """Whole prompt chunks: just past the MMV to 4096 rows, over every K of the
    1B/8B/SmolLM2 shapes."""
    rng = np.random.default_rng(k + rows)
    w = weight(rng, 960, k)
    gain_tensor = WeightTensor("g", Q.F32, (k,), rng.uniform(0.5, 1.5, k).astype(np.float32))
    matrix, gain, dense = gpu.linear(w), gpu.vector(gain_tensor), cpu.linear(w)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    poison(gpu, gpu.workspace.qkv)
    got = gpu.to_host(gpu.norm_matmul(gpu.load_activation(x), gain, matrix))
    normed = rms_normalize(x, gain_tensor.data, 1e-5)
    for expected, tolerance in references(gpu, normed, dense):
        assert rel_error(got, expected) <= tolerance, tolerance


@pytest.mark.parametrize(("k", "n"), [(576, 1024), (2048, 3072), (4096, 960)])
def test_gemm_over_q8_0_weights_matches_the_cpu(gpu, cpu, k, n):
    """Q8_0 matrices (tied embeddings as the LM head of a teacher-forced prompt)."""
    rng = np.random.default_rng(k + n)
    w = weight(rng, n, k, Q.Q8_0)
    gain_tensor = WeightTensor("g", Q.F32, (k,), rng.uniform(0.5, 1.5, k).astype(np.float32))
    matrix, gain, dense = gpu.linear(w), gpu.vector(gain_tensor), cpu.linear(w)
    for rows in row_counts(k, n):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        got = gpu.to_host(gpu.norm_matmul(gpu.load_activation(x), gain, matrix))
        normed = rms_normalize(x, gain_tensor.data, 1e-5)
        for expected, tolerance in references(gpu, normed, dense):
            assert rel_error(got, expected) <= tolerance, (rows, tolerance)


@contextmanager
def each_mmv_shape(gpu: GpuBackend) -> Iterator[Iterator[int]]:
    """The backend's matmuls planned with MMV shape 0, 1, ... of each tile count in turn (the
    last past a count's declared shapes), as each yielded index is taken: every declared
    rf_mmv kernel runs. The backend's own tuning after."""
    own = gpu.matmul

    def shapes() -> Iterator[int]:
        for index in range(max(len(mmv_shapes(t)) for t in (1, 2, 4, 8))):
            gpu.matmul = own.retuned(dataclasses.replace(own.tuning, mmv_shape_index=index))
            yield index

    try:
        yield shapes()
    finally:
        gpu.matmul = own


@pytest.mark.parametrize("k", [576, 608, 4096, 14336])  # 608: an odd block count
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_gemm_and_gemv_give_bit_identical_rows(invariant_gpu, k, qtype):
    """Batch invariant, a row's outputs do not depend on the batch: the GEMV (one row), the
    MMV (a decode batch: each kernel shape, whole and partial tiles) and the GEMM (a prompt
    chunk) share one summation order (kernels/rf_q8.h), for every epilogue."""
    gpu = invariant_gpu
    rng = np.random.default_rng(k)
    n = 968  # not a whole number of 16-row tiles
    w = gpu.linear(weight(rng, n, k, qtype))
    gate_up = gpu.linear(weight(rng, n, k, qtype, "gate"), weight(rng, n, k, qtype, "up"))
    gain_tensor = WeightTensor("g", Q.F32, (k,), rng.uniform(0.5, 1.5, k).astype(np.float32))
    gain = gpu.vector(gain_tensor)
    x = rng.standard_normal((MMV_MAX_ROWS + 17, k)).astype(np.float32)
    residual = rng.standard_normal((x.shape[0], n)).astype(np.float32)

    def run(rows: int) -> list[np.ndarray]:
        norm = gpu.to_host(gpu.norm_matmul(gpu.load_activation(x[:rows]), gain, w))
        swiglu = gpu.to_host(gpu.norm_gate_up_swiglu(gpu.load_activation(x[:rows]), gain, gate_up))
        res = upload(gpu, residual[:rows])
        added = gpu.to_host(gpu.matmul_add(upload(gpu, x[:rows]), w, res))
        return [norm, swiglu, added]

    chunk = run(x.shape[0])
    with each_mmv_shape(gpu) as shapes:
        for choice in shapes:
            for rows in (1, 2, GEMV_MAX_ROWS, 9, 16, 17, 32, 33, MMV_MAX_ROWS):
                for batch, prompt in zip(run(rows), chunk, strict=True):
                    assert np.array_equal(batch, prompt[:rows]), (rows, choice)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_qkv_rope_writes_the_same_q_k_v_for_decode_rows_and_prompt_chunks(cpu, kv_dtype):
    """The QKV GEMV's and MMV's RoPE + KV-append epilogue (decode rows) and the GEMM + rope
    kernel (a prompt chunk) write bit-identical q and KV rows, into either pool format, and
    both follow the CPU."""
    hp = hparams()
    n_ctx, chunk_rows = 96, MMV_MAX_ROWS + 16
    gpu = create_backend(
        "cuda", hp, n_slots=1, n_ctx=n_ctx,
        options=BackendOptions(max_tokens=chunk_rows, batch_invariant=True, kv_dtype=kv_dtype),
    )  # fmt: skip
    rng = np.random.default_rng(12)
    parts = [weight(rng, n, hp.n_embd, name=name)
             for n, name in ((hp.q_dim, "q"), (hp.kv_dim_k, "k"), (hp.kv_dim_v, "v"))]  # fmt: skip
    gain_values = rng.uniform(0.5, 1.5, hp.n_embd).astype(np.float32)
    gain_tensor = WeightTensor("g", Q.F32, (hp.n_embd,), gain_values)
    wqkv, gain, dense = gpu.linear(*parts), gpu.vector(gain_tensor), cpu.linear(*parts)
    x = rng.standard_normal((chunk_rows, hp.n_embd)).astype(np.float32)

    def run(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        for buf in (gpu.workspace.k_cache[0], gpu.workspace.v_cache[0]):
            gpu.driver.memset(buf, 0, gpu.stream)
        batch = StepBatch.prefill(list(range(rows)), 3, 0)  # positions 3 ..
        gpu.write_step_state(batch)
        q = gpu.to_host(gpu.norm_qkv_rope(gpu.load_activation(x[:rows]), gain, wqkv, 0, batch))
        caches = []
        for buf in (gpu.workspace.k_cache[0], gpu.workspace.v_cache[0]):
            host = np.empty((n_ctx, hp.kv_dim_k), dtype=KV_ELEMENT_DTYPES[kv_dtype])
            gpu.driver.copy_dtoh(host, buf)
            caches.append(host[3 : 3 + rows])
        return q, *caches

    chunk = run(chunk_rows)
    with each_mmv_shape(gpu) as shapes:
        for choice in shapes:
            for rows in (1, 2, GEMV_MAX_ROWS, 17, MMV_MAX_ROWS):
                for decode, prompt in zip(run(rows), chunk, strict=True):
                    assert np.array_equal(decode, prompt[:rows]), (rows, choice)
    batch = StepBatch.prefill(list(range(chunk_rows)), 3, 0)
    q_ref = CpuBackend(hp, 1, n_ctx).norm_qkv_rope(x, gain_tensor.data, dense, 0, batch)
    assert rel_error(chunk[0], q_ref.reshape(chunk[0].shape)) <= 1e-3


def test_an_fp8_pool_holds_each_value_rounded_as_the_reference_rounds_it():
    """V passes RoPE unrotated, so the rope kernel's fp8 pool holds exactly
    float32_to_e4m3 of each v: ties (to even), subnormals, saturation at +-448 (infinities
    too), NaN and signed zeros among them."""
    hp = hparams()
    rows = 64
    options = BackendOptions(max_tokens=rows, kv_dtype="fp8")
    gpu = create_backend("cuda", hp, n_slots=1, n_ctx=rows, options=options)
    rng = np.random.default_rng(3)
    width = hp.q_dim + hp.kv_dim_k + hp.kv_dim_v
    qkv = rng.standard_normal((rows, width)).astype(np.float32)
    finite = E4M3_HALF_BITS.view(np.float16)[np.isfinite(E4M3_HALF_BITS.view(np.float16))]
    finite = np.sort(finite.astype(np.float32))
    edges = np.concatenate([
        finite, (finite[1:] + finite[:-1]) / 2, np.nextafter(finite, np.float32(np.inf)),
        np.nextafter(finite, np.float32(-np.inf)),
        np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0, 448.0, 464.0, 465.0, 1e30, 2.0**-10]),
        rng.standard_normal(4096).astype(np.float32) * np.float32(10.0) ** rng.uniform(-4, 3, 4096),
    ]).astype(np.float32)  # fmt: skip
    v = np.resize(edges, (rows, hp.kv_dim_v))
    qkv[:, hp.q_dim + hp.kv_dim_k :] = v
    assert edges.size <= v.size
    batch = StepBatch.prefill(list(range(rows)), 0, 0)
    gpu.write_step_state(batch)
    gpu.driver.copy_htod(gpu.workspace.qkv, qkv)
    gpu.rope(Activation(gpu.workspace.qkv, rows, width), 0)
    pool = np.empty((rows, hp.kv_dim_v), dtype=np.uint8)
    gpu.driver.copy_dtoh(pool, gpu.workspace.v_cache[0])
    assert np.array_equal(pool, float32_to_e4m3(v))


def test_batch_invariant_prefill_chunk_equals_prefill_then_decode(synthetic_model):
    """Batch invariant, the last row of a one-chunk prefill (GEMM) equals the same token
    decoded (GEMV)."""
    engine = Engine.load(synthetic_model, backend="cuda", n_ctx=256, batch_invariant=True)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, engine.hparams.n_vocab, 61).tolist()
    assert len(prompt) <= engine.prefill_chunk
    whole = engine.logits(prompt)  # one chunk through the GEMM path, logits of every row
    engine.logits(prompt[:-1])  # the prefix through the GEMM path fills the cache ...
    last = len(prompt) - 1
    step = engine._run(StepBatch.decode([prompt[-1]], [last], [0]), True)  # ... a GEMV step
    assert np.array_equal(whole[-1], step.logits[0])  # one summation order: bit-identical
    assert np.array_equal(whole[:-1], engine.logits(prompt[:-1]))  # deterministic


@pytest.mark.parametrize(("gemm", "cpu_activations"), [("int8", "q8"), ("vendor", "f32")])
def test_prefill_follows_the_cpu_engine(synthetic_model, gemm, cpu_activations):
    """Both GEMMs follow the CPU engine of the nearest arithmetic (q8 activations for the
    int8 GEMM, float32 for the vendor GEMM's fp16 operands), the prompt one 96-row chunk."""
    gpu = Engine.load(synthetic_model, backend="cuda", n_ctx=256, batch_invariant=gemm == "int8")
    cpu = Engine.load(synthetic_model, backend="cpu", n_ctx=256, activations=cpu_activations)
    prompt = np.random.default_rng(6).integers(0, gpu.hparams.n_vocab, 96).tolist()
    got, ref = gpu.logits(prompt), cpu.logits(prompt)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    confident = (top2[:, 1] - top2[:, 0]) >= 0.05 * np.max(np.abs(ref))
    assert np.array_equal(np.argmax(got, -1)[confident], np.argmax(ref, -1)[confident])
    assert np.mean(np.abs(got - ref)) <= 5e-3 * np.max(np.abs(ref))  # no drift, only rounding
    assert rel_error(got, ref) <= 5e-2


def test_overlapped_launches_give_the_same_logits_as_serialized_ones(synthetic_model):
    """Programmatic dependent launch lets each kernel start before the previous one ends;
    every kernel waits for its inputs inside, so the logits must not move by a bit."""
    runs = []
    for overlap in (False, True):
        engine = Engine.load(synthetic_model, backend="cuda", n_ctx=256, overlap=overlap)
        assert engine.backend.overlap == (overlap and engine.backend.driver.supports_overlap)
        prompt = np.random.default_rng(9).integers(0, engine.hparams.n_vocab, 40).tolist()
        session = engine.open_session(prompt, max_tokens=16)
        session.eog_ids = frozenset()
        events = [engine.prefill(session)]
        while not session.finished:
            events.extend(engine.decode([session]))
        runs.append(([e.token for e in events], [e.logprob for e in events],
                     engine.logits(prompt + [e.token for e in events][:-1])))  # fmt: skip
    (tokens_a, logprobs_a, logits_a), (tokens_b, logprobs_b, logits_b) = runs
    assert tokens_a == tokens_b and logprobs_a == logprobs_b
    assert np.array_equal(logits_a, logits_b)


def test_resident_weights_take_at_most_1_1x_the_gguf_tensor_bytes(synthetic_model):
    """Weights are repacked, never expanded: the device holds the GGUF's quant and scale
    bytes (scales moved apart), norms as they are, and a tied LM head shares the table."""
    from dataclasses import fields

    from rocforge_rt.backends.gpu.matmul import DeviceMatrix

    engine = Engine.load(synthetic_model, backend="cuda", n_ctx=64)
    weights = engine.weights
    held = [weights.token_embd, weights.output_norm, weights.lm_head]
    held += [getattr(layer, f.name) for layer in weights.layers for f in fields(layer)]
    buffers = {}
    for item in held:
        for buf in (item.qs, item.d) if isinstance(item, DeviceMatrix) else (item,):
            buffers[buf.ptr] = buf.nbytes
    gguf_bytes = sum(t.nbytes for t in engine.model.tensors.values())
    assert sum(buffers.values()) <= 1.1 * gguf_bytes


@pytest.mark.parametrize("n_sessions", [12, MMV_MAX_ROWS + 2])
def test_decode_batches_replay_in_their_graph(synthetic_model, n_sessions):
    """12 sessions decode through the MMV, 66 through the vendor GEMM (cuBLAS kernels
    captured with the expansions); the graph gives the same tokens and log-probabilities
    as eager steps."""
    runs = []
    for mode in ("deferred", "graph"):
        engine = Engine.load(synthetic_model, backend="cuda", n_ctx=64, n_slots=n_sessions,
                             mode=mode, matmul_tuning=EVERY_SIZE_ON_THE_GEMM)  # fmt: skip
        rng = np.random.default_rng(4)
        sessions = [engine.open_session(rng.integers(0, 1000, 5).tolist(), max_tokens=6)
                    for _ in range(n_sessions)]  # fmt: skip
        for session in sessions:
            session.eog_ids = frozenset()
            engine.prefill(session)
        steps = [[(e.token, e.logprob) for e in engine.decode(sessions)] for _ in range(4)]
        assert engine.backend.runtime_stats()["graph_captures"] == (2 if mode == "graph" else 0)
        runs.append(steps)
    assert runs[0] == runs[1]
