"""Sampling: greedy is argmax, seeds reproduce, top-k/min-p/top-p cut the candidates, draws
follow the distribution, penalties are llama.cpp's over the recent tokens, and the rules
are the ones the device kernel implements."""

import math

import numpy as np
import pytest

from rocforge_rt.errors import EngineError, EngineErrorCode
from rocforge_rt.step.sampling import (
    GREEDY,
    PENALTY_WINDOW,
    SAMPLING_BOUNDS,
    Bounds,
    RowSampling,
    Sampler,
    SamplingParams,
    candidate_weights,
    draw_bits,
    mix64,
    nucleus,
    penalize,
    rank_order,
    recent_window,
    sample_row,
)

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 0.0], dtype=np.float32)


def draws(params: SamplingParams, n: int = 200, logits: np.ndarray = LOGITS) -> list[int]:
    """Tokens drawn at positions 1..n (each position keys one draw)."""
    sampler = Sampler(params)
    return [sampler.sample(logits, position).token for position in range(1, n + 1)]


def test_temperature_zero_is_argmax():
    assert set(draws(SamplingParams(temperature=0.0), 20)) == {1}


def test_top_k_one_is_argmax_at_any_temperature():
    assert set(draws(SamplingParams(temperature=5.0, top_k=1))) == {1}


def test_same_seed_gives_the_same_tokens_and_another_seed_differs():
    a = draws(SamplingParams(temperature=1.5, seed=7))
    b = draws(SamplingParams(temperature=1.5, seed=7))
    c = draws(SamplingParams(temperature=1.5, seed=8))
    assert a == b and a != c


def test_without_a_seed_each_turn_draws_its_own():
    assert draws(SamplingParams(temperature=1.5)) != draws(SamplingParams(temperature=1.5))


def test_a_draw_depends_on_seed_and_position_only():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    first = [sampler.sample(LOGITS, p).token for p in (5, 9, 5)]
    assert first[0] == first[2]
    assert draw_bits(3, 5) == draw_bits(3, 5) != draw_bits(3, 6) != draw_bits(4, 5)


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


def test_temperature_sharpens_and_flattens():
    cold = np.bincount(draws(SamplingParams(temperature=0.25, seed=1), 2000), minlength=5)
    hot = np.bincount(draws(SamplingParams(temperature=4.0, seed=1), 2000), minlength=5)
    assert cold[1] > 0.85 * 2000 and hot[1] < 0.45 * 2000


def test_equal_logits_rank_by_token_id():
    tied = np.array([0.5, 2.0, 2.0, -0.0, 0.0, 2.0], dtype=np.float32)
    assert rank_order(tied).tolist() == [1, 2, 5, 0, 3, 4]
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=2), 300, tied)) == {1, 2}


def test_weights_are_exact_integers_and_the_nucleus_reaches_top_p():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(5000).astype(np.float32) * 3
    params = SamplingParams(temperature=0.8, top_k=100)
    candidates, weights = candidate_weights(logits, params)
    assert len(candidates) == 100 and weights.dtype == np.uint64
    assert weights[0] == 2**40  # the best candidate weighs exp(0) * 2^40
    assert np.all(np.diff(weights.astype(np.int64)) <= 0)  # ranked, so non-increasing
    total = int(weights.sum())
    kept = nucleus(weights, 0.9)
    assert int(weights[:kept].sum()) >= math.ceil(0.9 * total) > int(weights[: kept - 1].sum())


def test_each_weight_is_the_exp_of_its_gap_rounded_to_float32_from_float64():
    """The weights' exp is the float64 exp rounded once to float32 (what the device
    computes too), not a float32 exp whose last bit depends on the library."""
    logits = np.round(np.random.default_rng(3).standard_normal(4000) * 2).astype(np.float32) / 2
    params = SamplingParams(temperature=0.7)
    candidates, weights = candidate_weights(logits, params)
    gaps = (logits[candidates] - logits.max()) / np.float32(0.7)
    rounded = np.array([np.float32(math.exp(float(g))) for g in gaps], dtype=np.float32)
    assert weights.tolist() == (rounded * np.float32(2.0**40)).astype(np.uint64).tolist()


def test_logprobs_report_the_best_alternatives_in_order():
    sampled = Sampler(SamplingParams(logprobs=3)).sample(LOGITS, 1)
    assert [t for t, _ in sampled.top] == [1, 2, 0]
    assert sampled.logprob == pytest.approx(sampled.top[0][1])
    assert sum(np.exp(lp) for _, lp in sampled.top) < 1.0


def test_mix64_is_splitmix64():
    # splitmix64's first output for state 0 is the finalizer applied to the golden gamma
    assert mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_row_sampling_carries_each_rows_parameters_and_seed():
    sampler = Sampler(SamplingParams(temperature=0.5, top_k=40, top_p=0.9, seed=11, logprobs=2))
    rows = RowSampling.of([GREEDY, sampler])
    assert rows.rows == 2 and rows.needs_sampler
    params, seed, recent = rows.row(1)
    assert (params.top_k, params.logprobs, seed, recent) == (40, 2, 11, None)
    assert params.temperature == pytest.approx(0.5) and params.top_p == pytest.approx(0.9)
    assert not RowSampling.greedy(3).needs_sampler
    assert RowSampling.of([Sampler(SamplingParams(logprobs=1))]).needs_sampler


def test_sample_row_is_what_a_sampler_draws():
    params = SamplingParams(temperature=0.9, top_p=0.8, seed=5)
    assert Sampler(params).sample(LOGITS, 4) == sample_row(LOGITS, params, 5, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"logprobs": 21},
        {"seed": -1},
        {"seed": 1 << 64},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.5},
        # what the device cannot hold: top_k is its int32, the others float32, and it divides
        # by the temperature and the repetition penalty; a step reads its rows back as float32
        {"top_k": 2**31},
        {"top_p": 1e-46},  # 0 in float32
        {"temperature": 1e-46},  # 0 in float32, not greedy: a division by 0
        {"temperature": float("inf")},
        {"repetition_penalty": 1e-46},
        {"repetition_penalty": 1e39},  # inf in float32: every logit / inf
        {"min_p": 1e-40},  # float32 subnormals: the device's arithmetic may flush them to 0
        {"frequency_penalty": -1e-40},
        {"presence_penalty": 1e-46},
        {"top_k": 1.5},
        {"logprobs": True},
    ],
)
def test_invalid_parameters_are_rejected_with_their_name(kwargs):
    """SamplingParams checks every value as it is built (SAMPLING_BOUNDS, the wire's own
    bounds): no engine, backend or device ever sees one it cannot hold."""
    with pytest.raises(EngineError, match=next(iter(kwargs))) as info:
        SamplingParams(**kwargs)
    assert info.value.code is EngineErrorCode.INVALID_ARGUMENT


def test_the_bounds_of_each_parameter_are_its_largest_and_smallest_values() -> None:
    for name, bounds in SAMPLING_BOUNDS.items():
        for value in (bounds.lo, bounds.hi):
            SamplingParams(**{name: value})
    assert SamplingParams(seed=None).seed is None  # a random seed a turn


@pytest.mark.parametrize(
    ("bounds", "held", "refused"),
    [
        (Bounds(0, 20, integer=True), [0, 20], [-1, 21, 1.0, True, "1", None]),
        (Bounds(0.5, 1.0), [0.5, 1, 1.0], [0.4, 1.01, 0, float("nan"), float("inf"), False]),
        (Bounds(0.5, 1.0, or_zero=True), [0, -0.0, 0.5], [0.25, -0.5]),
        (Bounds(0.5, 2.0, or_zero=True, signed=True), [0, -2, -0.5, 2.0], [-0.25, 0.25, 2.5]),
        (Bounds(0.0, 1.0, open_lo=True), [1e-300, 1.0], [0.0, -1.0]),
    ],
)  # fmt: skip
def test_bounds_admit_numbers_within_them_as_floats(bounds: Bounds, held: list, refused: list):
    for value in held:
        admitted = bounds.admit(value)
        assert admitted == value and type(admitted) is (int if bounds.integer else float)
    assert math.copysign(1.0, Bounds(0.5, 1.0, or_zero=True).admit(-0.0)) == 1.0  # -0.0 is 0.0
    for value in refused:
        assert bounds.admit(value) is None, value


def test_bounds_say_what_they_take() -> None:
    assert Bounds(0, 20, integer=True).expected == "an integer in [0, 20]"
    assert Bounds(0.5, 1.0, or_zero=True).expected == "0 or a number in [0.5, 1.0]"
    assert Bounds(0.5, 2.0, or_zero=True, signed=True).expected == (
        "0 or a number in [-2.0, -0.5] or [0.5, 2.0]"
    )
    assert Bounds(0.0, 9, open_lo=True).expected == "a number in (0.0, 9]"


# --- penalties and min-p ----------------------------------------------------------------
def test_the_recent_window_holds_position_q_at_q_mod_the_window_and_nothing_before_0():
    window = recent_window([7, 8, 9])
    assert window[:3].tolist() == [7, 8, 9] and set(window[3:].tolist()) == {-1}
    long = list(range(100, 100 + PENALTY_WINDOW + 5))  # positions 0 .. W + 4
    window = recent_window(long)
    assert sorted(window.tolist()) == long[5:]
    assert window[(PENALTY_WINDOW + 4) % PENALTY_WINDOW] == long[-1]


def test_a_decode_step_advances_the_window_by_its_input_token():
    context = list(range(1, 80))
    penalized = Sampler(SamplingParams(repetition_penalty=1.1))
    rows = RowSampling.of([penalized, GREEDY], [context, [4, 5]])
    after = rows.advanced(np.array([500, 6], dtype=np.int32), np.array([79, 2]))
    assert after.recent[0].tolist() == recent_window([*context, 500]).tolist()
    assert after.recent[1].tolist() == recent_window([4, 5, 6]).tolist()


def test_penalties_follow_llamacpp_for_each_token_seen_in_the_window():
    logits = np.array([2.0, -1.0, 0.5, 3.0, 1.0], dtype=np.float32)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    recent = recent_window([0, 1, 0, 0, 2])  # token 0 three times, 1 and 2 once; 3, 4 never
    got = penalize(logits, params, recent)
    # x / 2 (x * 2 when x <= 0), then - (count * 0.25 + 0.5)
    assert got.tolist() == [1.0 - 1.25, -2.0 - 0.75, 0.25 - 0.75, 3.0, 1.0]


def test_a_repetition_penalty_moves_greedy_off_a_repeated_token():
    params = SamplingParams(repetition_penalty=1.5)
    recent = recent_window([1, 1])  # token 1 is LOGITS' argmax (3.0 -> 2.0 < 2.5)
    assert sample_row(LOGITS, params, 0, 3, recent).token == 2
    assert sample_row(LOGITS, SamplingParams(), 0, 3, recent).token == 1


def test_penalized_rows_need_their_recent_tokens_and_take_the_sampler():
    with pytest.raises(ValueError, match="recent"):
        sample_row(LOGITS, SamplingParams(presence_penalty=1.0), 0, 3)
    rows = RowSampling.of([Sampler(SamplingParams(frequency_penalty=0.5))], [[3, 4]])
    assert rows.penalized and rows.needs_sampler
    assert RowSampling.of([GREEDY], [[3, 4]]).recent is None  # nobody penalized: not built


def test_min_p_gives_weight_zero_to_tokens_below_min_p_times_the_best_at_temperature_1():
    params = SamplingParams(temperature=2.0, min_p=0.3)
    candidates, weights = candidate_weights(LOGITS, params)
    kept = {int(t) for t, w in zip(candidates, weights, strict=True) if w > 0}
    best = LOGITS.max()
    assert kept == {t for t in range(5) if math.exp(LOGITS[t] - best) >= 0.3} == {1, 2}
    assert set(draws(params)) == {1, 2}


def test_a_tiny_repetition_penalty_saturates_at_the_largest_float32_and_still_samples():
    logits = np.array([1.0, 30.0, 20.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0**-126, seed=3)
    recent = recent_window([1, 2])  # 30 and 20 times 2^126 overflow float32
    top = float(np.finfo(np.float32).max)
    assert penalize(logits, params, recent).tolist() == [1.0, top, top]
    picked = sample_row(logits, params, 3, 5, recent)
    assert picked.token in (1, 2) and picked.logprob == pytest.approx(math.log(0.5))
