"""Sampling: greedy is argmax, seeds reproduce, top-k/top-p cut the candidates."""

import numpy as np
import pytest

from rocforge_rt.engine.sampling import Sampler, SamplingParams
from rocforge_rt.errors import EngineError

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 0.0], dtype=np.float32)


def draws(params: SamplingParams, n: int = 200) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(LOGITS).token for _ in range(n)]


def test_temperature_zero_is_argmax():
    assert set(draws(SamplingParams(temperature=0.0), 20)) == {1}


def test_top_k_one_is_argmax_at_any_temperature():
    assert set(draws(SamplingParams(temperature=5.0, top_k=1))) == {1}


def test_same_seed_gives_the_same_tokens_and_another_seed_differs():
    a = draws(SamplingParams(temperature=1.5, seed=7))
    b = draws(SamplingParams(temperature=1.5, seed=7))
    c = draws(SamplingParams(temperature=1.5, seed=8))
    assert a == b and a != c


def test_top_k_keeps_only_the_k_most_likely():
    assert set(draws(SamplingParams(temperature=10.0, top_k=2, seed=0))) == {1, 2}


def test_top_p_keeps_the_smallest_nucleus():
    # softmax(LOGITS): token 1 ~0.55, token 2 ~0.33 -> a 0.6 nucleus holds exactly {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.6, seed=0))) == {1, 2}


def test_sampled_frequencies_follow_the_softmax():
    tokens = draws(SamplingParams(temperature=1.0, seed=3), 4000)
    probs = np.exp(LOGITS - LOGITS.max())
    probs /= probs.sum()
    freq = np.bincount(tokens, minlength=len(LOGITS)) / len(tokens)
    assert np.allclose(freq, probs, atol=0.03)


def test_logprobs_report_the_best_alternatives_in_order():
    sampled = Sampler(SamplingParams(logprobs=3)).sample(LOGITS)
    assert [t for t, _ in sampled.top] == [1, 2, 0]
    assert sampled.logprob == pytest.approx(sampled.top[0][1])
    assert sum(np.exp(lp) for _, lp in sampled.top) < 1.0


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"logprobs": 21}],
)
def test_invalid_parameters_are_rejected_with_their_name(kwargs):
    with pytest.raises(EngineError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
