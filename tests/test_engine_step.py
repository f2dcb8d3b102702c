"""One scheduler step for everything (Engine.step): decode rows and prompt chunks of several
sessions in one forward pass give each session the tokens it gets in steps of its own, on the
CPU and (batch invariant) on a GPU."""

from dataclasses import replace

import pytest

from rocforge_rt.backends.gpu import cuda
from rocforge_rt.engine.engine import Engine
from rocforge_rt.errors import EngineError, EngineErrorCode
from rocforge_rt.step.batch import SequencePart, StepBatch
from rocforge_rt.step.sampling import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 64, 128, 2, 9], [200, 31, 8, 77, 15, 140, 6, 90, 4],
           list(range(30, 51))]  # fmt: skip
SAMPLING = SamplingParams(temperature=0.9, top_k=20, seed=7, logprobs=3)
GPU = [pytest.mark.gpu, pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device")]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=GPU)])
def engine(request) -> Engine:
    """4 slots of 64 positions: the tiny model on the CPU; on a GPU the SmolLM2-shape model
    (the attention kernels take no head dim below 32), batch invariant, each step run on its
    own (pipelined decode, which takes decode rows from a step issued before: its tests)."""
    if request.param == "cpu":
        model = request.getfixturevalue("tiny_model")
        return Engine.load(model, backend="cpu", n_slots=4, n_ctx=64)
    model = request.getfixturevalue("synthetic_model")
    options = {"batch_invariant": True, "lookahead": False}
    return Engine.load(model, backend="cuda", n_slots=4, n_ctx=64, **options)


def alone(engine: Engine, prompt: list[int], n: int) -> list[tuple]:
    """The session's (token, logprob, alternatives) run in steps of its own."""
    session = engine.open_session(prompt, sampling=SAMPLING, max_tokens=n)
    session.eog_ids = frozenset()
    events = [engine.prefill(session)]
    while not session.finished:
        events += engine.decode([session])
    engine.close_session(session)
    return [(e.token, e.logprob, e.top_logprobs) for e in events]


def test_ragged_rows_put_every_logits_row_last_and_keep_each_sequence_in_order():
    batch = StepBatch.ragged([
        SequencePart([1, 2, 3], 4, 0, wants_logits=True),   # a prompt's last chunk
        SequencePart([5, 6], 0, 1, wants_logits=False),     # a chunk before its prompt ends
        SequencePart([7], 9, 2, wants_logits=True),         # a decode row
    ])  # fmt: skip
    assert batch.tokens.tolist() == [1, 2, 5, 6, 3, 7]
    assert batch.positions.tolist() == [4, 5, 0, 1, 6, 9]
    assert batch.slots.tolist() == [0, 0, 1, 1, 0, 2]
    assert batch.logit_rows.tolist() == [4, 5] and batch.sampling.rows == 2


def test_the_next_decode_step_fits_only_while_every_rows_next_position_is_in_its_slot():
    batch = StepBatch.ragged([SequencePart([7], 61, 0, wants_logits=True),
                              SequencePart([8], 62, 1, wants_logits=True)])  # fmt: skip
    assert batch.next_decode_fits(64)  # positions 62 and 63 come next
    assert not batch.next_decode(batch.tokens).next_decode_fits(64)  # 63 and 64
    assert batch.next_decode(batch.tokens).positions.tolist() == [62, 63]


@pytest.mark.parametrize("chunk", [3, 16])  # 16: a chunk past the GEMV's 8 rows beside short ones
@pytest.mark.parametrize("ragged", [True, False])
def test_prompts_arriving_together_prefill_in_one_step_beside_running_streams(
    engine, ragged, chunk, monkeypatch
):
    """Four sessions' prompts, chunked in several steps while earlier sessions decode, give
    each session exactly the tokens, log-probabilities and alternatives it gets alone, each
    step one forward pass (a backend without ragged steps runs the same schedule pass by
    pass)."""
    expected = [alone(engine, p, 6) for p in PROMPTS]
    monkeypatch.setattr(engine, "caps", replace(engine.caps, ragged_steps=ragged))
    passes = []
    run = engine._run
    monkeypatch.setattr(engine, "_run", lambda *a: passes.append(a[0].n_tokens) or run(*a))
    steps: list[list[int]] = []  # the passes of each step (their rows)
    sessions = [engine.open_session(p, sampling=SAMPLING, max_tokens=6) for p in PROMPTS]
    for s in sessions:
        s.eog_ids = frozenset()
    got: list[list[tuple]] = [[] for _ in sessions]
    decoding: list[int] = []
    while any(not s.finished for s in sessions):
        chunks = [(i, min(chunk, len(s.pending))) for i, s in enumerate(sessions)
                  if i not in decoding and not s.finished]  # fmt: skip
        before = len(passes)
        out = engine.step([sessions[i] for i in decoding], [(sessions[i], n) for i, n in chunks])
        steps.append(passes[before:])
        for i, event in zip(decoding, out.decoded, strict=True):
            got[i].append((event.token, event.logprob, event.top_logprobs))
        for (i, _), event in zip(chunks, out.prefilled, strict=True):
            if event is not None:
                got[i].append((event.token, event.logprob, event.top_logprobs))
                decoding.append(i)
        decoding = [i for i in decoding if not sessions[i].finished]
    assert got == expected
    first_chunks = [min(chunk, len(p)) for p in PROMPTS]  # what the first step takes of each
    assert steps[0] == ([sum(first_chunks)] if ragged else first_chunks)
    assert all(len(s) == 1 for s in steps) if ragged else any(len(s) > 1 for s in steps)


def test_a_chunk_that_does_not_end_its_prompt_samples_nothing(engine):
    session = engine.open_session(PROMPTS[2], max_tokens=4)
    first = engine.step([], [(session, 4)])
    assert first.prefilled == [None] and session.n_past == 4 and len(session.pending) == 5
    last = engine.step([], [(session, 5)])
    assert last.prefilled[0] is not None and session.pending == [last.prefilled[0].token]


def test_a_step_refuses_a_session_twice_or_more_prompt_tokens_than_it_has(engine):
    a = engine.open_session(PROMPTS[0], max_tokens=4)
    b = engine.open_session(PROMPTS[1], max_tokens=4)
    engine.prefill(b)
    for decode, prefill in (([], [(a, 8)]), ([], [(a, 0)]), ([], [(a, 3), (a, 3)]),
                            ([b], [(b, 1)])):  # fmt: skip
        with pytest.raises(EngineError) as info:
            engine.step(decode, prefill)
        assert info.value.code is EngineErrorCode.INVALID_ARGUMENT
    assert (a.n_past, len(a.pending), len(b.pending)) == (0, 7, 1)  # nothing was taken
    with pytest.raises(EngineError) as info:
        engine.step([a], [])
    assert info.value.code is EngineErrorCode.NOT_DECODABLE


def test_an_empty_step_runs_nothing(engine, monkeypatch):
    monkeypatch.setattr(engine, "_run", lambda *a: pytest.fail("a pass ran"))
    out = engine.step([], [])
    assert (out.decoded, out.prefilled) == ([], [])
