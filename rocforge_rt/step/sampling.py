"""Token sampling: greedy, temperature, top-k, top-p, seeded; the reference for the device.

Every backend samples inside its step with the same rules; this module holds them
in numpy (the CPU backend runs it, the GPU tests compare kernels/sampling.hip to it):

- Greedy (temperature 0, or top_k 1): the argmax, lowest index among equal maxima.
- Otherwise tokens are ranked by logit, then by index (lower first). The candidates
  are the top_k best (all when top_k is 0). Each candidate weighs
  W = floor(exp((x - max) / temperature) * 2^40) in integers (float32 exp), so every
  sum below is exact and the same in any order. top_p < 1 keeps the shortest ranked
  prefix whose weight reaches ceil(top_p * total), the nucleus. The draw is a 64-bit
  hash of (seed, position of the drawn token) scaled to the nucleus weight, looked up
  in the nucleus in token-id order.
- Reported log-probabilities are the model's own (the log-softmax of the logits at
  temperature 1), for the chosen token and for the best `logprobs` alternatives.

Because the draw depends only on the seed and the position, a seeded session gives
the same tokens whatever other sessions share its steps. A session without a seed
gets a random one when its turn starts.
"""

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rocforge_rt.errors import EngineError, EngineErrorCode

WEIGHT_SCALE = np.float32(2.0**40)  # weights are exp(...) in (0, 1] times this, truncated
MAX_LOGPROBS = 20
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None  # None: a random seed per turn
    logprobs: int = 0  # how many top alternatives to report with each token

    def __post_init__(self) -> None:
        checks = (
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.seed is None or 0 <= self.seed <= _MASK64,
                f"seed must be in [0, 2^64), got {self.seed}",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise EngineError(EngineErrorCode.INVALID_ARGUMENT, message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


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
    ]
)


class Sampler:
    """One turn's sampling parameters with its seed fixed (drawn at random when not given)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        record = np.array(
            [(params.temperature, params.top_k, params.top_p, params.logprobs, self.seed)],
            dtype=ROW_PARAMS_DTYPE,
        )
        self.record = record.tobytes()  # this row of a step's RowSampling

    def sample(self, logits: np.ndarray, position: int) -> SampledToken:
        """The token drawn at context position `position` from one row of logits."""
        return sample_row(logits, self.params, self.seed, position)


GREEDY = Sampler(SamplingParams(seed=0))


@dataclass(frozen=True)
class RowSampling:
    """How each logits row of one step picks its token: one ROW_PARAMS_DTYPE record a row."""

    params: np.ndarray  # ROW_PARAMS_DTYPE [B]

    @classmethod
    def greedy(cls, rows: int) -> "RowSampling":
        return cls.of([GREEDY] * rows)

    @classmethod
    def of(cls, samplers: Sequence["Sampler"]) -> "RowSampling":
        return cls(np.frombuffer(b"".join(s.record for s in samplers), dtype=ROW_PARAMS_DTYPE))

    @property
    def rows(self) -> int:
        return int(self.params.shape[0])

    @property
    def needs_sampler(self) -> bool:
        """Whether any row draws at random or reports alternatives (else argmax suffices)."""
        p = self.params
        drawn = (p["temperature"] != 0) & (p["top_k"] != 1)
        return bool(np.any(drawn) or np.any(p["logprobs"] > 0))

    def row(self, index: int) -> tuple[SamplingParams, int]:
        """Row `index` as SamplingParams and its seed."""
        r = self.params[index]
        params = SamplingParams(
            float(r["temperature"]), int(r["top_k"]), float(r["top_p"]), None, int(r["logprobs"])
        )
        return params, int(r["seed"])


def mix64(z: int) -> int:
    """The splitmix64 finalizer (kernels/sampling.hip rf_mix64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_bits(seed: int, position: int) -> int:
    """The 64 random bits of the draw at `position` (kernels/sampling.hip rf_draw_bits)."""
    return mix64((mix64(seed) + position * _GOLDEN64) & _MASK64)


def rank_order(logits: np.ndarray) -> np.ndarray:
    """Token ids by logit, highest first; equal logits by id, lowest first."""
    return np.lexsort((np.arange(logits.shape[0]), -logits))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - np.max(logits)
    return shifted - np.log(np.sum(np.exp(shifted)))


def candidate_weights(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The ranked top-k candidates and their integer weights (see the module docstring)."""
    x = np.asarray(logits, dtype=np.float32)
    order = rank_order(x)
    k = params.top_k if 0 < params.top_k < x.shape[0] else x.shape[0]
    candidates = order[:k]
    with np.errstate(under="ignore", over="ignore"):  # a tiny temperature: -inf, weight 0
        w = np.exp((x[candidates] - x.max()) / np.float32(params.temperature))
    return candidates, (w.astype(np.float32) * WEIGHT_SCALE).astype(np.uint64)


def nucleus(weights: np.ndarray, top_p: float) -> int:
    """How many ranked candidates the top-p cut keeps."""
    if top_p >= 1.0:
        return int(weights.shape[0])
    total = int(weights.sum(dtype=np.uint64))
    target = min(total, math.ceil(float(np.float32(top_p)) * float(total)))
    return int(np.searchsorted(np.cumsum(weights, dtype=np.uint64), target, side="left")) + 1


def draw(logits: np.ndarray, params: SamplingParams, seed: int, position: int) -> int:
    """A token drawn at random under `params` (not greedy) for context position `position`."""
    candidates, weights = candidate_weights(logits, params)
    kept = nucleus(weights, params.top_p)
    by_id = np.argsort(candidates[:kept], kind="stable")
    ids, cumulative = candidates[:kept][by_id], np.cumsum(weights[:kept][by_id], dtype=np.uint64)
    mass = int(cumulative[-1])
    r = (draw_bits(seed, position) * mass) >> 64
    return int(ids[int(np.searchsorted(cumulative, r, side="right"))])


def sample_row(
    logits: np.ndarray, params: SamplingParams, seed: int, position: int
) -> SampledToken:
    """The token for one row of logits, its log-probability and the best alternatives."""
    logits = np.asarray(logits, dtype=np.float32)
    token = int(np.argmax(logits)) if params.greedy else draw(logits, params, seed, position)
    logprobs = log_softmax(logits)
    best = rank_order(logits)[: params.logprobs] if params.logprobs else ()
    top = tuple((int(i), float(logprobs[i])) for i in best)
    return SampledToken(token=token, logprob=float(logprobs[token]), top=top)
