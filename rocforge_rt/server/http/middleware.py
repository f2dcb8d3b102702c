"""A log line per HTTP request, and the API key check: the two ASGI middlewares of the app.

`RequestLog` times each request from its arrival to the end of its response (a stream's
last event), counts it in the front's metrics (front_metrics.py) and writes one line
through the project's logging (logs.py: text, or JSON with the fields below under
`--log-format json`): method, path (never the query, the
body or a header), status, duration, and what the handler noted in the request's
`Outcome`: prompt and generated tokens, finish reason, the daemon's error code, whether it
streamed, whether the client went away first.

`ApiKeyCheck` asks every `/v1/` request for `Authorization: Bearer KEY` when the front has
a key (`/health` needs none), comparing in constant time; 401 in OpenAI's shape otherwise.
"""

import hmac
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from rocforge_rt.server.http.errors import ApiError
from rocforge_rt.server.http.front_metrics import FrontMetrics

log = logging.getLogger("rocforge.http")

OUTCOME_KEY = "rocforge.outcome"  # the ASGI scope's key of a request's Outcome
CLIENT_GONE = 499  # the status logged for a client that left before its response (nginx's)


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
