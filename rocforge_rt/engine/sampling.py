"""Token sampling: greedy, temperature, top-k, top-p, seeded."""

from dataclasses import dataclass

import numpy as np

from rocforge_rt.errors import EngineError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None
    logprobs: int = 0  # how many top alternatives to report with each token

    def __post_init__(self) -> None:
        checks = (
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
        )
        for ok, message in checks:
            if not ok:
                raise EngineError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_logits(self) -> bool:
        """Whether the host needs the whole logits row (else the device's argmax will do)."""
        return not self.greedy or self.logprobs > 0


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob) alternatives, best first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - np.max(logits)
    return shifted - np.log(np.sum(np.exp(shifted)))


class Sampler:
    """Chooses tokens from logits for one sequence; owns that sequence's random stream."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray) -> SampledToken:
        """Pick the next token (top-k, then temperature, then top-p, as llama.cpp orders them)."""
        logits = np.asarray(logits, dtype=np.float32)
        token = int(np.argmax(logits)) if self.params.greedy else self._draw(logits)
        logprobs = log_softmax(logits)
        top: tuple[tuple[int, float], ...] = ()
        if self.params.logprobs:
            best = np.argsort(-logprobs)[: self.params.logprobs]
            top = tuple((int(i), float(logprobs[i])) for i in best)
        return SampledToken(token=token, logprob=float(logprobs[token]), top=top)

    def _draw(self, logits: np.ndarray) -> int:
        p = self.params
        candidates = np.argsort(-logits, kind="stable")
        if p.top_k:
            candidates = candidates[: p.top_k]
        kept = logits[candidates].astype(np.float64)
        with np.errstate(over="ignore"):  # a tiny temperature sends all but the max to -inf
            probs = np.exp((kept - kept.max()) / p.temperature)
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
        return int(candidates[self._rng.choice(len(candidates), p=probs)])
