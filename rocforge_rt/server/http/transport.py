"""The front's HTTP connections, bounded as a server facing strangers must be.

uvicorn's h11 protocol, subclassed (`BoundedH11Protocol`, given as `uvicorn.Config(http=)`)
and set up by `server_config`, shared by `rocforge http` and the tests (the connection cap's
parts: connections.py):

- a request head (request line and headers) must come whole within `header_timeout_s`
  (10 s) of the connection, or of the first byte of the next request on a kept-alive one,
  or it gets `408 Request Timeout` and the connection closes (nginx's client_header_timeout,
  tightened from 60 s); an idle kept-alive connection closes after `keep_alive_s` (5 s,
  uvicorn's timeout_keep_alive);
- a head over `max_head_bytes` (16 KiB: h11's and Node's default, half of nginx's 4 x 8k
  large_client_header_buffers; an API client's head is a few hundred bytes) gets
  `431 Request Header Fields Too Large`, whole or not (h11 bounds only an unfinished one);
  a malformed one gets 400;
- at most `max_connections` (1000, nginx's usual worker_connections, and never past the
  RLIMIT_NOFILE soft limit less FD_RESERVE) are open: a new one past the cap closes the
  oldest connection still waiting for a request head (a slowloris, or an idle kept-alive
  one), so a real client is served; when every one has a request in progress, the new one
  gets 503 and is closed. The listening sockets (`GatedSocket`, `FrontServer` binds them)
  accept nothing past the cap and ACCEPT_BURST, so the process does not run out of
  descriptors before the connections evicted free theirs;
- each of these is one warning line, then at most one line per `log_interval_s` (10 s)
  counting the rest (`ThrottledLog`), as are the event loop's accept errors should the
  process run out of descriptors all the same (`FrontServer` installs the handler);
- a client that half-closes (EOF) after its whole request still gets its response, and the
  connection closes once it is sent; the EOF is also offered to the app (`client_eof`),
  for a response that is not streamed: an EOF is all a peer that close()s shows until a
  write to it fails, and nginx's rule is that such a client is gone.

uvicorn internals relied on (the same from uvicorn 0.30 to 0.55): `H11Protocol`'s
`__init__(config, server_state, app_state, _loop)`, `conn`, `cycle`, `client`,
`transport`, `loop`, `connection_made`, `connection_lost`, `data_received`,
`eof_received`, `handle_events` (it stops at `h11.NEED_DATA`), `on_response_complete`;
`RequestResponseCycle`'s `scope`, `more_body`, `response_started`, `response_complete`,
`disconnected` and `message_event`; `Server.serve(sockets)`, which serves the sockets given
through asyncio's `create_server(sock=)`: asyncio's accept loop calls their `accept`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from rocforge_rt.server.http.connections import (
    ConnectionGuard,
    ThrottledLog,
    connection_cap,
    install_accept_error_handler,
    listening_sockets,
)
from rocforge_rt.server.http.errors import UNAVAILABLE, ApiError

log = logging.getLogger("rocforge.http")

HEADER_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 16 << 10
MAX_CONNECTIONS = 1000
KEEP_ALIVE_S = 5
BACKLOG = 2048
LOG_INTERVAL_S = 10.0
SHUTDOWN_GRACE_S = 5  # streams still open at SIGTERM get this long to end

CLIENT_EOF = "rocforge.client_eof"  # the ASGI scope's extension: {"event": asyncio.Event}


@dataclass(frozen=True)
class TransportLimits:
    """The bounds of `server_config`'s server (the module docstring says why these)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    max_head_bytes: int = MAX_HEAD_BYTES
    max_connections: int = MAX_CONNECTIONS  # capped by RLIMIT_NOFILE (connection_cap)
    keep_alive_s: int = KEEP_ALIVE_S
    backlog: int = BACKLOG
    log_interval_s: float = LOG_INTERVAL_S


async def client_eof(scope: Mapping[str, Any]) -> None:
    """Return once the client has half-closed its connection (EOF) after its whole request;
    never under a server that does not say (no `rocforge.client_eof` extension)."""
    extension = scope.get("extensions", {}).get(CLIENT_EOF)
    if extension is None:
        await asyncio.Event().wait()  # never set
        return
    await extension["event"].wait()


class _BoundedH11(h11.Connection):
    """h11's server side that keeps a refused head (malformed, or over `max_head_bytes`
    whole or not) in `refusal` and reports NEED_DATA, where h11 would raise into uvicorn
    (which answers 400 to both and logs a line of its own)."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self._max_head_bytes = max_head_bytes
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        if self.refusal is not None:
            return h11.NEED_DATA
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = exc
            return h11.NEED_DATA
        if isinstance(event, h11.Request) and _head_bytes(event) > self._max_head_bytes:
            self.refusal = h11.RemoteProtocolError("request head too large", 431)
            return h11.NEED_DATA
        return event


def _head_bytes(request: h11.Request) -> int:
    """A request head's size as sent, but for optional whitespace."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 connection, bounded (the module docstring); needs a `TransportConfig`."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        if not isinstance(config, TransportConfig):
            raise TypeError("BoundedH11Protocol needs a TransportConfig (server_config's)")
        self._limits = config.limits
        self._guard = config.guard
        self._h11 = _BoundedH11(config.limits.max_head_bytes)
        self.conn = self._h11
        self._head_timer: asyncio.TimerHandle | None = None
        self._request: RequestResponseCycle | None = None  # the one given a client_eof event
        self._eof = asyncio.Event()  # that request's
        self._peer_eof = False

    # --- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self._guard.admit(self):
            cap = self._guard.cap
            self._guard.warnings.warn(
                f"connections refused with 503 (all {cap} open ones busy)",
                f"refused a connection from {self._peer()} with 503: all {cap} open"
                " connections (the cap) have a request in progress",
            )
            self._refuse(503, "too_many_connections", "the server has too many connections")
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and not self._in_request():
            self._arm_head_timer()  # the next request of a kept-alive connection begins
        super().data_received(data)

    def eof_received(self) -> bool | None:
        """Keep the connection open for the response when the whole request has come;
        otherwise it closes (None), as when the client leaves between requests."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body:
            return None
        self._peer_eof = True
        self._eof.set()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.lost(self)
        self._cancel_head_timer()
        super().connection_lost(exc)

    # --- uvicorn's H11Protocol ----------------------------------------------------------------
    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing():
            return
        if self._h11.refusal is not None:
            self._refuse_head(self._h11.refusal)
        elif self._in_request() and self.cycle is not self._request:
            self._begin_request()

    def shutdown(self) -> None:
        if not self.transport.is_closing():  # one the bounds closed may be in any h11 state
            super().shutdown()

    def on_response_complete(self) -> None:
        if self._peer_eof:
            self.transport.close()  # after the response: the client sends no more
        super().on_response_complete()  # may begin a pipelined request (handle_events)
        if not self.transport.is_closing() and not self._in_request():
            self._guard.wait(self)

    # --- the bounds ---------------------------------------------------------------------------
    def evict(self) -> None:
        """Closed for a newer connection (the guard counts it as closing)."""
        self._guard.warnings.warn(
            f"connections closed to make room (at the cap of {self._guard.cap})",
            f"at the cap of {self._guard.cap} connections: closed the oldest one waiting for"
            f" a request head ({self._peer()}) for a new one",
        )
        self._cancel_head_timer()
        self.transport.close()

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _begin_request(self) -> None:
        self._cancel_head_timer()
        self._guard.busy(self)
        self._request = self.cycle
        self._eof = asyncio.Event()
        self.cycle.scope.setdefault("extensions", {})[CLIENT_EOF] = {"event": self._eof}

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._in_request():
            return
        timeout = self._limits.header_timeout_s
        self._guard.warnings.warn(
            "request heads timed out (408)",
            f"408 to {self._peer()}: no whole request head within {timeout:g} s",
        )
        self._refuse(408, "request_timeout", f"no whole request head within {timeout:g} s")

    def _refuse_head(self, error: h11.RemoteProtocolError) -> None:
        status = error.error_status_hint
        limit = self._limits.max_head_bytes
        problem = str(error)[:200]  # h11's, quoting the client's bytes as a repr
        what = f"a request head over {limit} bytes" if status == 431 else f"malformed: {problem}"
        self._guard.warnings.warn(
            "requests refused (malformed, or heads too large)",
            f"{status} to {self._peer()}: {what}",
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # a malformed body: its app
            cycle.disconnected = True  # hears a disconnect
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        if status == 431:
            message = f"the request head (request line and headers) is over {limit} bytes"
            self._refuse(431, "request_header_fields_too_large", message)
        else:
            self._refuse(status, "bad_request", f"malformed HTTP request: {problem}")

    def _refuse(self, status: int, code: str, message: str) -> None:
        """An OpenAI-shaped error, then the connection closes; nothing of it is kept."""
        self._guard.closing(self)
        self._cancel_head_timer()
        kind = UNAVAILABLE if status == 503 else "invalid_request_error"
        body = json.dumps(ApiError(status, message, kind, code=code).body()).encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()

    def _peer(self) -> str:
        if self.client is None:
            return "a client"
        host, port = self.client
        return f"{host}:{port}"


class TransportConfig(uvicorn.Config):
    """uvicorn's settings with the limits, and the connection guard its protocols share."""

    def __init__(self, app: Any, limits: TransportLimits, **settings: Any) -> None:
        self.limits = limits
        self.guard = ConnectionGuard(
            connection_cap(limits.max_connections), ThrottledLog(limits.log_interval_s)
        )
        # uvicorn answers 503 when its connections (or tasks) reach this at a request; the
        # guard keeps the connections at the cap, so uvicorn's check bounds lingering tasks
        super().__init__(app, limit_concurrency=self.guard.cap + 1, **settings)


def server_config(
    app: Any, host: str, port: int, limits: TransportLimits | None = None
) -> TransportConfig:
    """uvicorn's settings for the front: the bounded h11 protocol on asyncio, our logging (no
    access log of its own: RequestLog writes one)."""
    limits = limits or TransportLimits()
    return TransportConfig(
        app,
        limits,
        host=host,
        port=port,
        http=BoundedH11Protocol,
        loop="asyncio",
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        server_header=False,
        backlog=limits.backlog,
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_head_bytes,
    )


class FrontServer(uvicorn.Server):
    """uvicorn's server on `GatedSocket`s, with the event loop's accept errors logged as
    `ThrottledLog` does."""

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self._guard = config.guard

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        install_accept_error_handler(asyncio.get_running_loop(), self._guard.warnings)
        host, port = self.config.host, self.config.port
        if sockets is None:
            try:
                sockets = listening_sockets(host, port, self._guard)
            except OSError as exc:
                log.error("cannot listen on %s port %d: %s", host, port, exc)
                return  # not started
            for sock in sockets:
                address, bound_port = sock.getsockname()[:2]
                shown = f"[{address}]" if sock.family == socket.AF_INET6 else address
                cap = self._guard.cap
                log.info(
                    "listening on http://%s:%d (%d connections at most)", shown, bound_port, cap
                )
        try:
            await super().serve(sockets)
        finally:
            self._guard.warnings.flush()
            for sock in sockets:
                sock.close()
