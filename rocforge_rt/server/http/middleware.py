"""The ASGI middlewares of the app: a log line per request, the Host check, the API key.

`RequestLog` times each request from its arrival to the end of its response (a stream's
last event), counts it in the front's metrics (front_metrics.py) and writes one line
through the project's logging (logs.py: text, or JSON with the fields below under
`--log-format json`): method, path (never the query, the
body or a header), status, duration, and what the handler noted in the request's
`Outcome`: prompt and generated tokens, finish reason, the daemon's error code, whether it
streamed, whether the client went away first.

`ApiKeyCheck` asks every `/v1/` request for `Authorization: Bearer KEY` when the front has
a key (`/health` needs none), comparing in constant time; 401 in OpenAI's shape otherwise.

`HostCheck` answers 421 Misdirected Request (RFC 9110: not a host this server answers
for) to a request whose `Host` is not one of `allowed_hosts`, every path included (a page
whose name was rebound to 127.0.0.1 could read `/health` and `/metrics` too): by default
the loopback names on a loopback listen address, any host on a wildcard one (which needs an
API key), the listen host otherwise. A request without `Host` (HTTP/1.0) passes: no browser
sends one. `cors` is Starlette's CORSMiddleware for the origins given, or nothing.
"""

import hmac
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from rocforge_rt.server.http.errors import ApiError
from rocforge_rt.server.http.front_metrics import FrontMetrics
from rocforge_rt.server.security import is_loopback_host

log = logging.getLogger("rocforge.http")

OUTCOME_KEY = "rocforge.outcome"  # the ASGI scope's key of a request's Outcome
CLIENT_GONE = 499  # the status logged for a client that left before its response (nginx's)
ANY_HOST = "*"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass
class Outcome:
    """What a handler learned about its request, for the log line."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None  # the error's code (the daemon's, or the front's)
    stream: bool | None = None
    client_gone: bool = False

    def note_reply(self, reply: dict[str, Any]) -> None:
        """A daemon token reply: its running usage and, in the last, its finish reason."""
        usage = reply.get("usage", {})
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        if reply.get("finish_reason") is not None:
            self.finish_reason = reply["finish_reason"]


def outcome(scope: dict[str, Any]) -> Outcome:
    """The request's Outcome (a fresh one outside RequestLog: tests call handlers bare)."""
    return scope.setdefault(OUTCOME_KEY, Outcome())


class RequestLog:
    """ASGI middleware: one log line per HTTP request, and its count and duration."""

    def __init__(self, app: Any, metrics: FrontMetrics) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        record = scope[OUTCOME_KEY] = Outcome()
        status = 500  # unless a response starts

        async def send_noting_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            duration_ms = (time.perf_counter() - started) * 1000.0
            if record.client_gone:
                status = CLIENT_GONE
            self._metrics.observe(scope["method"], scope["path"], status, duration_ms / 1000.0)
            log_request(scope["method"], scope["path"], status, duration_ms, record)


def log_request(method: str, path: str, status: int, duration_ms: float, record: Outcome) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    fields: dict[str, Any] = {
        "method": method,
        "path": path,
        "status": status,
        "duration_ms": round(duration_ms, 3),
    }
    fields.update({k: v for k, v in asdict(record).items() if v not in (None, False)})
    parts = [f"{status}"]
    if record.prompt_tokens is not None:
        parts.append(
            f"{record.prompt_tokens} prompt + {record.completion_tokens or 0} generated tokens"
        )
    if record.finish_reason is not None:
        parts.append(f"finish {record.finish_reason}")
    if record.error is not None:
        parts.append(f"error {record.error}")
    if record.client_gone:
        parts.append("client went away")
    parts.append(f"{duration_ms:.1f} ms")
    # the path is the client's: shown as a literal, so it cannot forge a line of its own
    log.info("%s %r: %s", method, path, ", ".join(parts), extra={"fields": fields})


class ApiKeyCheck:
    """ASGI middleware: `/v1/` requests need the API key (when there is one)."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._key is None or scope["type"] != "http" or not _protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = _bearer(scope)
        if given is not None and hmac.compare_digest(given, self._key):
            await self.app(scope, receive, send)
            return
        error = ApiError(
            401,
            "missing API key: send the header `Authorization: Bearer KEY`"
            if given is None
            else "invalid API key",
            code="invalid_api_key",
        )
        outcome(scope).error = error.code
        await _send_json(send, 401, error.body(), [(b"www-authenticate", b"Bearer")])


class HostCheck:
    """ASGI middleware: 421 to a request for a host this front does not serve."""

    def __init__(self, app: Any, allowed: tuple[str, ...] | None) -> None:
        self.app = app
        self._allowed = allowed  # host names (`*.example.com`: its subdomains); None: any

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._allowed is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if host is None or _host_allowed(host_name(host.decode("latin-1")), self._allowed):
            await self.app(scope, receive, send)
            return
        error = ApiError(
            421,
            f"this server does not answer for the host {host.decode('latin-1')!r}",
            code="misdirected_request",
        )
        outcome(scope).error = error.code
        await _send_json(send, 421, error.body(), [])


def allowed_hosts(listen_host: str, given: Sequence[str] | None) -> tuple[str, ...] | None:
    """The host names a front listening on `listen_host` answers for (None: any): `given`
    (`*` among them: any), or the default of the module docstring."""
    if given is not None:
        names = tuple(host_name(host) for host in given if host.strip())
        return None if ANY_HOST in names else names
    if listen_host in WILDCARD_HOSTS:
        return None
    if is_loopback_host(listen_host):
        return tuple(dict.fromkeys((*LOOPBACK_NAMES, host_name(listen_host))))
    return (host_name(listen_host),)


def host_name(host: str) -> str:
    """A Host header's (or listen address's) name: lower case, without its port, brackets
    or trailing dot (`[::1]:8000` is `::1`, `LocalHost.:80` is `localhost`)."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:  # more than one: an IPv6 address without brackets, no port
        host = host.partition(":")[0]
    return host.rstrip(".")


def _host_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    return any(
        name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:]))
        for pattern in allowed
    )


def cors(origins: Sequence[str]) -> list[Middleware]:
    """Starlette's CORS middleware for `origins` (`*`: any), or none when there are none:
    GET and POST, with the Authorization and Content-Type headers, no cookies."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    ]


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _bearer(scope: dict[str, Any]) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, credentials = value.partition(b" ")
            if scheme.lower() == b"bearer" and credentials.strip():
                return credentials.strip()
            return None
    return None


async def _send_json(
    send: Any, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]
) -> None:
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
