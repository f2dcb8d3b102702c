"""`rocforge client` (generate, stats, health, metrics, trace, profile) and `rocforge trace`:
requests to a running daemon through the client library (rocforge_client)."""

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rocforge_rt.cli.options import add_generation_options, sampling_options
from rocforge_rt.cli.stats_report import format_stats
from rocforge_rt.errors import RocforgeError, UsageError
from rocforge_rt.profiling.latency import distribution

DEFAULT_ADDR = "tcp://127.0.0.1:5555"
REPLY_TIMEOUT_S = 60.0  # a generation's reply can wait for a long prefill
HEALTH_TIMEOUT_S = 5.0  # the socket thread answers health at once, even while loading


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


def add_client_commands(sub: Any) -> None:
    """Register `client` and `trace` (the same as `client trace`) on the `rocforge`
    subparsers."""
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
