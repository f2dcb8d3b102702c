"""Jobs: requests on their way through the engine thread, how they can end, and the job board.

A `Job` is one engine request (open, append, step, generate, close) from the
moment the I/O thread accepts it until its final reply. `JobState` and the
outcomes (`Finished`, `Failed`, `Cancelled`, `Closed`) are the vocabulary of
its end; lifecycle.py holds the state machine that uses them.

`JobBoard` is the state both threads share, under one lock: which client owns
which session, and the requests in flight (so `abort` is answered at once, by
flagging the job for the engine thread to end, from the moment the job is
accepted). Session slots are counted in one place only, the engine's slot
allocator (engine/kv_cache.py), which the board shares: a job that will open a
session takes a real slot when it is accepted and holds it until its session takes
it over or the job ends. When no slot is free, or others already wait for one, it
waits: the board counts the jobs waiting (at most --max-queue; past that the job is
`busy` at once), and the engine thread keeps them in arrival order (policy.py) and
gives each freed slot to the oldest (`grant`). A session belongs to the holder of its
token (access.py); the board also counts the sessions each client opened, for
--max-sessions-per-client, and the requests each client has in flight: at most two a
session slot (a request on it and its `close`) plus --max-queue; past that its requests
could only be refused, and no client fills the engine thread's inbox. A request naming a
session its token does not open is refused by the I/O thread (`check_session`) before it
reaches the engine thread.
"""

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from rocforge_rt.engine.kv_cache import SlotAllocator
from rocforge_rt.engine.session import TokenEvent
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.errors import EngineError
from rocforge_rt.profiling.latency import RequestTimer
from rocforge_rt.server.access import Owner, new_token, same_secret
from rocforge_rt.server.protocol import (
    ErrorCode,
    Generate,
    Open,
    ProtocolError,
    Request,
    SessionRequest,
)


class CancelCause(StrEnum):
    """Why a request was cut short (a reply's `abort_reason`)."""

    CLIENT = "client"  # an `abort` request
    CLOSE = "close"  # its session was closed
    DISCONNECT = "disconnect"  # the client went away
    SHUTDOWN = "shutdown"  # the daemon is stopping
    DEADLINE = "deadline"  # its `deadline_ms` passed


@dataclass(frozen=True)
class Limits:
    """Per-daemon limits, fixed at start-up."""

    n_ctx: int
    max_sessions: int
    max_prompt_tokens: int
    max_new_tokens: int
    idle_timeout_s: float
    max_queue: int = 0  # jobs that may wait for a session slot; 0: none (busy at once)
    max_queue_time_s: float = 0.0  # the longest a job waits for a slot; 0: no limit


class JobState(StrEnum):
    """Where a job is (the table in lifecycle.py says how it moves)."""

    QUEUED = "queued"  # accepted by the I/O thread, waiting in the engine thread's inbox
    WAITING = "waiting"  # an open or one-shot generate waiting for a session slot (FIFO)
    PREFILLING = "prefilling"  # its turn's prompt goes through the engine chunk by chunk
    DECODING = "decoding"  # in the decode batch: one token a step
    ENDED = "ended"  # its final reply is made; it holds nothing


@dataclass(eq=False)
class Job:
    """A request on its way through the engine thread, and what it has produced so far."""

    request: Request
    envelope: tuple[bytes, ...]  # routing frames: the peer's identity (and a REQ delimiter)
    received: float  # perf_counter() at receipt
    cancel: CancelCause | None = None  # set by the I/O thread
    slot: int | None = None  # a KV slot taken at admission, until its session takes it over
    waits: bool = False  # counted in the board's queue: no slot yet (under the board's lock)
    waited: float | None = None  # seconds from receipt to its slot (or to its end without one)
    user: str | None = None  # the client's CURVE public key (z85); None without CURVE
    token: str | None = None  # the token of the session it opened, until its first reply
    turn_ids: list[int] | Exception | None = None  # its turn's prompt ids (prompts.py)
    # engine-thread state
    state: JobState = JobState.QUEUED
    session_id: int | None = None  # the session it runs on, once started
    timer: RequestTimer | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    remaining: float = 0  # tokens still wanted (step: n; generate: until the turn ends)
    events: list[TokenEvent] = field(default_factory=list)  # step: tokens not yet replied
    prefill_started: float | None = None

    @property
    def peer(self) -> bytes:
        return self.envelope[0]

    @property
    def deadline(self) -> float | None:
        ms = self.request.deadline_ms
        return None if ms is None else self.received + ms / 1000.0

    @property
    def streams(self) -> bool:
        return self.request.op == "generate"

    @property
    def opens_session(self) -> bool:
        """An open or a one-shot generate: it reserves a session slot when it is accepted."""
        request = self.request
        return isinstance(request, Open) or (
            isinstance(request, Generate) and request.turn is not None
        )


def _session_named(request: Request) -> int | None:
    """The session a request names (None: an open, a one-shot generate, an abort by id)."""
    return request.session if isinstance(request, SessionRequest) else None


@dataclass(frozen=True)
class PeerGone:
    """The engine thread's notice that a client's connection closed (daemon.py sends it)."""

    peer: bytes
    keep_sessions: bool  # it named its own routing id: it may come back for its sessions


# --- outcomes: how a job ends (lifecycle.Lifecycle.end takes one) --------------------------------
@dataclass(frozen=True)
class Finished:
    """The job ran its course: a token reply carrying its last tokens."""

    reason: FinishReason | None  # None: open, append or step ended while the turn goes on
    events: tuple[TokenEvent, ...] = ()


@dataclass(frozen=True)
class Failed:
    """An error reply. `finish_reason` ERROR: the engine failed mid-turn (the turn ends too)."""

    code: ErrorCode
    message: str
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class Cancelled:
    """Cut short: an error reply before the first token, else its tokens with finish `abort`."""

    cause: CancelCause


@dataclass(frozen=True)
class Closed:
    """A `close` request's: its session is closed."""

    context_tokens: int


Outcome = Finished | Failed | Cancelled | Closed


def slots_in_use(n_slots: int) -> str:
    """That every one of the daemon's session slots is in use, in words naming the flag."""
    if n_slots == 1:
        return "the only session slot (--max-sessions 1) is in use"
    return f"all {n_slots} session slots (--max-sessions {n_slots}) are in use"


def _requests(n: int) -> str:
    return "1 request is" if n == 1 else f"{n} requests are"


MAX_EXPIRED_REMEMBERED = 4096  # sessions the idle reaper closed, for a clearer refusal


class JobBoard:
    """Session owners, in-flight requests and the queue's count, shared by the I/O and
    engine threads.

    A session slot is the slot allocator's; its holder is either a job that will open a
    session (`job.slot`, from `admit` or `grant` until `session_opened` or `retire`) or an
    open session (until the engine closes it). The board keeps no count of slots of its
    own; it counts the jobs waiting for one (`job.waits`, from `admit` until `grant` or
    `retire`), so that no new job takes a slot ahead of them.
    """

    def __init__(
        self,
        slots: SlotAllocator,
        max_sessions_per_client: int | None = None,
        max_queue: int = 0,
    ) -> None:
        self._lock = threading.Lock()
        self._slots = slots
        self._quota = max_sessions_per_client  # None: only the slots limit
        self.max_queue = max_queue  # 0: no queue, a full daemon answers busy at once
        # past this many requests in flight, a client's requests could only be refused
        self.max_in_flight_per_client = 2 * slots.n_slots + max_queue
        self._waiting = 0  # jobs with `waits` set
        self._peak_waiting = 0  # the most there were since start or `reset_peak`
        self._owners: dict[int, Owner] = {}  # open session -> who opened it (its token)
        self._by_id: dict[tuple[bytes, int | str], Job] = {}
        self._jobs: set[Job] = set()
        self._in_flight: Counter[bytes] = Counter()  # jobs on the board, by client
        # session id -> token of sessions the idle reaper closed (oldest first, bounded)
        self._expired: dict[int, str] = {}

    def admit(self, job: Job) -> None:
        """Register a request; ProtocolError for a duplicate id, or `busy` when it needs a
        session slot and can neither take one (none free, or others wait) nor wait."""
        key = (job.peer, job.request.id)
        with self._lock:
            if job.request.id is not None and key in self._by_id:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"request id {job.request.id!r} is already in flight"
                )
            if self._in_flight[job.peer] >= self.max_in_flight_per_client:
                raise ProtocolError(
                    ErrorCode.BUSY,
                    f"this client has {self._in_flight[job.peer]} requests in flight, the most"
                    " one may have (2 x --max-sessions + --max-queue); wait for their replies",
                )
            if job.opens_session:
                self._check_quota(job)
                self._take_slot_or_wait(job)
            if job.request.id is not None:
                self._by_id[key] = job
            self._jobs.add(job)
            self._in_flight[job.peer] += 1

    def _take_slot_or_wait(self, job: Job) -> None:
        """A free slot when nobody waits; else a place in the queue; else `busy` (call with
        the lock held)."""
        if self._waiting == 0:
            try:
                job.slot = self._slots.acquire()
            except EngineError:
                pass
            else:
                job.waited = time.perf_counter() - job.received
                return
        if self._waiting >= self.max_queue:
            queue = (
                "the queue is off (--max-queue 0)"
                if self.max_queue == 0
                else f"{_requests(self._waiting)} waiting, the queue's limit (--max-queue"
                f" {self.max_queue})"
            )
            raise ProtocolError(
                ErrorCode.BUSY, f"{slots_in_use(self._slots.n_slots)} and {queue}; retry later"
            )
        job.waits = True
        self._waiting += 1
        self._peak_waiting = max(self._peak_waiting, self._waiting)

    def grant(self, job: Job) -> bool:
        """Give a waiting job a free slot (the engine thread, oldest job first); False when
        none is free."""
        with self._lock:
            if not job.waits:
                raise ValueError(f"request {job.request.id!r} is not waiting for a slot")
            try:
                job.slot = self._slots.acquire()
            except EngineError:
                return False
            job.waits = False
            self._waiting -= 1
            job.waited = time.perf_counter() - job.received
            return True

    def slot_free(self) -> bool:
        return self._slots.free > 0

    def _check_quota(self, job: Job) -> None:
        """`busy` when the job's client (routing id, or CURVE key) already has its quota of
        sessions open or opening (call with the lock held)."""
        if self._quota is None:
            return
        owners = self._owners.values()
        opening = [j for j in self._jobs if j.slot is not None or j.waits]  # no session yet
        counts = [
            sum(o.peer == job.peer for o in owners) + sum(j.peer == job.peer for j in opening)
        ]
        if job.user is not None:
            counts.append(
                sum(o.user == job.user for o in owners) + sum(j.user == job.user for j in opening)
            )
        if max(counts) >= self._quota:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"this client has {max(counts)} sessions open or opening, its quota"
                f" (--max-sessions-per-client {self._quota}); close one or retry later",
            )

    def retire(self, job: Job) -> None:
        """Take an ended job off the board; a slot it took and no session took over goes back,
        and a job still waiting for one leaves the queue."""
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)
                self._in_flight[job.peer] -= 1
                if not self._in_flight[job.peer]:
                    del self._in_flight[job.peer]
            if self._by_id.get((job.peer, job.request.id)) is job:
                del self._by_id[(job.peer, job.request.id)]
            if job.waits:
                job.waits = False
                self._waiting -= 1
            slot, job.slot = job.slot, None
        if slot is not None:
            self._slots.release(slot)

    def session_opened(self, job: Job, session_id: int) -> Owner:
        """The slot `job` took is now its session's (closing the session gives it back); the
        session gets a new token (the job's first reply carries it): its owner."""
        owner = Owner(job.peer, new_token(), job.user)
        with self._lock:
            job.slot = None
            job.token = owner.token
            self._owners[session_id] = owner
        return owner

    def session_closed(self, session_id: int, *, expired: bool = False) -> None:
        """The session is closed (`expired`: by the idle reaper, which its refusals say)."""
        with self._lock:
            owner = self._owners.pop(session_id, None)
            if expired and owner is not None:
                self._expired[session_id] = owner.token
                if len(self._expired) > MAX_EXPIRED_REMEMBERED:
                    del self._expired[next(iter(self._expired))]

    def check_session(self, session_id: int, token: str | None, user: str | None) -> None:
        """`unknown_session` unless that token (and CURVE key) opens the session: never opened,
        closed, expired, or another client's (a wrong token is not told apart)."""
        with self._lock:
            owner = self._owners.get(session_id)
            if owner is not None and owner.admits(token, user):
                return
            closed_token = self._expired.get(session_id)
            expired = closed_token is not None and same_secret(token, closed_token)
        why = "expired (idle timeout)" if expired else "not open"
        raise ProtocolError(
            ErrorCode.UNKNOWN_SESSION,
            f"session {session_id} is {why} for this client (or its token is wrong)",
        )

    def cancel(
        self,
        peer: bytes,
        cause: CancelCause,
        *,
        request: int | str | None = None,
        session: int | None = None,
    ) -> bool:
        """Flag the peer's request with that id, or the requests on that session (whoever sent
        them: the caller checked the session's token): from their acceptance for those that
        name it (step, generate, append), once it is open for those that open it. A `close`
        is not flagged: it ends what runs on its session."""
        with self._lock:
            if request is not None:
                found = self._by_id.get((peer, request))
                targets = [] if found is None else [found]
            else:
                targets = [
                    j
                    for j in self._jobs
                    if j.request.op != "close"
                    and session in (j.session_id, _session_named(j.request))
                ]
            targets = [j for j in targets if j.state is not JobState.ENDED]
            for job in targets:
                job.cancel = job.cancel or cause
            return bool(targets)

    def cancel_peer(self, peer: bytes, cause: CancelCause) -> bool:
        """Flag every request of the peer; whether it had any, or any session open."""
        with self._lock:
            mine = [job for job in self._jobs if job.peer == peer]
            for job in mine:
                job.cancel = job.cancel or cause
            return bool(mine) or any(o.peer == peer for o in self._owners.values())

    def cancel_all(self, cause: CancelCause) -> None:
        with self._lock:
            for job in self._jobs:
                job.cancel = job.cancel or cause

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "in_flight": len(self._jobs),
                "sessions": len(self._owners),
                "slots_free": self._slots.free,
                "waiting": self._waiting,
            }

    def queue(self, *, reset_peak: bool = False) -> dict[str, int]:
        """The queue's depth, its peak since the start (or the last reset) and its limit."""
        with self._lock:
            depth = {
                "waiting": self._waiting,
                "peak_waiting": self._peak_waiting,
                "max_queue": self.max_queue,
            }
            if reset_peak:
                self._peak_waiting = self._waiting
            return depth
