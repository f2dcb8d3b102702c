"""The step policy: what the engine's next step runs, and what each token means for its job.

Pure: jobs in, decisions out; no engine, no sockets, no clock of its own. Each
engine-thread iteration asks, in order:

1. `due_to_cancel(now)`: running and waiting jobs flagged by the I/O thread (abort,
   close, disconnect, shutdown) or past their deadline, then `overdue(now, limit)`:
   jobs that have waited for a session slot as long as --max-queue-time allows. They
   are ended before the step, so a request stops within one step.
2. The jobs waiting for a session slot (`waiting`, in arrival order) take the slots
   that are free, oldest first (lifecycle.py starts them); `next_due` says when the
   next waiting job runs out of time, so that the engine thread, idle, wakes for it.
3. `plan(budget, pending)`: one scheduler step (vLLM V1's unified scheduling) of at
   most `budget` tokens: the next token of every decoding job first, then prompt
   chunks of the jobs still prefilling, oldest first, as many as fit (a long prompt
   takes what is left of each step; prompts arriving together prefill together, and
   running generations never wait for a whole prompt). A chunk that ends its prompt
   samples the job's first token, which goes to `after_prefill`; each decoded token
   goes to `after_decode`.

`after_prefill` and `after_decode` count the token and say what it means: a
`Finished` outcome (the job ends with it), `Emit.STREAM` (send it now), or
`Emit.HOLD` (keep it for the job's final reply: a `step` replies once). A job
leaves the queues only when it ends (`remove`), or moves from prefill to decode
(it decodes from the next step on).
"""

from collections import deque
from collections.abc import Callable
from enum import StrEnum

from rocforge_rt.engine.scheduling import pack_step
from rocforge_rt.engine.session import TokenEvent
from rocforge_rt.server.jobs import CancelCause, Finished, Job, JobState


class Emit(StrEnum):
    """What to do with a token that does not end its job."""

    STREAM = "stream"  # reply with it now (generate)
    HOLD = "hold"  # keep it for the job's final reply (step)


class StepPolicy:
    """The jobs waiting for a session slot and the prefill queue (oldest first), and the
    decode batch (in order of arrival)."""

    def __init__(self) -> None:
        self.waiting: deque[Job] = deque()
        self.prefilling: deque[Job] = deque()
        self.decoding: list[Job] = []

    @property
    def busy(self) -> bool:
        """Whether the next step has work."""
        return bool(self.prefilling or self.decoding)

    def wait_for_slot(self, job: Job) -> None:
        """QUEUED -> WAITING: an open or one-shot generate that has no session slot yet."""
        job.state = JobState.WAITING
        self.waiting.append(job)

    def oldest_waiting(self) -> Job | None:
        return self.waiting[0] if self.waiting else None

    def overdue(self, now: float, limit_s: float) -> list[Job]:
        """Waiting jobs that have waited `limit_s` (0: no limit) since their receipt."""
        due = []
        if limit_s > 0:
            for job in self.waiting:  # in arrival order: the first still in time ends the scan
                if now - job.received < limit_s:
                    break
                due.append(job)
        return due

    def next_due(self, limit_s: float) -> float | None:
        """The earliest moment a waiting job reaches its deadline or the wait limit (None:
        nothing waits, or nothing waiting has either)."""
        times = [job.deadline for job in self.waiting if job.deadline is not None]
        if limit_s > 0 and self.waiting:
            times.append(self.waiting[0].received + limit_s)  # the oldest is due first
        return min(times, default=None)

    def queue_prefill(self, job: Job) -> None:
        """QUEUED (or WAITING, given a slot) -> PREFILLING: its turn's prompt is in the session
        (open, append, generate)."""
        job.state = JobState.PREFILLING
        self.prefilling.append(job)

    def join_decode(self, job: Job) -> None:
        """-> DECODING: a step on a session (n tokens), a generate on a session or past its
        prefill (tokens until the turn ends)."""
        job.state = JobState.DECODING
        job.remaining = job.request.n if job.request.op == "step" else float("inf")
        self.decoding.append(job)

    def due_to_cancel(self, now: float) -> list[tuple[Job, CancelCause]]:
        """Jobs to end before the step, running or waiting for a slot: flagged by the I/O
        thread, or past their deadline."""
        due = []
        for job in [*self.waiting, *self.prefilling, *self.decoding]:
            deadline = job.deadline
            if job.cancel is not None:
                due.append((job, job.cancel))
            elif deadline is not None and now >= deadline:
                due.append((job, CancelCause.DEADLINE))
        return due

    def plan(
        self, budget: int, pending: Callable[[Job], int]
    ) -> tuple[tuple[Job, ...], tuple[tuple[Job, int], ...]]:
        """The next step: (every job decoding, [(job, prompt tokens) of the jobs prefilling,
        oldest first, while the `budget` of tokens lasts]); `pending(job)` is how many
        prompt tokens a job still has. Every decoding job gets its token (the budget is at
        least the most sessions there are)."""
        return pack_step(budget, self.decoding, self.prefilling, pending)

    def after_prefill(self, job: Job, event: TokenEvent) -> Finished | Emit:
        """The first token of a turn: open and append end with it, a generate goes on."""
        job.completion_tokens = 1
        if job.request.op in ("open", "append") or event.finish_reason is not None:
            return Finished(event.finish_reason, (event,))
        self.prefilling.remove(job)
        self.join_decode(job)
        return Emit.STREAM

    def after_decode(self, job: Job, event: TokenEvent) -> Finished | Emit:
        """A generate streams each token until the turn ends; a step replies once, with its
        n tokens or fewer when the turn ends first."""
        job.completion_tokens += 1
        job.remaining -= 1
        if job.streams:
            if event.finish_reason is None:
                return Emit.STREAM
            return Finished(event.finish_reason, (event,))
        job.events.append(event)
        if event.finish_reason is None and job.remaining > 0:
            return Emit.HOLD
        events, job.events = tuple(job.events), []
        return Finished(event.finish_reason, events)

    def remove(self, job: Job) -> None:
        """Take an ending job out of the queues (nothing when it is in none)."""
        if job.state is JobState.WAITING and job in self.waiting:
            self.waiting.remove(job)
        if job in self.prefilling:
            self.prefilling.remove(job)
        if job in self.decoding:
            self.decoding.remove(job)
