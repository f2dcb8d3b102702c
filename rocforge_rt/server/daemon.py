"""The daemon: one ROUTER socket served by an I/O thread; the engine runs on its own thread.

The I/O thread is the only one that touches the ROUTER socket (router_socket.py: bounded
frames, ZMQ_MAXMSGSIZE, a backlog for replies that do not fit a client's queue). It
validates each request (unpacker limits), answers `health`, `info`, `abort`, `stats`,
`trace`, `metrics` and `profile` itself (io_ops.py), hands engine work to the engine thread
(engine_loop.py), and forwards that thread's replies. It never waits on the engine, so it
answers during a long prefill. The two threads share the job board (jobs.py), which admits
a request that needs a session slot when none is free to a bounded first-come queue
(--max-queue, --max-queue-time) and answers `busy` past it. Sessions answer to their token,
never to a routing id; off loopback the operator ops need the operator key (access.py).

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
from typing import Any

import zmq

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.kv_cache import SlotAllocator
from rocforge_rt.profiling.latency import LatencyRecorder
from rocforge_rt.server import protocol
from rocforge_rt.server.config import DaemonConfig, ServerError, check_options, plan
from rocforge_rt.server.engine_loop import END_OF_REPLIES, EngineLoop
from rocforge_rt.server.io_ops import IoOps, State
from rocforge_rt.server.jobs import CancelCause, Job, JobBoard, Limits, PeerGone
from rocforge_rt.server.metrics import DaemonMetrics
from rocforge_rt.server.peers import generated_routing_id
from rocforge_rt.server.protocol import (
    ErrorCode,
    ProtocolError,
    SessionRequest,
    TurnRequest,
    error_reply,
    ok_reply,
)
from rocforge_rt.server.refusals import WINDOW_S, Refusals
from rocforge_rt.server.replies import unpack_batch
from rocforge_rt.server.router_socket import LINGER_MS, RouterSocket
from rocforge_rt.server.security import check_bind, is_loopback_endpoint
from rocforge_rt.server.translate import check_prompt_bytes

log = logging.getLogger("rocforge.server")

POLL_MS = 100  # how often the I/O loop looks at the stop flag when idle


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
        self._socket: RouterSocket | None = None
        self._closed = False
        self._context = zmq.Context()
        try:  # a bind refused, or a signal's exception (SIGTERM): nothing left open
            self._replies = self._context.socket(zmq.PULL)
            self._socket = RouterSocket(
                self._context,
                config,
                on_message=self._on_message,
                on_peers_gone=self._peers_gone,
                on_not_reading=self._not_reading,
            )
            self.endpoint: str = self._socket.endpoint
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
            self.ops = IoOps(
                config,
                loopback=is_loopback_endpoint(config.bind),
                board=self.board,
                engine_loop=self.engine_loop,
                latency=self.latency,
                metrics=self.metrics,
                limits=lambda: self.limits,
            )
        except BaseException:
            self.close()
            raise
        log.info("listening on %s", self.endpoint)

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
        if self._socket is not None:
            self._socket.close()
        self._context.destroy(linger=LINGER_MS)  # the router's last replies go out first

    # --- the I/O loop ---------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        self._socket.register(poller)
        poller.register(self._replies, zmq.POLLIN)
        while True:
            events = dict(poller.poll(self._socket.poll_timeout_ms(POLL_MS)))
            self._socket.flush_backlog()
            if self._replies in events and self._forward_replies():
                return  # the engine thread has stopped and every reply is out
            self._socket.serve(events)
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
                self._socket.send(frames)

    def _not_reading(self, peer: bytes) -> None:
        """A client whose replies are dropped for not being read: its requests stop."""
        if self.board.cancel_peer(peer, CancelCause.DISCONNECT):
            self.engine_loop.wake()  # a request of its waiting for a slot ends now

    def _peers_gone(self, peers: list[bytes]) -> None:
        """Their connections closed: cut their requests now (the engine thread ends them at
        its next step) and have the engine thread end what runs on their sessions and close
        those no one can come back for."""
        for peer in peers:
            self.refusals.forget(peer)
            if self.board.cancel_peer(peer, CancelCause.DISCONNECT):
                log.info("client %s disconnected: its requests and sessions end", peer.hex())
                self.engine_loop.submit(PeerGone(peer, not generated_routing_id(peer)))

    def _reply(self, envelope: tuple[bytes, ...], reply: dict[str, Any]) -> None:
        self._socket.send([*envelope, protocol.pack(reply)])

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
            self._reply(job.envelope, ok_reply(request.id, **self.ops.health(state)))
            return
        if state is State.LOADING:
            raise ProtocolError(ErrorCode.NOT_READY, "the model is loading; ask `health`")
        if state is State.DRAINING:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        self.ops.check_operator_key(request)
        answer = self.ops.answer(job)
        if answer is not None:
            self._reply(job.envelope, ok_reply(request.id, **answer))
            return
        # a huge prompt never reaches the engine thread, nor a request on a session its token
        # does not open
        if isinstance(request, TurnRequest) and request.turn is not None:
            check_prompt_bytes(self.limits, self.engine_loop.max_token_bytes, request.turn.prompt)
        if isinstance(request, SessionRequest) and request.session is not None:
            self.board.check_session(request.session, request.token, job.user)
        self.board.admit(job)
        self.engine_loop.submit(job)
