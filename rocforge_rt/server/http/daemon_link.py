"""The HTTP front's link to the daemon: one DEALER socket that carries every request at once.

Each HTTP request becomes daemon requests with ids of their own (a counter: ids are per
connection on the daemon's side). A request is checked as the daemon would check it (its
schema, and its size against the daemon's --max-request-bytes) before it is sent and before
anything is held for it: no client of the front can make the daemon refuse or drop the one
connection every stream shares. One reader task takes every reply off the socket and
puts it on the queue of the request it answers; a handler waits on its own queue only,
so a thousand streams share one socket and one task. `send` never waits: the socket is
`immediate` (nothing is queued for a daemon that is not connected), so a request to a
daemon that is down fails at once with `DaemonUnavailable`.

The socket's monitor tells when the connection goes (the daemon stopped or died): every
request waiting then fails with `DaemonUnavailable` instead of waiting for its timeout,
and `generation` counts connections, so what the front caches from `info` is asked
again after a reconnect (the daemon may have come back with another model). TCP
keepalive finds a daemon whose host stopped answering (peers.py says why not ZeroMQ's
heartbeats).

A request left before its last reply (`Stream.close`: the HTTP client went away, or a
handler failed) is aborted by id: the daemon ends it within one step. The abort is sent
at once, without awaiting, so it goes out even from a task being cancelled.
"""

import asyncio
import contextlib
import itertools
import logging
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from rocforge_rt.server.peers import watch_silent_peers
from rocforge_rt.server.protocol import ErrorCode, ProtocolError, parse_request
from rocforge_rt.server.security import endpoint_problem, secure_client

log = logging.getLogger("rocforge.http")

MAX_REPLY_BYTES = 64 << 20
SEND_HWM = 100_000  # requests and aborts waiting to go out; past it the daemon is not reading
RECONNECT_MS = 100  # the first retry of a lost connection; then backing off to
RECONNECT_MAX_MS = 2000
REPLY_TIMEOUT_S = 600.0  # the longest wait for one reply (a first token behind long prompts)
MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
HANDSHAKE_FAILED = MONITOR_EVENTS & ~(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)


class DaemonUnavailable(Exception):
    """The daemon cannot be reached: not connected, the connection lost, or no reply in time."""


class DaemonError(Exception):
    """An error reply of the daemon: its code (fields.ErrorCode's values) and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class _Lost:
    """Put on a request's queue when the connection it went out on closed."""


_LOST = _Lost()


def _raise_for_error(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise DaemonError(str(error.get("code", "internal")), str(error.get("message", "")))


class Stream:
    """The replies to one request, in order; `close` (always: try/finally) aborts it on the
    daemon when its last reply has not come."""

    def __init__(self, link: "DaemonLink", rid: int, timeout: float) -> None:
        self._link = link
        self.rid = rid
        self._timeout = timeout
        self.done = False
        self._closed = False

    async def next(self) -> dict[str, Any]:
        """The next reply (`done` set once it is the last); DaemonError for an error reply,
        DaemonUnavailable when the connection went or no reply came in time."""
        reply = await self._link.receive(self.rid, self._timeout)
        self.done = not reply.get("ok") or reply.get("done", True)
        _raise_for_error(reply)
        return reply

    def close(self) -> None:
        """Stop listening (and abort the request if it has not ended); once is enough."""
        if self._closed:
            return
        self._closed = True
        if not self.done:
            self._link.abort(self.rid)
        self._link.release(self.rid)


class DaemonLink:
    """The connection to one daemon; `start` and `close` on the event loop that uses it."""

    def __init__(
        self,
        addr: str,
        *,
        curve_keys: Path | None = None,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        problem = endpoint_problem(addr, bind=False)
        if problem is not None:
            raise ValueError(f"cannot connect to {addr}: {problem}")
        self.addr = addr
        self.curve_keys = curve_keys
        self.reply_timeout_s = reply_timeout_s
        self.generation = 0  # connections made so far (a new one: the daemon may have changed)
        self.connected = False
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._auth_failed = False

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.DEALER)
        try:
            socket.linger = 0
            socket.immediate = 1  # no queue for a daemon not connected: sends fail at once
            socket.sndhwm = SEND_HWM
            socket.rcvhwm = 0
            socket.maxmsgsize = MAX_REPLY_BYTES
            socket.reconnect_ivl = RECONNECT_MS
            socket.reconnect_ivl_max = RECONNECT_MAX_MS
            watch_silent_peers(socket)
            if self.curve_keys is not None:
                secure_client(socket, self.curve_keys)
            self._monitor = socket.get_monitor_socket(MONITOR_EVENTS)
            socket.connect(self.addr)
        except BaseException:
            socket.close(linger=0)
            self._context.term()
            raise
        self._socket = socket
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="rocforge-http-replies"),
            asyncio.create_task(self._watch_connection(), name="rocforge-http-monitor"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all()
        if self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None

    @property
    def pending(self) -> int:
        """Requests sent whose replies are still listened for (until `release`)."""
        return len(self._queues)

    # --- requests -----------------------------------------------------------------------------
    def send(self, op: str, *, max_bytes: int | None = None, **fields: Any) -> int:
        """Send a request now (fields that are None are left out); its id, whose replies
        `receive` gives until `release`. DaemonUnavailable when it cannot go out;
        ProtocolError, as the daemon's refusal would say, for a request the daemon would
        refuse for its form or for being over `max_bytes` packed (its --max-request-bytes):
        the daemon never sees it, and nothing is held for it."""
        rid = next(self._ids)
        request = {"op": op, "id": rid, **{k: v for k, v in fields.items() if v is not None}}
        parse_request(request)
        payload = msgpack.packb(request, use_bin_type=True)
        if max_bytes is not None and len(payload) > max_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"the request is {len(payload)} bytes, over the daemon's limit of {max_bytes}"
                " (--max-request-bytes)",
            )
        self._queues[rid] = asyncio.Queue()
        try:
            self._send_now(payload)
        except DaemonUnavailable:
            self.release(rid)
            raise
        return rid

    def _send_now(self, payload: bytes) -> None:
        if self._socket is None:
            raise DaemonUnavailable("the link to the daemon is closed")
        # NOBLOCK resolves at once: a done future (nothing else here ever waits to send)
        sent = self._socket.send(payload, zmq.NOBLOCK)
        error = sent.exception() if sent.done() else None
        if isinstance(error, zmq.Again):
            raise DaemonUnavailable(f"the daemon at {self.addr} is not connected")
        if error is not None:
            raise DaemonUnavailable(f"cannot send to the daemon at {self.addr}: {error}")

    async def receive(self, rid: int, timeout: float | None = None) -> dict[str, Any]:
        """The next reply to request `rid`."""
        timeout = self.reply_timeout_s if timeout is None else timeout
        try:
            reply = await asyncio.wait_for(self._queues[rid].get(), timeout)
        except TimeoutError:
            raise DaemonUnavailable(f"no reply from the daemon within {timeout:g} s") from None
        if reply is _LOST:
            raise DaemonUnavailable(f"the connection to the daemon at {self.addr} was lost")
        return reply

    def release(self, rid: int) -> None:
        """Forget a request: replies still coming to it are dropped."""
        self._queues.pop(rid, None)

    def abort(self, rid: int) -> None:
        """Ask the daemon to stop request `rid` (a no-op when it has ended or is unknown)."""
        with contextlib.suppress(DaemonUnavailable):  # no connection: the daemon cut it already
            abort = {"op": "abort", "request": rid}  # no id: its reply is dropped
            self._send_now(msgpack.packb(abort, use_bin_type=True))

    async def call(self, op: str, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """One request, one reply; DaemonError for an error reply."""
        rid = self.send(op, **fields)
        try:
            reply = await self.receive(rid, timeout)
        finally:
            self.release(rid)
        _raise_for_error(reply)
        return reply

    def stream(self, op: str, *, max_bytes: int | None = None, **fields: Any) -> Stream:
        """Send a streaming request (`generate`); read its replies with `Stream.next`."""
        return Stream(self, self.send(op, max_bytes=max_bytes, **fields), self.reply_timeout_s)

    # --- tasks --------------------------------------------------------------------------------
    async def _read_replies(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                reply = msgpack.unpackb(frames[-1], raw=False)
            except Exception as exc:  # a daemon that sends garbage: drop the message
                log.warning("dropping an unreadable message from the daemon: %s", exc)
                continue
            if not isinstance(reply, dict):
                continue
            queue = self._queues.get(reply.get("id"))
            if queue is not None:
                queue.put_nowait(reply)
            elif reply.get("id") is None and not reply.get("ok"):
                log.warning("the daemon refused a request it could not read: %s", reply)

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self._auth_failed = True, False
                self.generation += 1
                log.info("connected to the daemon at %s", self.addr)
            elif kind == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    log.warning("lost the connection to the daemon at %s", self.addr)
                self.connected = False
                self._fail_all()
            elif kind & HANDSHAKE_FAILED and not self._auth_failed:
                self._auth_failed = True  # logged once until a handshake succeeds
                log.error(
                    "the daemon at %s refused the connection's handshake (CURVE keys: %s)",
                    self.addr,
                    self.curve_keys or "none",
                )

    def _fail_all(self) -> None:
        """Every request waiting for a reply: its connection is gone."""
        for queue in self._queues.values():
            queue.put_nowait(_LOST)
