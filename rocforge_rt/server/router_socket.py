"""The daemon's ROUTER socket: its options and CURVE, the requests read off it, the replies.

Only the daemon's I/O thread touches it. A request is read in bounded frames (ZMQ_MAXMSGSIZE
caps each; frames past a request's three are read and dropped, a bounded number per call);
the socket's monitor tells which connection closed (peers.py). Replies that do not fit a
client's queue wait in a backlog bounded in messages and bytes (backlog.py); a client past
its bounds is not reading its replies. What a request or a departure means is the daemon's:
it is called back.
"""

import logging
import time
from collections.abc import Callable

import zmq

from rocforge_rt.server.backlog import PIPE_MESSAGES, Backlog
from rocforge_rt.server.config import DaemonConfig, ServerError
from rocforge_rt.server.peers import PeerWatch, source_fd, watch_silent_peers
from rocforge_rt.server.security import secure_server

log = logging.getLogger("rocforge.server")

MAX_READS_PER_POLL = 64  # requests read before replies are forwarded again
BACKLOG_POLL_MS = 2  # how often replies waiting for a client's queue to drain are retried
MAX_FRAMES = 3  # identity, optional empty delimiter (REQ clients), payload
DRAIN_FRAMES_PER_POLL = 10_000  # frames beyond those of a message dropped per loop iteration
MAX_SLOW_PEERS_LOGGED = 4096
LINGER_MS = 1000
NOBLOCK = int(zmq.NOBLOCK)
MORE_NOBLOCK = int(zmq.NOBLOCK | zmq.SNDMORE)

# (frames, frames past MAX_FRAMES, when it was read, the sender's CURVE key or None)
OnMessage = Callable[[list[bytes], int, float, str | None], None]


def tune_router(router: zmq.Socket, max_request_bytes: int) -> None:
    """The ROUTER's options, set before it binds."""
    router.router_mandatory = 1  # a reply to a vanished client raises, so its work stops
    router.maxmsgsize = 2 * max_request_bytes  # larger: the peer is dropped
    router.sndhwm = PIPE_MESSAGES  # the rest waits in the backlog, bounded in bytes too
    router.linger = LINGER_MS
    watch_silent_peers(router)


class RouterSocket:
    """The bound ROUTER and its peer watch; its owner's context closes the socket, `close`
    the rest. `on_message` gets each request read; `on_peers_gone` the clients whose
    connection closed or whose replies cannot be delivered; `on_not_reading` a client whose
    replies are dropped for not being read."""

    def __init__(
        self,
        context: zmq.Context,
        config: DaemonConfig,
        *,
        on_message: OnMessage,
        on_peers_gone: Callable[[list[bytes]], None],
        on_not_reading: Callable[[bytes], None],
    ) -> None:
        self._on_message = on_message
        self._on_peers_gone = on_peers_gone
        self._on_not_reading = on_not_reading
        self._auth = None
        self._watch: PeerWatch | None = None
        self._mid_message = False  # dropping the frames a message has beyond a request's
        self._sink = bytearray(64)  # what they are read into (truncated), never kept
        self._backlog = Backlog()  # replies that did not fit a client's queue yet
        self._slow_peers: set[bytes] = set()  # clients dropped for not reading (logged once)
        try:
            self._router = router = context.socket(zmq.ROUTER)
            tune_router(router, config.max_request_bytes)
            if config.curve_keys is not None:
                self._auth = secure_server(context, router, config.curve_keys)
            self._watch = PeerWatch(router)
            try:
                router.bind(config.bind)
            except zmq.ZMQError as exc:
                raise ServerError(f"cannot bind {config.bind}: {exc}") from None
        except BaseException:
            self.close()
            raise
        self.endpoint: str = router.last_endpoint.decode()

    def close(self) -> None:
        """Stop the peer watch and the authenticator."""
        if self._watch is not None:
            self._watch.close()
        if self._auth is not None:
            self._auth.stop()

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._watch.socket, zmq.POLLIN)

    def poll_timeout_ms(self, idle_ms: int) -> int:
        """How long the I/O loop may wait: not at all while a message's frames are being
        dropped, a short while while replies wait in the backlog, else `idle_ms`."""
        return 0 if self._mid_message else BACKLOG_POLL_MS if self._backlog else idle_ms

    def flush_backlog(self) -> None:
        self._backlog.flush(self._send_now)

    def serve(self, events: dict[zmq.Socket, int]) -> None:
        """After a poll: the connections that closed, then the requests waiting."""
        if self._watch.socket in events:
            self._gone(self._watch.events())
        if self._router in events or self._mid_message:
            self._read_requests()

    # --- replies -------------------------------------------------------------------------------
    def send(self, frames: list[bytes]) -> None:
        """A reply to its client, now or after its earlier ones (the backlog); a client past
        the backlog's bounds is not reading: its replies are dropped, its requests stopped."""
        if not self._backlog.send(frames, self._send_now):
            self._not_reading(frames[0])

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
            self._gone([frames[0]])
        return True

    def _not_reading(self, peer: bytes) -> None:
        messages, nbytes = self._backlog.drop(peer)
        self._on_not_reading(peer)
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

    def _gone(self, peers: list[bytes]) -> None:
        """Their connections closed: their waiting replies are dropped, the daemon told."""
        for peer in peers:
            self._backlog.drop(peer)
        self._on_peers_gone(peers)

    # --- requests ------------------------------------------------------------------------------
    def _read_requests(self) -> None:
        if self._mid_message and not self._drop_frames():
            return
        for _ in range(MAX_READS_PER_POLL):
            try:
                first = self._router.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [first.bytes]
            self._gone(self._watch.events())  # every event before this message
            alive = self._watch.arrived(frames[0], source_fd(first))
            while self._router.rcvmore and len(frames) < MAX_FRAMES:
                frames.append(self._router.recv())
            extra = int(self._router.rcvmore)  # more frames than any request has: refused
            self._on_message(frames, extra, time.perf_counter(), self._user(first))
            if not alive:  # it was sent before its connection closed
                self._gone([frames[0]])
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
