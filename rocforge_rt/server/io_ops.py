"""The ops the daemon's I/O thread answers itself, never waiting on the engine thread.

`health` (at any time), `info`, `stats`, `trace`, `metrics` (the Prometheus text of the
daemon's metrics: metrics.py), `profile` and `abort`. Off loopback, the operator ops (those
that change the daemon's records or switches, or show its internals) need the operator key
(access.py).
"""

import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from rocforge_rt.profiling.latency import LatencyRecorder
from rocforge_rt.server import protocol, queries
from rocforge_rt.server.access import operator_allowed
from rocforge_rt.server.config import DaemonConfig
from rocforge_rt.server.engine_loop import EngineLoop
from rocforge_rt.server.jobs import CancelCause, Job, JobBoard, Limits
from rocforge_rt.server.metrics import DaemonMetrics
from rocforge_rt.server.protocol import ErrorCode, Profile, ProtocolError, Request, Stats, Trace


class State(StrEnum):
    """The daemon's state, as `health` tells it."""

    LOADING = "loading"  # live: the socket answers, the engine is loading or warming up
    READY = "ready"
    DRAINING = "draining"  # stopping: in-flight requests get their final replies


def is_operator_op(request: Request) -> bool:
    """Ops that change the daemon's records or switches, or show its internals."""
    return isinstance(request, Trace | Profile) or (isinstance(request, Stats) and request.reset)


class IoOps:
    """The answers of the I/O thread's own ops, from the daemon's records."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        loopback: bool,
        board: JobBoard,
        engine_loop: EngineLoop,
        latency: LatencyRecorder,
        metrics: DaemonMetrics,
        limits: Callable[[], Limits],
    ) -> None:
        """`loopback`: the daemon is bound to loopback only; `limits`: the daemon's (known
        once its model is read)."""
        self._config = config
        self._loopback = loopback
        self._board = board
        self._engine_loop = engine_loop
        self._latency = latency
        self._metrics = metrics
        self._limits = limits
        self._started = time.monotonic()

    def check_operator_key(self, request: Request) -> None:
        """ProtocolError (forbidden) for an operator op without the operator key on a daemon
        bound beyond loopback."""
        if is_operator_op(request) and not operator_allowed(
            loopback=self._loopback,
            configured=self._config.operator_key,
            given=request.operator_key,
        ):
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                f"op {request.op!r}{' with reset' if request.op == 'stats' else ''} needs the"
                " operator key (field 'operator_key') on a daemon bound beyond loopback",
            )

    def answer(self, job: Job) -> dict[str, Any] | None:
        """The reply's fields for an op answered here but `health`; None for the engine's."""
        engine_loop = self._engine_loop
        handler = {  # looked up per request
            "info": self.info,
            "stats": lambda r: queries.stats(
                engine_loop, self._latency, r, self.uptime(), self.queue(r.reset)
            ),
            "trace": lambda r: queries.trace(engine_loop, r),
            "metrics": lambda _r: {"text": self._metrics.exposition().decode()},
            "profile": lambda r: queries.profile(engine_loop, r),
            "abort": lambda r: self.abort(job, r),
        }.get(job.request.op)
        return None if handler is None else handler(job.request)

    def health(self, state: State) -> dict[str, Any]:
        loading = self._engine_loop.loading if state is State.LOADING else None
        return {
            "live": True,
            "ready": state is State.READY,
            "state": str(state),
            **({"loading": loading} if loading is not None else {}),
            "uptime_s": self.uptime(),
            **self._board.counts(),
            "max_queue": self._config.max_queue,
        }

    def queue(self, reset: bool) -> dict[str, Any]:
        """The queue of requests waiting for a session slot, for `stats`."""
        return {
            **self._board.queue(reset_peak=reset),
            "max_queue_time_s": self._config.max_queue_time_s,
        }

    def uptime(self) -> float:
        return time.monotonic() - self._started

    def info(self, _request: Request) -> dict[str, Any]:
        limits, config = self._limits(), self._config
        return {
            "protocol_version": protocol.PROTOCOL_VERSION,
            **self._engine_loop.info,
            "limits": {
                "ctx_size": limits.n_ctx,
                "max_sessions": limits.max_sessions,
                "max_prompt_tokens": limits.max_prompt_tokens,
                "max_new_tokens": limits.max_new_tokens,
                "idle_timeout_s": limits.idle_timeout_s,
                "max_request_bytes": config.max_request_bytes,
                "prefill_chunk": config.prefill_chunk,
                "max_sessions_per_client": config.max_sessions_per_client or limits.max_sessions,
                "max_queue": limits.max_queue,
                "max_queue_time_s": limits.max_queue_time_s,
            },
        }

    def abort(self, job: Job, request: Request) -> dict[str, Any]:
        """By request id: this client's own request; by session: with the session's token."""
        if request.session is not None:
            self._board.check_session(request.session, request.token, job.user)
        aborted = self._board.cancel(
            job.peer, CancelCause.CLIENT, request=request.request, session=request.session
        )
        if aborted:
            self._engine_loop.wake()  # a request waiting for a slot ends now, not at a timeout
        return {"aborted": aborted}
