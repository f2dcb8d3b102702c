"""The HTTP front's connections bounded as a server facing strangers must be (transport.py),
and its Host check and CORS (middleware.py): raw sockets against a front in a thread, in
front of a CPU daemon on the tiny model; the last test runs the front as a process under a
descriptor limit of 1024 (`ulimit -n`) and floods it with slowloris connections.
"""

import argparse
import asyncio
import errno
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_daemon import serving
from test_http_front import running_front

from rocforge_rt.cli.local_daemon import free_loopback_port
from rocforge_rt.cli.serve import _front_args
from rocforge_rt.server.daemon import Daemon
from rocforge_rt.server.http.app import FrontConfig
from rocforge_rt.server.http.command import DEFAULT_MAX_CONNECTIONS, add_http_options
from rocforge_rt.server.http.connections import (
    FD_RESERVE,
    ThrottledLog,
    install_accept_error_handler,
)
from rocforge_rt.server.http.middleware import allowed_hosts, host_name
from rocforge_rt.server.http.transport import MAX_CONNECTIONS, TransportLimits, client_eof

PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: never whole
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
HEALTH_CLOSE = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
TOKENS = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving(tiny_model) as d:
        yield d


@contextmanager
def front(
    app: Any, limits: TransportLimits | None = None, host: str = "127.0.0.1"
) -> Iterator[int]:
    """`app` served as `running_front` serves it; the port. A FrontConfig's app is served once
    its `/health` (asked for `host`) is 200."""
    with running_front(app, limits) as base:
        port = httpx.URL(base).port
        limit = time.monotonic() + 10
        while isinstance(app, FrontConfig) and _status(f"{base}/health", host) != 200:
            assert time.monotonic() < limit, "the front's daemon link did not come up"
            time.sleep(0.02)
        yield port


def connect(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if data:
        sock.sendall(data)
    return sock


def read_to_eof(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """All the server sends until it closes the connection (a timeout if it does not)."""
    sock.settimeout(timeout)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def read_response(sock: socket.socket) -> bytes:
    """One response with a content-length, from a connection that stays open."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:100]
    return int(response.split(b" ", 2)[1])


def error_code(response: bytes) -> str:
    return json.loads(response.partition(b"\r\n\r\n")[2])["error"]["code"]


def is_open(sock: socket.socket) -> bool:
    """Nothing came and the connection did not close within 0.2 s."""
    sock.settimeout(0.2)
    try:
        return sock.recv(1) != b""
    except TimeoutError:
        return True
    except ConnectionResetError:
        return False


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "rocforge.http" and text in r.getMessage()]


# --- the request head: a deadline and a size -------------------------------------------------
def test_a_head_not_whole_in_time_gets_408_and_is_closed(daemon: Daemon, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.http")
    with front(FrontConfig(daemon=daemon.endpoint), TransportLimits(header_timeout_s=0.3)) as port:
        started = time.monotonic()
        response = read_to_eof(connect(port, PARTIAL_HEAD))
        assert status_of(response) == 408 and b"connection: close" in response
        assert error_code(response) == "request_timeout"
        assert 0.3 <= time.monotonic() - started < 2
        # kept alive: the deadline runs from the next request's first byte, not from the
        # last response (an idle connection is uvicorn's timeout_keep_alive's, 5 s)
        with connect(port, HEALTH) as kept:
            assert status_of(read_response(kept)) == 200
            time.sleep(0.5)
            kept.sendall(HEALTH)
            assert status_of(read_response(kept)) == 200
            kept.sendall(PARTIAL_HEAD)
            assert status_of(read_to_eof(kept)) == 408
    (line,) = warnings_of(caplog, "no whole request head within 0.3 s")
    assert line.exc_info is None


def test_a_100_kb_header_or_10000_headers_get_431_and_one_warning_line(
    daemon: Daemon, caplog
) -> None:
    caplog.set_level(logging.INFO)
    big = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
    many = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"x-n: 1\r\n" * 10_000 + b"\r\n"
    with front(FrontConfig(daemon=daemon.endpoint)) as port:
        for request in (big, many):
            response = read_to_eof(connect(port, request))
            assert status_of(response) == 431 and b"connection: close" in response
            assert error_code(response) == "request_header_fields_too_large"
        assert status_of(read_to_eof(connect(port, HEALTH_CLOSE))) == 200  # the front goes on
    (line,) = warnings_of(caplog, "431 to 127.0.0.1")  # the second within 10 s: counted
    assert line.exc_info is None and "over 16384 bytes" in line.getMessage()
    assert warnings_of(caplog, "1 more requests refused")  # at the front's exit
    assert not [r for r in caplog.records if r.name.startswith("uvicorn") and r.levelno > 20]


# --- the connection cap ----------------------------------------------------------------------
def test_past_the_cap_the_oldest_connection_sending_its_head_goes_for_a_new_one(
    daemon: Daemon, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.http")
    with front(FrontConfig(daemon=daemon.endpoint), TransportLimits(max_connections=4)) as port:
        slow = [connect(port, PARTIAL_HEAD) for _ in range(4)]
        time.sleep(0.3)  # all four in, oldest first
        with connect(port, HEALTH) as client:
            assert status_of(read_response(client)) == 200
        assert read_to_eof(slow[0]) == b""  # closed without a word
        assert all(is_open(sock) for sock in slow[1:])
        for sock in slow:
            sock.close()
    assert len(warnings_of(caplog, "closed the oldest one waiting for a request head")) == 1


def test_past_the_cap_with_every_connection_busy_a_new_one_gets_503(daemon: Daemon) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json"
        b"\r\ncontent-length: 100\r\n\r\n{"
    )  # a request in progress: its body is still coming
    with front(FrontConfig(daemon=daemon.endpoint), TransportLimits(max_connections=2)) as port:
        busy = [connect(port, head) for _ in range(2)]
        time.sleep(0.3)
        response = read_to_eof(connect(port))
        assert status_of(response) == 503 and error_code(response) == "too_many_connections"
        assert all(is_open(sock) for sock in busy)
        for sock in busy:
            sock.close()
        time.sleep(0.1)
        assert status_of(read_to_eof(connect(port, HEALTH_CLOSE))) == 200


# --- clients that half-close -----------------------------------------------------------------
def test_a_client_that_half_closes_after_its_request_still_gets_its_response(
    daemon: Daemon, tiny_model: Path
) -> None:
    body = json.dumps(
        {"model": tiny_model.stem, "prompt": [TOKENS], "max_tokens": 4, "stream": True}
    ).encode()
    streamed = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json"
        b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    with front(FrontConfig(daemon=daemon.endpoint)) as port:
        for request in (HEALTH, streamed):
            with connect(port, request) as sock:
                sock.shutdown(socket.SHUT_WR)
                response = read_to_eof(sock)  # and the front closes once it is sent
            assert status_of(response) == 200
        assert b'"finish_reason":"length"' in response and b"data: [DONE]" in response


async def _tells_eof(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app answering whether its client half-closed within 0.5 s of its request."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    try:
        await asyncio.wait_for(client_eof(scope), 0.5)
        body = b"eof"
    except TimeoutError:
        body = b"no eof"
    headers = [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def test_client_eof_tells_the_app_of_a_half_close() -> None:
    """`client_eof(scope)` returns when the client half-closed after its request, and never
    where the server does not say (another server, a bare scope)."""
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with front(_tells_eof) as port:
        with connect(port, request) as sock:
            sock.shutdown(socket.SHUT_WR)
            assert read_to_eof(sock).endswith(b"\r\n\r\neof")
        with connect(port, request) as sock:
            assert read_to_eof(sock).endswith(b"\r\n\r\nno eof")
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(client_eof({"type": "http"}), 0.05))


# --- the Host check and CORS -----------------------------------------------------------------
def test_a_host_not_served_gets_421_and_the_loopback_names_pass(daemon: Daemon, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.http")
    with front(FrontConfig(daemon=daemon.endpoint)) as port:
        base = f"http://127.0.0.1:{port}"
        for path in ("/health", "/metrics", "/v1/models"):
            response = httpx.get(f"{base}{path}", headers={"Host": "evil.example"})
            assert response.status_code == 421, path
            assert response.json()["error"]["code"] == "misdirected_request"
        for host in ("localhost", f"localhost:{port}", "127.0.0.1", "[::1]:8000", "LOCALHOST."):
            assert httpx.get(f"{base}/health", headers={"Host": host}).status_code == 200, host
    refused = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("status") == 421]
    assert len(refused) == 3 and refused[0]["error"] == "misdirected_request"
    config = FrontConfig(daemon=daemon.endpoint, allowed_hosts=("*.example.com",))
    with front(config, host="api.example.com") as port:
        url = f"http://127.0.0.1:{port}/health"
        assert httpx.get(url, headers={"Host": "api.example.com"}).status_code == 200
        assert httpx.get(url).status_code == 421  # the option replaces the default


def test_the_allowed_hosts_follow_the_listen_address_unless_given() -> None:
    assert allowed_hosts("127.0.0.1", None) == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts("::1", None) == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts("127.0.0.2", None) == ("localhost", "127.0.0.1", "::1", "127.0.0.2")
    assert allowed_hosts("0.0.0.0", None) is None and allowed_hosts("::", None) is None
    assert allowed_hosts("10.1.2.3", None) == ("10.1.2.3",)
    assert allowed_hosts("0.0.0.0", ["API.example.com:443", "10.1.2.3"]) == (
        "api.example.com",
        "10.1.2.3",
    )
    assert allowed_hosts("127.0.0.1", ["a.example", "*"]) is None
    assert [host_name(h) for h in ("[::1]:80", "::1", "Example.COM.", "h:8000")] == [
        "::1",
        "::1",
        "example.com",
        "h",
    ]


def test_cors_headers_come_only_for_the_origins_given(daemon: Daemon) -> None:
    origin = {"Origin": "https://app.example"}
    preflight = {
        **origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    with front(FrontConfig(daemon=daemon.endpoint)) as port:
        response = httpx.get(f"http://127.0.0.1:{port}/health", headers=origin)
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers
    config = FrontConfig(daemon=daemon.endpoint, api_key="k", cors_origins=("https://app.example",))
    with front(config) as port:
        base = f"http://127.0.0.1:{port}"
        response = httpx.get(f"{base}/health", headers=origin)
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        response = httpx.options(f"{base}/v1/chat/completions", headers=preflight)
        assert response.status_code == 200  # no key asked of a preflight
        assert "POST" in response.headers["access-control-allow-methods"]
        assert "authorization" in response.headers["access-control-allow-headers"].lower()
        refused = httpx.get(f"{base}/v1/models", headers=origin)  # no key: 401, readable
        assert refused.status_code == 401 and "access-control-allow-origin" in refused.headers
        other = httpx.get(f"{base}/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


# --- the event loop's accept errors ----------------------------------------------------------
def test_accept_errors_are_logged_once_then_counted(caplog) -> None:
    caplog.set_level(logging.INFO)
    accept_error = {
        "message": "socket.accept() out of system resource",
        "exception": OSError(errno.EMFILE, "Too many open files"),
    }

    async def flood() -> None:
        loop = asyncio.get_running_loop()
        install_accept_error_handler(loop, ThrottledLog(0.2))
        for _ in range(5):
            loop.call_exception_handler(accept_error)
        loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
        await asyncio.sleep(0.3)

    asyncio.run(flood())
    (line,) = warnings_of(caplog, "cannot accept connections: Too many open files")
    assert line.exc_info is None
    assert warnings_of(caplog, "4 more accept errors (out of system resources) in the last 0.2")
    (other,) = [r for r in caplog.records if r.name == "asyncio"]  # the default handler's
    assert "something else" in other.getMessage()


# --- the options -----------------------------------------------------------------------------
def test_serve_hands_the_new_front_options_to_its_front() -> None:
    serve = argparse.Namespace(
        http="127.0.0.1:8000", curve_keys=None, http_model_name=None,
        http_allowed_hosts="api.example.com, *.corp", http_cors_origins="https://app.example",
        http_max_connections=50, log_level="info", log_format="text",
    )  # fmt: skip
    parser = argparse.ArgumentParser()
    add_http_options(parser)
    args = parser.parse_args(_front_args(serve, "tcp://127.0.0.1:5555"))
    assert args.allowed_hosts == ("api.example.com", "*.corp")
    assert args.cors_origins == ("https://app.example",) and args.max_connections == 50
    defaults = parser.parse_args([])
    assert (defaults.allowed_hosts, defaults.cors_origins) == (None, ())
    assert defaults.max_connections == DEFAULT_MAX_CONNECTIONS == MAX_CONNECTIONS


# --- the bar, reduced ----------------------------------------------------------------
@contextmanager
def descriptors(needed: int) -> Iterator[None]:
    """This process may open `needed` descriptors (its soft limit raised for the while)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the descriptor limit ({hard}) is below {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_1100_slowloris_connections_leave_a_front_of_1024_descriptors_serving(
    daemon: Daemon, tiny_model: Path, tmp_path: Path
) -> None:
    """A front process with RLIMIT_NOFILE 1024 and 1,100 connections that each send part of
    a head and then nothing still answers a health check and a completion within 2 s, and
    its log stays small."""
    port = free_loopback_port()
    base = f"http://127.0.0.1:{port}"
    root = str(Path(__file__).resolve().parents[1])
    log_path = tmp_path / "front.log"
    command = ["/bin/sh", "-c", 'ulimit -n 1024 && exec "$@"', "sh", sys.executable, "-m",
               "rocforge_rt.server.http", "--daemon", daemon.endpoint, "--listen",
               f"127.0.0.1:{port}"]  # fmt: skip
    with log_path.open("w") as log_file:
        env = {**os.environ, "PYTHONPATH": root}
        process = subprocess.Popen(command, stderr=log_file, env=env)
    slow: list[socket.socket] = []
    try:
        with descriptors(2048):
            limit = time.monotonic() + 30
            while _status(f"{base}/health") != 200:
                assert process.poll() is None and time.monotonic() < limit, log_path.read_text()
                time.sleep(0.05)
            for _ in range(1100):
                slow.append(connect(port, PARTIAL_HEAD))
            started = time.monotonic()
            assert httpx.get(f"{base}/health", timeout=2).status_code == 200
            body = {"model": tiny_model.stem, "prompt": [TOKENS], "max_tokens": 2}
            completion = httpx.post(f"{base}/v1/completions", json=body, timeout=2)
            assert completion.status_code == 200, completion.text
            assert completion.json()["usage"]["completion_tokens"] == 2
            assert time.monotonic() - started < 2
            for sock in slow:
                sock.close()
    finally:
        process.terminate()
        process.wait(30)
    log = log_path.read_text()
    assert len(log.encode()) < 1 << 20 and "Traceback" not in log
    assert log.count("closed the oldest one waiting for a request head") == 1, log[-2000:]
    assert f"more connections closed to make room (at the cap of {1024 - FD_RESERVE})" in log
    assert "cannot accept" not in log  # never out of descriptors


def _status(url: str, host: str = "127.0.0.1") -> int | None:
    try:
        return httpx.get(url, headers={"Host": host}, timeout=2).status_code
    except httpx.HTTPError:
        return None
