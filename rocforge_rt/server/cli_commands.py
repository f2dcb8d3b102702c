"""The `rocforge` subcommands of the serving half: serve (with `--http`, the HTTP front as a
child process: front_process.py), client, trace, keys, demo; and the options the CLI's
commands share (the prompt and sampling, the models and cache folders).

`add_server_commands(sub)` registers them on the CLI's subparsers. `LocalDaemon`
runs a daemon in a subprocess on a free loopback port (the demo and
scripts/bench_ttft.py use it).
"""

import argparse
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rocforge_rt.backends import BACKEND_NAMES
from rocforge_rt.dirs import CACHE_ENV, MODELS_ENV, cache_dir, models_dir, point_numba_cache
from rocforge_rt.engine.engine import DEFAULT_PREFILL_CHUNK
from rocforge_rt.errors import RocforgeError, UsageError
from rocforge_rt.profiling.latency import distribution
from rocforge_rt.server.command_line import positive_int
from rocforge_rt.server.config import (
    DEFAULT_BIND,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_QUEUE_TIME_S,
    DEFAULT_MAX_REFUSALS_PER_CLIENT,
    DaemonConfig,
    ServerError,
)
from rocforge_rt.server.front_process import FrontProcess, connect_address, front_command
from rocforge_rt.server.logs import add_log_options, configure_logging
from rocforge_rt.server.security import API_KEY_ENV, check_http_listen
from rocforge_rt.step.kv_format import KV_DTYPES

DEFAULT_ADDR = "tcp://127.0.0.1:5555"
REPLY_TIMEOUT_S = 60.0  # a generation's reply can wait for a long prefill
HEALTH_TIMEOUT_S = 5.0  # the socket thread answers health at once, even while loading
DEMO_PROMPT = "Write one sentence about the sea."
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '123456', '512M', '8GiB', '1.5G' (K, M, G, T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 8GiB, 1048576)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "_kmgt".index(unit.lower() or "_"))


def _default_model(path: str | None) -> Path:
    from rocforge_rt.model.default_model import ensure_default_model

    return Path(path) if path else ensure_default_model()


# --- serve ------------------------------------------------------------------------------------
def _cmd_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    _serve(args)
    return 0


def _serve(args: argparse.Namespace) -> None:
    from rocforge_rt.server.daemon import Daemon

    config = DaemonConfig(
        model=_default_model(args.model),
        backend=args.backend,
        bind=args.bind,
        ctx_size=args.ctx_size,
        max_sessions=args.max_sessions,
        kv_dtype=args.kv_cache_dtype,
        memory_limit=args.gpu_memory_limit,
        threads=args.threads,
        idle_timeout_s=args.idle_timeout,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        max_request_bytes=args.max_request_bytes,
        prefill_chunk=args.prefill_chunk,
        batch_invariant=args.batch_invariant,
        pipelined_decode=not args.no_pipelined_decode,
        curve_keys=Path(args.curve_keys) if args.curve_keys else None,
        max_sessions_per_client=args.max_sessions_per_client,
        operator_key=args.operator_key,
        max_queue=args.max_queue,
        max_queue_time_s=args.max_queue_time,
        max_refusals_per_client=args.max_refusals_per_client,
    )
    api_key = args.http_api_key or os.environ.get(API_KEY_ENV) or None
    if args.http is not None:
        check_http_listen(args.http, api_key, "--http-api-key")  # before the model loads
    daemon = Daemon(config)
    front = None
    try:  # a SIGTERM before `run` installs its handler still closes the daemon (Terminated)
        if args.http is not None:
            front = FrontProcess(
                front_command(_front_args(args, connect_address(daemon.endpoint))),
                where=f"http://{args.http}",
                env={**os.environ, API_KEY_ENV: api_key} if api_key else None,
            )
            front.start_when_ready(daemon.wait_ready)
        daemon.run(before_close=front.stop if front is not None else None)
    finally:
        if front is not None:
            front.stop()  # a no-op once the daemon stopped it
        daemon.close()  # likewise


def _front_args(args: argparse.Namespace, daemon: str) -> list[str]:
    """The HTTP front's options for `serve --http` (the API key goes in its environment)."""
    front = ["--daemon", daemon, "--listen", args.http, "--exit-with-parent"]
    if args.curve_keys:
        front += ["--curve-keys", args.curve_keys]
    if args.http_model_name:
        front += ["--model-name", args.http_model_name]
    if args.http_allowed_hosts is not None:
        front += ["--allowed-hosts", args.http_allowed_hosts]
    if args.http_cors_origins:
        front += ["--cors-origins", args.http_cors_origins]
    if args.http_max_connections is not None:
        front += ["--max-connections", str(args.http_max_connections)]
    return [*front, "--log-level", args.log_level, "--log-format", args.log_format]


# --- client -----------------------------------------------------------------------------------
class ClientCommandError(RocforgeError):
    """A client command failed: the daemon's error reply, or no reply in time."""


def _client(args: argparse.Namespace) -> Any:
    from rocforge_client import connect

    return connect(args.addr, curve_keys=args.curve_keys, timeout=args.timeout)


def _reporting_client_errors(command: Callable[[argparse.Namespace], int]) -> Callable:
    """A client command whose client errors become the CLI's: a malformed --addr a usage
    error, any other (the daemon's error, a timeout) a ClientCommandError."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from rocforge_client import BadAddress, ClientError

        try:
            return command(args)
        except BadAddress as exc:
            raise UsageError(str(exc)) from None
        except ClientError as exc:
            raise ClientCommandError(str(exc)) from None

    return run


@_reporting_client_errors
def _cmd_client_generate(args: argparse.Namespace) -> int:
    turn: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        **sampling_options(args),
        "stop": args.stop or None,
    }
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        turn["messages"] = [*system, {"role": "user", "content": args.prompt}]
    else:
        turn["prompt"] = args.prompt
    with _client(args) as client:
        result = stream_generation(client, turn, sys.stdout)
    print(format_generation(result), file=sys.stderr)
    return 0


def stream_generation(client: Any, turn: dict[str, Any], out: Any) -> dict[str, Any]:
    """Run one streamed generation, writing its text to `out`; client-side timings (ms)."""
    sent = time.perf_counter()
    arrivals, last = [], None
    for reply in client.generate(**turn):
        arrivals.append(time.perf_counter())
        out.write(reply.text)
        out.flush()
        last = reply
    out.write("\n")
    gaps = [(b - a) * 1000.0 for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "finish_reason": last.finish_reason,
        "usage": last.usage,
        "server_timings": last.timings,
        "ttft_ms": (arrivals[0] - sent) * 1000.0,
        "itl_ms": distribution(gaps),
        "e2e_ms": (arrivals[-1] - sent) * 1000.0,
    }


def format_generation(result: dict[str, Any]) -> str:
    usage, itl = result["usage"], result["itl_ms"]
    server = result["server_timings"]
    return (
        f"finish_reason={result['finish_reason']} prompt_tokens={usage.get('prompt_tokens')}"
        f" completion_tokens={usage.get('completion_tokens')}\n"
        f"TTFT {result['ttft_ms']:.1f} ms (daemon: {server.get('ttft_ms', 0.0):.1f} ms)"
        f" | inter-token mean {itl['mean']:.1f} ms, p50 {itl['p50']:.1f}, p99 {itl['p99']:.1f}"
        f" | end-to-end {result['e2e_ms']:.1f} ms"
    )


@_reporting_client_errors
def _cmd_client_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats(reset=args.reset, records=args.records, operator_key=args.operator_key)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


@_reporting_client_errors
def _cmd_client_health(args: argparse.Namespace) -> int:
    from rocforge_client import ClientError, Timeout

    with _client(args) as client:
        try:
            health = client.health()
        except Timeout:
            raise ClientError(
                f"no daemon at {args.addr}: no reply to health within {args.timeout:g} s"
                " (start one with `rocforge serve`, or pass --addr)"
            ) from None
    print(json.dumps(health))
    return 0 if health["ready"] else 1


@_reporting_client_errors
def _cmd_client_metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.metrics(), end="")
    return 0


@_reporting_client_errors
def _cmd_client_trace(args: argparse.Namespace) -> int:
    with _client(args) as client:
        trace = client.trace(steps=args.steps, operator_key=args.operator_key)
    Path(args.output).write_text(json.dumps(trace))
    print(f"wrote {args.output}: open it in https://ui.perfetto.dev", file=sys.stderr)
    return 0


@_reporting_client_errors
def _cmd_client_profile(args: argparse.Namespace) -> int:
    switch = {"on": True, "off": False, None: None}
    with _client(args) as client:
        state = client.profile(
            launches=switch[args.launches],
            kernels=switch[args.kernels],
            every=args.every,
            operator_key=args.operator_key,
        )
    print(json.dumps(state))
    return 0 if state["available"] else 1


def format_stats(stats: dict[str, Any]) -> str:
    """The stats endpoint as a text report: latency, steps, op table, KV use, queue, hints."""
    lines = [f"{'latency (ms)':<16}{'n':>6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    latency = stats["latency"]
    rows = (("queue wait", "wait_ms"), ("TTFT", "ttft_ms"), ("inter-token", "itl_ms"),
            ("end-to-end", "e2e_ms"))  # fmt: skip
    for label, key in rows:
        if key not in latency:  # a daemon from before the queue
            continue
        d = latency[key]
        lines.append(
            f"  {label:<14}{d['n']:>6}{d['mean']:>10.2f}{d['p50']:>10.2f}{d['p90']:>10.2f}"
            f"{d['p99']:>10.2f}"
        )
    overhead = stats["overhead"]
    for kind, s in overhead["steps"].items():
        loop = (
            ""
            if s["loop_ms"] is None
            else f", loop {s['loop_ms']:.2f} ms/step ({s['loop_host_us_per_step']:.0f} us"
            " outside Engine.step)"
        )
        lines.append(
            f"{kind} steps: {s['steps']}, mean {s['mean_ms']:.2f} ms, batch {s['mean_batch']:.2f},"
            f" {s['ops_per_step']:.0f} ops/step, host outside ops {s['other_host_us_per_step']:.0f}"
            f" us/step, {s['host_us_per_token']:.0f} us/token{loop}"
        )
    lines.append(
        f"{'op (host time)':<24}{'calls':>9}{'mean us':>11}{'max us':>11}"
        f"{'total ms':>11}{'share':>8}"
    )
    for op in overhead["ops"]:
        lines.append(
            f"  {op['op']:<22}{op['calls']:>9}{op['mean_us']:>11.1f}{op['max_us']:>11.1f}"
            f"{op['total_ms']:>11.1f}{op['share']:>8.1%}"
        )
    kv, sessions = stats["kv"], stats["sessions"]
    lines.append(
        f"sessions: {sessions['open']}/{sessions['max']} open, {sessions['generating']} generating;"
        f" KV: {kv['tokens_cached']} tokens cached, {kv['bytes_used'] / 2**20:.1f} of"
        f" {kv['pool_bytes'] / 2**20:.1f} MiB ({kv['use']:.1%})"
    )
    if "queue" in stats:
        lines.append(format_queue(stats["queue"]))
    if "runtime" in stats:
        lines.extend(_runtime_lines(stats["runtime"]))
    advice = [
        a for a in stats["recommendations"] if a["action"] != "no_action" or a["scope"] == "step"
    ]
    quiet = len(stats["recommendations"]) - len(advice)
    lines.append("recommendations:" + (f" ({quiet} kernels: no action)" if quiet else ""))
    lines.extend(f"  - [{a['action']}] {a['message']}" for a in advice)
    return "\n".join(lines)


def format_queue(queue: dict[str, Any]) -> str:
    """The queue of requests waiting for a session slot, on one line."""
    limit = queue["max_queue_time_s"]
    return (
        f"queue: {queue['waiting']} waiting for a session slot (peak {queue['peak_waiting']}),"
        f" at most {queue['max_queue']} (--max-queue), each for at most"
        + (f" {limit:g} s (--max-queue-time)" if limit > 0 else " any time (--max-queue-time 0)")
    )


def _runtime_lines(runtime: dict[str, Any]) -> list[str]:
    """The GPU runtime's scalars on one line, then its per-kernel table."""
    scalars = {k: v for k, v in runtime.items() if not isinstance(v, dict)}
    lines = ["runtime: " + ", ".join(f"{k}={_short(v)}" for k, v in scalars.items())]
    gpu = runtime.get("gpu_time", {})
    if gpu.get("timed_steps"):
        replay = gpu["graph_replay_us_mean"] if gpu["timed_replays"] else None
        lines.append(
            f"GPU time ({gpu['timed_steps']} timed steps): busy {gpu['gpu_busy_us_per_step']:.0f}"
            f" us/step, gaps {gpu['gpu_gaps_us_per_step']:.0f} us/step"
            + (f", graph replay {replay:.0f} us" if replay is not None else "")
        )
    kernels = runtime.get("kernels", {})
    if kernels:
        lines.append(
            f"{'kernel':<30}{'launch us':>11}{'std':>8}{'GPU us':>9}{'calls/step':>12}"
            f"{'arg hits':>10}{'misses':>8}"
        )
    nan = float("nan")
    for name, row in kernels.items():
        lines.append(
            f"  {name:<28}{row.get('host_us_mean', nan):>11.2f}{row.get('host_us_std', nan):>8.2f}"
            f"{row.get('gpu_us_mean', nan):>9.2f}{row.get('calls_per_step', nan):>12.1f}"
            f"{row.get('arg_cache_hits', 0):>10}{row.get('arg_cache_misses', 0):>8}"
        )
    return lines


def _short(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


# --- keys -------------------------------------------------------------------------------------
def _cmd_keys(args: argparse.Namespace) -> int:
    from rocforge_rt.server.security import generate_keys

    paths = generate_keys(Path(args.dir))
    print(
        f"server key pair: {paths.server_secret} (keep it on the daemon's machine)\n"
        f"client key pair: {paths.client_secret} (give it and {paths.server_public} to a client)\n"
        f"authorized clients: {paths.authorized_dir}\n"
        f"serve with: rocforge serve --curve-keys {args.dir} --bind tcp://0.0.0.0:5555\n"
        f"connect with: rocforge client health --curve-keys {args.dir} --addr tcp://HOST:5555"
    )
    return 0


# --- demo -------------------------------------------------------------------------------------
def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(addr: str, process: subprocess.Popen, timeout: float) -> None:
    """Ask the daemon `process` serves at `addr` for `health` until it is ready; ServerError
    when the process exits first or `timeout` passes."""
    from rocforge_client import Timeout, connect

    limit = time.monotonic() + timeout
    with connect(addr) as client:
        while time.monotonic() < limit:
            if process.poll() is not None:
                raise ServerError(f"the daemon exited with code {process.returncode}")
            try:
                if client.health(timeout=0.5)["ready"]:
                    return
            except Timeout:
                continue
            time.sleep(0.1)
    raise ServerError(f"the daemon was not ready within {timeout:.0f} s")


class LocalDaemon:
    """`rocforge serve` in a subprocess on a free loopback port; stopped with SIGTERM."""

    def __init__(
        self, model: Path, serve_args: Sequence[str] = (), *, ready_timeout: float = 300.0
    ):
        self.addr = f"tcp://127.0.0.1:{free_loopback_port()}"
        self.command = [
            sys.executable,
            "-m",
            "rocforge_rt.cli",
            "serve",
            "--model",
            str(model),
            "--bind",
            self.addr,
            *serve_args,
        ]
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LocalDaemon":
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.stop()

    def start(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this checkout
        path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
        self.process = subprocess.Popen(self.command, env={**os.environ, "PYTHONPATH": path})
        try:
            wait_until_ready(self.addr, self.process, self.ready_timeout)
        except ServerError:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, and return the exit code (SIGKILL after `timeout`)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _cmd_demo(args: argparse.Namespace) -> int:
    from rocforge_client import connect

    model = _default_model(args.model)
    serve_args = [
        "--backend",
        args.backend,
        "--ctx-size",
        "1024",
        "--max-sessions",
        "2",
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        "--log-level",
        "warning",
    ]
    print(f"starting the daemon on {model.name} ...", file=sys.stderr)
    with LocalDaemon(model, serve_args) as daemon:
        with connect(daemon.addr) as client:
            turn = {
                "messages": [{"role": "user", "content": args.prompt}],
                "max_tokens": args.max_tokens,
            }
            result = stream_generation(client, turn, sys.stdout)
            stats = client.stats()
        code = daemon.stop()
    print(format_generation(result), file=sys.stderr)
    print(format_stats(stats), file=sys.stderr)
    if code != 0:
        raise ServerError(f"the daemon exited with code {code} after SIGTERM (expected 0)")
    print("daemon stopped cleanly (SIGTERM, exit code 0)", file=sys.stderr)
    return 0


# --- registration -----------------------------------------------------------------------------
def prompt_argument(text: str) -> str:
    """--prompt: the text, or all of stdin for `-`."""
    return sys.stdin.read() if text == "-" else text


def prompt_file(path: str) -> str:
    """--prompt-file: the file's text (UTF-8), as it is."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    """Prompt, chat and sampling options shared by `generate` and `client generate`."""
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", type=prompt_argument, metavar="TEXT", help="the prompt; - reads it from stdin"
    )
    prompt.add_argument(
        "--prompt-file",
        dest="prompt",
        type=prompt_file,
        metavar="PATH",
        help="read the prompt from a file (UTF-8, as it is)",
    )
    parser.add_argument("--chat", action="store_true", help="render the prompt as a chat turn")
    parser.add_argument(
        "--system", metavar="TEXT", help="system message for --chat (default: none)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, metavar="N", help="tokens to generate at most"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0: all)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="sample within this probability mass (1: all)"
    )
    # llama.cpp's, as rocforge_rt/step/sampling.py says
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="0 to 1: tokens less likely than MIN_P times the best one are out (0: off)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 0: on each of the last 64 tokens of the context (1: off)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="-2 to 2: times each token's count in the last 64 (0: off)",
    )
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="-2 to 2: once for each token in the last 64 (0: off)",
    )
    parser.add_argument(
        "--seed", type=int, metavar="N", help="sampling seed (default: a random one)"
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop at this text (repeatable) (default: none)",
    )


SAMPLING_OPTIONS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options of add_generation_options, by the names SamplingParams and the
    protocol's turn fields share."""
    return {name: getattr(args, name) for name in SAMPLING_OPTIONS}


def add_location_options(parser: argparse.ArgumentParser, *, models: bool = True) -> None:
    """--models-dir (where `models` is true) and --cache-dir; `export_locations` applies them."""
    if models:
        parser.add_argument(
            "--models-dir",
            metavar="DIR",
            help=f"the models folder, where the default model is built (default: {models_dir()};"
            f" ${MODELS_ENV} where set)",
        )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the cache folder: compiled kernels, numba's cache, downloads outside a checkout"
        f" (default: {cache_dir()}; ${CACHE_ENV} where set)",
    )


def export_locations(args: argparse.Namespace) -> None:
    """Put --models-dir and --cache-dir in the environment (ROCFORGE_MODELS_DIR,
    ROCFORGE_CACHE_DIR and numba's NUMBA_CACHE_DIR, unless the user set it) before the
    command runs, so that everything it loads or starts (numba, a daemon) uses them."""
    for option, variable in (("models_dir", MODELS_ENV), ("cache_dir", CACHE_ENV)):
        folder = getattr(args, option, None)
        if folder:
            os.environ[variable] = str(Path(folder).absolute())
    point_numba_cache()


def _client_options(parser: argparse.ArgumentParser, timeout: float = REPLY_TIMEOUT_S) -> None:
    parser.add_argument(
        "--addr", default=DEFAULT_ADDR, metavar="ENDPOINT", help="the daemon's ZeroMQ address"
    )
    parser.add_argument(
        "--curve-keys",
        metavar="DIR",
        help="folder with client.key_secret and server.key (default: none, plaintext)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=timeout,
        metavar="SECONDS",
        help="the longest wait for each reply",
    )


def _operator_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--operator-key",
        metavar="KEY",
        help="the daemon's --operator-key, needed beyond loopback (default: none)",
    )


def _add_trace_command(sub: Any) -> None:
    trace = sub.add_parser("trace", help="write a Chrome/Perfetto trace of recent steps")
    _client_options(trace)
    _operator_option(trace)
    trace.add_argument(
        "--steps", type=int, metavar="N", help="how many recent steps (default: all it keeps)"
    )
    trace.add_argument(
        "--output", default="rocforge-trace.json", metavar="PATH", help="the trace file to write"
    )
    trace.set_defaults(func=_cmd_client_trace)


BATCH_INVARIANT_HELP = (
    "GPU: a token's logits identical alone, batched or in a prompt chunk (prompt chunks on"
    " the int8 GEMM instead of cuBLAS/hipBLAS in fp16: slower prompts)"
)


THREADS_HELP = "CPU backend threads (default: the physical cores); other backends ignore it"
MODEL_HELP = "GGUF path (default: the SmolLM2 Q4_0 default model, built on first use)"
BACKEND_HELP = "auto: a GPU if any, else cpu"
KV_CACHE_DTYPE_HELP = (
    "the KV cache's elements: f16, or fp8 (E4M3, as vLLM's fp8: half the KV memory, lossy)"
)


def add_kv_cache_dtype_option(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype: the KV pool's format (step/kv_format.py), f16 by default."""
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_DTYPES, default="f16", help=KV_CACHE_DTYPE_HELP
    )


SERVE_DESCRIPTION = f"""\
Run the ZeroMQ daemon (and, with --http, the OpenAI-compatible HTTP API beside it).

Each option may come from the environment instead: ROCFORGE_<OPTION>, the option's
name in capitals with - as _ (--ctx-size: ROCFORGE_CTX_SIZE; a switch takes 1 or 0).
An option on the command line wins. The HTTP API's key is ${API_KEY_ENV}."""


def add_server_commands(sub: Any) -> None:
    """Register serve, client, trace, keys and demo on the `rocforge` subparsers."""
    serve = sub.add_parser(
        "serve",
        help="run the ZeroMQ daemon (options also from ROCFORGE_* variables)",
        description=SERVE_DESCRIPTION,
        environment=True,
        environment_skip=("http_api_key",),  # ROCFORGE_API_KEY, as `rocforge http`'s
    )
    serve.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    serve.add_argument("--backend", choices=BACKEND_NAMES, default="auto", help=BACKEND_HELP)
    serve.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="ENDPOINT",
        help="ZeroMQ endpoint (beyond loopback: --curve-keys)",
    )
    serve.add_argument("--ctx-size", type=int, default=2048, metavar="N", help="tokens per session")
    serve.add_argument(
        "--max-sessions", type=int, default=4, metavar="N", help="sessions (KV slots)"
    )
    add_kv_cache_dtype_option(serve)
    serve.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)
    serve.add_argument(
        "--gpu-memory-limit",
        type=parse_size,
        metavar="SIZE",
        help="weights + KV pool budget, e.g. 8GiB (default: device memory; CPU: host RAM)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="seconds before an unused session is closed",
    )
    serve.add_argument(
        "--max-prompt-tokens",
        type=int,
        metavar="N",
        help="per turn (default: the context size - 1)",
    )
    serve.add_argument(
        "--max-new-tokens", type=int, metavar="N", help="per turn (default: the context size)"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=1 << 20,
        metavar="SIZE",
        help="the largest request message, e.g. 1MiB",
    )
    serve.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        metavar="N",
        help="prompt tokens per forward pass",
    )
    serve.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    serve.add_argument(
        "--no-pipelined-decode",
        action="store_true",
        help="GPU: read each decode step back before issuing the next (for A/B runs)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        metavar="N",
        help="requests (open, one-shot generate) that wait, first come first served, for a"
        " session slot when every one is in use; past N they get `busy`; 0: no queue, busy at"
        f" once (default: {DEFAULT_MAX_QUEUE})",
    )
    serve.add_argument(
        "--max-queue-time",
        type=float,
        default=DEFAULT_MAX_QUEUE_TIME_S,
        metavar="SECONDS",
        help="the longest a request waits for a session slot, then it gets `busy`; 0: no limit"
        f" (default: {DEFAULT_MAX_QUEUE_TIME_S:g})",
    )
    serve.add_argument(
        "--curve-keys",
        metavar="DIR",
        help="folder made by `rocforge keys`, needed off loopback (default: none, plaintext)",
    )
    serve.add_argument(
        "--max-sessions-per-client",
        type=int,
        metavar="N",
        help="sessions one client (routing id; with CURVE, client key) may hold or be opening"
        " (default: --max-sessions)",
    )
    serve.add_argument(
        "--max-refusals-per-client",
        type=int,
        default=DEFAULT_MAX_REFUSALS_PER_CLIENT,
        metavar="N",
        help="malformed or unknown-session requests a client may send a second before its"
        " messages are dropped for the rest of that second (0: no limit)",
    )
    serve.add_argument(
        "--operator-key",
        metavar="KEY",
        help="needed by stats --reset, trace and profile when bound beyond loopback"
        " (default: none: refused there)",
    )
    serve.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API there (a child process, started once"
        " the daemon is ready; beyond loopback it needs --http-api-key) (default: off)",
    )
    serve.add_argument(
        "--http-api-key",
        metavar="KEY",
        help=f"the HTTP API's key: `Authorization: Bearer KEY` (default: ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--http-model-name",
        metavar="NAME",
        help="the model's id in the HTTP API (default: the GGUF file name's stem)",
    )
    serve.add_argument(
        "--http-allowed-hosts",
        metavar="HOSTS",
        help="the Host names the HTTP API serves, comma-separated (`*`: any); others get 421"
        " (default: on loopback its names, on 0.0.0.0 or [::] any, else the --http host)",
    )
    serve.add_argument(
        "--http-cors-origins",
        metavar="ORIGINS",
        help="the origins browsers may call the HTTP API from, comma-separated (`*`: any)"
        " (default: none, no CORS headers)",
    )
    serve.add_argument(
        "--http-max-connections",
        type=positive_int,
        metavar="N",
        help="the HTTP API's open connections at most; past it the oldest one still sending"
        " its request head is closed (default: 1000, fewer under a low descriptor limit)",
    )
    add_log_options(serve)
    add_location_options(serve)
    serve.set_defaults(func=_cmd_serve)

    client = sub.add_parser("client", help="talk to a running daemon")
    client_sub = client.add_subparsers(
        dest="client_command", required=True, title="commands", metavar="COMMAND"
    )
    gen = client_sub.add_parser("generate", help="stream a generation to stdout")
    _client_options(gen)
    add_generation_options(gen)
    gen.set_defaults(func=_cmd_client_generate)
    stats = client_sub.add_parser("stats", help="latency, op overhead table, KV use")
    _client_options(stats)
    _operator_option(stats)
    stats.add_argument("--reset", action="store_true", help="clear the records after reading")
    stats.add_argument(
        "--records", type=int, default=0, metavar="N", help="include the last N requests"
    )
    stats.add_argument("--json", action="store_true", help="raw JSON instead of a table")
    stats.set_defaults(func=_cmd_client_stats)
    health = client_sub.add_parser("health", help="live/ready (exit 0 when ready)")
    _client_options(health, timeout=HEALTH_TIMEOUT_S)
    health.set_defaults(func=_cmd_client_health)
    metrics = client_sub.add_parser("metrics", help="Prometheus metrics, in the text format")
    _client_options(metrics)
    metrics.set_defaults(func=_cmd_client_metrics)
    _add_trace_command(client_sub)
    profile = client_sub.add_parser(
        "profile", help="switch the launch tracker and the kernel timer (GPU backends)"
    )
    _client_options(profile)
    _operator_option(profile)
    profile.add_argument(
        "--launches", choices=("on", "off"), help="per-launch host times (default: unchanged)"
    )
    profile.add_argument(
        "--kernels", choices=("on", "off"), help="GPU time of sampled steps (default: unchanged)"
    )
    profile.add_argument(
        "--every",
        type=int,
        metavar="N",
        help="the kernel timer times one step in N (default: unchanged)",
    )
    profile.set_defaults(func=_cmd_client_profile)

    _add_trace_command(sub)  # `rocforge trace`, the same as `rocforge client trace`

    keys = sub.add_parser("keys", help="make CURVE keys for a daemon and a client")
    keys.add_argument("dir", help="folder to write the keys into")
    keys.set_defaults(func=_cmd_keys)

    demo = sub.add_parser(
        "demo", help="start a daemon on the default model, stream a chat reply, print stats"
    )
    demo.add_argument("--model", metavar="PATH", help=MODEL_HELP)
    demo.add_argument(
        "--prompt",
        type=prompt_argument,
        default=DEMO_PROMPT,
        metavar="TEXT",
        help="the user's message; - reads it from stdin",
    )
    demo.add_argument(
        "--max-tokens", type=int, default=48, metavar="N", help="tokens to generate at most"
    )
    demo.add_argument("--backend", choices=BACKEND_NAMES, default="auto", help=BACKEND_HELP)
    add_kv_cache_dtype_option(demo)
    add_location_options(demo)
    demo.set_defaults(func=_cmd_demo)
