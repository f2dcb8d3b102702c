"""A single-session generation loop with its timings (for the CLI and benchmarks)."""

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.session import TokenEvent
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.step.sampling import SamplingParams


@dataclass
class GenerationStats:
    """Figures of one generation; TTFT covers prefill and the first sampled token."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0  # from the first token to the last
    finish_reason: FinishReason | None = None

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s else 0.0


class Generation:
    """Iterate to stream a session's tokens; `stats` is filled as it goes."""

    def __init__(
        self,
        engine: Engine,
        prompt: Sequence[int],
        *,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        max_tokens: int = 256,
    ) -> None:
        self.engine = engine
        self.prompt = list(prompt)
        self.sampling = sampling
        self.stop = tuple(stop)
        self.max_tokens = max_tokens
        self.stats = GenerationStats(prompt_tokens=len(self.prompt))

    def __iter__(self) -> Iterator[TokenEvent]:
        engine = self.engine
        started = time.perf_counter()
        session = engine.open_session(
            self.prompt, sampling=self.sampling, stop=self.stop, max_tokens=self.max_tokens
        )
        try:
            event = engine.prefill(session)
            first = time.perf_counter()
            self.stats.ttft_s = first - started
            while True:
                self.stats.generated_tokens += 1
                self.stats.decode_s = time.perf_counter() - first
                yield event
                if event.finish_reason is not None:
                    self.stats.finish_reason = event.finish_reason
                    return
                (event,) = engine.decode([session])
        finally:
            engine.close_session(session)
