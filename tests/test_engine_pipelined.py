"""Pipelined decode: after a decode-only step the backend issues the next one before this one
is read back, and the engine takes it only for sessions that want exactly that step. Every
session gets the tokens it gets without pipelining, whatever ends, arrives or changes beside
it; on the CPU backend's lazy model of it in CI, and on a GPU (graph replays)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from rocforge_rt.backends.cpu import CpuBackend
from rocforge_rt.backends.gpu import cuda
from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.scheduling import pack_step
from rocforge_rt.engine.session import Session
from rocforge_rt.model.gguf_file import load_model_file
from rocforge_rt.step.sampling import SamplingParams

GPU = [pytest.mark.gpu, pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device")]
SAMPLED = SamplingParams(temperature=0.9, top_k=20, seed=7, logprobs=3)
N_CTX = 48


def engines(kind: str, request: pytest.FixtureRequest) -> tuple[Engine, Engine]:
    """(pipelined, reference) engines of 4 slots: the tiny model on the CPU; on a GPU the
    SmolLM2-shape model, batch invariant, in graph mode with and without lookahead."""
    if kind == "cpu":
        model = load_model_file(request.getfixturevalue("tiny_model"))
        backend = CpuBackend(model.hparams, 4, N_CTX, lookahead=True)
        pipelined = Engine(model, backend, n_slots=4, n_ctx=N_CTX)
        return pipelined, Engine.load(model, backend="cpu", n_slots=4, n_ctx=N_CTX)
    model = load_model_file(request.getfixturevalue("synthetic_model"))
    options = {"backend": "cuda", "n_slots": 4, "n_ctx": N_CTX, "batch_invariant": True}
    return Engine.load(model, **options), Engine.load(model, lookahead=False, **options)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=GPU)])
def pair(request) -> tuple[Engine, Engine]:
    return engines(request.param, request)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrives: int = 0  # the step at which it joins
    sampling: SamplingParams = SamplingParams()
    eog: frozenset[int] = frozenset()
    events: list[tuple] = field(default_factory=list)


def count_calls(backend: Any, name: str) -> list[int]:
    """Count the calls of one of the backend's methods (on this instance)."""
    calls = [0]
    method: Callable[..., Any] = getattr(backend, name)

    def counted(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        return method(*a, **kw)

    setattr(backend, name, counted)
    return calls


def serve(engine: Engine, requests: list[Request], budget: int = 8) -> list[list[tuple]]:
    """Schedule the requests as the daemon does (each joins at its step; every decoding
    session's token, then prompt chunks oldest first within `budget`); each one's
    (token, logprob, alternatives) in order."""
    live: dict[int, tuple[Request, Session]] = {}
    decoding: list[Session] = []
    waiting: list[Session] = []
    step = 0
    while step == 0 or live or any(r.arrives >= step for r in requests):
        for r in requests:
            if r.arrives == step:
                s = engine.open_session(r.prompt, sampling=r.sampling, max_tokens=r.max_tokens)
                s.eog_ids = r.eog
                live[id(s)] = (r, s)
                waiting.append(s)
        decode, chunks = pack_step(budget, decoding, waiting, lambda s: len(s.pending))
        out = engine.step(decode, chunks)
        done = [(s, e) for s, e in zip(decode, out.decoded, strict=True)]
        for (s, _), e in zip(chunks, out.prefilled, strict=True):
            if e is not None:
                waiting.remove(s)
                decoding.append(s)
                done.append((s, e))
        for s, e in done:
            live[id(s)][0].events.append((e.token, e.logprob, e.top_logprobs))
            if s.finished:
                decoding.remove(s)
                del live[id(s)]
                engine.close_session(s)
        step += 1
    return [r.events for r in requests]


def scenario(eog: frozenset[int] = frozenset()) -> list[Request]:
    """Streams that end at different steps (token limits, an end token), with prompts
    arriving while others decode, greedy and sampled."""
    return [
        Request([5, 17, 42, 99, 3], 12),
        Request([11, 64, 128, 2, 9, 31], 7, sampling=SAMPLED),
        Request([200, 31, 8, 77], 10, arrives=3, eog=eog),
        Request(list(range(30, 45)), 6, arrives=5, sampling=SAMPLED),
    ]


def test_every_session_gets_the_tokens_it_gets_without_pipelining(pair):
    pipelined, reference = pair
    expected = serve(reference, scenario())
    taken = count_calls(pipelined.backend, "take_ahead")
    assert serve(pipelined, scenario()) == expected
    assert taken[0] == 6  # of 13 steps: the decode steps after a decode-only step


PENALIZED = SamplingParams(
    temperature=0.9, top_k=20, seed=3, min_p=0.05,
    repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
)  # fmt: skip


def test_penalized_sessions_get_the_tokens_they_get_without_pipelining(pair):
    """The recent tokens the penalties count advance with each step issued ahead (on a GPU,
    in the device's copy) as they do step by step."""

    def requests() -> list[Request]:
        return [
            Request([5, 17, 42, 99, 3], 12, sampling=PENALIZED),
            Request([11, 64, 5, 5, 5], 10, sampling=SamplingParams(repetition_penalty=1.5)),
            Request(list(range(30, 45)), 8, arrives=2),
        ]

    pipelined, reference = pair
    expected = serve(reference, requests())
    greedy_unpenalized = [Request([11, 64, 5, 5, 5], 10)]
    assert serve(reference, greedy_unpenalized)[0] != expected[1]  # the penalty acts
    assert serve(pipelined, requests()) == expected


def test_a_session_ending_on_an_end_token_leaves_the_others_their_tokens(pair):
    """The step issued ahead still holds the ended session's row: it is dropped, the other
    rows are taken."""
    pipelined, reference = pair
    ending = serve(reference, scenario())[2]
    eog = frozenset({ending[4][0]})  # its fifth token, mid-way, now ends it
    expected = serve(reference, scenario(eog))
    assert len(expected[2]) < len(ending)
    assert serve(pipelined, scenario(eog)) == expected


def test_a_new_turn_is_not_given_the_step_issued_for_the_last_one(pair):
    """A session that ended on an end token (read after the next step was issued) and goes
    on with a one-token turn feeds that token, at the position the step issued ahead used."""
    pipelined, reference = pair

    def run(engine: Engine, eog: frozenset[int]) -> list[tuple]:
        s = engine.open_session([7, 8, 9, 10], sampling=SAMPLED, max_tokens=12)
        s.eog_ids = eog
        events = [engine.prefill(s)]
        while not s.finished:
            events += engine.decode([s])
        if events[-1].finish_reason == "stop_token":
            engine.append(s, [(events[-1].token + 1) % engine.hparams.n_vocab], max_tokens=4)
            events += [engine.decode([s])[0] for _ in range(3)]
        engine.close_session(s)
        return [(e.token, e.finish_reason) for e in events]

    tokens = [token for token, _ in run(reference, frozenset())]
    end = next(k for k in range(3, len(tokens)) if tokens[k] not in tokens[:k])
    expected = run(reference, frozenset({tokens[end]}))  # that token now ends the turn
    assert len(expected) == end + 4 and expected[end][1] == "stop_token"
    assert run(pipelined, frozenset({tokens[end]})) == expected


def furthest_position_issued_ahead(backend: Any) -> list[int]:
    """Watch the backend: the furthest position a step issued ahead writes (one stream)."""
    furthest, run_step, take_ahead = [-1], backend.run_step, backend.take_ahead

    def watched_run_step(batch: Any, *a: Any, **kw: Any) -> Any:
        out = run_step(batch, *a, **kw)
        if out.ahead:
            furthest[0] = int(batch.positions.max()) + 1
        return out

    def watched_take_ahead(again: bool) -> Any:
        out = take_ahead(again)
        if out.ahead:
            furthest[0] += 1
        return out

    backend.run_step, backend.take_ahead = watched_run_step, watched_take_ahead
    return furthest


def test_the_step_issued_ahead_never_writes_past_a_slot(pair):
    """A stream that runs to the end of its context ends there with the same tokens; no
    step is issued ahead for a position past the slot's end."""
    pipelined, reference = pair
    prompt = list(range(3, 3 + N_CTX - 8))
    expected = serve(reference, [Request(prompt, N_CTX)])
    assert len(expected[0]) == 9  # its first token, then decode steps at positions 40..47
    furthest = furthest_position_issued_ahead(pipelined.backend)
    assert serve(pipelined, [Request(prompt, N_CTX)]) == expected
    assert furthest[0] == N_CTX - 1


def test_other_work_drops_the_step_issued_ahead(pair):
    """Teacher-forced logits in between: the step issued ahead is dropped, the session's
    tokens go on unchanged."""
    pipelined, reference = pair
    runs = []
    for engine in (reference, pipelined):
        s = engine.open_session([4, 5, 6], max_tokens=12)
        tokens = [engine.prefill(s).token, engine.decode([s])[0].token]
        engine.logits([9, 10, 11], slot=(s.slot + 1) % 4)
        tokens += [engine.decode([s])[0].token for _ in range(4)]
        runs.append(tokens)
    assert runs[0] == runs[1]
