"""The daemon: one ROUTER socket served by an I/O thread; the engine runs on its own thread.

The I/O thread is the only one that touches the ROUTER socket. It reads each
request (bounded frames, ZMQ_MAXMSGSIZE, unpacker limits), validates it,
answers `health`, `info`, `abort`, `stats` and `trace` itself, hands engine
work to the engine thread (engine_loop.py), and forwards that thread's replies.
`metrics` answers with the Prometheus text of the daemon's metrics (metrics.py).
It never waits on the engine, so it answers during a long prefill. Replies that do not
fit a client's queue wait in a backlog bounded in messages and bytes (backlog.py). The two
threads share the job board (jobs.py), which admits a request that needs a session slot
when none is free to a bounded first-come queue (--max-queue, --max-queue-time) and
answers `busy` past it. Sessions answer to their token, never to a
routing id; off loopback the operator ops need the operator key (access.py).

Start-up: the options and the bind address are checked before anything binds; the socket
then goes live at once (`health` says live, state `loading`) while the engine thread reads
the model, checks the configuration against it (the memory budget: config.py), loads it
and runs a warm-up; then ready.
Shutdown (SIGTERM/SIGINT or `stop()`): new work is refused, every request in
flight is cut and gets its final reply, sockets close, `run` returns; during
the load or warm-up, those stop at their next layer or step.

Clients that vanish: the socket's monitor tells which connection closed
(peers.py); that client's requests are cut within one step, and its sessions
closed (kept for the idle timeout when it named its own routing id and may
come back). A reply that cannot be delivered (EHOSTUNREACH) means the same.
"""

import logging
import signal
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import zmq

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.kv_cache import SlotAllocator
from rocforge_rt.profiling.latency import LatencyRecorder
from rocforge_rt.server import protocol, queries
from rocforge_rt.server.access import operator_allowed
from rocforge_rt.server.backlog import PIPE_MESSAGES, Backlog
from rocforge_rt.server.config import DaemonConfig, ServerError, check_options, plan
from rocforge_rt.server.engine_loop import END_OF_REPLIES, EngineLoop
from rocforge_rt.server.jobs import CancelCause, Job, JobBoard, Limits, PeerGone
from rocforge_rt.server.metrics import DaemonMetrics
from rocforge_rt.server.peers import (
    PeerWatch,
    generated_routing_id,
    source_fd,
    watch_silent_peers,
)
from rocforge_rt.server.protocol import ErrorCode, ProtocolError, Request, error_reply, ok_reply
from rocforge_rt.server.refusals import WINDOW_S, Refusals
from rocforge_rt.server.replies import unpack_batch
from rocforge_rt.server.security import check_bind, is_loopback_endpoint, secure_server
from rocforge_rt.server.translate import check_prompt_bytes

log = logging.getLogger("rocforge.server")

POLL_MS = 100  # how often the I/O loop looks at the stop flag when idle
MAX_READS_PER_POLL = 64  # requests read before replies are forwarded again
BACKLOG_POLL_MS = 2  # how often replies waiting for a client's queue to drain are retried
MAX_FRAMES = 3  # identity, optional empty delimiter (REQ clients), payload
DRAIN_FRAMES_PER_POLL = 10_000  # frames beyond those of a message dropped per loop iteration
MAX_SLOW_PEERS_LOGGED = 4096
LINGER_MS = 1000
NOBLOCK = int(zmq.NOBLOCK)
MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)


def tune_router(router: zmq.Socket, max_request_bytes: int) -> None:
    """The ROUTER's options, set before it binds."""
    router.router_mandatory = 1  # a reply to a vanished client raises, so its work stops
    router.maxmsgsize = 2 * max_request_bytes  # larger: the peer is dropped
    router.sndhwm = PIPE_MESSAGES  # the rest waits in the backlog, bounded in bytes too
    router.linger = LINGER_MS
    watch_silent_peers(router)


class State(StrEnum):
    LOADING = "loading"  # live: the socket answers, the engine is loading or warming up
    READY = "ready"
    DRAINING = "draining"  # stopping: in-flight requests get their final replies


class Daemon:
    """Binds at construction; `run` serves in the calling thread, `start` in a new one."""

    def __init__(
        self, config: DaemonConfig, *, engine_hook: Callable[[Engine], None] | None = None
    ) -> None:
        check_options(config)
        check_bind(config.bind, config.curve_keys)
        self.config = config
        slots = SlotAllocator(config.max_sessions)
        self.board = JobBoard(  # the engine's slots, and the queue of requests waiting for one
            slots, config.max_sessions_per_client, config.max_queue
        )
        self._loopback = is_loopback_endpoint(config.bind)
        self.refusals = Refusals(config.max_refusals_per_client)
        self.metrics = DaemonMetrics(
            usage=lambda: self.engine_loop.usage,
            runtime=lambda: self.engine_loop.runtime_stats,
            waiting=lambda: self.board.counts()["waiting"],
        )
        self.latency = LatencyRecorder(observer=self.metrics)
        self._draining = False
        self.error: Exception | None = None
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()
        self._auth = None
        self._watch: PeerWatch | None = None
        self._mid_message = False  # dropping the frames a message has beyond a request's
        self._sink = bytearray(64)  # what they are read into (truncated), never kept
        self._backlog = Backlog()  # replies that did not fit a client's queue yet
        self._slow_peers: set[bytes] = set()  # clients dropped for not reading (logged once)
        self._closed = False
        self._context = zmq.Context()
        try:  # a bind refused, or a signal's exception (SIGTERM): nothing left open
            self._router = self._context.socket(zmq.ROUTER)
            self._replies = self._context.socket(zmq.PULL)
            self._configure_router()
            self._watch = PeerWatch(self._router)
            try:
                self._router.bind(config.bind)
            except zmq.ZMQError as exc:
                raise ServerError(f"cannot bind {config.bind}: {exc}") from None
            self.endpoint: str = self._router.last_endpoint.decode()
            reply_endpoint = f"inproc://rocforge-replies-{id(self)}"
            self._replies.rcvhwm = 0
            self._replies.bind(reply_endpoint)
            self.engine_loop = EngineLoop(
                lambda should_stop: plan(config, engine_hook, slots=slots, should_stop=should_stop),
                self.board,
                self.refusals,
                self.latency,
                self._context,
                reply_endpoint,
                on_decode_step=self.metrics.observe_step,
            )
        except BaseException:
            self.close()
            raise
        log.info("listening on %s", self.endpoint)

    def _configure_router(self) -> None:
        router = self._router
        tune_router(router, self.config.max_request_bytes)
        if self.config.curve_keys is not None:
            self._auth = secure_server(self._context, router, self.config.curve_keys)

    # --- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "Daemon":
        """Serve in a background thread until the block ends; ServerError if not ready."""
        self.start()
        while not self.wait_ready(0.05):
            if not self._thread.is_alive():
                self.join()
                raise self.error or ServerError("the daemon stopped before it was ready")
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
        self.join()

    def start(self) -> None:
        """Serve in a background thread (tests, embedding); `stop` and `join` end it."""
        self._thread = threading.Thread(target=self._run_captured, name="rocforge-io", daemon=True)
        self._thread.start()

    def _run_captured(self) -> None:
        try:
            self.run()
        except Exception as exc:
            self.error = exc

    def stop(self) -> None:
        """Ask the daemon to shut down (safe from any thread and from signal handlers)."""
        self._stop_requested.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def limits(self) -> Limits:
        """The per-daemon limits (the engine thread's plan: set once the state is not
        loading)."""
        limits = self.engine_loop.limits
        if limits is None:
            raise RuntimeError("the daemon's limits are not known before its model is read")
        return limits

    @property
    def state(self) -> State:
        if self._draining:
            return State.DRAINING
        return State.READY if self.engine_loop.ready.is_set() else State.LOADING

    def wait_ready(self, timeout: float) -> bool:
        return self.engine_loop.ready.wait(timeout)

    def run(self, before_close: Callable[[], object] | None = None) -> None:
        """Serve until stopped; ServerError if the engine could not start or failed.

        `before_close` runs once every reply is out, before the sockets close (`serve
        --http` stops its front there, so the front never sees the daemon vanish)."""
        restore = self._install_signal_handlers()  # before any thread starts: a signal's own
        # handler may raise out of here until then
        engine_thread = threading.Thread(target=self.engine_loop.run, name="rocforge-engine")
        engine_thread.start()
        try:
            self._serve()
        except BaseException:
            self.engine_loop.stop()  # the engine thread must end for the join below
            raise
        finally:
            engine_thread.join()
            if before_close is not None:
                before_close()
            self.close()
            for sig, handler in restore.items():
                signal.signal(sig, handler)
        if self.engine_loop.failure is not None:
            raise ServerError(self.engine_loop.failure)
        log.info("stopped")

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handle(signum: int, _frame: Any) -> None:
            log.info("%s received: shutting down", signal.Signals(signum).name)
            self.stop()

        return {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def close(self) -> None:
        """Close the daemon's sockets: `run` does once it has served; whoever made a daemon
        that never ran closes it (a ZeroMQ context with a socket open never ends). Once is
        enough."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.destroy(linger=LINGER_MS)  # the router's last replies go out first

    # --- the I/O loop ---------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        poller.register(self._watch.socket, zmq.POLLIN)
        while True:
            timeout = 0 if self._mid_message else BACKLOG_POLL_MS if self._backlog else POLL_MS
            events = dict(poller.poll(timeout))
            self._backlog.flush(self._send_now)
            if self._replies in events and self._forward_replies():
                return  # the engine thread has stopped and every reply is out
            if self._watch.socket in events:
                self._peers_gone(self._watch.events())
            if self._router in events or self._mid_message:
                self._read_requests()
            if not self._draining and (
                self._stop_requested.is_set() or self.engine_loop.failure is not None
            ):
                self._draining = True
                self.board.cancel_all(CancelCause.SHUTDOWN)
                self.engine_loop.stop()

    def _forward_replies(self) -> bool:
        """Send the engine thread's replies (batches: replies.py); True once it has sent its
        last."""
        while True:
            try:
                message = self._replies.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if message == END_OF_REPLIES:
                return True
            for frames in unpack_batch(message):
                self._send(frames)

    def _send(self, frames: list[bytes]) -> None:
        """A reply to its client, now or after its earlier ones (the backlog); a client past
        the backlog's bounds is not reading: its replies are dropped, its requests stopped."""
        if not self._backlog.send(frames, self._send_now):
            self._slow_peer(frames[0])

    def _send_now(self, frames: list[bytes]) -> bool:
        """False when the client's queue is full; a client gone (EHOSTUNREACH) counts as sent:
        its work is stopped, and its reply is dropped."""
        router = self._router
        try:  # frame by frame with plain int flags: send_multipart's checks cost more
            for frame in frames[:-1]:
                router.send(frame, MORE_NOBLOCK)
            router.send(frames[-1], NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            log.debug("dropping a reply to a client: %s", exc)
            self._peers_gone([frames[0]])
        return True

    def _slow_peer(self, peer: bytes) -> None:
        messages, nbytes = self._backlog.drop(peer)
        if self.board.cancel_peer(peer, CancelCause.DISCONNECT):
            self.engine_loop.wake()  # a request of its waiting for a slot ends now
        if peer in self._slow_peers:
            return
        if len(self._slow_peers) >= MAX_SLOW_PEERS_LOGGED:
            self._slow_peers.clear()
        self._slow_peers.add(peer)
        log.warning(
            "client %s does not read its replies (%d messages, %d bytes waiting): they are"
            " dropped and its requests stopped",
            peer.hex(),
            messages,
            nbytes,
        )

    def _peers_gone(self, peers: list[bytes]) -> None:
        """Their connections closed: cut their requests now (the engine thread ends them at
        its next step) and have the engine thread end what runs on their sessions and close
        those no one can come back for."""
        for peer in peers:
            self._backlog.drop(peer)
            self.refusals.forget(peer)
            if self.board.cancel_peer(peer, CancelCause.DISCONNECT):
                log.info("client %s disconnected: its requests and sessions end", peer.hex())
                self.engine_loop.submit(PeerGone(peer, not generated_routing_id(peer)))

    def _reply(self, envelope: tuple[bytes, ...], reply: dict[str, Any]) -> None:
        self._send([*envelope, protocol.pack(reply)])

    def _read_requests(self) -> None:
        if self._mid_message and not self._drop_frames():
            return
        for _ in range(MAX_READS_PER_POLL):
            try:
                first = self._router.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [first.bytes]
            self._peers_gone(self._watch.events())  # every event before this message
            alive = self._watch.arrived(frames[0], source_fd(first))
            while self._router.rcvmore and len(frames) < MAX_FRAMES:
                frames.append(self._router.recv())
            extra = int(self._router.rcvmore)  # more frames than any request has: refused
            self._on_message(frames, extra, time.perf_counter(), self._user(first))
            if not alive:  # it was sent before its connection closed
                self._peers_gone([frames[0]])
            if extra:
                self._mid_message = True
                if not self._drop_frames():
                    return  # the rest in the next iterations, replies forwarded between

    def _drop_frames(self) -> bool:
        """Read and drop the rest of a message with too many frames, a bounded number per
        call, into one small buffer (ZeroMQ gives no way past a message's frames but to read
        them: about 2 us each); True once the message is over."""
        router, sink = self._router, self._sink
        for _ in range(DRAIN_FRAMES_PER_POLL):
            if not router.rcvmore:
                self._mid_message = False
                return True
            router.recv_into(sink)
        return False

    def _user(self, frame: zmq.Frame) -> str | None:
        """The CURVE public key (z85) the authenticator gave the sender; None without CURVE."""
        if self._auth is None:
            return None
        try:
            return frame.get("User-Id") or None
        except zmq.ZMQError:
            return None

    def _on_message(
        self, frames: list[bytes], extra: int, received: float, user: str | None = None
    ) -> None:
        from_req = len(frames) == 3 and not extra and frames[1] == b""  # REQ's empty frame
        well_framed = len(frames) == 2 or from_req
        envelope = (frames[0], b"") if from_req else (frames[0],)
        dropped = self.refusals.drop(frames[0], time.monotonic())
        if dropped:
            if dropped == 1:  # the client hears it once a second
                self._reply(
                    envelope,
                    error_reply(
                        None,
                        ErrorCode.RATE_LIMITED,
                        f"over {self.refusals.max_per_client_s} refused requests in"
                        f" {WINDOW_S:g} s (--max-refusals-per-client): this client's messages"
                        " are dropped unread for the rest of it",
                    ),
                )
            return
        rid = None
        try:
            if not well_framed:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    "a request is one msgpack frame (DEALER) or an empty frame and one msgpack"
                    f" frame (REQ); got {'more than ' if extra else ''}{len(frames) - 1} frames",
                )
            obj = protocol.unpack(
                frames[-1], self.config.max_request_bytes, self._max_array_items()
            )
            rid = protocol.request_id(obj)
            request = protocol.parse_request(obj)
            self._dispatch(Job(request, envelope, received, user=user))
        except ProtocolError as exc:
            if rid is None and well_framed:  # too large or malformed: its id, if it has one
                rid = protocol.peek_request_id(frames[-1])
            self._refuse(envelope, rid, exc)
        except Exception as exc:  # a bug: fail this request, keep serving everyone else
            log.exception("request failed in the I/O thread")
            message = f"the daemon failed on this request: {type(exc).__name__}: {exc}"
            self._reply(envelope, error_reply(rid, ErrorCode.INTERNAL, message))

    def _max_array_items(self) -> int:
        limits = self.engine_loop.limits  # None while the model is read: only health then
        return protocol.max_array_items(limits.max_prompt_tokens if limits else None)

    def _refuse(
        self, envelope: tuple[bytes, ...], rid: int | str | None, exc: ProtocolError
    ) -> None:
        """Answer a refused request; a line at debug level, and the client's count."""
        log.debug("refused request %r of client %s: %s", rid, envelope[0].hex(), exc)
        self.refusals.note(envelope[0], exc.code)
        self._reply(envelope, error_reply(rid, exc.code, exc.message))

    def _dispatch(self, job: Job) -> None:
        request = job.request
        state = self.state
        if request.op == "health":
            self._reply(job.envelope, ok_reply(request.id, **self._health(state)))
            return
        if state is State.LOADING:
            raise ProtocolError(ErrorCode.NOT_READY, "the model is loading; ask `health`")
        if state is State.DRAINING:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if self._operator_op(request) and not operator_allowed(
            loopback=self._loopback, configured=self.config.operator_key, given=request.operator_key
        ):
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                f"op {request.op!r}{' with reset' if request.op == 'stats' else ''} needs the"
                " operator key (field 'operator_key') on a daemon bound beyond loopback",
            )
        handler = {
            "info": self._info,
            "stats": lambda r: queries.stats(
                self.engine_loop, self.latency, r, self._uptime(), self._queue(r.reset)
            ),
            "trace": lambda r: queries.trace(self.engine_loop, r),
            "metrics": lambda _r: {"text": self.metrics.exposition().decode()},
            "profile": lambda r: queries.profile(self.engine_loop, r),
            "abort": lambda r: self._abort(job, r),
        }.get(request.op)
        if handler is not None:
            self._reply(job.envelope, ok_reply(request.id, **handler(request)))
            return
        if request.turn is not None:  # a huge prompt never reaches the engine thread
            check_prompt_bytes(self.limits, self.engine_loop.max_token_bytes, request.turn.prompt)
        if request.session is not None:  # nor a request on a session its token does not open
            self.board.check_session(request.session, request.token, job.user)
        self.board.admit(job)
        self.engine_loop.submit(job)

    @staticmethod
    def _operator_op(request: Request) -> bool:
        """Ops that change the daemon's records or switches, or show its internals."""
        return request.op in ("trace", "profile") or (request.op == "stats" and request.reset)

    def _health(self, state: State) -> dict[str, Any]:
        return {
            "live": True,
            "ready": state is State.READY,
            "state": str(state),
            "uptime_s": self._uptime(),
            **self.board.counts(),
            "max_queue": self.config.max_queue,
        }

    def _queue(self, reset: bool) -> dict[str, Any]:
        """The queue of requests waiting for a session slot, for `stats`."""
        return {
            **self.board.queue(reset_peak=reset),
            "max_queue_time_s": self.config.max_queue_time_s,
        }

    def _uptime(self) -> float:
        return time.monotonic() - self._started

    def _info(self, _request: Request) -> dict[str, Any]:
        limits = self.limits
        return {
            "protocol_version": protocol.PROTOCOL_VERSION,
            **self.engine_loop.info,
            "limits": {
                "ctx_size": limits.n_ctx,
                "max_sessions": limits.max_sessions,
                "max_prompt_tokens": limits.max_prompt_tokens,
                "max_new_tokens": limits.max_new_tokens,
                "idle_timeout_s": limits.idle_timeout_s,
                "max_request_bytes": self.config.max_request_bytes,
                "prefill_chunk": self.config.prefill_chunk,
                "max_sessions_per_client": self.config.max_sessions_per_client
                or limits.max_sessions,
                "max_queue": limits.max_queue,
                "max_queue_time_s": limits.max_queue_time_s,
            },
        }

    def _abort(self, job: Job, request: Request) -> dict[str, Any]:
        """By request id: this client's own request; by session: with the session's token."""
        if request.session is not None:
            self.board.check_session(request.session, request.token, job.user)
        aborted = self.board.cancel(
            job.peer, CancelCause.CLIENT, request=request.request, session=request.session
        )
        if aborted:
            self.engine_loop.wake()  # a request waiting for a slot ends now, not at a timeout
        return {"aborted": aborted}
