"""The engine's executor thread: admission, chunked prefill, continuous batching, reaping.

Threads (DESIGN.md: one thread drives an Engine). The daemon's I/O thread owns
the ROUTER socket: it validates requests, answers `health`, `info`, `abort`,
`stats` and `trace` itself, and `submit`s engine work here as Jobs. This thread
alone calls the engine; it sends replies through its own inproc PUSH socket,
which the I/O thread forwards to clients, so neither waits on the other.

Each loop iteration takes new jobs, ends those aborted or past their deadline,
runs at most one prefill chunk (of the oldest prompt still prefilling) and then
one batched `engine.decode` over every session that is generating. A request
therefore stops within one step, and a long prompt delays running generations
by one chunk at a time, not by its whole prefill.

`JobBoard` is the state both threads share, under one lock: session slots
reserved (so a full daemon answers `busy` at once), which client owns which
session, and the requests in flight (so `abort` is answered at once).
"""

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import zmq

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.kv_cache import kv_bytes_per_token, kv_pool_bytes
from rocforge_rt.engine.session import Session, TokenEvent
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.errors import EngineError
from rocforge_rt.profiling.latency import LatencyRecorder, RequestTimer
from rocforge_rt.profiling.op_timer import OpTimer
from rocforge_rt.server.protocol import (
    ErrorCode,
    Prompt,
    ProtocolError,
    Request,
    Turn,
    error_reply,
    ok_reply,
    pack,
)
from rocforge_rt.step.sampling import SamplingParams

log = logging.getLogger("rocforge.server")

END_OF_REPLIES = b""  # the last message the engine thread sends: it has stopped
RUNTIME_STATS_INTERVAL_S = 0.1  # how often the backend's runtime counters are read
MAX_EXPIRED_REMEMBERED = 4096


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


@dataclass(eq=False)
class Job:
    """A request on its way through the engine thread, and what it has produced so far."""

    request: Request
    envelope: tuple[bytes, ...]  # routing frames: the peer's identity (and a REQ delimiter)
    received: float  # perf_counter() at receipt
    reserves_slot: bool = False
    cancel: CancelCause | None = None  # set by the I/O thread
    # engine-thread state
    session_id: int | None = None
    timer: RequestTimer | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    remaining: float = 0  # tokens still wanted (step: n; generate: until the turn ends)
    events: list[TokenEvent] = field(default_factory=list)  # step: tokens not yet replied
    prefill_started: float | None = None
    done: bool = False

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
    def one_shot(self) -> bool:
        """A generate that opened its own session (closed when it ends)."""
        return self.request.op == "generate" and self.request.turn is not None


class JobBoard:
    """Slots, session owners and in-flight requests, shared by the I/O and engine threads."""

    def __init__(self, n_slots: int) -> None:
        self._lock = threading.Lock()
        self._free_slots = n_slots
        self._owners: dict[int, bytes] = {}
        self._by_id: dict[tuple[bytes, int | str], Job] = {}
        self._jobs: set[Job] = set()

    def admit(self, job: Job) -> None:
        """Register a request; ProtocolError for a duplicate id, or `busy` when it needs a
        session slot and none is free."""
        key = (job.peer, job.request.id)
        with self._lock:
            if job.request.id is not None and key in self._by_id:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"request id {job.request.id!r} is already in flight"
                )
            if job.reserves_slot:
                if self._free_slots == 0:
                    raise ProtocolError(ErrorCode.BUSY, "every session slot is in use; retry later")
                self._free_slots -= 1
            if job.request.id is not None:
                self._by_id[key] = job
            self._jobs.add(job)

    def finish(self, job: Job) -> None:
        with self._lock:
            self._jobs.discard(job)
            if self._by_id.get((job.peer, job.request.id)) is job:
                del self._by_id[(job.peer, job.request.id)]

    def session_opened(self, session_id: int, owner: bytes) -> None:
        with self._lock:
            self._owners[session_id] = owner

    def release_slot(self, session_id: int | None = None) -> None:
        """Give back a slot: a session's that closed, or an open's that failed."""
        with self._lock:
            self._free_slots += 1
            if session_id is not None:
                self._owners.pop(session_id, None)

    def owns(self, peer: bytes, session_id: int) -> bool:
        with self._lock:
            return self._owners.get(session_id) == peer

    def cancel(
        self,
        peer: bytes,
        cause: CancelCause,
        *,
        request: int | str | None = None,
        session: int | None = None,
    ) -> bool:
        """Flag the peer's request with that id, or its request on that session."""
        with self._lock:
            if request is not None:
                target = self._by_id.get((peer, request))
            else:
                target = next(
                    (j for j in self._jobs if j.peer == peer and j.session_id == session), None
                )
            if target is None or target.done:
                return False
            target.cancel = target.cancel or cause
            return True

    def cancel_peer(self, peer: bytes, cause: CancelCause) -> None:
        with self._lock:
            for job in self._jobs:
                if job.peer == peer:
                    job.cancel = job.cancel or cause

    def cancel_all(self, cause: CancelCause) -> None:
        with self._lock:
            for job in self._jobs:
                job.cancel = job.cancel or cause

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"in_flight": len(self._jobs), "sessions": len(self._owners)}


@dataclass(eq=False)
class _Live:
    """An open session, who owns it and the request running on it."""

    session: Session
    owner: bytes
    last_used: float
    job: Job | None = None


def _always() -> bool:
    return True


def _token_map(event: TokenEvent, logprobs: bool) -> dict[str, Any]:
    token: dict[str, Any] = {"token": event.token, "text": event.text, "logprob": event.logprob}
    if logprobs:
        token["top_logprobs"] = [list(pair) for pair in event.top_logprobs]
    return token


def _engine_error(exc: EngineError) -> ProtocolError:
    message = str(exc)
    for code in (ErrorCode.BUSY, ErrorCode.CONTEXT_FULL):
        if message.startswith(f"{code}:"):
            return ProtocolError(code, message)
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


class Scheduler:
    """Runs every engine call on one thread (see the module docstring)."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        limits: Limits,
        board: JobBoard,
        latency: LatencyRecorder,
        context: zmq.Context,
        reply_endpoint: str,
    ) -> None:
        self._engine_factory = engine_factory
        self.limits = limits
        self._board = board
        self._latency = latency
        self._context = context
        self._reply_endpoint = reply_endpoint
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._sessions: dict[int, _Live] = {}
        self._prefilling: deque[Job] = deque()
        self._decoding: list[Job] = []
        self._expired: deque[tuple[bytes, int]] = deque(maxlen=MAX_EXPIRED_REMEMBERED)
        self._stopping = False
        self._next_reap = 0.0
        self._out: zmq.Socket | None = None  # created on the engine thread, used only there
        self._outgoing: list[list[bytes]] = []
        self._runtime_stats: Callable[[], dict[str, Any]] | None = None
        self._next_runtime_stats = 0.0
        self._reset_requested = threading.Event()
        self.engine: Engine | None = None
        self.op_timer: OpTimer | None = None
        # published for the I/O thread (each replaced whole, never mutated)
        self.ready = threading.Event()
        self.failure: str | None = None
        self.info: dict[str, Any] = {}
        self.usage: dict[str, Any] = {}
        self.runtime_stats: dict[str, Any] | None = None

    # --- called from the I/O thread -------------------------------------------------------
    def submit(self, job: Job) -> None:
        self._inbox.put(job)

    def reset_stats(self) -> None:
        """Ask for the backend's runtime counters to be cleared (done on the engine thread)."""
        self._reset_requested.set()

    def stop(self) -> None:
        """Finish: every job left gets its final reply (the I/O thread cancelled them)."""
        self._inbox.put(None)

    # --- the engine thread ------------------------------------------------------------------
    def run(self) -> None:
        self._out = self._context.socket(zmq.PUSH)
        self._out.sndhwm = 0  # never block the engine on the I/O thread
        self._out.connect(self._reply_endpoint)
        try:
            try:
                self._start_engine()
            except Exception as exc:  # a model or device that cannot start: report, stop
                log.exception("engine start-up failed")
                self.failure = f"engine start-up failed: {exc}"
                return
            self.ready.set()
            try:
                self._loop()
            except Exception as exc:  # a bug: answer what is running, then stop the daemon
                log.exception("the engine thread failed")
                self.failure = f"the engine thread failed: {exc}"
                self._fail_everything(self.failure)
        finally:
            self._flush()
            self._out.send(END_OF_REPLIES)
            self._out.close(linger=1000)

    def _start_engine(self) -> None:
        engine = self._engine_factory()
        self.op_timer = OpTimer(engine.ops)
        engine.ops = self.op_timer
        self.engine = engine
        self._runtime_stats = getattr(engine.backend, "runtime_stats", None)
        started = time.perf_counter()
        self._warm_up()
        self.op_timer.reset()
        self.info = {**self._describe(), "warmup_ms": (time.perf_counter() - started) * 1000.0}
        self._publish_usage()
        log.info("ready (warm-up took %.0f ms)", self.info["warmup_ms"])

    def _describe(self) -> dict[str, Any]:
        """The model, backend, device and KV pool, for `info`."""
        engine = self.engine
        hp = engine.hparams
        return {
            "model": {
                "path": str(engine.model.path),
                "name": engine.model.metadata.get("general.name"),
                "arch": hp.arch,
                "n_layer": hp.n_layer,
                "n_embd": hp.n_embd,
                "n_vocab": hp.n_vocab,
                "n_ctx_train": hp.n_ctx_train,
                "tokenizer": engine.tokenizer is not None,
                "chat_template": engine.tokenizer is not None
                and engine.tokenizer.chat_template is not None,
            },
            "backend": engine.backend.name,
            "device": engine.backend.device_info(),
            "kv": {
                "bytes_per_token": kv_bytes_per_token(hp),
                "pool_bytes": kv_pool_bytes(hp, engine.slots.n_slots, engine.n_ctx),
            },
        }

    def _warm_up(self) -> None:
        """A prefill per slot, then a decode step of each batch size (a GPU backend captures
        its step graph per batch size), before `ready`."""
        engine = self.engine
        token = engine.tokenizer.bos_id if engine.tokenizer and engine.tokenizer.bos_id else 0
        n_slots = engine.slots.n_slots
        sessions = [engine.open_session([token], max_tokens=n_slots + 1) for _ in range(n_slots)]
        try:
            for session in sessions:
                engine.prefill(session)
            for size in range(n_slots, 0, -1):
                running = [s for s in sessions if not s.finished][:size]
                if len(running) == size:  # a session may have ended early (EOS, context)
                    engine.decode(running)
        finally:
            for session in sessions:
                engine.close_session(session)
        self._reset_runtime_stats()

    def _loop(self) -> None:
        while True:
            busy = bool(self._prefilling or self._decoding)
            self._take_jobs(block=not busy)
            if self._reset_requested.is_set():
                self._reset_requested.clear()
                self._reset_runtime_stats()
            now = time.perf_counter()
            self._cut_cancelled(now)
            self._flush()
            if self._stopping and not (self._prefilling or self._decoding):
                self._close_all()
                return
            self._reap_idle(now)
            if self._prefilling:
                self._prefill_chunk()
                self._flush()
            if self._decoding:
                self._decode_step()
                self._flush()
            self._publish_usage()

    def _take_jobs(self, *, block: bool) -> None:
        timeout = min(1.0, self.limits.idle_timeout_s / 4)
        try:
            job = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            while True:
                if job is None:
                    self._stopping = True
                else:
                    self._start(job)
                    self._flush()
                job = self._inbox.get_nowait()
        except queue.Empty:
            return

    # --- starting jobs ----------------------------------------------------------------------
    def _start(self, job: Job) -> None:
        try:
            if job.cancel is not None:
                cause = job.cancel
                raise ProtocolError(ErrorCode.ABORTED, f"aborted ({cause}) before it started")
            op = job.request.op
            if op == "close":
                self._close(job)
            elif job.request.turn is not None and op != "append":
                self._open(job)
            elif op == "append":
                self._append(job)
            else:
                self._continue(job)
        except ProtocolError as exc:
            self._fail(job, exc.code, exc.message)
        except Exception as exc:
            log.exception("request %r failed", job.request.id)
            self._fail(job, ErrorCode.INTERNAL, f"internal error: {exc}")

    def _prompt_ids(self, prompt: Prompt, *, first_turn: bool) -> list[int]:
        if prompt.tokens is not None:
            return list(prompt.tokens)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "this model has no vocabulary: send 'tokens', not text"
            )
        if prompt.messages is not None:
            messages = [{"role": r, "content": c} for r, c in prompt.messages]
            try:
                return tokenizer.encode(tokenizer.apply_chat_template(messages))
            except ValueError as exc:
                raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        return tokenizer.encode(prompt.text, add_bos=None if first_turn else False)

    def _turn_args(self, turn: Turn, ids: list[int]) -> dict[str, Any]:
        limits = self.limits
        if not ids:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the prompt has no tokens")
        if len(ids) >= limits.n_ctx:
            raise ProtocolError(
                ErrorCode.CONTEXT_FULL,
                f"a turn of {len(ids)} tokens cannot fit in ctx size {limits.n_ctx}",
            )
        if len(ids) > limits.max_prompt_tokens:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"prompt of {len(ids)} tokens exceeds the limit of {limits.max_prompt_tokens}"
                " (--max-prompt-tokens)",
            )
        max_tokens = turn.max_tokens or limits.max_new_tokens
        if max_tokens > limits.max_new_tokens:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"max_tokens {max_tokens} exceeds the limit of {limits.max_new_tokens}"
                " (--max-new-tokens)",
            )
        s = turn.sampling
        try:
            sampling = SamplingParams(s.temperature, s.top_k, s.top_p, s.seed, s.logprobs)
        except EngineError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        return {"sampling": sampling, "stop": turn.stop, "max_tokens": max_tokens}

    def _open(self, job: Job) -> None:
        turn = job.request.turn
        ids = self._prompt_ids(turn.prompt, first_turn=True)
        args = self._turn_args(turn, ids)
        try:
            session = self.engine.open_session(ids, **args)
        except EngineError as exc:
            raise _engine_error(exc) from None
        now = time.perf_counter()
        self._sessions[session.session_id] = _Live(session, job.peer, now, job)
        self._board.session_opened(session.session_id, job.peer)
        job.session_id = session.session_id
        self._queue_prefill(job, len(ids))

    def _append(self, job: Job) -> None:
        live = self._owned(job, idle=True)
        turn = job.request.turn
        ids = self._prompt_ids(turn.prompt, first_turn=False)
        args = self._turn_args(turn, ids)
        session = live.session
        if session.n_context + len(ids) >= self.limits.n_ctx:
            raise ProtocolError(
                ErrorCode.CONTEXT_FULL,
                f"{session.n_context} tokens in context + {len(ids)} new leave no room"
                f" in ctx size {self.limits.n_ctx}",
            )
        bad = [t for t in ids if t >= self.engine.hparams.n_vocab]
        if bad:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"token id {bad[0]} is outside the vocabulary"
            )
        if not session.finished:  # a new turn ends the one still running
            session.finish(FinishReason.ABORT)
        try:
            self.engine.append(session, ids, **args)
        except EngineError as exc:
            raise _engine_error(exc) from None
        live.job = job
        job.session_id = session.session_id
        self._queue_prefill(job, len(ids))

    def _queue_prefill(self, job: Job, prompt_tokens: int) -> None:
        job.prompt_tokens = prompt_tokens
        job.timer = self._latency.begin(job.request.op, job.received, ttft=True)
        self._prefilling.append(job)

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
        job.remaining = job.request.n if job.request.op == "step" else float("inf")
        job.timer = self._latency.begin(job.request.op, job.received, ttft=False)
        self._decoding.append(job)

    def _close(self, job: Job) -> None:
        live = self._owned(job, idle=False)
        if live.job is not None:
            self._cut(live.job, CancelCause.CLOSE)
        context_tokens = live.session.n_context
        self._drop(live)
        self._end(job)
        usage = {"context_tokens": context_tokens}
        reply = ok_reply(job.request.id, session=job.request.session, closed=True, usage=usage)
        self._reply(job, reply)

    def _owned(self, job: Job, *, idle: bool) -> _Live:
        sid = job.request.session
        live = self._sessions.get(sid)
        if live is None or live.owner != job.peer:
            why = "expired (idle timeout)" if (job.peer, sid) in self._expired else "not open"
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION, f"session {sid} is {why} for this client"
            )
        if idle and live.job is not None:
            raise ProtocolError(
                ErrorCode.SESSION_BUSY,
                f"session {sid} is running request {live.job.request.id!r}; wait or abort it",
            )
        live.last_used = time.perf_counter()
        return live

    # --- steps ------------------------------------------------------------------------------
    def _prefill_chunk(self) -> None:
        job = self._prefilling[0]
        session = self._sessions[job.session_id].session
        if job.prefill_started is None:
            job.prefill_started = time.perf_counter()
        n = min(len(session.pending), self.engine.prefill_chunk)
        with self.op_timer.step("prefill", n_tokens=n, n_seqs=1):  # replies are host time too
            try:
                event = self.engine.prefill(session, should_stop=_always)
            except Exception as exc:
                self._engine_failed([job], exc)
                return
            if event is not None:
                self._prefilling.popleft()
                self._first_token(job, event)

    def _decode_step(self) -> None:
        jobs = self._decoding
        sessions = [self._sessions[j.session_id].session for j in jobs]
        with self.op_timer.step("decode", n_tokens=len(jobs), n_seqs=len(jobs)):
            try:
                events = self.engine.decode(sessions)
            except Exception as exc:
                self._engine_failed(list(jobs), exc)
                return
            for job, event in zip(jobs, events, strict=True):
                self._next_token(job, event)
        self._decoding = [j for j in self._decoding if not j.done]
        now = time.perf_counter()
        if self._runtime_stats is not None and now >= self._next_runtime_stats:
            self._next_runtime_stats = now + RUNTIME_STATS_INTERVAL_S
            self.runtime_stats = self._runtime_stats()

    def _first_token(self, job: Job, event: TokenEvent) -> None:
        job.completion_tokens = 1
        if job.request.op in ("open", "append") or event.finish_reason is not None:
            self._finish(job, [event], event.text, event.finish_reason)
        else:
            job.remaining = float("inf")
            self._stream(job, event)
            self._decoding.append(job)

    def _next_token(self, job: Job, event: TokenEvent) -> None:
        job.completion_tokens += 1
        job.remaining -= 1
        if job.streams:
            if event.finish_reason is None:
                self._stream(job, event)
            else:
                self._finish(job, [event], event.text, event.finish_reason)
            return
        job.events.append(event)
        if event.finish_reason is not None or job.remaining <= 0:
            events, job.events = job.events, []
            self._finish(job, events, "".join(e.text for e in events), event.finish_reason)

    # --- ends ---------------------------------------------------------------------------------
    def _cut_cancelled(self, now: float) -> None:
        for job in [*self._prefilling, *self._decoding]:
            deadline = job.deadline
            if job.cancel is not None:
                self._cut(job, job.cancel)
            elif deadline is not None and now >= deadline:
                self._cut(job, CancelCause.DEADLINE)

    def _cut(self, job: Job, cause: CancelCause) -> None:
        """End a running job early: an error if it produced nothing yet, else an abort."""
        if job in self._prefilling:
            self._prefilling.remove(job)
        if job in self._decoding:
            self._decoding.remove(job)
        live = self._sessions[job.session_id]
        held = "" if live.session.finished else live.session.finish(FinishReason.ABORT)
        if job.completion_tokens == 0 and not job.events:
            code = (
                ErrorCode.DEADLINE_EXCEEDED if cause is CancelCause.DEADLINE else ErrorCode.ABORTED
            )
            self._fail(job, code, f"request cut before its first token ({cause})")
            return
        events, job.events = job.events, []
        text = "".join(e.text for e in events) + held
        self._finish(job, events, text, FinishReason.ABORT, abort_reason=str(cause))

    def _engine_failed(self, jobs: list[Job], exc: Exception) -> None:
        log.error("engine step failed for requests %s", [j.request.id for j in jobs], exc_info=exc)
        for job in jobs:
            self._sessions[job.session_id].session.finish(FinishReason.ERROR)
            if job in self._prefilling:
                self._prefilling.remove(job)
            self._fail(job, ErrorCode.INTERNAL, f"engine error: {exc}", finish_reason="error")
        self._decoding = [j for j in self._decoding if not j.done]

    def _fail(self, job: Job, code: ErrorCode, message: str, **extra: Any) -> None:
        """An error reply that ends the job; a session it opened is closed."""
        if job.streams:
            extra["done"] = True
        self._end(job)  # first, so that the client sees the state its reply implies
        if job.reserves_slot and job.session_id is None:
            self._board.release_slot()
        self._reply(job, error_reply(job.request.id, code, message, **extra))

    def _finish(
        self,
        job: Job,
        events: list[TokenEvent],
        text: str,
        finish_reason: FinishReason | None,
        **extra: Any,
    ) -> None:
        now = time.perf_counter()
        if events:
            job.timer.token_sent(now, streamed=job.streams)
        record = job.timer.finish(
            now,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens,
            finish_reason=finish_reason,
        )
        timings = {"e2e_ms": record.e2e_ms}
        if record.ttft_ms is not None:
            timings["ttft_ms"] = record.ttft_ms
        if record.itl_ms_mean is not None:
            timings["itl_ms_mean"] = record.itl_ms_mean
        if job.prefill_started is not None:
            timings["queue_ms"] = (job.prefill_started - job.received) * 1000.0
        if job.streams:
            extra["done"] = True
        reply = self._token_reply(job, events, text, finish_reason, timings, **extra)
        self._end(job)
        self._reply(job, reply)

    def _stream(self, job: Job, event: TokenEvent) -> None:
        job.timer.token_sent(time.perf_counter(), streamed=True)
        ttft_ms = job.timer.ttft_ms if job.completion_tokens == 1 else None
        timings = {} if ttft_ms is None else {"ttft_ms": ttft_ms}
        self._reply(job, self._token_reply(job, [event], event.text, None, timings, done=False))

    def _token_reply(
        self,
        job: Job,
        events: list[TokenEvent],
        text: str,
        finish_reason: FinishReason | None,
        timings: dict[str, float],
        **extra: Any,
    ) -> dict[str, Any]:
        session = self._sessions[job.session_id].session
        logprobs = session.sampler is not None and session.sampler.params.logprobs > 0
        return ok_reply(
            job.request.id,
            session=job.session_id,
            tokens=[_token_map(e, logprobs) for e in events],
            text=text,
            finish_reason=None if finish_reason is None else str(finish_reason),
            usage={
                "prompt_tokens": job.prompt_tokens,
                "completion_tokens": job.completion_tokens,
                "context_tokens": session.n_context,
                "context_size": self.limits.n_ctx,
            },
            timings=timings,
            **extra,
        )

    def _end(self, job: Job) -> None:
        """Take a finished job off the books (before its final reply goes out)."""
        job.done = True
        self._board.finish(job)
        live = self._sessions.get(job.session_id) if job.session_id is not None else None
        if live is not None and (
            job.one_shot or (job.request.op == "open" and job.completion_tokens == 0)
        ):
            self._drop(live)
        elif live is not None and live.job is job:
            live.job = None
            live.last_used = time.perf_counter()
        self._publish_usage()

    def _drop(self, live: _Live) -> None:
        session_id = live.session.session_id
        self.engine.close_session(live.session)
        del self._sessions[session_id]
        self._board.release_slot(session_id)

    def _reap_idle(self, now: float) -> None:
        if now < self._next_reap:
            return
        self._next_reap = now + min(1.0, self.limits.idle_timeout_s / 4)
        for live in list(self._sessions.values()):
            if live.job is None and now - live.last_used > self.limits.idle_timeout_s:
                log.info(
                    "closing session %d: idle for %.0f s",
                    live.session.session_id,
                    now - live.last_used,
                )
                self._expired.append((live.owner, live.session.session_id))
                self._drop(live)

    def _reset_runtime_stats(self) -> None:
        reset = getattr(self.engine.backend, "reset_runtime_stats", None)
        if reset is not None and self._runtime_stats is not None:
            reset()
            self.runtime_stats = self._runtime_stats()

    def _fail_everything(self, message: str) -> None:
        jobs = [*self._prefilling, *self._decoding]
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                jobs.append(job)
        for job in jobs:
            job.done = True
            self._board.finish(job)
            self._reply(job, error_reply(job.request.id, ErrorCode.INTERNAL, message, done=True))

    def _close_all(self) -> None:
        for live in list(self._sessions.values()):
            self._drop(live)
        self._publish_usage()

    def _reply(self, job: Job, reply: dict[str, Any]) -> None:
        self._outgoing.append([*job.envelope, pack(reply)])

    def _flush(self) -> None:
        """Send the replies made so far (after the step that made them is on record)."""
        for frames in self._outgoing:
            self._out.send_multipart(frames)
        self._outgoing.clear()

    def _publish_usage(self) -> None:
        engine = self.engine
        cached = sum(live.session.n_past for live in self._sessions.values())
        per_token = kv_bytes_per_token(engine.hparams)
        pool = kv_pool_bytes(engine.hparams, engine.slots.n_slots, engine.n_ctx)
        self.usage = {
            "sessions": {
                "open": len(self._sessions),
                "max": engine.slots.n_slots,
                "prefilling": len(self._prefilling),
                "generating": len(self._decoding),
            },
            "kv": {
                "slots_in_use": engine.slots.in_use,
                "slots": engine.slots.n_slots,
                "tokens_cached": cached,
                "bytes_used": cached * per_token,
                "pool_bytes": pool,
                "use": cached * per_token / pool,
            },
        }
