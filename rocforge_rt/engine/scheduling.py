"""What one scheduler step takes (vLLM V1's unified scheduling): its token budget, its
packing of decode rows and prompt chunks, and the check of a step's arguments."""

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from rocforge_rt.engine.session import Session
from rocforge_rt.errors import EngineError, EngineErrorCode

T = TypeVar("T")  # what pack_step schedules: sessions, or the daemon's jobs


def step_token_budget(prefill_chunk: int, n_slots: int) -> int:
    """Tokens one step may take: a prompt chunk's worth, and at least a row per session."""
    return max(prefill_chunk, n_slots)


def pack_step(
    budget: int,
    decoding: Sequence[T],
    waiting: Iterable[T],
    pending: Callable[[T], int],
) -> tuple[tuple[T, ...], tuple[tuple[T, int], ...]]:
    """One scheduler step of at most `budget` tokens: every decoding item's next token, then
    prompt chunks of the waiting items in their order while the budget lasts;
    `pending(item)` is how many prompt tokens an item still has. The arguments of
    `Engine.step`, for sessions or for whatever the caller schedules."""
    left = budget - len(decoding)
    chunks = []
    for item in waiting:
        if left <= 0:
            break
        n = min(pending(item), left)
        if n > 0:
            chunks.append((item, n))
            left -= n
    return tuple(decoding), tuple(chunks)


def check_step(decode: Sequence[Session], prefill: Sequence[tuple[Session, int]]) -> None:
    """EngineError unless every decode session has its one token to feed (NOT_DECODABLE),
    and every (session, n) of `prefill` has n prompt tokens pending and is in the step
    once (INVALID_ARGUMENT)."""
    for s in decode:
        if s.finished or len(s.pending) != 1:
            raise EngineError(
                EngineErrorCode.NOT_DECODABLE, f"session {s.session_id} is not ready to decode"
            )
    seen = {s.session_id for s in decode}
    for session, n in prefill:
        if session.session_id in seen or not 1 <= n <= len(session.pending):
            raise EngineError(
                EngineErrorCode.INVALID_ARGUMENT,
                f"session {session.session_id}: {n} prompt tokens of"
                f" {len(session.pending)} pending, or the session twice in one step",
            )
        seen.add(session.session_id)
