"""Token sampling: penalties, greedy, temperature, top-k, min-p, top-p, seeded; the
reference for the device.

Every backend samples inside its step with the same rules; this module holds them
in numpy (the CPU backend runs it, the GPU tests compare kernels/sampling.hip to it):

- Penalties first, llama.cpp's (its sampler `penalties`), over the last PENALTY_WINDOW
  tokens of the context, prompt included (`recent`): each token seen there c times has
  its logit x divided by repetition_penalty (multiplied, when x <= 0) and kept within
  float32's finite range, then x - (c * frequency_penalty + presence_penalty), in float32
  in that order. Everything below, log-probabilities included, sees the penalized logits.
- Greedy (temperature 0, or top_k 1): the argmax, lowest index among equal maxima.
- Otherwise tokens are ranked by logit, then by index (lower first). The candidates
  are the top_k best (all when top_k is 0). Each candidate weighs
  W = floor(exp((x - max) / temperature) * 2^40) in integers, so every sum below is
  exact and the same in any order; min_p > 0 gives weight 0 to a token whose exp(x - max)
  (temperature 1: llama.cpp's min-p) is below min_p. The quotient is float32; each exp is
  taken in float64 and rounded to float32 (`exp_f32`), the same on every platform and on
  the device: float32 exps differ between libraries in the last bit, and with many equal
  logits (every copy off alike) that moved the draw's boundaries by thousands of weights.
  top_p < 1 keeps the shortest ranked prefix whose weight reaches ceil(top_p * total),
  the nucleus (so min-p cuts before top-p; llama.cpp cuts after, which differs only
  when both are set). The draw is a 64-bit hash of (seed, position of the drawn token)
  scaled to the nucleus weight, looked up in the nucleus in token-id order.
- Reported log-probabilities are the log-softmax of the logits at temperature 1 (the
  model's own, bar penalties), for the chosen token and for the best `logprobs`
  alternatives.

Because the draw depends only on the seed and the position, a seeded session gives
the same tokens whatever other sessions share its steps. A session without a seed
gets a random one when its turn starts.
"""

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rocforge_rt.errors import EngineError, EngineErrorCode

WEIGHT_SCALE = np.float32(2.0**40)  # weights are exp(...) in (0, 1] times this, truncated
PENALTY_WINDOW = 64  # recent tokens the penalties count (llama.cpp's penalty_last_n default)
# The penalties' values that change nothing (SamplingParams and ROW_PARAMS_DTYPE names).
NEUTRAL_PENALTIES = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}

# --- the limits of the sampling parameters: every layer imports these -----------------------
# float32's smallest normal and largest numbers: a step holds sampling values as float32 (a
# value that rounds to 0 or a subnormal would change meaning), and the device divides by the
# temperature and the repetition penalty.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = (1 << 31) - 1  # the device reads top_k as int32
SEED_MAX = (1 << 64) - 1  # seeds are uint64
MAX_TEMPERATURE = 100.0  # far past any use (OpenAI's own range ends at 2)
MAX_LOGPROBS = 20  # alternatives a token may report (OpenAI's top_logprobs range)
MAX_PENALTY = 2.0  # |frequency_penalty| and |presence_penalty| (OpenAI's range)
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


_NUMBERS = (int, float)  # a tuple: isinstance checks it faster than a union


@dataclass(frozen=True, slots=True)
class Bounds:
    """The values one parameter may take: an integer, or a finite number, in [lo, hi] ((lo, hi]
    when `open_lo`); with `or_zero` 0 too; `signed`: in [-hi, -lo] too. The one check of
    every numeric field (the wire's, the OpenAI front's and SamplingParams')."""

    lo: float
    hi: float
    integer: bool = False
    or_zero: bool = False
    signed: bool = False
    open_lo: bool = False

    def admit(self, value: Any) -> float | None:
        """`value` as it is held (a number as a float, -0.0 as 0.0), or None when outside."""
        if not isinstance(value, _NUMBERS) or isinstance(value, bool):
            return None
        if self.integer:
            return value if isinstance(value, int) and self.lo <= value <= self.hi else None
        magnitude = abs(value) if self.signed else value
        above_lo = self.lo < magnitude if self.open_lo else self.lo <= magnitude
        if (above_lo and magnitude <= self.hi) or (self.or_zero and value == 0):
            return value + 0.0  # NaN and the infinities fail both comparisons above
        return None

    @property
    def expected(self) -> str:
        """What `admit` takes, in words: 'an integer in [0, 20]', '0 or a number in ...'."""
        if self.integer:
            return f"an integer in [{self.lo}, {self.hi}]"
        span = f"{'(' if self.open_lo else '['}{self.lo}, {self.hi}]"
        if self.signed:
            span = f"[-{self.hi}, -{self.lo}] or {span}"
        return f"{'0 or ' if self.or_zero else ''}a number in {span}"


# What each sampling parameter may hold: what the device reads (int32, normal float32) within
# the ranges of llama.cpp's and OpenAI's samplers. 0 turns off temperature (greedy), min_p and
# the additive penalties; 1 turns off top_p and the repetition penalty.
SAMPLING_BOUNDS: dict[str, Bounds] = {
    "temperature": Bounds(FLOAT32_TINY, MAX_TEMPERATURE, or_zero=True),
    "top_k": Bounds(0, INT32_MAX, integer=True),  # 0: no cut; the server: at most the vocabulary
    "top_p": Bounds(FLOAT32_TINY, 1.0),
    "seed": Bounds(0, SEED_MAX, integer=True),
    "logprobs": Bounds(0, MAX_LOGPROBS, integer=True),
    "min_p": Bounds(FLOAT32_TINY, 1.0, or_zero=True),
    "repetition_penalty": Bounds(FLOAT32_TINY, FLOAT32_MAX),
    "frequency_penalty": Bounds(FLOAT32_TINY, MAX_PENALTY, or_zero=True, signed=True),
    "presence_penalty": Bounds(FLOAT32_TINY, MAX_PENALTY, or_zero=True, signed=True),
}


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy (argmax). Each value is checked
    against SAMPLING_BOUNDS when built (EngineError INVALID_ARGUMENT naming it), so the engine
    and the device only ever see values they can hold."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None  # None: a random seed per turn
    logprobs: int = 0  # how many top alternatives to report with each token
    min_p: float = 0.0  # 0: no min-p cut
    repetition_penalty: float = 1.0  # 1: none
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name, bounds in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if bounds.admit(value) is None and not (name == "seed" and value is None):
                raise EngineError(
                    EngineErrorCode.INVALID_ARGUMENT,
                    f"{name} must be {bounds.expected}, got {value!r}",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return any(getattr(self, name) != value for name, value in NEUTRAL_PENALTIES.items())


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob) alternatives, best first


# Per-row sampling parameters as the device reads them (kernels/sampling.hip rf_sample_params).
ROW_PARAMS_DTYPE = np.dtype(
    [
        ("temperature", "<f4"),
        ("top_k", "<i4"),
        ("top_p", "<f4"),
        ("logprobs", "<i4"),
        ("seed", "<u8"),
        ("min_p", "<f4"),
        ("repetition_penalty", "<f4"),
        ("frequency_penalty", "<f4"),
        ("presence_penalty", "<f4"),
    ]
)


class Sampler:
    """One turn's sampling parameters with its seed fixed (drawn at random when not given)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        p = params
        record = np.array(
            [(p.temperature, p.top_k, p.top_p, p.logprobs, self.seed, p.min_p,
              p.repetition_penalty, p.frequency_penalty, p.presence_penalty)],
            dtype=ROW_PARAMS_DTYPE,
        )  # fmt: skip
        self.record = record.tobytes()  # this row of a step's RowSampling

    def sample(
        self, logits: np.ndarray, position: int, recent: np.ndarray | None = None
    ) -> SampledToken:
        """The token drawn at context position `position` from one row of logits, after
        the penalties over `recent` (see recent_window)."""
        return sample_row(logits, self.params, self.seed, position, recent)


GREEDY = Sampler(SamplingParams(seed=0))


@dataclass(frozen=True)
class RowSampling:
    """How each logits row of one step picks its token: one ROW_PARAMS_DTYPE record a row,
    and, when a row is penalized, every row's recent tokens (recent_window's layout)."""

    params: np.ndarray  # ROW_PARAMS_DTYPE [B]
    recent: np.ndarray | None = None  # int32 [B, PENALTY_WINDOW]

    def __post_init__(self) -> None:
        if self.penalized and self.recent is None:
            raise ValueError("penalized rows need their recent tokens")

    @classmethod
    def greedy(cls, rows: int) -> "RowSampling":
        return cls.of([GREEDY] * rows)

    @classmethod
    def of(
        cls, samplers: Sequence["Sampler"], contexts: Sequence[Sequence[int]] = ()
    ) -> "RowSampling":
        """The rows of `samplers`; `contexts` (each row's tokens so far, the row's input
        token last) are read only when a row is penalized."""
        params = np.frombuffer(b"".join(s.record for s in samplers), dtype=ROW_PARAMS_DTYPE)
        recent = None
        if any(s.params.penalized for s in samplers):
            recent = np.stack([recent_window(c) for c in contexts])
        return cls(params, recent)

    @property
    def penalized(self) -> bool:
        """Whether any row's logits are penalized before it picks."""
        return any(bool(np.any(self.params[name] != value))
                   for name, value in NEUTRAL_PENALTIES.items())  # fmt: skip

    def advanced(self, tokens: np.ndarray, positions: np.ndarray) -> "RowSampling":
        """The rows of the next decode step, whose input `tokens` sit at `positions`."""
        if self.recent is None:
            return self
        recent = self.recent.copy()
        recent[np.arange(len(tokens)), np.asarray(positions) % PENALTY_WINDOW] = tokens
        return RowSampling(self.params, recent)

    @property
    def rows(self) -> int:
        return int(self.params.shape[0])

    @property
    def needs_sampler(self) -> bool:
        """Whether any row draws at random or reports alternatives (else argmax suffices)."""
        p = self.params
        drawn = (p["temperature"] != 0) & (p["top_k"] != 1)
        return bool(np.any(drawn) or np.any(p["logprobs"] > 0) or self.penalized)

    def row(self, index: int) -> tuple[SamplingParams, int, np.ndarray | None]:
        """Row `index` as SamplingParams, its seed and its recent tokens (None: unpenalized)."""
        r = self.params[index]
        params = SamplingParams(
            float(r["temperature"]), int(r["top_k"]), float(r["top_p"]), None,
            int(r["logprobs"]), float(r["min_p"]), float(r["repetition_penalty"]),
            float(r["frequency_penalty"]), float(r["presence_penalty"]),
        )  # fmt: skip
        return params, int(r["seed"]), None if self.recent is None else self.recent[index]


def recent_window(context: Sequence[int]) -> np.ndarray:
    """int32 [PENALTY_WINDOW]: the last PENALTY_WINDOW tokens of `context`, the token at
    position q at index q % PENALTY_WINDOW (so a decode step writes one entry); -1 where
    the window reaches before position 0."""
    window = np.full(PENALTY_WINDOW, -1, dtype=np.int32)
    first = max(0, len(context) - PENALTY_WINDOW)
    window[np.arange(first, len(context)) % PENALTY_WINDOW] = context[first:]
    return window


def penalize(logits: np.ndarray, params: SamplingParams, recent: np.ndarray) -> np.ndarray:
    """The logits after llama.cpp's penalties over the `recent` tokens (float32)."""
    x = np.array(logits, dtype=np.float32)
    ids, counts = np.unique(recent[recent >= 0], return_counts=True)
    v = x[ids]
    rep = np.float32(params.repetition_penalty)
    with np.errstate(over="ignore"):  # a tiny penalty: clamped to the largest float32
        v = np.clip(np.where(v <= 0, v * rep, v / rep), -FLOAT32_MAX, FLOAT32_MAX, dtype=np.float32)
    per_count = counts.astype(np.float32) * np.float32(params.frequency_penalty)
    x[ids] = v - (per_count + np.float32(params.presence_penalty))
    return x


def mix64(z: int) -> int:
    """The splitmix64 finalizer (kernels/sampling.hip rf_mix64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_bits(seed: int | np.ndarray, position: int) -> int | np.ndarray:
    """The 64 random bits of the draw at `position` (kernels/sampling.hip rf_draw_bits), of
    an int seed, or of each of a uint64 array of seeds (its sums wrap as the masks do)."""
    return mix64((mix64(seed) + (position * _GOLDEN64 & _MASK64)) & _MASK64)


def rank_order(logits: np.ndarray) -> np.ndarray:
    """Token ids by logit, highest first; equal logits by id, lowest first."""
    return np.lexsort((np.arange(logits.shape[0]), -logits))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - np.max(logits)
    return shifted - np.log(np.sum(np.exp(shifted)))


def exp_f32(x: np.ndarray) -> np.ndarray:
    """float32 exp(x), rounded from float64 (kernels/sampling.hip rf_exp_f32)."""
    return np.exp(np.asarray(x, dtype=np.float64)).astype(np.float32)


def candidate_weights(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The ranked top-k candidates and their integer weights (see the module docstring)."""
    x = np.asarray(logits, dtype=np.float32)
    order = rank_order(x)
    k = params.top_k if 0 < params.top_k < x.shape[0] else x.shape[0]
    candidates = order[:k]
    gap = x[candidates] - x.max()
    with np.errstate(under="ignore", over="ignore"):  # a tiny temperature: -inf, weight 0
        w = exp_f32(gap / np.float32(params.temperature))
        if params.min_p > 0:
            w = np.where(exp_f32(gap) >= np.float32(params.min_p), w, np.float32(0))
    return candidates, (w.astype(np.float32) * WEIGHT_SCALE).astype(np.uint64)


def nucleus(weights: np.ndarray, top_p: float) -> int:
    """How many ranked candidates the top-p cut keeps."""
    if top_p >= 1.0:
        return int(weights.shape[0])
    total = int(weights.sum(dtype=np.uint64))
    target = min(total, math.ceil(float(np.float32(top_p)) * float(total)))
    return int(np.searchsorted(np.cumsum(weights, dtype=np.uint64), target, side="left")) + 1


def nucleus_by_id(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The nucleus a draw looks up: its token ids in id order and their cumulative weights
    (uint64; the last is the nucleus weight)."""
    candidates, weights = candidate_weights(logits, params)
    kept = nucleus(weights, params.top_p)
    by_id = np.argsort(candidates[:kept], kind="stable")
    return candidates[:kept][by_id], np.cumsum(weights[:kept][by_id], dtype=np.uint64)


def draw_point(cumulative: np.ndarray, seed: int, position: int) -> int:
    """Where the draw at `position` falls in the nucleus weight: [0, cumulative[-1])."""
    return (draw_bits(seed, position) * int(cumulative[-1])) >> 64


def draw(logits: np.ndarray, params: SamplingParams, seed: int, position: int) -> int:
    """A token drawn at random under `params` (not greedy) for context position `position`."""
    ids, cumulative = nucleus_by_id(logits, params)
    r = draw_point(cumulative, seed, position)
    return int(ids[int(np.searchsorted(cumulative, r, side="right"))])


def sample_row(
    logits: np.ndarray,
    params: SamplingParams,
    seed: int,
    position: int,
    recent: np.ndarray | None = None,
) -> SampledToken:
    """The token for one row of logits, its log-probability and the best alternatives;
    `recent` (recent_window's layout) is needed when `params` are penalized."""
    logits = np.asarray(logits, dtype=np.float32)
    if params.penalized:
        if recent is None:
            raise ValueError("penalized sampling needs the recent tokens")
        logits = penalize(logits, params, recent)
    token = int(np.argmax(logits)) if params.greedy else draw(logits, params, seed, position)
    logprobs = log_softmax(logits)
    best = rank_order(logits)[: params.logprobs] if params.logprobs else ()
    top = tuple((int(i), float(logprobs[i])) for i in best)
    return SampledToken(token=token, logprob=float(logprobs[token]), top=top)
