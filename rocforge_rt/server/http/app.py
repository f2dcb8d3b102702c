"""The Starlette app: the OpenAI routes, `/health`, server-sent events, client disconnects.

- `POST /v1/chat/completions`: a `generate` of `messages` (the daemon's chat template
  renders them);
- `POST /v1/completions`: a `generate` of `prompt` (text, or token ids);
- `GET /v1/models`, `GET /v1/models/{id}`: the daemon's model (`info`), named by
  `--model-name` or its GGUF file name's stem;
- `GET /health`: 200 when the daemon is ready, 503 otherwise (no API key needed);
- `GET /metrics`: Prometheus' text format, the daemon's metrics (its `metrics` op) and
  then the front's own (front_metrics.py); no API key needed, as `/health`.

A generation waits for its first reply (its first token, or the daemon's refusal) before
the response starts, so a refusal (busy, too long, not ready) gets its own status even
when streaming. Then a streamed one is sent as server-sent events (`data: {chunk}` lines,
`data: [DONE]` last; an error after the first token is one `data: {"error": ...}` event,
which the OpenAI SDK raises), and one that is not is collected into one object.

A client that goes away (its connection closes) while its generation runs has it aborted
on the daemon by request id, which ends it within one step: `EventStream` listens for the
disconnect while it streams, and a response that is not streamed races its collection
against it.
"""

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rocforge_rt.server.http.daemon_link import (
    REPLY_TIMEOUT_S,
    DaemonError,
    DaemonLink,
    DaemonUnavailable,
    Stream,
)
from rocforge_rt.server.http.errors import ApiError, bad_field, from_daemon, unavailable
from rocforge_rt.server.http.front_metrics import FrontMetrics
from rocforge_rt.server.http.middleware import (
    CLIENT_GONE,
    ApiKeyCheck,
    HostCheck,
    Outcome,
    RequestLog,
    allowed_hosts,
    cors,
    outcome,
)
from rocforge_rt.server.http.openai_replies import ChatShaper, CompletionShaper, Shaper
from rocforge_rt.server.http.openai_requests import (
    Generation,
    chat_request,
    completion_request,
)
from rocforge_rt.server.http.transport import client_eof
from rocforge_rt.server.protocol import ProtocolError

log = logging.getLogger("rocforge.http")

BODY_TIMEOUT_S = 30.0  # the longest a request body may take to arrive (nginx: 60 s a read)
JSON_TYPES = ("application/json",)  # a body's Content-Type, parameters (charset) aside
INFO_TIMEOUT_S = 5.0  # `info` and `health` are answered by the daemon's I/O thread at once
HEALTH_TIMEOUT_S = 2.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class FrontConfig:
    daemon: str  # the daemon's ZeroMQ endpoint
    api_key: str | None = None  # /v1/* needs `Authorization: Bearer KEY` when set
    curve_keys: Path | None = None  # client.key_secret and server.key, for a CURVE daemon
    model_name: str | None = None  # the model's id (default: the GGUF file name's stem)
    reply_timeout_s: float = REPLY_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S  # a request body slower than this: 408
    listen_host: str = "127.0.0.1"  # where the front listens: its default allowed hosts
    allowed_hosts: tuple[str, ...] | None = None  # the Host names served (`*`: any)
    cors_origins: tuple[str, ...] = ()  # the origins browsers may call from (none: no CORS)


@dataclass(frozen=True)
class ModelCard:
    """The daemon's model as this front names it, and its limits, from `info`."""

    id: str
    created: int
    max_new_tokens: int
    max_request_bytes: int  # the daemon's --max-request-bytes: the largest body taken

    def entry(self) -> dict[str, Any]:
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "rocforge"}


class ClientGone(Exception):
    """The HTTP client closed its connection before its response."""


# Characters JSON leaves raw in a string that common line readers (Python's
# str.splitlines, httpx's aiter_lines) take for line breaks, though SSE does not:
# escaped, so that every event stays one line for them too.
_LINE_BREAKS_ESCAPED = {ord(c): f"\\u{ord(c):04x}" for c in "\x1c\x1d\x1e\x85\u2028\u2029"}


def _sse(data: dict[str, Any]) -> bytes:
    """One server-sent event: `data` as one line of JSON (UTF-8, see _LINE_BREAKS_ESCAPED)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.translate(_LINE_BREAKS_ESCAPED).encode() + b"\n\n"


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return once the client has gone (call after the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any], *, eof_is_gone: bool) -> Any:
    """`work`'s result, or ClientGone (and `work` cancelled) if the client goes first: its
    connection closes or, with `eof_is_gone`, it sends EOF. A whole reply takes EOF for gone,
    as nginx does: the front cannot tell a client that half-closed from one that left until
    it writes to it, and a stream writes soon (a client gone is found at its first events)."""
    task = asyncio.ensure_future(work)
    watches = [asyncio.ensure_future(_disconnected(request.receive))]
    if eof_is_gone:
        watches.append(asyncio.ensure_future(client_eof(request.scope)))
    try:
        await asyncio.wait({task, *watches}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watch in watches:
            watch.cancel()
        task.cancel()  # a no-op once it is done
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone


class EventStream(StreamingResponse):
    """Server-sent events that stop when the client disconnects, whatever the ASGI server's
    spec version; `on_close` runs at the end however it came (the generation's stream is
    closed: aborted if it has not ended, even if the events never began)."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any
    ) -> None:
        super().__init__(events, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the connection broke mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _disconnected(receive)
                group.cancel_scope.cancel()
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()


class Front:
    """The routes' shared state: the daemon link and what it says about the model."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self.link = DaemonLink(
            config.daemon, curve_keys=config.curve_keys, reply_timeout_s=config.reply_timeout_s
        )
        self._card: ModelCard | None = None
        self._card_generation = -1
        self.metrics = FrontMetrics(
            (route.path for route in self.routes()), pending=lambda: self.link.pending
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        await self.link.start()
        log.info("HTTP front for the daemon at %s", self.config.daemon)
        try:
            yield
        finally:
            await self.link.close()

    def routes(self) -> list[Route]:
        return [
            Route("/health", _handler(self.health), methods=["GET"]),
            Route("/v1/models", _handler(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", _handler(self.model), methods=["GET"]),
            Route("/v1/chat/completions", _handler(self.chat), methods=["POST"]),
            Route("/v1/completions", _handler(self.completions), methods=["POST"]),
            Route("/metrics", _handler(self.prometheus), methods=["GET"]),
        ]

    # --- the model ----------------------------------------------------------------------------
    async def card(self) -> ModelCard:
        """The daemon's model, asked once a connection (503 when it cannot be asked)."""
        generation = self.link.generation
        if self._card is not None and self._card_generation == generation:
            return self._card
        try:
            info = await self.link.call("info", timeout=INFO_TIMEOUT_S)
        except DaemonUnavailable as exc:
            raise unavailable(f"the daemon is unavailable: {exc}") from None
        except DaemonError as exc:
            raise from_daemon(exc.code, exc.message) from None
        name = self.config.model_name or Path(info["model"]["path"]).stem
        limits = info["limits"]
        self._card = ModelCard(
            name, int(time.time()), limits["max_new_tokens"], limits["max_request_bytes"]
        )
        self._card_generation = generation
        return self._card

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [(await self.card()).entry()]})

    async def model(self, request: Request) -> Response:
        card = await self.card()
        self._check_model(request.path_params["model"], card, param=None)
        return JSONResponse(card.entry())

    @staticmethod
    def _check_model(model: str, card: ModelCard, param: str | None = "model") -> None:
        if model != card.id:
            raise ApiError(
                404,
                f"the model {model!r} does not exist: this server serves {card.id!r}",
                param=param,
                code="model_not_found",
            )

    # --- health -------------------------------------------------------------------------------
    async def health(self, _request: Request) -> Response:
        try:
            health = await self.link.call("health", timeout=HEALTH_TIMEOUT_S)
        except (DaemonUnavailable, DaemonError) as exc:
            return JSONResponse({"status": "unavailable", "message": str(exc)}, status_code=503)
        counts = ("in_flight", "sessions", "slots_free", "uptime_s")
        body = {"status": health["state"], "daemon": {k: health.get(k) for k in counts}}
        if "loading" in health:
            body["loading"] = health["loading"]  # {"stage": "compiling kernels", "done": 3, ...}
        return JSONResponse(body, status_code=200 if health["ready"] else 503)

    # --- metrics ------------------------------------------------------------------------------
    async def prometheus(self, _request: Request) -> Response:
        """The daemon's metrics, then the front's; the front's alone when the daemon is down."""
        try:
            daemon = (await self.link.call("metrics", timeout=HEALTH_TIMEOUT_S))["text"]
            self.metrics.daemon_up.set(1)
        except (DaemonUnavailable, DaemonError) as exc:
            log.warning("metrics: the daemon did not answer: %s", exc)
            daemon = ""
            self.metrics.daemon_up.set(0)
        text = daemon.encode() + self.metrics.exposition()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    # --- generations --------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat_request, ChatShaper)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, completion_request, CompletionShaper)

    async def _generate(
        self,
        request: Request,
        parse: Callable[[Any], Generation],
        shaper_type: type[Shaper],
    ) -> Response:
        record = outcome(request.scope)
        card = await self.card()
        body = await _json_body(request, card.max_request_bytes, self.config.body_timeout_s)
        generation = parse(body)
        record.stream = generation.stream
        self._check_model(generation.model, card)
        fields = generation.generate_fields(card.max_new_tokens)
        shaper = shaper_type(generation, card.id)
        try:
            stream = self.link.stream("generate", max_bytes=card.max_request_bytes, **fields)
        except ProtocolError as exc:  # what the daemon would refuse: it never sees it
            raise from_daemon(exc.code, exc.message, generation.prompt_field) from None
        try:
            if generation.stream:
                first = await _unless_disconnected(request, stream.next(), eof_is_gone=False)
                record.note_reply(first)
                events = self._events(shaper, stream, first, record)
                response = EventStream(
                    events, on_close=partial(_close, stream, record), headers=SSE_HEADERS
                )
                stream = None  # the event stream closes it
                return response
            collected = self._collect(shaper, stream, record)
            await _unless_disconnected(request, collected, eof_is_gone=True)
            return JSONResponse(shaper.whole())
        except DaemonError as exc:
            raise from_daemon(exc.code, exc.message, generation.prompt_field) from None
        finally:
            if stream is not None:
                stream.close()

    @staticmethod
    async def _collect(shaper: Shaper, stream: Stream, record: Outcome) -> None:
        while not stream.done:
            reply = await stream.next()
            record.note_reply(reply)
            shaper.add(reply)

    @staticmethod
    async def _events(
        shaper: Shaper, stream: Stream, first: dict[str, Any], record: Outcome
    ) -> AsyncIterator[bytes]:
        """The SSE events of a streamed generation whose first reply has come (EventStream
        closes `stream` when they end, however they end)."""
        try:
            for chunk in shaper.opening_chunks():
                yield _sse(chunk)
            reply = first
            while True:
                for chunk in shaper.chunks(reply):
                    yield _sse(chunk)
                if stream.done:
                    break
                reply = await stream.next()
                record.note_reply(reply)
        except DaemonError as exc:
            record.error = exc.code
            yield _sse(from_daemon(exc.code, exc.message).body())
        except DaemonUnavailable as exc:
            record.error = "daemon_unavailable"
            yield _sse(unavailable(f"the daemon is unavailable: {exc}").body())
        yield DONE_EVENT


def _close(stream: Stream, record: Outcome) -> None:
    """The end of a streamed response: the generation is aborted if it has not ended, and a
    response that ended before its last reply or its error lost its client."""
    stream.close()
    record.client_gone = record.client_gone or (
        record.finish_reason is None and record.error is None
    )


def _handler(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable:
    """An endpoint whose refusals are OpenAI-shaped errors."""

    async def handle(request: Request) -> Response:
        record = outcome(request.scope)
        try:
            return await endpoint(request)
        except ApiError as error:
            record.error = error.code or error.type
            return _error_response(error)
        except DaemonUnavailable as exc:
            record.error = "daemon_unavailable"
            return _error_response(unavailable(f"the daemon is unavailable: {exc}"))
        except ClientGone:
            record.client_gone = True
            return Response(status_code=CLIENT_GONE)
        except Exception:
            log.exception("the HTTP front failed on %s %s", request.method, request.url.path)
            record.error = "internal"
            error = ApiError(500, "the server failed on this request", "server_error")
            return _error_response(error)

    return handle


async def _json_body(request: Request, max_bytes: int, timeout_s: float) -> Any:
    """The request's JSON body: 415 when it is not declared JSON (a cross-site form or
    text/plain post, which a browser sends without asking), 413 when over `max_bytes` (the
    daemon's limit: it never sees a larger request), 408 when it takes over `timeout_s` to
    arrive, 400 when it is not JSON or holds a string that is not Unicode text."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type not in JSON_TYPES:
        raise ApiError(
            415,
            f"the request body must be JSON, sent as `Content-Type: application/json`"
            f" (found {content_type or 'none'!r})",
            code="unsupported_media_type",
        )
    too_large = ApiError(
        413,
        f"the request body is over {max_bytes} bytes (the daemon's --max-request-bytes)",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise too_large
    except ClientDisconnect:  # it left before the whole body came
        raise ClientGone from None
    except TimeoutError:
        raise ApiError(
            408, f"the request body took over {timeout_s:g} s to arrive", code="request_timeout"
        ) from None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad_field(None, f"the request body is not valid JSON: {exc}") from None
    _check_text(parsed)
    return parsed


def _check_text(value: Any) -> None:
    """400 for a string that is not Unicode text: JSON's escapes can spell a lone surrogate
    ("\\ud800"), which no UTF-8 encoder (msgpack's, the tokenizer's) takes."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = item[exc.start : exc.start + 1].encode("unicode_escape").decode()
                raise bad_field(
                    None,
                    f"the request body holds a string that is not Unicode text (a lone"
                    f" surrogate, {bad}, at character {exc.start})",
                ) from None


async def _http_error(_request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, method not allowed) in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    return _error_response(ApiError(status, str(getattr(exc, "detail", exc))))


def create_app(config: FrontConfig) -> Starlette:
    front = Front(config)
    return Starlette(
        routes=front.routes(),
        middleware=[
            Middleware(RequestLog, metrics=front.metrics),
            Middleware(HostCheck, allowed=allowed_hosts(config.listen_host, config.allowed_hosts)),
            *cors(config.cors_origins),  # outside the key check: a preflight carries no key
            Middleware(ApiKeyCheck, api_key=config.api_key),
        ],
        exception_handlers={HTTPException: _http_error},
        lifespan=front.lifespan,
    )
