"""One sequence being generated: its KV slot, pending tokens, sampler and stop rules."""

from collections.abc import Sequence
from dataclasses import dataclass

from rocforge_rt.engine.stopping import FinishReason, StopStringFilter
from rocforge_rt.errors import EngineError, EngineErrorCode
from rocforge_rt.model.tokenizer import TextStream
from rocforge_rt.step.sampling import SampledToken, Sampler


@dataclass(frozen=True)
class TokenEvent:
    """A token produced for a session, with the text it releases to the client."""

    token: int
    text: str  # UTF-8-safe: whole characters only, stop strings cut
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    finish_reason: FinishReason | None


def check_turn(
    tokens: Sequence[int], n_context: int, max_tokens: int, n_vocab: int, n_ctx: int
) -> None:
    """EngineError unless a turn of `tokens` (token ids below n_vocab) after n_context tokens
    leaves room in a context of n_ctx (CONTEXT_FULL) and asks for at least one token."""
    if not tokens:
        raise EngineError(EngineErrorCode.INVALID_ARGUMENT, "a turn needs at least one token")
    if max_tokens < 1:
        raise EngineError(
            EngineErrorCode.INVALID_ARGUMENT, f"max_tokens must be >= 1, got {max_tokens}"
        )
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise EngineError(
            EngineErrorCode.INVALID_ARGUMENT,
            f"token id {bad[0]} is outside the vocabulary [0, {n_vocab})",
        )
    if n_context + len(tokens) >= n_ctx:
        raise EngineError(
            EngineErrorCode.CONTEXT_FULL,
            f"{n_context} tokens in context + {len(tokens)} new leave no room in ctx size {n_ctx}",
        )


class Session:
    """State of one sequence. Tokens in `pending` are known but not yet in the KV cache."""

    def __init__(
        self,
        session_id: int,
        slot: int,
        n_ctx: int,
        eog_ids: frozenset[int],
        stream: TextStream | None,
    ) -> None:
        self.session_id = session_id
        self.slot = slot
        self.n_ctx = n_ctx
        self.eog_ids = eog_ids
        self.stream = stream  # None for models without a vocabulary: events carry no text
        self.n_past = 0  # tokens already in the KV cache
        self.pending: list[int] = []
        self.history: list[int] = []  # every token of the context, in order
        self.sampler: Sampler | None = None
        self.stop_filter = StopStringFilter(())
        self.max_new_tokens = 0
        self.n_generated = 0
        self.finish_reason: FinishReason | None = None

    def start_turn(
        self, tokens: list[int], sampler: Sampler, stops: tuple[str, ...], max_new_tokens: int
    ) -> None:
        """Queue a prompt (or a further turn) and the rules for the reply to it."""
        self.pending.extend(tokens)
        self.history.extend(tokens)
        self.sampler = sampler
        self.stop_filter = StopStringFilter(stops)
        self.max_new_tokens = max_new_tokens
        self.n_generated = 0
        self.finish_reason = None

    @property
    def n_context(self) -> int:
        """Tokens of the context, cached or pending."""
        return self.n_past + len(self.pending)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_pending(self, limit: int) -> list[int]:
        """Remove and return up to `limit` pending tokens, advancing n_past past them."""
        taken, self.pending = self.pending[:limit], self.pending[limit:]
        self.n_past += len(taken)
        return taken

    def accept(self, sampled: SampledToken) -> TokenEvent:
        """Record a sampled token: decide whether the turn ends and what text it releases."""
        self.n_generated += 1
        token = sampled.token
        if token in self.eog_ids:
            text, reason = self._drain(), FinishReason.STOP_TOKEN
        else:
            self.pending.append(token)
            self.history.append(token)
            piece = self.stream.push(token) if self.stream else ""
            text, hit = self.stop_filter.push(piece)
            if hit:
                reason = FinishReason.STOP_STRING
            elif self.n_generated >= self.max_new_tokens or self.n_past >= self.n_ctx:
                text, reason = text + self._drain(), FinishReason.LENGTH
            else:
                reason = None
        self.finish_reason = reason
        return TokenEvent(token, text, sampled.logprob, sampled.top, reason)

    def finish(self, reason: FinishReason) -> str:
        """End the turn from outside (abort, error); return the text still held back."""
        self.finish_reason = reason
        return self._drain()

    def _drain(self) -> str:
        text, hit = self.stop_filter.push(self.stream.flush() if self.stream else "")
        return text if hit else text + self.stop_filter.flush()
