"""The CPU backend's attention is row-independent: a token's output is bit-identical decoded
alone, beside other sessions' rows, or inside its prompt's chunk; and it is softmax
attention over the positions up to its own. Both with the fp16 KV pool and with the fp8
one, which holds the E4M3 bytes of the rotated keys and of the values, half the bytes."""

import threading

import numpy as np
import pytest
from gpu_checks import hparams

from rocforge_rt.backends.cpu import CpuBackend
from rocforge_rt.backends.cpu_kernels import PARALLEL_KERNELS
from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.kv_cache import kv_pool_bytes
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.kv_format import e4m3_to_float16, float32_to_e4m3

N_CTX = 96
SHAPES = [(9, 3, 64), (8, 8, 32), (4, 1, 128)]  # (query heads, KV heads, head dim)


@pytest.fixture(
    scope="module",
    params=[(*shape, kv) for kv in ("f16", "fp8") for shape in SHAPES],
    ids=lambda p: f"{p[0]}x{p[1]}x{p[2]}-{p[3]}",
)
def backend(request) -> CpuBackend:
    """Two slots of random keys and values in a pool of fp16 or fp8 elements."""
    n_head, n_kv, head_dim, kv_dtype = request.param
    hp = hparams(n_embd=n_head * head_dim, n_head=n_head, n_head_kv=n_kv, head_dim=head_dim)
    cpu = CpuBackend(hp, 2, N_CTX, kv_dtype=kv_dtype)
    rng = np.random.default_rng(n_head)
    for cache in (cpu.k_cache[0], cpu.v_cache[0]):
        values = rng.standard_normal(cache.shape).astype(np.float32)
        cache[:] = float32_to_e4m3(values) if kv_dtype == "fp8" else values.astype(np.float16)
    return cpu


def pool_values(cpu: CpuBackend, elements: np.ndarray) -> np.ndarray:
    """KV pool elements (fp16, or fp8 bytes) as their values, float64."""
    halves = e4m3_to_float16(elements) if cpu.kv_dtype == "fp8" else elements
    return halves.astype(np.float64)


def queries(cpu: CpuBackend, rows: int, seed: int) -> np.ndarray:
    hp = cpu.hparams
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, hp.n_head * hp.head_dim_k)).astype(np.float32)


def test_a_token_gets_the_same_bits_alone_batched_and_inside_a_prompt_chunk(backend):
    chunk = list(range(40, 73))  # a prompt chunk of slot 0 at positions 40..72
    q = queries(backend, len(chunk), 1)
    inside = backend.attention(q, 0, StepBatch.prefill([0] * len(chunk), 40, 0))
    other = queries(backend, 1, 2)
    for i, position in enumerate(chunk):
        alone = backend.attention(q[i : i + 1], 0, StepBatch.decode([0], [position], [0]))
        beside = backend.attention(
            np.concatenate([other, q[i : i + 1]]),
            0,
            StepBatch.decode([0, 0], [17, position], [1, 0]),
        )
        assert np.array_equal(alone[0], inside[i]), position
        assert np.array_equal(beside[1], inside[i]), position


def test_each_head_is_softmax_attention_over_the_positions_up_to_its_own(backend):
    hp = backend.hparams
    positions = [0, 1, 63, 95]
    q = queries(backend, len(positions), 3)
    got = backend.attention(q, 0, StepBatch.decode([0] * 4, positions, [1] * 4))
    group = hp.n_head // hp.n_head_kv
    for r, position in enumerate(positions):
        keys = pool_values(backend, backend.k_cache[0][1, : position + 1])  # [L, Hkv, D]
        values = pool_values(backend, backend.v_cache[0][1, : position + 1])
        for h in range(hp.n_head):
            query = q[r].reshape(hp.n_head, hp.head_dim_k)[h].astype(np.float64)
            scores = keys[:, h // group] @ query / np.sqrt(hp.head_dim_k)
            weights = np.exp(scores - scores.max())
            expected = weights @ values[:, h // group] / weights.sum()
            output = got[r].reshape(hp.n_head, hp.head_dim_v)[h]
            np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)


def test_attention_waits_while_another_thread_runs_a_parallel_kernel(backend):
    """Parallel kernels run one at a time in a process (cpu_kernels.PARALLEL_KERNELS)."""
    done = threading.Event()
    step = StepBatch.decode([0], [10], [0])
    worker = threading.Thread(
        target=lambda: (backend.attention(queries(backend, 1, 3), 0, step), done.set())
    )
    with PARALLEL_KERNELS:
        worker.start()
        assert not done.wait(0.3)
    worker.join(timeout=60)
    assert done.is_set()


def rotated(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Adjacent-pair RoPE of x [rows, heads, dim] in float32: (e * c - o * s, e * s + o * c)
    with row r's angles at positions[r]."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * c - odd * s, even * s + odd * c
    return out


@pytest.mark.parametrize("kv_dtype", ["f16", "fp8"])
def test_the_pool_holds_the_rotated_keys_and_the_values_in_its_format(kv_dtype):
    """A step's k, rotated in float32, and its v go into their rows' slots and positions as
    fp16 (numpy's cast) or as fp8 E4M3 bytes (`float32_to_e4m3`); the rest stays zero, and
    the rotated q that comes back is the same either way."""
    hp = hparams(n_embd=4 * 32, n_head=4, n_head_kv=2, head_dim=32)
    cpu = CpuBackend(hp, 2, N_CTX, kv_dtype=kv_dtype)
    rng = np.random.default_rng(5)
    qkv = (rng.standard_normal((5, hp.q_dim + hp.kv_dim_k + hp.kv_dim_v)) * 8).astype(np.float32)
    slots, positions = np.array([1, 0, 1, 0, 1]), np.array([0, 3, 17, 40, 95])
    q = cpu.rope_kv_append(qkv, 0, StepBatch.decode([0] * 5, positions, slots))
    qk = rotated(qkv[:, : hp.q_dim + hp.kv_dim_k].reshape(5, -1, 32), positions, cpu.rope_cos,
                 cpu.rope_sin)  # fmt: skip
    k, v = qk[:, hp.n_head :], qkv[:, hp.q_dim + hp.kv_dim_k :].reshape(5, 2, 32)
    stored = {"f16": lambda x: x.astype(np.float16), "fp8": float32_to_e4m3}[kv_dtype]
    assert np.array_equal(q.view(np.uint32), qk[:, : hp.n_head].view(np.uint32))
    for cache, expected in ((cpu.k_cache[0], k), (cpu.v_cache[0], v)):
        assert cache.dtype == {"f16": np.float16, "fp8": np.uint8}[kv_dtype]
        held = cache[slots, positions]
        assert np.array_equal(held.view(np.uint8), stored(expected).view(np.uint8))
        assert np.count_nonzero(cache) == np.count_nonzero(held)


def test_the_warm_up_of_an_fp8_pool_runs_the_attention_on_its_bytes(monkeypatch):
    """The daemon's warm-up compiles the kernels a step takes: attention over fp8 bytes
    (over fp16 bits: test_cpu_matmul's warm-up test)."""
    from rocforge_rt.backends import cpu

    elements = []

    def attend(q, keys_t, values, *rest):
        elements.append((keys_t.dtype, values.dtype))
        return compiled_attend(q, keys_t, values, *rest)

    compiled_attend = cpu.attend
    monkeypatch.setattr(cpu, "attend", attend)
    CpuBackend(hparams(), 1, 1, threads=1, kv_dtype="fp8").warm_up()
    assert elements == [(np.uint8, np.uint8)]


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's n greedy tokens, its sessions decoded in one batch."""
    sessions = [engine.open_session(prompt, max_tokens=n) for prompt in prompts]
    for session in sessions:
        session.eog_ids = frozenset()
    tokens = [[engine.prefill(session).token] for session in sessions]
    while live := [i for i, s in enumerate(sessions) if not s.finished]:
        for i, event in zip(live, engine.decode([sessions[i] for i in live]), strict=True):
            tokens[i].append(event.token)
    for session in sessions:
        engine.close_session(session)
    return tokens


def test_an_fp8_engine_decodes_alone_and_batched_alike_in_half_the_kv_memory(tiny_model):
    """Engine.load(kv_dtype="fp8") on the CPU: a pool of half the bytes (`kv_pool_bytes`),
    greedy tokens the same decoded alone or two sessions in a batch, and logits that follow
    the fp16 pool's (lossy: correlation >= 0.99 at every position of the prompt)."""
    prompts = [[5, 17, 42, 99, 3, 250, 7, 64, 128, 11], [200, 31, 8, 77]]
    fp8 = Engine.load(tiny_model, backend="cpu", n_slots=2, n_ctx=64, kv_dtype="fp8")
    f16 = Engine.load(tiny_model, backend="cpu", n_slots=2, n_ctx=64)
    assert (fp8.kv_dtype, f16.kv_dtype) == ("fp8", "f16")
    assert fp8.backend.device_info()["kv_dtype"] == "fp8"

    def pool(engine: Engine) -> int:
        return sum(a.nbytes for a in engine.backend.keys_t + engine.backend.v_cache)

    assert pool(fp8) == kv_pool_bytes(fp8.hparams, 2, 64, "fp8")
    assert 2 * pool(fp8) == pool(f16) == kv_pool_bytes(f16.hparams, 2, 64)
    alone = [greedy(fp8, [prompt], 8)[0] for prompt in prompts]
    assert greedy(fp8, prompts, 8) == alone
    ours, reference = fp8.logits(prompts[0]), f16.logits(prompts[0])
    assert not np.array_equal(ours, reference)  # the keys and values are rounded to fp8
    for row, expected in zip(ours, reference, strict=True):
        assert np.corrcoef(row, expected)[0, 1] >= 0.99
