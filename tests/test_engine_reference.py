"""The CPU engine agrees with llama.cpp on the default model (../shared/reference)."""

import numpy as np
import pytest

from rocforge_rt.engine.engine import Engine
from rocforge_rt.step.batch import StepBatch


@pytest.fixture(scope="module")
def engine(default_model) -> Engine:
    return Engine.load(default_model, backend="cpu", n_ctx=256)


def cases(reference):
    return reference["cases"]


def last_logits(engine: Engine, ids: list[int]) -> np.ndarray:
    return engine.logits(ids)[-1]


def test_prompt_ids_are_the_reference_ids(engine, reference):
    for case in cases(reference):
        assert engine.tokenizer.encode(case["prompt"]) == case["ids"]


def test_top1_matches_wherever_llamacpp_is_confident(engine, reference):
    for case in cases(reference):
        (top1, l1), (_, l2) = case["top20"][0], case["top20"][1]
        if l1 - l2 >= 0.5:
            assert int(np.argmax(last_logits(engine, case["ids"]))) == top1, case["prompt"]


def test_our_top1_is_among_llamacpps_top2(engine, reference):
    """A check that holds at every reference point: none of the three has a 0.5 margin."""
    for case in cases(reference):
        top2 = {t for t, _ in case["top20"][:2]}
        assert int(np.argmax(last_logits(engine, case["ids"]))) in top2, case["prompt"]


def test_top10_overlap_is_at_least_8_of_10(engine, reference):
    for case in cases(reference):
        ours = set(np.argsort(-last_logits(engine, case["ids"]))[:10].tolist())
        theirs = {t for t, _ in case["top20"][:10]}
        assert len(ours & theirs) >= 8, case["prompt"]


def test_logits_of_llamacpp_top20_differ_by_at_most_one(engine, reference):
    for case in cases(reference):
        logits = last_logits(engine, case["ids"])
        worst = max(abs(float(logits[t]) - value) for t, value in case["top20"])
        assert worst <= 1.0, (case["prompt"], worst)


def test_teacher_forced_argmax_follows_llamacpp_greedy_at_90_percent(engine, reference):
    hits = total = 0
    for case in cases(reference):
        sequence = case["ids"] + case["greedy"][:-1]
        predicted = np.argmax(engine.logits(sequence), axis=-1)[len(case["ids"]) - 1 :]
        hits += int(np.sum(predicted == np.array(case["greedy"])))
        total += len(case["greedy"])
    assert hits / total >= 0.9, f"{hits}/{total}"


def test_a_token_gets_the_same_logits_at_the_end_of_its_prompt_and_decoded(engine, reference):
    """Matmuls and attention are row-independent: a prompt's last position gets the same
    bits in a one-pass prefill as decoded after the rest (with a BLAS attention the chat
    case's differed by 0.7, and its greedy second token with them)."""
    for case in cases(reference):
        ids = case["ids"] + case["greedy"][:1]
        in_prompt = last_logits(engine, ids)
        engine.logits(ids[:-1])
        decoded = engine._run(StepBatch.decode([ids[-1]], [len(ids) - 1], [0]), True)
        assert np.array_equal(decoded.logits[0], in_prompt), case["prompt"]


NEAR_TIE = 0.25  # logits within which rounding order decides a greedy choice


def test_greedy_generation_streams_its_decoded_text_and_opens_like_llamacpp(engine, reference):
    """The first token is llama.cpp's; the second too, unless our logits put llama.cpp's
    choice within NEAR_TIE of ours (a near-tie that the two attention roundings decide: in
    the chat case llama.cpp's 290 sits 0.03 below our 42)."""
    from rocforge_rt.engine.generate import Generation

    for case in cases(reference):
        events = list(Generation(engine, case["ids"], max_tokens=len(case["greedy"])))
        tokens = [e.token for e in events]
        assert "".join(e.text for e in events) == engine.tokenizer.decode(tokens)
        assert tokens[0] == case["greedy"][0], case["prompt"]
        if tokens[1] != case["greedy"][1]:
            second = last_logits(engine, case["ids"] + tokens[:1])
            gap = float(second[tokens[1]] - second[case["greedy"][1]])
            assert gap <= NEAR_TIE, (case["prompt"], gap)
