"""The CPU backend's attention is row-independent: a token's output is bit-identical decoded
alone, beside other sessions' rows, or inside its prompt's chunk; and it is softmax
attention over the positions up to its own."""

import threading

import numpy as np
import pytest
from gpu_checks import hparams

from rocforge_rt.backends.cpu import CpuBackend
from rocforge_rt.backends.cpu_kernels import PARALLEL_KERNELS
from rocforge_rt.step.batch import StepBatch

N_CTX = 96


@pytest.fixture(scope="module", params=[(9, 3, 64), (8, 8, 32), (4, 1, 128)])
def backend(request) -> CpuBackend:
    """Two slots of random keys and values; (query heads, KV heads, head dim)."""
    n_head, n_kv, head_dim = request.param
    hp = hparams(n_embd=n_head * head_dim, n_head=n_head, n_head_kv=n_kv, head_dim=head_dim)
    cpu = CpuBackend(hp, 2, N_CTX)
    rng = np.random.default_rng(n_head)
    for cache in (cpu.k_cache[0], cpu.v_cache[0]):
        cache[:] = rng.standard_normal(cache.shape).astype(np.float16)
    return cpu


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
        keys = backend.k_cache[0][1, : position + 1].astype(np.float64)  # [L, Hkv, D]
        values = backend.v_cache[0][1, : position + 1].astype(np.float64)
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
