#!/usr/bin/env python3
"""The hardening issue's bars, measured end to end against real `rocforge serve` processes.

Each bar is a scenario, run by name (`--only NAME ...`; default: all, in this order). Each
starts its own `rocforge serve --backend cpu --model MODEL --bind tcp://127.0.0.1:PORT`
(with `--http 127.0.0.1:HPORT` where it needs the HTTP front, and --ctx-size,
--max-sessions and --serve-args), on free loopback ports, and stops it with SIGTERM. The
serve command's stdout and stderr (the daemon's log and its front's) go to a file per
scenario in --log-dir, whose growth is measured. The figures are recorded raw; `met` is
computed from them (null where the scenario was skipped or failed to run).

- `oversized`: 3 streamed `/v1/completions` of --stream-tokens tokens run at once (a
  thread each, `stream_options.include_usage`); once each has had its first event, a
  --big-mib body (a prompt string of that many MiB) is POSTed, one after the other (3 and
  1.5 MiB by default). Recorded: each big request's status and seconds to its response
  (and how many streams were still running then), each stream's status, finish_reason and
  completion tokens (`usage`, else its chunks). Bar: every big one gets 413 within
  --big-limit-s (1 s), and every stream ends with finish_reason "length" after all its
  tokens.
- `surrogates`: --surrogate-requests (60,000) POSTs whose JSON text holds a lone surrogate
  escape (`"a\\ud800b"`), cycling through `/v1/completions`' `prompt`, a chat message's
  `content` and `/v1/completions`' `stop`, over --surrogate-connections keep-alive
  connections (an httpx.Client a thread), after a warm-up of --surrogate-warmup (1,000)
  the same. Recorded: the status counts (warm-up apart), the front process's VmRSS after the
  warm-up and at the end and its growth in %, the log's growth in bytes, the count of
  "Traceback" in the log. Bar: every response 400, RSS growth < 10 %, no traceback.
- `flood`: over ZeroMQ (no front): one greedy generate of --flood-tokens (48) tokens of
  "Once upon a time" timed --flood-repeats (3) times alone, then beside a CPU-load control
  (another process spinning a Python loop: one core), then beside a flood (another process
  whose DEALER sends invalid `step` requests, session 999999, as fast as zmq.NOBLOCK lets
  it, draining the replies): the three phases in turn, --flood-rounds (3) rounds. Recorded:
  the times, each phase's median, the ratios flood/alone, control/alone, flood/control, the
  flood's send rate (messages zmq accepted a second) and its replies by error code, the
  daemon log's growth during the flood phases. Bar: flood/control <= --flood-max-ratio (3).
- `sigterm`: for each of --sigterm-delays (0.05 0.3 1 2 3 s) and --sigterm-trials (3)
  trials, `serve` is started and sent SIGTERM that long after Popen returned. Recorded: the
  exit status and the seconds from SIGTERM to exit. Then, --sigterm-trials times, the
  seconds from start to the first `health` reply over ZeroMQ (polled with --health-poll-s
  attempts) and its `state`, and to `ready`. Bar: every exit status 0 within
  --sigterm-limit-s (2 s), and every first health reply within --health-limit-s (1 s).
- `slowloris`: `serve --http` started with RLIMIT_NOFILE 1024 (soft = hard; the front
  inherits it); --slowloris-connections (1,100) TCP connections to the front each send
  `POST /v1/completions HTTP/1.1` and a Host line, then nothing. Then a GET /health and a
  small completion are timed, and the connections held --slowloris-hold-s (12 s: past the
  front's 10 s head timeout) more. Recorded: how many connections opened, the front's open
  descriptors then, each request's status and seconds, the slow connections' states after
  the requests and after the hold (open, closed, reset, or answered with a status), the
  log's growth until the end of the hold. Bar: both 200 within --slowloris-limit-s (2 s),
  log growth < 1 MB. Skipped when this process's hard descriptor limit is under 2,300 (its
  soft limit is raised to the hard one).
- `origin`: GET /v1/models with `Host: evil.example` and a POST /v1/completions of a valid
  JSON body sent as `Content-Type: text/plain`. Bar: 400 or 421, and 415.

One JSON file (--out; default docs/bench/hardening-<date>.json): the date, the git commit
(and whether the tracked files differ from it), the machine, the model, this command, the
serve command, and per scenario its parameters, figures, bar and `met`; a table on stdout.
The serve logs stay in --log-dir (default: a new temporary folder), named in the report.

    python scripts/hardening_bars.py --only sigterm origin --sigterm-trials 1 \\
        --sigterm-delays 0.3 2 --out /tmp/hardening.json          # a quick run
    python scripts/hardening_bars.py                              # the full run (~10 min)
    python scripts/hardening_bars.py --rocforge "/path/to/venv/bin/rocforge" ...  # a wheel

--rocforge is the serve command's prefix (default: this interpreter's `-m rocforge_rt`, with
the checkout on PYTHONPATH; a command given is run with the environment as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct-q4_0.gguf"
FRONT_MODULE = "rocforge_rt.server.http"  # front_process.py's: how serve starts its front
PROMPT = "Once upon a time"
SURROGATE = "a\ud800b"  # json.dumps writes it as the escape "a\ud800b", ASCII
FLOOD_TOKEN = "x" * 32
FLOOD_SESSION = 999999
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
SERVE_NOFILE = 1024  # slowloris: the serve process's RLIMIT_NOFILE, soft and hard
SLOWLORIS_MIN_HARD_NOFILE = 2300  # this process: the connections and httpx beside them
MIB = 1 << 20
MAX_LOG_GROWTH_BYTES = 1_000_000  # slowloris: 1 MB
MAX_RSS_GROWTH_PCT = 10.0  # surrogates
PHASES = ("alone", "control", "flood")  # flood: a round's phases, in turn


# --- processes, ports, /proc -----------------------------------------------------------------


def free_port() -> int:
    from rocforge_rt.cli.local_daemon import free_loopback_port  # ~1 s to import

    return free_loopback_port()


def parse_vm_rss(status_text: str) -> int | None:
    """The VmRSS line of a /proc/PID/status text, in bytes (None if it has none)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            assert unit == "kB", line
            return int(value) * 1024
    return None


def rss_bytes(pid: int) -> int | None:
    try:
        return parse_vm_rss(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None


def parse_stat_ppid(stat_text: str) -> int:
    """The parent pid in a /proc/PID/stat text (the field after the state; the command
    name, in parentheses, may hold spaces and parentheses)."""
    return int(stat_text.rpartition(")")[2].split()[1])


def child_pids(pid: int) -> list[int]:
    """The children of `pid`: /proc/PID/task/*/children, else a scan of /proc/*/stat."""
    tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if tasks:
        return [int(c) for task in tasks for c in task.read_text().split()]
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if parse_stat_ppid(stat.read_text()) == pid:
                children.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def find_front(serve_pid: int) -> int | None:
    """The HTTP front among the serve process's descendants: `python -m
    rocforge_rt.server.http ...` (or a command whose first arguments name `http`)."""
    todo = child_pids(serve_pid)
    while todo:
        pid = todo.pop(0)
        args = command_line(pid)
        if FRONT_MODULE in args or "http" in args[:3]:
            return pid
        todo.extend(child_pids(pid))
    return None


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def count_in_file(path: Path, needle: bytes) -> int:
    try:
        return path.read_bytes().count(needle)
    except OSError:
        return 0


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def growth_pct(before: int | None, after: int | None) -> float | None:
    """How much `after` is over `before`, in % (2 decimals); None without both."""
    return None if not before or after is None else round((after / before - 1) * 100, 2)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


# --- rocforge serve ---------------------------------------------------------------------------


def serve_prefix(args: argparse.Namespace) -> list[str]:
    return shlex.split(args.rocforge) if args.rocforge else [sys.executable, "-m", "rocforge_rt"]


def serve_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment: this checkout on PYTHONPATH for the default command only (it would
    shadow an installed wheel's package)."""
    env = dict(os.environ)
    if not args.rocforge:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return env


def serve_command(args: argparse.Namespace, bind: str, http: str | None) -> list[str]:
    command = [*serve_prefix(args), "serve", "--backend", "cpu", "--model", str(args.model)]
    command += ["--bind", bind]
    if http is not None:
        command += ["--http", http]
    command += ["--ctx-size", str(args.ctx_size), "--max-sessions", str(args.max_sessions)]
    return command + shlex.split(args.serve_args)


@dataclass
class Serve:
    """A `rocforge serve` process this script started."""

    process: subprocess.Popen
    addr: str  # its ZeroMQ address
    base_url: str | None  # its HTTP front's, if any
    log_path: Path
    started_at: float  # time.monotonic() once Popen returned

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """SIGTERM and wait (SIGKILL past `timeout`): the exit status and seconds."""
        if self.process.poll() is not None:
            return {"exit_status": self.process.returncode, "stop_s": 0.0, "killed": False}
        sent = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
            killed = False
        except subprocess.TimeoutExpired:
            self.process.kill()
            code, killed = self.process.wait(), True
        return {"exit_status": code, "stop_s": round(time.monotonic() - sent, 4), "killed": killed}


def launch(
    args: argparse.Namespace,
    log_name: str,
    *,
    http: bool = True,
    preexec_fn: Callable[[], None] | None = None,
) -> Serve:
    """Start serve on free ports, its output appended to LOG_DIR/<log_name>.log."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    listen = f"127.0.0.1:{free_port()}" if http else None
    log_path = Path(args.log_dir) / f"{log_name}.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            serve_command(args, addr, listen),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=serve_env(args),
            preexec_fn=preexec_fn,
        )
    started = time.monotonic()
    base_url = f"http://{listen}" if listen else None
    return Serve(process, addr, base_url, log_path, started)


def wait_http_ready(serve: Serve, timeout: float) -> str:
    """Poll GET /health until 200; the model's id (GET /v1/models)."""
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        if serve.process.poll() is not None:
            raise RuntimeError(f"serve exited with status {serve.process.returncode}")
        try:
            if httpx.get(f"{serve.base_url}/health", timeout=2).status_code == 200:
                models = httpx.get(f"{serve.base_url}/v1/models", timeout=5).json()
                return models["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the front at {serve.base_url} was not ready within {timeout:g} s")


@contextmanager
def serving(
    args: argparse.Namespace,
    name: str,
    figures: dict[str, Any],
    *,
    http: bool = True,
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[tuple[Serve, str | None]]:
    """A ready serve (and its model id, with http) for a scenario; stopped at the end, its
    exit recorded in figures["serve_stop"]."""
    serve = launch(args, name, http=http, preexec_fn=preexec_fn)
    try:
        if http:
            model_id = wait_http_ready(serve, args.ready_timeout)
        else:
            from rocforge_rt.cli.local_daemon import wait_until_ready  # ~1 s to import

            wait_until_ready(serve.addr, serve.process, args.ready_timeout)
            model_id = None
        figures["ready_s"] = round(time.monotonic() - serve.started_at, 3)
        yield serve, model_id
    finally:
        figures["serve_stop"] = serve.stop()


def scenario_result(
    bar: str, parameters: dict[str, Any], figures: dict[str, Any], met: bool | None, summary: str
) -> dict[str, Any]:
    return {
        "bar": bar,
        "parameters": parameters,
        "figures": figures,
        "met": met,
        "summary": summary,
    }


# --- oversized --------------------------------------------------------------------------------


def oversized_met(
    big: Sequence[dict[str, Any]], streams: Sequence[dict[str, Any]], tokens: int, limit_s: float
) -> bool:
    fast = all(b["status"] == 413 and b["seconds"] <= limit_s for b in big)
    complete = all(stream_complete(s, tokens) for s in streams)
    return bool(big) and bool(streams) and fast and complete


def stream_complete(stream: dict[str, Any], tokens: int) -> bool:
    return stream["finish_reason"] == "length" and stream["completion_tokens"] == tokens


def stream_completion(
    url: str, body: dict[str, Any], first_event: threading.Event, timeout: float
) -> dict[str, Any]:
    """One streamed completion: its status, chunks, finish_reason, completion tokens."""
    record: dict[str, Any] = {
        "status": None,
        "chunks": 0,
        "finish_reason": None,
        "usage_tokens": None,
        "done": False,
        "error": None,
    }
    started = time.perf_counter()
    try:
        with httpx.stream("POST", url, json=body, timeout=timeout) as response:
            record["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not first_event.is_set():
                    record["first_event_s"] = round(time.perf_counter() - started, 4)
                    first_event.set()
                if line == "data: [DONE]":
                    record["done"] = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record["error"] = event["error"]
                for choice in event.get("choices") or ():
                    record["chunks"] += 1
                    record["finish_reason"] = choice.get("finish_reason") or record["finish_reason"]
                if event.get("usage"):
                    record["usage_tokens"] = event["usage"].get("completion_tokens")
    except httpx.HTTPError as exc:
        record["error"] = repr(exc)
    finally:
        first_event.set()  # a failed stream must not hold the big requests back
        record["ended_at"] = time.perf_counter()
        record["seconds"] = round(record["ended_at"] - started, 4)
    usage = record["usage_tokens"]
    record["completion_tokens"] = usage if usage is not None else record["chunks"]
    return record


def post_big(url: str, model_id: str, size: int, timeout: float) -> dict[str, Any]:
    body = json.dumps({"model": model_id, "prompt": "x" * size, "max_tokens": 1}).encode()
    record: dict[str, Any] = {"prompt_bytes": size, "body_bytes": len(body), "status": None}
    started = time.perf_counter()
    try:
        response = httpx.post(
            url, content=body, headers={"Content-Type": "application/json"}, timeout=timeout
        )
        record["status"] = response.status_code
        record["error_code"] = error_code(response)
    except httpx.HTTPError as exc:
        record["error"] = repr(exc)
    record["responded_at"] = time.perf_counter()
    record["seconds"] = round(record["responded_at"] - started, 4)
    return record


def error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def scenario_oversized(args: argparse.Namespace) -> dict[str, Any]:
    parameters = {
        "streams": 3,
        "stream_tokens": args.stream_tokens,
        "big_mib": args.big_mib,
        "big_limit_s": args.big_limit_s,
    }
    figures: dict[str, Any] = {}
    with serving(args, "oversized", figures) as (serve, model_id):
        url = f"{serve.base_url}/v1/completions"
        body = {
            "model": model_id,
            "prompt": PROMPT,
            "max_tokens": args.stream_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = [threading.Event() for _ in range(3)]
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(stream_completion, url, body, event, args.request_timeout)
                for event in events
            ]
            for event in events:
                event.wait(args.request_timeout)
            big = [
                post_big(url, model_id, int(mib * MIB), args.request_timeout)
                for mib in args.big_mib
            ]
            streams = [future.result() for future in futures]
        for b in big:
            b["streams_running"] = sum(s["ended_at"] > b["responded_at"] for s in streams)
        for record in (*big, *streams):
            record.pop("responded_at", None)
            record.pop("ended_at", None)
        figures.update(big=big, streams=streams)
    met = oversized_met(big, streams, args.stream_tokens, args.big_limit_s)
    done = sum(stream_complete(s, args.stream_tokens) for s in streams)
    summary = (
        "big: "
        + ", ".join(f"{b['status']} in {b['seconds']:.3f} s" for b in big)
        + f"; streams complete {done}/{len(streams)}"
    )
    bar = f"big bodies 413 within {args.big_limit_s:g} s; the 3 streams finish all tokens"
    return scenario_result(bar, parameters, figures, met, summary)


# --- surrogates -------------------------------------------------------------------------------


def surrogate_requests(model_id: str) -> list[tuple[str, bytes]]:
    """(path, JSON body) with the escape \\ud800 in the text: prompt, chat content, stop."""
    bodies = [
        ("/v1/completions", {"model": model_id, "prompt": SURROGATE, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {
                "model": model_id,
                "messages": [{"role": "user", "content": SURROGATE}],
                "max_tokens": 1,
            },
        ),
        (
            "/v1/completions",
            {"model": model_id, "prompt": "Hi", "max_tokens": 1, "stop": SURROGATE},
        ),
    ]
    return [(path, json.dumps(body).encode()) for path, body in bodies]


def surrogates_met(
    statuses: Counter[str] | dict[str, int], rss_growth_pct: float | None, tracebacks: int
) -> bool:
    return (
        set(statuses) == {"400"}
        and rss_growth_pct is not None
        and rss_growth_pct < MAX_RSS_GROWTH_PCT
        and tracebacks == 0
    )


def send_batch(
    base_url: str,
    requests: Sequence[tuple[str, bytes]],
    total: int,
    connections: int,
    timeout: float,
) -> Counter[str]:
    """`total` POSTs cycling through `requests`, over `connections` keep-alive connections
    (a thread each); the statuses (or exception names) counted."""

    def worker(start: int) -> Counter[str]:
        counts: Counter[str] = Counter()
        headers = {"Content-Type": "application/json"}
        with httpx.Client(base_url=base_url, headers=headers, timeout=timeout) as client:
            for i in range(start, total, connections):
                path, body = requests[i % len(requests)]
                try:
                    counts[str(client.post(path, content=body).status_code)] += 1
                except httpx.HTTPError as exc:
                    counts[type(exc).__name__] += 1
        return counts

    with ThreadPoolExecutor(connections) as pool:
        return sum(pool.map(worker, range(connections)), Counter())


def scenario_surrogates(args: argparse.Namespace) -> dict[str, Any]:
    parameters = {
        "requests": args.surrogate_requests,
        "warmup": args.surrogate_warmup,
        "connections": args.surrogate_connections,
    }
    figures: dict[str, Any] = {}
    with serving(args, "surrogates", figures) as (serve, model_id):
        requests = surrogate_requests(model_id)
        front = find_front(serve.process.pid)
        figures["front_pid"] = front

        def send(n: int) -> Counter[str]:
            return send_batch(
                serve.base_url, requests, n, args.surrogate_connections, args.request_timeout
            )

        figures["warmup_statuses"] = dict(send(args.surrogate_warmup))
        rss_before = rss_bytes(front) if front else None
        serve_rss_before = rss_bytes(serve.process.pid)
        log_before = serve.log_size()
        started = time.perf_counter()
        statuses = send(args.surrogate_requests)
        seconds = time.perf_counter() - started
        rss_after = rss_bytes(front) if front else None
        figures.update(
            statuses=dict(statuses),
            seconds=round(seconds, 3),
            requests_per_s=round(args.surrogate_requests / seconds, 1),
            front_rss_before_bytes=rss_before,
            front_rss_after_bytes=rss_after,
            front_rss_growth_pct=growth_pct(rss_before, rss_after),
            serve_rss_before_bytes=serve_rss_before,
            serve_rss_after_bytes=rss_bytes(serve.process.pid),
            log_growth_bytes=serve.log_size() - log_before,
        )
    figures["tracebacks"] = count_in_file(serve.log_path, b"Traceback")
    all_statuses = statuses + Counter(figures["warmup_statuses"])
    growth = figures["front_rss_growth_pct"]
    met = surrogates_met(all_statuses, growth, figures["tracebacks"])
    summary = (
        f"statuses {dict(all_statuses)}; front RSS growth {growth} %; log +"
        f"{figures['log_growth_bytes']} B; tracebacks {figures['tracebacks']};"
        f" {figures['requests_per_s']} req/s"
    )
    bar = f"all 400, front RSS growth < {MAX_RSS_GROWTH_PCT:g} %, no traceback"
    return scenario_result(bar, parameters, figures, met, summary)


# --- flood ------------------------------------------------------------------------------------


def flood_worker(addr: str) -> None:
    """The flood process: invalid `step`s as fast as zmq takes them, replies drained; on
    SIGTERM, one JSON line: sent, seconds, replies by error code."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(addr)
    sent = blocked = 0
    codes: Counter[str] = Counter()

    def drain() -> None:
        while True:
            try:
                reply = msgpack.unpackb(sock.recv(zmq.NOBLOCK), raw=False)
            except zmq.Again:
                return
            ok = isinstance(reply, dict) and reply.get("ok")
            error = reply.get("error") if isinstance(reply, dict) else None
            codes["ok" if ok else (error or {}).get("code", "unreadable")] += 1

    started = time.perf_counter()
    while not stopping.is_set():
        request = {"op": "step", "id": sent, "session": FLOOD_SESSION, "token": FLOOD_TOKEN}
        try:
            sock.send(msgpack.packb(request), zmq.NOBLOCK)
            sent += 1
            if sent == 1:
                print("ready", flush=True)
        except zmq.Again:
            blocked += 1
        drain()
    seconds = time.perf_counter() - started
    time.sleep(0.2)  # the last replies
    drain()
    print(
        json.dumps({"sent": sent, "blocked": blocked, "seconds": seconds, "replies": dict(codes)}),
        flush=True,
    )


def spin_worker() -> None:
    """The control: a busy Python loop (one core) until SIGTERM."""
    print("ready", flush=True)
    while True:
        pass


def start_worker(kind: str, *worker_args: str) -> subprocess.Popen:
    """This script as a worker process (flood or spin), once it says it is ready."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, *worker_args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if line.strip() != "ready":
        process.kill()
        process.wait()
        raise RuntimeError(f"the {kind} worker did not start (said {line!r})")
    return process


def stop_worker(process: subprocess.Popen) -> str:
    process.terminate()
    out, _ = process.communicate(timeout=30)
    return out


def timed_generate(client: Any, tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    count, reason = 0, None
    for reply in client.generate(prompt=PROMPT, max_tokens=tokens, temperature=0.0):
        count += len(reply.tokens)
        reason = reply.finish_reason or reason
    return {"seconds": time.perf_counter() - started, "tokens": count, "finish_reason": reason}


def flood_phase(
    serve: Serve, client: Any, phase: str, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """--flood-repeats timed generates alone, beside the spin worker (control) or beside the
    flood worker; and for a flood, the worker's figures and the log's growth meanwhile."""
    worker = {"alone": None, "control": ("spin",), "flood": ("flood", serve.addr)}[phase]
    log_before = serve.log_size()
    process = start_worker(*worker) if worker else None
    try:
        runs = [timed_generate(client, args.flood_tokens) for _ in range(args.flood_repeats)]
    finally:
        out = stop_worker(process) if process else ""
    if phase != "flood":
        return runs, None
    flood = json.loads(out.strip().splitlines()[-1])
    flood["log_growth_bytes"] = serve.log_size() - log_before
    return runs, flood


def flood_met(flood_over_control: float | None, max_ratio: float) -> bool:
    return flood_over_control is not None and flood_over_control <= max_ratio


def scenario_flood(args: argparse.Namespace) -> dict[str, Any]:
    from rocforge_client import connect

    parameters = {
        "tokens": args.flood_tokens,
        "repeats": args.flood_repeats,
        "rounds": args.flood_rounds,
        "max_ratio": args.flood_max_ratio,
    }
    figures: dict[str, Any] = {}
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    floods: list[dict[str, Any]] = []
    generated: Counter[str] = Counter()
    with serving(args, "flood", figures, http=False) as (serve, _):
        log_start = serve.log_size()
        with connect(serve.addr, timeout=args.request_timeout) as client:
            timed_generate(client, args.flood_tokens)  # warm-up
            for _round in range(args.flood_rounds):
                for phase in PHASES:
                    runs, flood = flood_phase(serve, client, phase, args)
                    times[phase] += [round(run["seconds"], 4) for run in runs]
                    generated.update(f"{r['tokens']} tokens, {r['finish_reason']}" for r in runs)
                    if flood is not None:
                        floods.append(flood)
        figures["log_growth_bytes"] = serve.log_size() - log_start
    medians = {phase: median(values) for phase, values in times.items()}
    sent = sum(f["sent"] for f in floods)
    flood_seconds = sum(f["seconds"] for f in floods)
    replies = sum((Counter(f["replies"]) for f in floods), Counter())
    flood_over_control = ratio(medians["flood"], medians["control"])
    figures.update(
        times_s=times,
        generated=dict(generated),
        median_s={k: rounded(v) for k, v in medians.items()},
        flood_over_alone=rounded(ratio(medians["flood"], medians["alone"]), 3),
        control_over_alone=rounded(ratio(medians["control"], medians["alone"]), 3),
        flood_over_control=rounded(flood_over_control, 3),
        flood_sent=sent,
        flood_blocked=sum(f["blocked"] for f in floods),
        flood_send_rate_per_s=round(sent / flood_seconds, 1) if flood_seconds else None,
        flood_replies=dict(replies),
        flood_log_growth_bytes=sum(f["log_growth_bytes"] for f in floods),
    )
    met = flood_met(flood_over_control, args.flood_max_ratio)
    m = figures["median_s"]
    summary = (
        f"median s alone {m['alone']} control {m['control']} flood {m['flood']};"
        f" flood/control {figures['flood_over_control']}; {figures['flood_send_rate_per_s']}"
        f" msg/s, replies {dict(replies)}; log +{figures['flood_log_growth_bytes']} B"
    )
    bar = f"flood/control <= {args.flood_max_ratio:g}"
    return scenario_result(bar, parameters, figures, met, summary)


# --- sigterm ----------------------------------------------------------------------------------


def sigterm_met(
    trials: Sequence[dict[str, Any]],
    health: Sequence[dict[str, Any]],
    exit_limit_s: float,
    health_limit_s: float,
) -> bool:
    return (
        bool(trials)
        and all(t["exit_status"] == 0 and t["exit_s"] <= exit_limit_s for t in trials)
        and bool(health)
        and all(
            h["first_reply_s"] is not None and h["first_reply_s"] <= health_limit_s for h in health
        )
    )


def sigterm_trial(args: argparse.Namespace, delay: float) -> dict[str, Any]:
    """serve, SIGTERM `delay` s after Popen returned: exit status and seconds to exit."""
    serve = launch(args, "sigterm", http=False)
    time.sleep(delay)
    early = serve.process.poll()
    sent = time.monotonic()
    serve.process.send_signal(signal.SIGTERM)
    try:
        code = serve.process.wait(args.sigterm_wait_s)
        killed = False
    except subprocess.TimeoutExpired:
        serve.process.kill()
        code, killed = serve.process.wait(), True
    exit_s = time.monotonic() - sent
    return {
        "delay_s": delay,
        "exit_status": code,
        "exit_s": round(exit_s, 4),
        "killed": killed,
        "exited_before_signal": early is not None,
    }


def health_trial(args: argparse.Namespace) -> dict[str, Any]:
    """serve, its `health` polled over ZeroMQ from the start: first reply, then ready."""
    from rocforge_client import ClientError, Timeout, connect

    serve = launch(args, "sigterm-health", http=False)
    record: dict[str, Any] = {"first_reply_s": None, "first_state": None, "ready_s": None}
    states: list[str] = []
    limit = serve.started_at + args.ready_timeout
    try:
        with connect(serve.addr) as client:
            while time.monotonic() < limit and serve.process.poll() is None:
                try:
                    health = client.health(timeout=args.health_poll_s)
                except Timeout:
                    continue
                except ClientError as exc:  # an error reply: noted, asked again
                    record.setdefault("errors", []).append(exc.code)
                    time.sleep(args.health_poll_s)
                    continue
                seconds = round(time.monotonic() - serve.started_at, 4)
                if not states or states[-1] != health.get("state"):
                    states.append(health.get("state"))
                if record["first_reply_s"] is None:
                    record.update(first_reply_s=seconds, first_state=health.get("state"))
                if health.get("ready"):
                    record["ready_s"] = seconds
                    break
                time.sleep(args.health_poll_s)
    finally:
        stop = serve.stop(args.sigterm_wait_s)
    record.update(states=states, exit_status=stop["exit_status"], exit_s=stop["stop_s"])
    return record


def scenario_sigterm(args: argparse.Namespace) -> dict[str, Any]:
    parameters = {
        "delays_s": args.sigterm_delays,
        "trials": args.sigterm_trials,
        "exit_limit_s": args.sigterm_limit_s,
        "health_limit_s": args.health_limit_s,
        "health_poll_s": args.health_poll_s,
    }
    trials = [
        sigterm_trial(args, delay)
        for delay in args.sigterm_delays
        for _ in range(args.sigterm_trials)
    ]
    health = [health_trial(args) for _ in range(args.sigterm_trials)]
    figures = {"trials": trials, "health": health}
    met = sigterm_met(trials, health, args.sigterm_limit_s, args.health_limit_s)
    worst = max(trials, key=lambda t: t["exit_s"])
    codes = Counter(str(t["exit_status"]) for t in trials)
    firsts = [h["first_reply_s"] for h in health]
    summary = (
        f"exit statuses {dict(codes)}, slowest exit {worst['exit_s']:.2f} s (delay"
        f" {worst['delay_s']:g} s); first health at {firsts} s"
        f" ({', '.join(str(h['first_state']) for h in health)})"
    )
    bar = (
        f"every exit status 0 within {args.sigterm_limit_s:g} s of SIGTERM; health answered"
        f" within {args.health_limit_s:g} s of start"
    )
    return scenario_result(bar, parameters, figures, met, summary)


# --- slowloris --------------------------------------------------------------------------------


def limit_nofile() -> None:
    """preexec_fn: the serve process (and so its front) gets RLIMIT_NOFILE 1024."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (SERVE_NOFILE, SERVE_NOFILE))


def raise_own_nofile() -> tuple[int, int]:
    """This process's descriptor soft limit raised to its hard limit; (soft, hard) now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def slow_connections(host: str, port: int, count: int) -> tuple[list[socket.socket], Counter]:
    """`count` connections, each sending a request line and a Host line, then nothing."""
    sockets: list[socket.socket] = []
    failures: Counter[str] = Counter()
    for _ in range(count):
        try:
            sock = socket.create_connection((host, port), timeout=2)
            sock.sendall(SLOW_HEAD)
            sockets.append(sock)
        except OSError as exc:
            failures[type(exc).__name__] += 1
    return sockets, failures


def connection_state(sock: socket.socket) -> str:
    """A slow connection now: open, closed, reset, or answered (with its status line's code:
    "answered 408")."""
    sock.setblocking(False)  # in timeout mode, recv would wait for data first
    try:
        data = sock.recv(32, socket.MSG_PEEK)
    except BlockingIOError:
        return "open"
    except OSError:
        return "reset"
    return f"answered {status_of(data)}" if data else "closed"


def status_of(response_start: bytes) -> str:
    """The status code at the start of an HTTP/1.x response ("?" if it has none)."""
    parts = response_start.split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return parts[1].decode()
    return "?"


def timed_request(method: str, url: str, timeout: float, **kwargs: Any) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        response = httpx.request(method, url, timeout=timeout, **kwargs)
        record: dict[str, Any] = {"status": response.status_code}
    except httpx.HTTPError as exc:
        record = {"status": None, "error": repr(exc)}
    record["seconds"] = round(time.perf_counter() - started, 4)
    return record


def slowloris_met(
    health: dict[str, Any], completion: dict[str, Any], log_growth: int, limit_s: float
) -> bool:
    return (
        all(r["status"] == 200 and r["seconds"] <= limit_s for r in (health, completion))
        and log_growth < MAX_LOG_GROWTH_BYTES
    )


def scenario_slowloris(args: argparse.Namespace) -> dict[str, Any]:
    parameters = {
        "connections": args.slowloris_connections,
        "serve_nofile": SERVE_NOFILE,
        "limit_s": args.slowloris_limit_s,
        "hold_s": args.slowloris_hold_s,
    }
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    bar = f"/health and a completion 200 within {args.slowloris_limit_s:g} s; log growth < 1 MB"
    if hard < SLOWLORIS_MIN_HARD_NOFILE or soft < args.slowloris_connections + 200:
        reason = (
            f"skipped: this process's descriptor limit is {soft} (hard {hard}); the scenario"
            f" needs a hard limit of {SLOWLORIS_MIN_HARD_NOFILE} (ulimit -Hn)"
        )
        return scenario_result(bar, parameters, {"skipped": reason}, None, reason)
    figures: dict[str, Any] = {"client_nofile": [soft, hard]}
    with serving(args, "slowloris", figures, preexec_fn=limit_nofile) as (serve, model_id):
        front = find_front(serve.process.pid)
        figures["front_pid"] = front
        log_before = serve.log_size()
        host, port = serve.base_url.removeprefix("http://").rsplit(":", 1)
        started = time.perf_counter()
        sockets, failures = slow_connections(host, int(port), args.slowloris_connections)
        try:
            figures.update(
                opened=len(sockets),
                open_failures=dict(failures),
                open_s=round(time.perf_counter() - started, 3),
                front_fds=len(os.listdir(f"/proc/{front}/fd")) if front else None,
            )
            figures["health"] = timed_request("GET", f"{serve.base_url}/health", 30)
            body = {"model": model_id, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
            figures["completion"] = timed_request(
                "POST", f"{serve.base_url}/v1/completions", 30, json=body
            )
            figures["slow_connections_after"] = dict(Counter(map(connection_state, sockets)))
            time.sleep(args.slowloris_hold_s)  # past the front's head timeout, say
            figures["slow_connections_after_hold"] = dict(Counter(map(connection_state, sockets)))
            figures["log_growth_bytes"] = serve.log_size() - log_before
        finally:
            for sock in sockets:
                sock.close()
    met = slowloris_met(
        figures["health"],
        figures["completion"],
        figures["log_growth_bytes"],
        args.slowloris_limit_s,
    )
    h, c = figures["health"], figures["completion"]
    summary = (
        f"opened {figures['opened']}; /health {h['status']} in {h['seconds']:.3f} s;"
        f" completion {c['status']} in {c['seconds']:.3f} s; slow ones then"
        f" {figures['slow_connections_after']}, after {args.slowloris_hold_s:g} s"
        f" {figures['slow_connections_after_hold']}; log +{figures['log_growth_bytes']} B"
    )
    return scenario_result(bar, parameters, figures, met, summary)


# --- origin -----------------------------------------------------------------------------------


def origin_met(host_status: int | None, media_status: int | None) -> bool:
    return host_status in (400, 421) and media_status == 415


def scenario_origin(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with serving(args, "origin", figures) as (serve, model_id):
        host = httpx.get(
            f"{serve.base_url}/v1/models", headers={"Host": "evil.example"}, timeout=30
        )
        body = json.dumps({"model": model_id, "prompt": "Hi", "max_tokens": 1})
        media = httpx.post(
            f"{serve.base_url}/v1/completions",
            content=body.encode(),
            headers={"Content-Type": "text/plain"},
            timeout=30,
        )
        figures.update(
            foreign_host={"status": host.status_code, "error_code": error_code(host)},
            text_plain={"status": media.status_code, "error_code": error_code(media)},
        )
    met = origin_met(host.status_code, media.status_code)
    summary = f"Host evil.example: {host.status_code}; text/plain JSON: {media.status_code}"
    return scenario_result("foreign Host 400 or 421; text/plain 415", {}, figures, met, summary)


# --- the run ----------------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "oversized": scenario_oversized,
    "surrogates": scenario_surrogates,
    "flood": scenario_flood,
    "sigterm": scenario_sigterm,
    "slowloris": scenario_slowloris,
    "origin": scenario_origin,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    names = ", ".join(SCENARIOS)
    add(
        "--only",
        nargs="+",
        choices=list(SCENARIOS),
        default=list(SCENARIOS),
        metavar="NAME",
        help=f"the scenarios to run, of {names} (default: all)",
    )
    add(
        "--out",
        type=Path,
        metavar="PATH",
        help="the JSON report (default: docs/bench/hardening-<date>.json)",
    )
    add(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="the serve logs, a file per scenario (default: a new temporary folder)",
    )
    add(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        metavar="GGUF",
        help="the model serve loads (default: %(default)s)",
    )
    add(
        "--rocforge",
        metavar="CMD",
        help="the serve command's prefix, e.g. an installed wheel's `rocforge` console script"
        " (default: this Python's -m rocforge_rt, the checkout on PYTHONPATH)",
    )
    add("--ctx-size", type=int, default=512, metavar="N", help="serve's (default: %(default)s)")
    add("--max-sessions", type=int, default=4, metavar="N", help="serve's (default: %(default)s)")
    add("--serve-args", default="", metavar="ARGS", help="more serve options, one string")
    add(
        "--ready-timeout",
        type=float,
        default=180.0,
        metavar="S",
        help="the longest wait for serve to be ready (default: %(default)s)",
    )
    add(
        "--request-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="the longest wait for one HTTP or ZeroMQ request (default: %(default)s)",
    )
    add(
        "--stream-tokens",
        type=int,
        default=128,
        metavar="N",
        help="oversized: tokens a stream (default: %(default)s)",
    )
    add(
        "--big-mib",
        type=float,
        nargs="+",
        default=[3.0, 1.5],
        metavar="MIB",
        help="oversized: the big bodies' prompt sizes (default: %(default)s)",
    )
    add(
        "--big-limit-s",
        type=float,
        default=1.0,
        metavar="S",
        help="oversized: the bar on a big one's response (default: %(default)s)",
    )
    add(
        "--surrogate-requests",
        type=int,
        default=60_000,
        metavar="N",
        help="surrogates: requests measured (default: %(default)s)",
    )
    add(
        "--surrogate-warmup",
        type=int,
        default=1000,
        metavar="N",
        help="surrogates: requests before the first RSS reading (default: %(default)s)",
    )
    add(
        "--surrogate-connections",
        type=int,
        default=4,
        metavar="N",
        help="surrogates: keep-alive connections, a thread each (default: %(default)s)",
    )
    add(
        "--flood-tokens",
        type=int,
        default=48,
        metavar="N",
        help="flood: tokens of the timed generate (default: %(default)s)",
    )
    add(
        "--flood-repeats",
        type=int,
        default=3,
        metavar="N",
        help="flood: timed generates a phase (default: %(default)s)",
    )
    add(
        "--flood-rounds",
        type=int,
        default=3,
        metavar="N",
        help="flood: rounds of alone, control, flood (default: %(default)s)",
    )
    add(
        "--flood-max-ratio",
        type=float,
        default=3.0,
        metavar="R",
        help="flood: the bar on flood/control (default: %(default)s)",
    )
    add(
        "--sigterm-delays",
        type=float,
        nargs="+",
        default=[0.05, 0.3, 1.0, 2.0, 3.0],
        metavar="S",
        help="sigterm: delays from start to SIGTERM (default: %(default)s)",
    )
    add(
        "--sigterm-trials",
        type=int,
        default=3,
        metavar="N",
        help="sigterm: trials a delay, and health trials (default: %(default)s)",
    )
    add(
        "--sigterm-limit-s",
        type=float,
        default=2.0,
        metavar="S",
        help="sigterm: the bar on SIGTERM to exit (default: %(default)s)",
    )
    add(
        "--sigterm-wait-s",
        type=float,
        default=30.0,
        metavar="S",
        help="sigterm: SIGKILL past this (default: %(default)s)",
    )
    add(
        "--health-limit-s",
        type=float,
        default=1.0,
        metavar="S",
        help="sigterm: the bar on start to first health reply (default: %(default)s)",
    )
    add(
        "--health-poll-s",
        type=float,
        default=0.05,
        metavar="S",
        help="sigterm: a health attempt's wait (default: %(default)s)",
    )
    add(
        "--slowloris-connections",
        type=int,
        default=1100,
        metavar="N",
        help="slowloris: connections that never finish their head (default: %(default)s)",
    )
    add(
        "--slowloris-limit-s",
        type=float,
        default=2.0,
        metavar="S",
        help="slowloris: the bar on /health and the completion (default: %(default)s)",
    )
    add(
        "--slowloris-hold-s",
        type=float,
        default=12.0,
        metavar="S",
        help="slowloris: how long the connections stay open after (default: %(default)s)",
    )
    add("--worker", nargs="+", help=argparse.SUPPRESS)  # flood/spin processes: this script
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.out is None:
        args.out = ROOT / "docs" / "bench" / f"hardening-{datetime.now():%Y%m%d}.json"
    if args.log_dir is None:
        args.log_dir = Path(tempfile.mkdtemp(prefix="rocforge-hardening-"))
    args.only = [name for name in SCENARIOS if name in args.only]  # the docstring's order
    return args


def run_scenario(name: str, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[{datetime.now():%H:%M:%S}] {name} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        result = SCENARIOS[name](args)
    except Exception as exc:  # a scenario that could not run: recorded, the others go on
        result = {
            "error": f"{type(exc).__name__}: {exc}",
            "met": None,
            "summary": f"failed: {type(exc).__name__}: {exc}",
        }
    result["seconds"] = round(time.monotonic() - started, 1)
    result["log"] = str(Path(args.log_dir) / f"{name}.log")
    return result


def table(results: dict[str, dict[str, Any]]) -> str:
    width = max(len("scenario"), *map(len, results))
    lines = [f"{'scenario':<{width}}  met    figures"]
    for name, result in results.items():
        met = {True: "yes", False: "NO", None: "-"}[result["met"]]
        lines.append(f"{name:<{width}}  {met:<5}  {result['summary']}")
    return "\n".join(lines)


def report(
    args: argparse.Namespace, argv: Sequence[str], results: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor(),
        },
        "model": str(args.model),
        "command": [sys.executable, str(Path(__file__).resolve()), *argv],
        "serve_command": serve_command(args, "tcp://127.0.0.1:PORT", "127.0.0.1:HPORT"),
        "log_dir": str(args.log_dir),
        "met": {
            "met": sum(r["met"] is True for r in results.values()),
            "not_met": sum(r["met"] is False for r in results.values()),
            "not_measured": sum(r["met"] is None for r in results.values()),
        },
        "scenarios": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        if kind == "flood":
            flood_worker(*rest)
        else:
            spin_worker()
        return 0
    raise_own_nofile()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    results = {name: run_scenario(name, args) for name in args.only}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report(args, argv, results), indent=2) + "\n")
    print(table(results))
    print(f"wrote {args.out} (logs in {args.log_dir})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
