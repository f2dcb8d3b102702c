"""The engine thread: its inbox, the engine's start-up and warm-up, and the step loop.

Threads (one thread drives an Engine: docs/architecture.md). The daemon's I/O thread owns
the ROUTER socket: it validates requests, answers `health`, `info`, `abort`,
`stats` and `trace` itself, and `submit`s engine work here as Jobs. This thread
alone calls the engine; it sends replies through its own inproc PUSH socket, the
replies of each flush as one message (replies.py), which the I/O thread splits and
forwards to clients, so neither waits on the other.

Jobs reach this thread through the prompt thread (prompts.py), which tokenizes their
prompts on the way. Each iteration takes new jobs (lifecycle.py starts them) and notices of
clients gone, ends those the policy finds cancelled, past their deadline or waiting for a
session slot past --max-queue-time, gives the free slots to the jobs waiting for one
(oldest first: a slot a `close` freed goes to a waiting job in the same iteration),
then runs the step the policy plans (policy.py): the next token of every decoding job
and prompt chunks of the jobs still prefilling, oldest first, within a token budget
(Engine.step). The replies each stage made go out after it. With nothing to step, the
thread waits for new jobs, never past the moment a waiting job runs out of time (nor a
second); the I/O thread `wake`s it when an `abort` flags a job.

Start-up, on this thread while the I/O thread already answers `health` (loading): the
model file is read and the configuration checked against it (config.plan), the engine
built, and a warm-up run; then `ready`. `stop` is heard all along: the model's reading
stops between two of its fields, the weights' upload between layers and the warm-up
between steps, and the thread ends without an error (nothing was being served). A
configuration the model cannot serve (over the memory budget, say) ends it with its
`failure`, one line, no traceback.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.kv_cache import kv_bytes_per_token, kv_pool_bytes
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.errors import LoadCancelled, RocforgeError
from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.profiling.latency import LatencyRecorder
from rocforge_rt.profiling.op_timer import OpTimer
from rocforge_rt.server.config import Plan
from rocforge_rt.server.jobs import (
    CancelCause,
    Cancelled,
    Failed,
    Job,
    JobBoard,
    Limits,
    PeerGone,
)
from rocforge_rt.server.lifecycle import Lifecycle
from rocforge_rt.server.logs import ThroughputLog
from rocforge_rt.server.policy import StepPolicy
from rocforge_rt.server.prompts import PromptThread
from rocforge_rt.server.protocol import ErrorCode
from rocforge_rt.server.refusals import Refusals
from rocforge_rt.server.replies import Outbox, usage_map
from rocforge_rt.server.translate import max_token_bytes
from rocforge_rt.step.forward import BracketedOps

log = logging.getLogger("rocforge.server")

END_OF_REPLIES = b""  # the last message the engine thread sends: it has stopped
WAKE = object()  # an inbox item that only wakes the engine thread (a job was flagged)
RUNTIME_STATS_INTERVAL_S = 0.1  # how often the backend's runtime counters are read
MAX_TAKEN_PER_ITERATION = 256  # inbox items started before the next step runs


class EngineLoop:
    """Runs every engine call on one thread (see the module docstring)."""

    def __init__(
        self,
        planner: Callable[[Callable[[], bool]], Plan],  # should_stop -> the plan (config.plan)
        board: JobBoard,
        refusals: Refusals,
        latency: LatencyRecorder,
        context: zmq.Context,
        reply_endpoint: str,
        on_decode_step: Callable[[int], None] = lambda _sessions: None,
    ) -> None:
        self._planner = planner
        self._on_decode_step = on_decode_step  # told each step's decoded sessions (metrics)
        self._board = board
        self._refusals = refusals
        self._latency = latency
        self._context = context
        self._reply_endpoint = reply_endpoint
        self._inbox: queue.SimpleQueue[Job | PeerGone | object | None] = queue.SimpleQueue()
        self._prompts = PromptThread(self._tokenizer, self._inbox.put)
        self._policy = StepPolicy()
        self._outbox = Outbox()
        self._lifecycle: Lifecycle | None = None  # once the engine has started
        self._stopping = False
        self._stop_requested = threading.Event()  # heard while loading, too
        self._out: zmq.Socket | None = None  # created on the engine thread, used only there
        self._next_runtime_stats = 0.0
        self._reset_requested = threading.Event()
        self.engine: Engine | None = None
        self.op_timer: OpTimer | None = None
        # published for the I/O thread (each replaced whole, never mutated)
        self.ready = threading.Event()
        self.loading: dict[str, Any] | None = None  # the load's stage, done, total (`health`)
        self.failure: str | None = None
        self.limits: Limits | None = None  # once the plan is made
        self.info: dict[str, Any] = {}
        self.max_token_bytes: int | None = None  # the vocabulary's longest token, in bytes
        self.usage: dict[str, Any] = {}
        self.runtime_stats: dict[str, Any] | None = None

    # --- called from the I/O thread -------------------------------------------------------
    def submit(self, job: Job | PeerGone) -> None:
        self._prompts.submit(job)

    def wake(self) -> None:
        """Have the engine thread look at the jobs now, if it waits for new ones (a job waiting
        for a slot was flagged: it ends at once, not at the next timeout)."""
        self._inbox.put(WAKE)

    def reset_stats(self) -> None:
        """Ask for the backend's runtime counters to be cleared (done on the engine thread)."""
        self._reset_requested.set()

    def stop(self) -> None:
        """Finish: every job left gets its final reply (the I/O thread cancelled them); a load
        or warm-up in progress stops at its next layer or step."""
        self._stop_requested.set()
        self._prompts.submit(None)

    # --- the prompt thread --------------------------------------------------------------------
    def _tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer if self.engine is not None else None

    # --- the engine thread ------------------------------------------------------------------
    def run(self) -> None:
        self._prompts.start()
        self._out = self._context.socket(zmq.PUSH)
        self._out.sndhwm = 0  # never block the engine on the I/O thread
        self._out.connect(self._reply_endpoint)
        try:
            try:
                self._start_engine()
            except LoadCancelled:
                log.info("stopped while loading")
                return
            except RocforgeError as exc:  # a model file or a configuration it cannot serve
                log.error("cannot start: %s", exc)
                self.failure = str(exc)
                return
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
            self._prompts.finish()
            self._flush()
            self._out.send(END_OF_REPLIES)
            self._out.close(linger=1000)

    def _loading(self, stage: str, done: int, total: int) -> None:
        """A load's progress (`LoadProgress`): logged, and published for `health`."""
        self.loading = {"stage": stage, "done": done, "total": total}
        log.info("loading: %s %d/%d", stage, done, total)

    def _start_engine(self) -> None:
        plan = self._planner(self._stop_requested.is_set)
        self.limits = plan.limits
        engine = plan.build(self._stop_requested.is_set, self._loading)
        self.op_timer = OpTimer()
        engine.ops = BracketedOps(engine.ops, self.op_timer.bracket)
        self.engine = engine
        started = time.perf_counter()
        self._warm_up()
        self.op_timer.reset()
        self.info = {**self._describe(), "warmup_ms": (time.perf_counter() - started) * 1000.0}
        self.max_token_bytes = max_token_bytes(engine.tokenizer)
        self._lifecycle = Lifecycle(
            engine,
            self.limits,
            self._board,
            self._policy,
            self._latency,
            self._outbox,
            self._refusals,
        )
        self._publish_usage()
        self._throughput = ThroughputLog(time.perf_counter())
        model, device = self.info["model"], self.info["device"]
        log.info(
            "ready: model %s (%s, %d layers), backend %s on %s, %d sessions x %d tokens,"
            " prefill chunk %d, warm-up %.0f ms",
            model["name"] or model["path"],
            model["arch"],
            model["n_layer"],
            self.info["backend"],
            device["device"],
            engine.slots.n_slots,
            engine.n_ctx,
            engine.prefill_chunk,
            self.info["warmup_ms"],
        )

    def _describe(self) -> dict[str, Any]:
        """The model, backend, device and KV pool, for `info`."""
        engine = self.engine
        hp, kv_dtype = engine.hparams, engine.kv_dtype
        return {
            "model": {
                "path": Path(engine.model.path).name,  # the file name: no absolute path
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
                "dtype": kv_dtype,
                "bytes_per_token": kv_bytes_per_token(hp, kv_dtype),
                "pool_bytes": kv_pool_bytes(hp, engine.slots.n_slots, engine.n_ctx, kv_dtype),
            },
        }

    def _warm_up(self) -> None:
        """A prefill per slot, then a decode step of each batch size (a GPU backend captures
        its step graph per batch size), before `ready`; LoadCancelled between steps when
        asked to stop."""
        engine = self.engine
        engine.backend.warm_up()
        token = engine.tokenizer.bos_id if engine.tokenizer and engine.tokenizer.bos_id else 0
        n_slots = engine.slots.n_slots
        sessions = [engine.open_session([token], max_tokens=n_slots + 1) for _ in range(n_slots)]
        try:
            for session in sessions:
                self._check_stop()
                engine.prefill(session)
            for size in range(n_slots, 0, -1):
                self._check_stop()
                running = [s for s in sessions if not s.finished][:size]
                if len(running) == size:  # a session may have ended early (EOS, context)
                    engine.decode(running)
        finally:
            for session in sessions:
                engine.close_session(session)
        self._reset_runtime_stats()

    def _check_stop(self) -> None:
        if self._stop_requested.is_set():
            raise LoadCancelled("warm-up stopped: asked to stop")

    def _loop(self) -> None:
        """Iterate until stopped and idle; each iteration that ran a step goes on record with
        the op timer's `loop` (from its start, or from the end of a wait for work)."""
        policy, lifecycle, clock = self._policy, self._lifecycle, time.perf_counter_ns
        while True:
            busy = policy.busy or (policy.waiting and self._board.slot_free())
            started = clock()
            self._take_jobs(block=not busy)
            if not busy:
                started = clock()
            if self._reset_requested.is_set():
                self._reset_requested.clear()
                self._reset_runtime_stats()
            now = time.perf_counter()
            for job, cause in policy.due_to_cancel(now):
                lifecycle.end(job, Cancelled(cause))
            lifecycle.end_overdue(now)
            if self._stopping:  # flagged by the I/O thread already: no waiting job starts now
                for job in list(policy.waiting):
                    lifecycle.end(job, Cancelled(job.cancel or CancelCause.SHUTDOWN))
            self._flush()
            if self._stopping and not policy.busy:
                for live in list(lifecycle.sessions.values()):
                    lifecycle.close_session(live)
                self._publish_usage()
                return
            lifecycle.reap_idle(now)
            lifecycle.start_waiting()  # the slots freed so far, this iteration's included
            decode, chunks = policy.plan(self.engine.step_budget, self._pending_prompt_tokens)
            step = self._step(decode, chunks) if decode or chunks else None
            if not self._flush():  # usage is published once an iteration, with any replies
                self._publish_usage()
            self._throughput.maybe_log(time.perf_counter(), self.usage)
            if step is not None:
                kind, engine_ns = step
                self.op_timer.loop(kind, clock() - started, engine_ns)

    def _take_jobs(self, *, block: bool) -> None:
        """Start what came in (at most MAX_TAKEN_PER_ITERATION items: a client flooding the
        inbox cannot hold the steps back), then send the replies that made."""
        for taken in range(MAX_TAKEN_PER_ITERATION):
            try:
                if block and taken == 0:
                    item = self._inbox.get(timeout=self._idle_wait())
                else:
                    item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._stopping = True
            elif isinstance(item, PeerGone):
                self._lifecycle.peer_gone(item)
            elif item is not WAKE:
                self._lifecycle.start(item)
        self._flush()

    def _idle_wait(self) -> float:
        """How long to wait for new jobs with nothing to step: the idle reaper's interval (a
        second at most), and no later than the first waiting job's deadline or limit."""
        timeout = min(1.0, self.limits.idle_timeout_s / 4)
        due = self._policy.next_due(self.limits.max_queue_time_s)
        if due is not None:
            timeout = min(timeout, max(0.0, due - time.perf_counter()))
        return timeout

    # --- the step -----------------------------------------------------------------------------
    def _pending_prompt_tokens(self, job: Job) -> int:
        return len(self._lifecycle.session_of(job).pending)

    def _step(
        self, decode: tuple[Job, ...], chunks: tuple[tuple[Job, int], ...]
    ) -> tuple[str, int] | None:
        """One engine step: a token for every decoding job, the planned prompt chunks. Its
        kind and the ns spent inside Engine.step; None when the engine failed."""
        lifecycle, policy = self._lifecycle, self._policy
        now = time.perf_counter()
        for job, _ in chunks:
            if job.prefill_started is None:
                job.prefill_started = now
        kind = "mixed" if decode and chunks else "decode" if decode else "prefill"
        n_tokens = len(decode) + sum(n for _, n in chunks)
        with self.op_timer.step(kind, n_tokens=n_tokens, n_seqs=len(decode) + len(chunks)):
            engine_started = time.perf_counter_ns()
            try:  # replies are host time too
                out = self.engine.step(
                    [lifecycle.session_of(j) for j in decode],
                    [(lifecycle.session_of(j), n) for j, n in chunks],
                )
            except Exception as exc:
                self._engine_failed([*decode, *(j for j, _ in chunks)], exc)
                return None
            engine_ns = time.perf_counter_ns() - engine_started
            self._on_decode_step(len(decode))
            first_tokens = sum(event is not None for event in out.prefilled)
            self._throughput.add(n_tokens - len(decode), len(decode) + first_tokens)
            for job, event in zip(decode, out.decoded, strict=True):
                lifecycle.deliver(job, event, policy.after_decode(job, event))
            for (job, _), event in zip(chunks, out.prefilled, strict=True):
                if event is not None:
                    lifecycle.deliver(job, event, policy.after_prefill(job, event))
        now = time.perf_counter()
        if decode and now >= self._next_runtime_stats:
            self._next_runtime_stats = now + RUNTIME_STATS_INTERVAL_S
            self.runtime_stats = self.engine.backend.runtime_stats()
        return kind, engine_ns

    def _engine_failed(self, jobs: Sequence[Job], exc: Exception) -> None:
        log.error("engine step failed for requests %s", [j.request.id for j in jobs], exc_info=exc)
        failure = Failed(ErrorCode.INTERNAL, f"engine error: {exc}", FinishReason.ERROR)
        for job in jobs:
            self._lifecycle.end(job, failure)

    def _fail_everything(self, message: str) -> None:
        """After a bug in the loop: end every job running or queued with an internal error."""
        self._prompts.finish()  # everything submitted so far is in the inbox
        jobs = [*self._policy.waiting, *self._policy.prefilling, *self._policy.decoding]
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Job):
                jobs.append(job)
        for job in jobs:
            try:
                self._lifecycle.end(job, Failed(ErrorCode.INTERNAL, message))
            except Exception:  # the state the bug left may break a release: still answer the rest
                log.exception("ending request %r failed", job.request.id)

    def _reset_runtime_stats(self) -> None:
        backend = self.engine.backend
        backend.reset_runtime_stats()
        self.runtime_stats = backend.runtime_stats()

    def _flush(self) -> bool:
        """Send the replies made so far, after the step that made them is on record and the
        usage they imply is published (`stats` never lags a reply); False when there were
        none (nothing published)."""
        if not self._outbox.pending:
            return False
        self._publish_usage()
        self._outbox.send(self._out)
        return True

    def _publish_usage(self) -> None:
        sessions = [live.session for live in self._lifecycle.sessions.values()]
        policy = self._policy
        self.usage = usage_map(self.engine, sessions, len(policy.prefilling), len(policy.decoding))
