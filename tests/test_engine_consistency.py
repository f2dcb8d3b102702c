"""The engine's ways of computing the same thing agree: cached decode, chunked prefill, batching."""

import numpy as np
import pytest

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.errors import EngineError, EngineErrorCode
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import forward
from rocforge_rt.step.sampling import SamplingParams

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]


@pytest.fixture()
def engine(tiny_model) -> Engine:
    return Engine.load(tiny_model, backend="cpu", n_slots=3, n_ctx=64, prefill_chunk=4)


def greedy_tokens(engine: Engine, prompt: list[int], n: int) -> list[int]:
    session = engine.open_session(prompt, max_tokens=n)
    tokens = [engine.prefill(session).token]
    while not session.finished:
        tokens.append(engine.decode([session])[0].token)
    engine.close_session(session)
    return tokens


def test_cached_decode_equals_a_full_forward_over_the_whole_sequence(engine):
    generated = greedy_tokens(engine, PROMPT, 8)
    full = engine.logits(PROMPT + generated[:-1], slot=2)
    assert np.argmax(full[len(PROMPT) - 1 :], axis=-1).tolist() == generated


def test_chunked_prefill_gives_the_logits_of_a_single_pass(engine):
    session = engine.open_session(PROMPT, sampling=SamplingParams(logprobs=5), max_tokens=1)
    chunked = engine.prefill(session)  # prefill_chunk=4: three forward passes
    engine.close_session(session)
    single = engine.logits(PROMPT, slot=1)[-1]
    logprobs = single - np.log(np.sum(np.exp(single - single.max()))) - single.max()
    assert chunked.token == int(np.argmax(single))
    assert chunked.logprob == pytest.approx(float(logprobs[chunked.token]), abs=1e-4)


QUESTIONS = [
    "Who are you?",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three colors.",
    "How do plants make food?",
    "Tell me a short joke.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
]


@pytest.fixture(scope="module")
def smollm2(default_model) -> Engine:
    return Engine.load(default_model, backend="cpu", n_slots=len(QUESTIONS), n_ctx=128)


def test_batched_decode_equals_decoding_each_session_alone(smollm2):
    """SmolLM2's greedy replies to 8 chat prompts, decoded alone and all 8 in one batch.

    With a matmul whose rounding depends on the batch, int8 roundings flip over 30 layers
    and near-tied greedy choices change ("trained by Hugging" / "trained by the H")."""
    chat = smollm2.tokenizer.apply_chat_template
    prompts = [smollm2.tokenizer.encode(chat([{"role": "user", "content": q}])) for q in QUESTIONS]
    alone = [greedy_tokens(smollm2, p, 32) for p in prompts]
    sessions = [smollm2.open_session(p, max_tokens=32) for p in prompts]
    together = [[smollm2.prefill(s).token] for s in sessions]
    while live := [i for i, s in enumerate(sessions) if not s.finished]:
        events = smollm2.decode([sessions[i] for i in live])
        for i, event in zip(live, events, strict=True):
            together[i].append(event.token)
    for session in sessions:
        smollm2.close_session(session)
    assert together == alone


def test_a_full_pool_answers_busy_and_a_closed_session_frees_its_slot(engine):
    sessions = [engine.open_session(PROMPT) for _ in range(3)]
    with pytest.raises(EngineError, match="busy") as info:
        engine.open_session(PROMPT)
    assert info.value.code is EngineErrorCode.BUSY
    engine.close_session(sessions[0])
    engine.open_session(PROMPT)


def test_a_prompt_that_fills_the_context_is_rejected_as_context_full(engine):
    with pytest.raises(EngineError, match="context_full") as info:
        engine.open_session(list(range(64)))
    assert info.value.code is EngineErrorCode.CONTEXT_FULL


def test_generation_stops_with_length_at_the_end_of_the_context(engine):
    session = engine.open_session(list(range(60)), max_tokens=100)
    events = [engine.prefill(session)]
    while not session.finished:
        events.extend(engine.decode([session]))
    assert events[-1].finish_reason == FinishReason.LENGTH
    assert session.n_past == 64  # every KV position used


def test_token_ids_outside_the_vocabulary_are_rejected(engine):
    with pytest.raises(EngineError, match="outside the vocabulary") as info:
        engine.open_session([1, 2, engine.hparams.n_vocab])
    assert info.value.code is EngineErrorCode.INVALID_ARGUMENT


def test_sampling_an_end_of_generation_id_ends_the_turn_with_stop_token(engine):
    tokens = greedy_tokens(engine, PROMPT, 6)
    stop = tokens[2]
    session = engine.open_session(PROMPT, max_tokens=6)
    session.eog_ids = frozenset({stop})  # as the GGUF's <|im_end|> is for the default model
    events = [engine.prefill(session)]
    while not session.finished:
        events.extend(engine.decode([session]))
    assert [e.token for e in events] == tokens[: tokens.index(stop) + 1]
    assert events[-1].finish_reason is FinishReason.STOP_TOKEN
    assert all(e.finish_reason is None for e in events[:-1])


def test_another_turn_continues_the_same_cache(engine):
    session = engine.open_session(PROMPT[:5], max_tokens=1)
    first = engine.prefill(session)
    engine.append(session, PROMPT[5:], max_tokens=1)
    second = engine.prefill(session)
    whole = engine.logits(PROMPT[:5] + [first.token] + PROMPT[5:], slot=2)
    assert second.token == int(np.argmax(whole[-1]))


def test_forward_logits_rows_follow_the_batch_request(engine):
    batch = StepBatch.prefill(PROMPT, 0, 0, "none")
    assert forward(engine.backend, engine.weights, batch).shape == (0, engine.hparams.n_vocab)
