"""The front's connection cap (transport.py's module docstring says why): `ConnectionGuard`
counts the connections and picks the one to evict, `GatedSocket` accepts only where it has
room, `ThrottledLog` writes a kind of warning at most once an interval, and
`install_accept_error_handler` turns the event loop's accept errors into such warnings.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time
from collections import deque
from typing import Any, Protocol

log = logging.getLogger("rocforge.http")

FD_RESERVE = 128  # descriptors kept from the connection cap: ACCEPT_BURST and the process's
ACCEPT_BURST = 32  # accepted past the cap before the connections they evict free their own
ACCEPT_PAUSE_S = 0.5  # no accept after running out of descriptors (asyncio retries in 1 s)
STALE_ACCEPT_S = 5.0
ACCEPT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def connection_cap(configured: int) -> int:
    """`configured`, or fewer where the descriptor limit leaves less room (FD_RESERVE kept)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft - FD_RESERVE))


class ThrottledLog:
    """Warnings of a kind, at most one line per interval: the first at once, then a line
    counting those that came since (when the interval ends, or at `flush`)."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._last: dict[str, float] = {}  # kind -> when its last line was written
        self._held: dict[str, int] = {}  # kind -> how many since
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def warn(self, kind: str, line: str) -> None:
        """One event of `kind` ("request heads timed out (408)"), `line` telling of it."""
        last = self._last.get(kind)
        if last is None or time.monotonic() - last >= self._interval_s:
            self._last[kind] = time.monotonic()
            log.warning("%s", line)
            return
        self._held[kind] = self._held.get(kind, 0) + 1
        if kind not in self._timers:
            delay = last + self._interval_s - time.monotonic()
            loop = asyncio.get_running_loop()
            self._timers[kind] = loop.call_later(max(delay, 0.0), self._sum_up, kind)

    def flush(self) -> None:
        """The lines held back, now (at shutdown)."""
        for kind in list(self._held):
            self._sum_up(kind)

    def _sum_up(self, kind: str) -> None:
        timer = self._timers.pop(kind, None)
        if timer is not None:
            timer.cancel()
        count = self._held.pop(kind, 0)
        if count:
            self._last[kind] = time.monotonic()
            log.warning("%d more %s in the last %g s", count, kind, self._interval_s)


class Evictable(Protocol):
    """A connection the guard may close to make room (transport.py's `BoundedH11Protocol`)."""

    def evict(self) -> None: ...


class ConnectionGuard:
    """The server's connections: those counted against the cap, those waiting for a request
    head in the order they began to wait (the oldest goes first), and the descriptors all
    of them hold, accepted or closing, which `may_accept` keeps within the cap and a burst."""

    def __init__(self, cap: int, warnings: ThrottledLog) -> None:
        self.cap = cap
        self.warnings = warnings
        self._held: set[Evictable] = set()  # from connection_made to connection_lost
        self._open: set[Evictable] = set()  # held and not closed by us: the capped
        self._waiting: dict[Evictable, None] = {}  # insertion-ordered: oldest first
        self._accepted: deque[float] = deque()  # when each accepted one not yet made came

    def may_accept(self) -> bool:
        """Room for one more descriptor: connections evicted to make room for the ones just
        accepted free theirs a few loop iterations later."""
        stale = time.monotonic() - STALE_ACCEPT_S
        while self._accepted and self._accepted[0] < stale:
            self._accepted.popleft()  # accepted but never made (asyncio failed on it)
        return len(self._held) + len(self._accepted) < self.cap + ACCEPT_BURST

    def accepted(self) -> None:
        self._accepted.append(time.monotonic())

    def admit(self, new: Evictable) -> bool:
        """Count `new` in, closing the oldest waiting connection to make room if need be;
        False when none can go (`new` is not counted then, and must close)."""
        if self._accepted:
            self._accepted.popleft()
        self._held.add(new)
        if len(self._open) >= self.cap:
            victim = next(iter(self._waiting), None)
            if victim is None:
                return False
            self.closing(victim)
            victim.evict()
        self._open.add(new)
        self.wait(new)
        return True

    def wait(self, connection: Evictable) -> None:
        """`connection` waits for a request head, from now: the newest to be evicted."""
        self._waiting.pop(connection, None)
        self._waiting[connection] = None

    def busy(self, connection: Evictable) -> None:
        """`connection` has a request in progress: not to be evicted."""
        self._waiting.pop(connection, None)

    def closing(self, connection: Evictable) -> None:
        """Closed by the server: out of the cap's count; its descriptor, until it is lost."""
        self._open.discard(connection)
        self._waiting.pop(connection, None)

    def lost(self, connection: Evictable) -> None:
        self.closing(connection)
        self._held.discard(connection)


class GatedSocket(socket.socket):
    """A listening socket whose `accept` takes no connection the guard has no room for, and
    none for ACCEPT_PAUSE_S after running out of descriptors: asyncio's accept loop takes
    up to the backlog (2048) at a time, past any descriptor limit, and on each failure logs
    a traceback and schedules a retry of its own (CPython 3.11-3.13)."""

    def __init__(self, family: int, proto: int, guard: ConnectionGuard) -> None:
        super().__init__(family, socket.SOCK_STREAM, proto)
        self._guard = guard
        self._paused_until = 0.0

    def accept(self) -> tuple[socket.socket, Any]:
        if time.monotonic() < self._paused_until or not self._guard.may_accept():
            raise BlockingIOError(errno.EAGAIN, "no room for a connection now")
        try:
            accepted = super().accept()
        except OSError as exc:
            if exc.errno in ACCEPT_ERRNOS:
                self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
            raise
        self._guard.accepted()
        return accepted


def listening_sockets(host: str, port: int, guard: ConnectionGuard) -> list[socket.socket]:
    """`host`'s addresses bound as asyncio's create_server binds them (SO_REUSEADDR, IPv6
    only on an IPv6 socket), accepting through `guard`."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, _type, proto, _name, address in dict.fromkeys(infos):
            sock = GatedSocket(family, proto, guard)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def install_accept_error_handler(loop: asyncio.AbstractEventLoop, warnings: ThrottledLog) -> None:
    """Out of descriptors (or memory), asyncio stops accepting for a second and logs
    "socket.accept() out of system resource" with a traceback, again at each retry: here
    one line, then a count per interval. Every other error goes where it went."""
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if (
            isinstance(exc, OSError)
            and exc.errno in ACCEPT_ERRNOS
            and context.get("message", "").startswith("socket.accept()")
        ):
            warnings.warn(
                "accept errors (out of system resources)",
                f"cannot accept connections: {exc.strerror} (errno {exc.errno}); new ones"
                " wait in the listen backlog, accepting again in 1 s",
            )
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
