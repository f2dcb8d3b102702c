"""Sampling on the device (kernels/sampling.hip) against the reference rules
(rocforge_rt/step/sampling.py), on the same logits; and seeded sampling end to end.

The kernel ranks, cuts and draws in exact integer weights, as the reference does, so
the tokens must be equal: both take each weight's exp in float64 and round it to
float32, so only an exp within a float64 ulp of a float32 rounding boundary could differ.
"""

from dataclasses import replace

import numpy as np
import pytest
from gpu_checks import hparams

from rocforge_rt.backends import BackendOptions, create_backend
from rocforge_rt.backends.gpu import cuda
from rocforge_rt.backends.gpu.workspace import Activation
from rocforge_rt.engine.engine import Engine
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.sampling import (
    RowSampling,
    Sampler,
    SamplingParams,
    draw_bits,
    draw_point,
    nucleus_by_id,
    recent_window,
    sample_row,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device"),
]

ROWS = 8
PARAMS = [
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, logprobs=5),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.5, top_p=0.5),
    SamplingParams(temperature=0.3, top_k=1000),
    SamplingParams(logprobs=20),  # greedy with alternatives
    SamplingParams(temperature=0.9, top_k=2, logprobs=1),
    SamplingParams(temperature=4.0, top_p=0.999),
    SamplingParams(),  # greedy
]


def sampler_logits(rng: np.random.Generator, n_vocab: int, kind: str) -> np.ndarray:
    """Rows of logits: spread, peaked, or with ties (repeated values, both zeros)."""
    x = rng.standard_normal((ROWS, n_vocab)).astype(np.float32)
    if kind == "peaked":
        x *= 6.0
    if kind == "ties":
        x = np.round(x * 2) / 2  # few distinct values: every cut falls among equals
        x[:, ::7] = -0.0
    return x


def sampling_backend(logits: np.ndarray):
    """A CUDA backend of ROWS slots whose logits buffer holds `logits` [ROWS, n_vocab]."""
    gpu = create_backend("cuda", hparams(n_vocab=logits.shape[1]), n_slots=ROWS, n_ctx=64,
                         options=BackendOptions(max_tokens=ROWS, mode="deferred"))  # fmt: skip
    gpu.driver.copy_htod(gpu.workspace.logits, logits)
    return gpu


def sample_on_device(gpu, samplers: list[Sampler], positions: list[int]):
    """One decode step's sampling of the logits buffer, row r by samplers[r] for the token
    after positions[r]."""
    batch = StepBatch.decode([0] * ROWS, positions, list(range(ROWS)), RowSampling.of(samplers))
    logits = Activation(gpu.workspace.logits, ROWS, gpu.hparams.n_vocab)
    return gpu.run_step(batch, lambda _: logits, False)


# 600000: more argmax slices than the combining block has threads (ARGMAX_SLICE, ARGMAX_THREADS).
@pytest.mark.parametrize("n_vocab", [1000, 49152, 128256, 270000, 600000])
@pytest.mark.parametrize("kind", ["spread", "peaked", "ties"])
def test_device_sampler_picks_what_the_reference_picks(n_vocab, kind):
    rng = np.random.default_rng(n_vocab + len(kind))
    logits = sampler_logits(rng, n_vocab, kind)
    gpu = sampling_backend(logits)
    mismatches = 0
    for trial in range(12):
        samplers = [Sampler(p) for p in PARAMS]
        positions = rng.integers(0, 60, ROWS).tolist()
        out = sample_on_device(gpu, samplers, positions)
        for row, sampler in enumerate(samplers):
            want = sample_row(logits[row], sampler.params, sampler.seed, positions[row] + 1)
            mismatches += int(out.tokens[row]) != want.token
            seen = (trial, row, positions[row], sampler.seed)  # the seed: drawn at random
            assert out.logprobs[row] == pytest.approx(want.logprob, abs=1e-4), seen
            assert [t for t, _ in out.top[row]] == [t for t, _ in want.top], seen
            np.testing.assert_allclose([v for _, v in out.top[row]],
                                       [v for _, v in want.top], atol=1e-4)  # fmt: skip
    assert mismatches == 0


NEAR_BITS = 34  # a near draw falls within cumulative[-1] / 2^NEAR_BITS of a token boundary
_U64 = np.uint64


def _mulhi(a: np.ndarray, b: np.uint64) -> np.ndarray:
    """The high 64 bits of a * b, uint64 (kernels/sampling.hip rf_mulhi64)."""
    low = _U64(0xFFFFFFFF)
    a_lo, a_hi, b_lo, b_hi = a & low, a >> _U64(32), b & low, b >> _U64(32)
    p0, p1, p2, p3 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (p0 >> _U64(32)) + (p1 & low) + (p2 & low)
    return p3 + (p1 >> _U64(32)) + (p2 >> _U64(32)) + (mid >> _U64(32))


def boundary_distance(cumulative: np.ndarray, r: np.ndarray) -> np.ndarray:
    """How far each draw point r lies from the nearest end of the token it picks."""
    j = np.searchsorted(cumulative, r, side="right")
    start = np.where(j > 0, cumulative[np.maximum(j - 1, 0)], _U64(0))
    return np.minimum(r - start, cumulative[j] - r)


def seeds_drawing_near_a_boundary(cumulative: np.ndarray, position: int, count: int) -> list[int]:
    """The first `count` seeds whose draw at `position` falls within cumulative[-1] >>
    NEAR_BITS weight units of a token boundary of the nucleus `cumulative` (sampling's
    nucleus_by_id): candidates found 2^20 seeds at a time in numpy, each checked with the
    reference's own draw_point."""
    mass, margin = int(cumulative[-1]), int(cumulative[-1]) >> NEAR_BITS
    found: list[int] = []
    for start in range(0, 1 << 32, 1 << 20):
        seeds = np.arange(start, start + (1 << 20), dtype=np.uint64)
        bits = draw_bits(seeds, position)
        near = seeds[boundary_distance(cumulative, _mulhi(bits, _U64(mass))) < margin]
        for seed in near[: count - len(found)].tolist():
            r = draw_point(cumulative, seed, position)
            assert boundary_distance(cumulative, np.array([r], dtype=np.uint64))[0] < margin
            found.append(seed)
        if len(found) == count:
            return found
    raise AssertionError("too few near draws")


def test_draws_near_a_token_boundary_over_thousands_of_equal_logits_are_the_references():
    """With few distinct logits thousands of tokens share each weight, so an exp whose last
    bit differed from the reference's would move many boundaries at once. Draws chosen to
    fall within 2^-NEAR_BITS of the nucleus weight from a boundary must still give the
    reference's tokens (with numpy's float32 exp in the reference instead, 55 of these 192
    moved on the machine that wrote this test)."""
    rng = np.random.default_rng(7)
    logits = sampler_logits(rng, 128256, "ties")
    gpu = sampling_backend(logits)
    params = [SamplingParams(temperature=t) for t in (4.0, 1.0, 0.7, 1.5, 2.0, 0.9, 3.0, 1.2)]
    position = 40  # the drawn token's; each row's input token sits at position - 1
    seeds = [seeds_drawing_near_a_boundary(nucleus_by_id(logits[row], p)[1], position, 24)
             for row, p in enumerate(params)]  # fmt: skip
    for trial in range(24):
        samplers = [Sampler(replace(p, seed=seeds[row][trial])) for row, p in enumerate(params)]
        out = sample_on_device(gpu, samplers, [position - 1] * ROWS)
        for row, sampler in enumerate(samplers):
            want = sample_row(logits[row], sampler.params, sampler.seed, position)
            assert int(out.tokens[row]) == want.token, (trial, row, sampler.seed)


PENALIZED = [
    SamplingParams(repetition_penalty=1.3),  # greedy
    SamplingParams(temperature=0.8, min_p=0.05, logprobs=3),
    SamplingParams(temperature=1.2, top_p=0.9, min_p=0.1, frequency_penalty=0.7),
    SamplingParams(temperature=0.7, top_k=40, presence_penalty=-1.5, repetition_penalty=0.8),
    SamplingParams(temperature=1.0, frequency_penalty=2.0, presence_penalty=2.0, logprobs=5),
    SamplingParams(temperature=1.0, min_p=0.5, repetition_penalty=2.0**-126),  # saturates
    SamplingParams(temperature=0.5, top_k=1000, repetition_penalty=1.1, min_p=0.02),
    SamplingParams(temperature=1.0),  # unpenalized beside penalized rows
]


@pytest.mark.parametrize("n_vocab", [1000, 49152, 128256])
def test_device_penalties_and_min_p_pick_what_the_reference_picks(n_vocab):
    """Each row's recent tokens (uploaded, then the step's input token recorded by the
    penalty kernel) hold the row's best tokens several times, so the penalties move the
    pick; the device's tokens, log-probabilities and alternatives are the reference's."""
    gpu = create_backend("cuda", hparams(n_vocab=n_vocab), n_slots=ROWS, n_ctx=256,
                         options=BackendOptions(max_tokens=ROWS, mode="deferred"))  # fmt: skip
    rng = np.random.default_rng(n_vocab)
    logits = sampler_logits(rng, n_vocab, "peaked")
    for trial in range(8):
        contexts = []
        for row in range(ROWS):
            best = np.argsort(-logits[row])[:4]
            length = int(rng.integers(1, 150))
            contexts.append(rng.choice(np.concatenate([best, best, [0, 1, 2]]), length).tolist())
        samplers = [Sampler(p) for p in PENALIZED]
        positions = [len(c) - 1 for c in contexts]
        batch = StepBatch.decode([c[-1] for c in contexts], positions, list(range(ROWS)),
                                 RowSampling.of(samplers, contexts))  # fmt: skip
        gpu.driver.copy_htod(gpu.workspace.logits, logits)  # the penalties change it in place
        out = gpu.run_step(batch, lambda _: Activation(gpu.workspace.logits, ROWS, n_vocab), False)
        for row, sampler in enumerate(samplers):
            want = sampler.sample(logits[row], positions[row] + 1, recent_window(contexts[row]))
            assert int(out.tokens[row]) == want.token, (trial, row)
            assert out.logprobs[row] == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in out.top[row]] == [t for t, _ in want.top], (trial, row)


def test_the_device_sampler_advances_the_step_state():
    n_vocab = 4096
    options = BackendOptions(max_tokens=2)
    gpu = create_backend("cuda", hparams(n_vocab=n_vocab), n_slots=2, n_ctx=64, options=options)
    logits = np.random.default_rng(1).standard_normal((2, n_vocab)).astype(np.float32)
    gpu.driver.copy_htod(gpu.workspace.logits, logits)
    sampling = RowSampling.of([Sampler(SamplingParams(temperature=1.0, seed=4)),
                               Sampler(SamplingParams())])  # fmt: skip
    batch = StepBatch.decode([7, 8], [10, 20], [0, 1], sampling)
    out = gpu.run_step(batch, lambda _: Activation(gpu.workspace.logits, 2, n_vocab), False)
    state = np.empty(4, dtype=np.int32)
    gpu.driver.copy_dtoh(state[:2], gpu.workspace.step_tokens, nbytes=8)
    gpu.driver.copy_dtoh(state[2:], gpu.workspace.step_positions, nbytes=8)
    assert state.tolist() == [*out.tokens.tolist(), 11, 21]
    assert out.tokens[1] == int(np.argmax(logits[1]))


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine.load(default_model, backend="cuda", n_ctx=256, n_slots=3)


def generate(engine: Engine, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    session = engine.open_session(prompt, sampling=params, max_tokens=n)
    session.eog_ids = frozenset()
    tokens = [engine.prefill(session).token]
    while not session.finished:
        tokens.append(engine.decode([session])[0].token)
    engine.close_session(session)
    return tokens


def test_seeded_sampling_reproduces_and_another_seed_differs(engine, reference):
    prompt = reference["cases"][0]["ids"]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    first = generate(engine, prompt, params, 24)
    assert generate(engine, prompt, params, 24) == first
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=43)
    assert generate(engine, prompt, other_seed, 24) != first
    assert generate(engine, prompt, SamplingParams(), 24) != first  # not greedy in disguise


def test_seeded_sessions_draw_the_same_batched_or_alone(engine, reference):
    params = [SamplingParams(temperature=0.8, top_k=50, seed=s, logprobs=2) for s in (1, 2, 3)]
    prompts = [case["ids"] for case in reference["cases"]]
    alone = [generate(engine, p, sp, 10) for p, sp in zip(prompts, params, strict=True)]
    sessions = [engine.open_session(p, sampling=sp, max_tokens=10)
                for p, sp in zip(prompts, params, strict=True)]  # fmt: skip
    for s in sessions:
        s.eog_ids = frozenset()
    batched = [[engine.prefill(s).token] for s in sessions]
    for _ in range(9):
        for row, event in zip(batched, engine.decode(sessions), strict=True):
            row.append(event.token)
    for s in sessions:
        engine.close_session(s)
    assert batched == alone


def test_steady_sampled_decode_copies_nothing_to_the_device(engine, reference, monkeypatch):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=9, logprobs=3)
    session = engine.open_session(reference["cases"][1]["ids"], sampling=params, max_tokens=12)
    session.eog_ids = frozenset()
    engine.prefill(session)
    engine.decode([session])  # the first decode step writes the step state once
    copies = []
    real_copy = engine.backend.driver.copy_htod
    monkeypatch.setattr(engine.backend.driver, "copy_htod",
                        lambda *a, **k: copies.append(a) or real_copy(*a, **k))  # fmt: skip
    events = [engine.decode([session])[0] for _ in range(5)]
    engine.close_session(session)
    assert copies == []
    assert all(len(e.top_logprobs) == 3 for e in events)
