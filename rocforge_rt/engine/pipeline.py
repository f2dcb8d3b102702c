"""Pipelined decode: the engine's side of a decode step issued ahead.

After a decode-only step the engine asks the backend to issue the next decode step of the
same rows before reading this one back (StepRunner, where the backend can: the GPU's graph
mode), so that the caller's work between steps (stops, detokenization, replies) overlaps
the device's. The next `Engine.step` takes that step's tokens for each of its decode
sessions that still wants exactly it (same token, position and sampler); rows of sessions
that ended are dropped, and a step that wants anything else drops the whole step issued
ahead and runs its own. A dropped row's KV entry lies past its session's context and is
overwritten before it is read.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from rocforge_rt.engine.session import Session, TokenEvent
from rocforge_rt.step.forward import StepOutput, StepRunner
from rocforge_rt.step.sampling import Sampler


@dataclass(frozen=True)
class AheadRow:
    """A row of the decode step issued ahead: what it feeds the device, so that it is
    taken only for a session that still wants exactly that step."""

    session: Session
    token: int  # sampled by the step before
    position: int
    sampler: Sampler


def may_look_ahead(sessions: Sequence[Session]) -> bool:
    """Whether the decode step after the one these sessions just took their tokens for is
    worth issuing before it is read: not when every session is sure to end with this step's
    token (its token limit). The backend also declines a step past a slot's end."""
    return any(s.n_generated + 1 < s.max_new_tokens for s in sessions)


class DecodePipeline:
    """The rows of the decode step a backend issued ahead, if it did, and their taking."""

    def __init__(self, runner: StepRunner) -> None:
        self._runner = runner  # the backend; its methods are looked up at each call
        self._rows: tuple[AheadRow, ...] | None = None

    @property
    def issued(self) -> bool:
        """Whether a decode step was issued ahead and is not yet taken or dropped."""
        return self._rows is not None

    def forget(self) -> None:
        """Another step runs: the backend drops the step issued ahead."""
        self._rows = None

    def note(self, out: StepOutput, sessions: Sequence[Session]) -> None:
        """Remember what the step issued ahead (if `out` says one was) feeds each row: the
        token `out` sampled, at the position after the session's last."""
        if out.ahead:
            self._rows = tuple(
                AheadRow(s, int(out.tokens[row]), s.n_past, s.sampler)
                for row, s in enumerate(sessions)
            )

    def take(
        self, decode: Sequence[Session], prefill: Sequence[tuple[Session, int]]
    ) -> dict[int, TokenEvent]:
        """The decode sessions' tokens (by id of session) from the step issued ahead, when
        it is the step every one of them wants now (its rows may be more: those are
        dropped); else it is dropped and {} returned. Issues the step after it first when
        the same rows decode on."""
        rows, self._rows = self._rows or (), None
        index = {id(row.session): r for r, row in enumerate(rows)}

        def wants_it(s: Session) -> bool:
            row = rows[index[id(s)]] if id(s) in index else None
            return (
                row is not None
                and s.pending == [row.token]
                and s.n_past == row.position
                and s.sampler is row.sampler
            )

        if not decode or not all(map(wants_it, decode)):
            self._runner.discard_ahead()
            return {}
        for s in decode:
            s.take_pending(1)
        again = not prefill and len(decode) == len(rows) and may_look_ahead(decode)
        out = self._runner.take_ahead(again)
        self.note(out, [row.session for row in rows])
        return {id(s): s.accept(out.sampled(index[id(s)])) for s in decode}
