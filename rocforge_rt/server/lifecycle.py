"""A job's life on the engine thread: how it starts, the one place it ends, the sessions it uses.

States (jobs.JobState) and how a job moves between them:

    QUEUED ──start──▶ PREFILLING ──first token, the turn goes on──▶ DECODING
      │ │ │            ▲     │                                        ▲    │
      │ │ └─▶ WAITING ─┘     │ a free slot: the oldest waiting starts │    │
      │ │         │          │                                        │    │
      │ └─────────┼──────────┼─── start: step, generate on a session ─┘    │
      │           │          │                                             │
      └───────────┴──────────┴──────── end(job, outcome) ──────────────────┴──▶ ENDED

| from       | to         | when                                                            |
| ---------- | ---------- | --------------------------------------------------------------- |
| QUEUED     | PREFILLING | `start` of an open, append or one-shot generate: prompt queued  |
| QUEUED     | WAITING    | `start` of an open or one-shot generate that the board admitted |
|            |            | to its queue (no slot free, or others waiting): checked, parked |
| WAITING    | PREFILLING | `start_waiting`: a slot is free and it is the oldest waiting;   |
|            |            | it starts as if it had just been admitted with that slot        |
| QUEUED     | DECODING   | `start` of a step, or of a generate on an open session          |
| PREFILLING | DECODING   | the first token of a generate whose turn goes on (policy.py)    |
| any        | ENDED      | `end(job, outcome)`, the only way out, with the final reply     |

| outcome (jobs.py)      | final reply                                                      |
| ---------------------- | ---------------------------------------------------------------- |
| Finished(reason, ...)  | its last tokens and `finish_reason` (None: the turn goes on)     |
| Failed(code, ...)      | an error; `finish_reason: error` when the engine failed mid-turn |
|                        | (WAITING past --max-queue-time: `busy`, naming the wait)         |
| Cancelled(cause)       | QUEUED or WAITING: `aborted` "before it started"; no token yet:  |
|                        | `aborted` (`deadline_exceeded` for a deadline); else its tokens  |
|                        | so far with `finish_reason: abort` and `abort_reason`            |
| Closed(context_tokens) | a `close`'s `closed: true`                                       |

What `end` releases, once each:

| what the job holds                          | at its end                                   |
| ------------------------------------------- | -------------------------------------------- |
| its place among the jobs waiting for a slot | left; the board's count of them goes down    |
| its place in the prefill or decode queue    | left                                         |
| its board entry (in flight, its request id) | removed                                      |
| the KV slot it took when accepted or when   | back to the allocator; or, once it opened    |
| its wait ended (open, one-shot generate)    | its session, the session's until that closes |
| the session it opened                       | closed for a one-shot generate, and for an   |
|                                             | open that ends before its first token        |
| any other session it ran on                 | stays open, idle from now                    |

Ending a job that has already ended does nothing (no second reply, nothing
released twice): `end` returns False.

Closing a session (`close_session`) is a separate operation, for the client's
`close`, the idle reaper, a client's vanishing (`peer_gone`) and shutdown: the
session's KV slot goes back to the engine's allocator (the engine thread gives it to
the oldest job waiting for one before its next step). A job running on the
session is ended first (abort_reason `close`, or `disconnect`); when that job had
opened the session (a one-shot generate, an open still in prefill), its end
closes the session, and the close does not close it again.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.session import Session, TokenEvent
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.errors import EngineError
from rocforge_rt.profiling.latency import LatencyRecorder
from rocforge_rt.server.access import Owner
from rocforge_rt.server.jobs import (
    CancelCause,
    Cancelled,
    Closed,
    Failed,
    Finished,
    Job,
    JobBoard,
    JobState,
    Limits,
    Outcome,
    PeerGone,
    slots_in_use,
)
from rocforge_rt.server.logs import log_request_end
from rocforge_rt.server.policy import Emit, StepPolicy
from rocforge_rt.server.protocol import ErrorCode, ProtocolError, ok_reply
from rocforge_rt.server.refusals import Refusals
from rocforge_rt.server.replies import Outbox, final_reply, job_error_reply, stream_reply
from rocforge_rt.server.translate import ENGINE_ERROR_CODES, check_room, turn_args

log = logging.getLogger("rocforge.server")


@dataclass(eq=False)
class OpenSession:
    """An open session, who owns it (its token) and the job running on it."""

    session: Session
    owner: Owner
    last_used: float
    job: Job | None = None


def _turn_ids(job: Job) -> list[int]:
    """The prompt ids the prompt thread made for the job's turn (or what stopped it)."""
    if isinstance(job.turn_ids, Exception):
        raise job.turn_ids
    if job.turn_ids is None:
        raise RuntimeError("a job with a turn reached the engine thread untokenized")
    return job.turn_ids


class Lifecycle:
    """Starts and ends jobs and keeps the open sessions (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        limits: Limits,
        board: JobBoard,
        policy: StepPolicy,
        latency: LatencyRecorder,
        outbox: Outbox,
        refusals: Refusals,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.board = board
        self.policy = policy
        self.latency = latency
        self.outbox = outbox
        self.refusals = refusals
        self.sessions: dict[int, OpenSession] = {}
        self._next_reap = 0.0

    def session_of(self, job: Job) -> Session:
        return self.sessions[job.session_id].session

    # --- QUEUED -> PREFILLING, DECODING, or ENDED at once -------------------------------------
    def start(self, job: Job) -> None:
        """Start a job from the inbox (or one the queue gave a slot); a close, a refusal or a
        job cancelled while queued ends here; one admitted without a slot waits for one."""
        try:
            op = job.request.op
            if job.cancel is not None:
                self.end(job, Cancelled(job.cancel))
            elif op == "close":
                self._close(job)
            elif job.opens_session and job.waits:
                self._wait(job)
            elif job.opens_session:
                self._open(job)
            elif op == "append":
                self._append(job)
            else:
                self._continue(job)
        except ProtocolError as exc:
            self.end(job, Failed(exc.code, exc.message))
        except EngineError as exc:
            self.end(job, Failed(ENGINE_ERROR_CODES[exc.code], exc.message))
        except Exception as exc:
            log.exception("request %r failed", job.request.id)
            self.end(job, Failed(ErrorCode.INTERNAL, f"internal error: {exc}"))

    def _wait(self, job: Job) -> None:
        """Park a job the board admitted to its queue; a turn the daemon would refuse anyway
        is refused now, not once a slot frees."""
        turn_args(self.limits, self.engine.hparams.n_vocab, job.request.turn, _turn_ids(job))
        self.policy.wait_for_slot(job)

    def start_waiting(self) -> None:
        """Give the free slots to the jobs waiting for one, oldest first: each starts as if it
        had just been admitted with its slot (a refusal gives the slot back for the next)."""
        while (job := self.policy.oldest_waiting()) is not None and self.board.grant(job):
            self.policy.waiting.popleft()
            self.start(job)

    def end_overdue(self, now: float) -> None:
        """End the jobs that have waited --max-queue-time for a slot: `busy`."""
        limit = self.limits.max_queue_time_s
        for job in self.policy.overdue(now, limit):
            message = (
                f"waited {now - job.received:.1f} s for a session slot, the limit"
                f" (--max-queue-time {limit:g}): {slots_in_use(self.engine.slots.n_slots)};"
                " retry later"
            )
            self.end(job, Failed(ErrorCode.BUSY, message))

    def _open(self, job: Job) -> None:
        turn = job.request.turn
        ids = _turn_ids(job)
        args = turn_args(self.limits, self.engine.hparams.n_vocab, turn, ids)
        session = self.engine.open_session(ids, slot=job.slot, **args)  # None: it takes one
        owner = self.board.session_opened(job, session.session_id)  # the slot is the session's
        self.sessions[session.session_id] = OpenSession(session, owner, time.perf_counter(), job)
        job.session_id = session.session_id
        self._queue_prefill(job, len(ids))

    def _append(self, job: Job) -> None:
        live = self._owned(job, idle=True)
        turn = job.request.turn
        ids = _turn_ids(job)
        args = turn_args(self.limits, self.engine.hparams.n_vocab, turn, ids)
        session = live.session
        check_room(self.limits, self.engine.hparams.n_vocab, session, ids)
        if not session.finished:  # a new turn ends the one still running
            session.finish(FinishReason.ABORT)
        self.engine.append(session, ids, **args)
        live.job = job
        job.session_id = session.session_id
        self._queue_prefill(job, len(ids))

    def _queue_prefill(self, job: Job, prompt_tokens: int) -> None:
        job.prompt_tokens = prompt_tokens
        job.timer = self.latency.begin(job.request.op, job.received, ttft=True, wait_s=job.waited)
        self.policy.queue_prefill(job)

    def _continue(self, job: Job) -> None:
        live = self._owned(job, idle=True)
        session = live.session
        if session.finished:
            raise ProtocolError(
                ErrorCode.TURN_FINISHED,
                f"session {session.session_id}'s turn has ended ({session.finish_reason});"
                " append another turn to continue",
            )
        live.job = job
        job.session_id = session.session_id
        job.timer = self.latency.begin(job.request.op, job.received, ttft=False)
        self.policy.join_decode(job)

    def _close(self, job: Job) -> None:
        live = self._owned(job, idle=False)
        if live.job is not None:  # its end closes the session when that job opened it
            self.end(live.job, Cancelled(CancelCause.CLOSE))
        context_tokens = live.session.n_context
        if self.sessions.get(live.session.session_id) is live:
            self.close_session(live)
        self.end(job, Closed(context_tokens))

    def _owned(self, job: Job, *, idle: bool) -> OpenSession:
        """The request's session, if its token (and CURVE key) admit it, and, when `idle`,
        nothing runs on it. A wrong or missing token is refused as a session not open."""
        sid = job.request.session
        self.board.check_session(sid, job.request.token, job.user)
        live = self.sessions[sid]
        if idle and live.job is not None:
            raise ProtocolError(
                ErrorCode.SESSION_BUSY,
                f"session {sid} is running request {live.job.request.id!r}; wait or abort it",
            )
        live.last_used = time.perf_counter()
        return live

    # --- tokens, and the end ----------------------------------------------------------------
    def deliver(self, job: Job, event: TokenEvent, meaning: Finished | Emit) -> None:
        """Act on what the policy says a token means: the job ends with it, or it is streamed
        now (a held token waits in the job for its final reply)."""
        if isinstance(meaning, Finished):
            self.end(job, meaning)
        elif meaning is Emit.STREAM:
            reply = stream_reply(job, self.session_of(job), self.limits.n_ctx, event)
            self.outbox.add(job, reply)

    def end(self, job: Job, outcome: Outcome) -> bool:
        """End a job: its final reply, then release what it holds (see the module docstring).

        False, doing nothing, when it has already ended.
        """
        if job.state is JobState.ENDED:
            return False
        refused = isinstance(outcome, Failed) and job.state is JobState.QUEUED
        live = self.sessions.get(job.session_id) if job.session_id is not None else None
        reply = self._final_reply(job, live, outcome)  # before its session may close
        self.policy.remove(job)
        job.state = JobState.ENDED
        self.board.retire(job)
        self.outbox.add(job, reply)
        if job.opens_session:  # its wait for a slot, over now if it had none
            if job.waited is None:
                job.waited = time.perf_counter() - job.received
            self.latency.add_wait(job.waited)
        wait_ms = None if job.waited is None else job.waited * 1000.0
        if refused:  # a line at debug level, and in the summary (refusals.py)
            self.refusals.note(job.peer, outcome.code)
        level = logging.DEBUG if refused else logging.INFO
        log_request_end(job.request.op, job.request.id, reply, wait_ms=wait_ms, level=level)
        if live is not None and live.job is job:
            live.job = None
            live.last_used = time.perf_counter()
            if job.opens_session and (job.streams or job.completion_tokens == 0):
                self.close_session(live)  # a one-shot generate's, or an open's that failed
        return True

    def _final_reply(self, job: Job, live: OpenSession | None, outcome: Outcome) -> dict[str, Any]:
        match outcome:
            case Finished(reason, events):
                return final_reply(job, live.session, self.limits.n_ctx, events, reason)
            case Failed(code, message, finish_reason):
                if finish_reason is not None and live is not None:
                    live.session.finish(finish_reason)
                return job_error_reply(job, code, message, finish_reason)
            case Cancelled(cause):
                return self._cancelled_reply(job, live, cause)
            case Closed(context_tokens):
                usage = {"context_tokens": context_tokens}
                return ok_reply(
                    job.request.id, session=job.request.session, closed=True, usage=usage
                )

    def _cancelled_reply(
        self, job: Job, live: OpenSession | None, cause: CancelCause
    ) -> dict[str, Any]:
        """An error when it produced nothing yet, else its tokens so far, finish `abort`."""
        code = ErrorCode.DEADLINE_EXCEEDED if cause is CancelCause.DEADLINE else ErrorCode.ABORTED
        if job.state in (JobState.QUEUED, JobState.WAITING):
            return job_error_reply(job, code, f"aborted ({cause}) before it started")
        session = live.session
        held = "" if session.finished else session.finish(FinishReason.ABORT)
        if job.completion_tokens == 0 and not job.events:
            return job_error_reply(job, code, f"request cut before its first token ({cause})")
        events, job.events = job.events, []
        return final_reply(
            job,
            session,
            self.limits.n_ctx,
            events,
            FinishReason.ABORT,
            tail=held,
            abort_reason=cause,
        )

    # --- sessions -----------------------------------------------------------------------------
    def close_session(self, live: OpenSession, *, expired: bool = False) -> None:
        """Close a session no job runs on: its KV slot goes back to the engine and the board
        (`expired`: the idle reaper's)."""
        session_id = live.session.session_id
        self.engine.close_session(live.session)
        del self.sessions[session_id]
        self.board.session_closed(session_id, expired=expired)

    def peer_gone(self, notice: PeerGone) -> None:
        """A client's connection closed: end its jobs running on its sessions now (its others
        were flagged by the I/O thread and end at their start or next step), then close its
        sessions, ending whatever runs on them, unless it may come back for them
        (`keep_sessions`: they wait for the idle timeout, and a client that came back with the
        session's token under another routing id keeps driving them)."""
        for live in [s for s in self.sessions.values() if s.owner.peer == notice.peer]:
            if live.job is not None and (live.job.peer == notice.peer or not notice.keep_sessions):
                self.end(live.job, Cancelled(CancelCause.DISCONNECT))
            if not notice.keep_sessions and self.sessions.get(live.session.session_id) is live:
                log.info("closing session %d: its client disconnected", live.session.session_id)
                self.close_session(live)

    def reap_idle(self, now: float) -> None:
        """Close sessions unused for --idle-timeout (their ids are remembered as expired)."""
        if now < self._next_reap:
            return
        self._next_reap = now + min(1.0, self.limits.idle_timeout_s / 4)
        for live in list(self.sessions.values()):
            if live.job is None and now - live.last_used > self.limits.idle_timeout_s:
                log.info(
                    "closing session %d: idle for %.0f s",
                    live.session.session_id,
                    now - live.last_used,
                )
                self.close_session(live, expired=True)
