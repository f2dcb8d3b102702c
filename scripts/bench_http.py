#!/usr/bin/env python3
"""What the OpenAI-compatible HTTP front costs: the same streams through the ZeroMQ client and
through the front, in turn, against one daemon.

For each stream count S in --streams, --rounds rounds each of two halves, in turn: S
generations started together through the ZeroMQ protocol (bench_serve's driver: a socket
per stream, one thread polling them all), then the same S through the front's
`/v1/completions` with `stream: true` (one HTTP connection per stream, asyncio), each of
the same --prompt-tokens token ids (a different prompt per stream) and --max-tokens new
tokens, greedy. A token's arrival is a reply (ZeroMQ) or an event (HTTP) that carries text;
on a model with a vocabulary those are one a token, bar a token that only completes a
character later (a model without one sends no text, so only ZeroMQ can be timed on it).

Per path and stream count: inter-token latency (the gaps of all S streams) p50 and p99,
TTFT p50 and the decode tokens/s (bench_serve's definition), medians over the rounds; and
the HTTP / ZeroMQ ratios of the ITL and TTFT medians. JSON and a PNG (ITL p50 and p99 of
each path against the stream count) to --out, a line per stream count to stderr.

    python scripts/bench_http.py --spawn-daemon models/smollm2-135m-instruct-q4_0.gguf \\
        --backend cuda --streams 8 --rounds 5
    python scripts/bench_http.py --addr tcp://127.0.0.1:5555 --http http://127.0.0.1:8000 ...
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from bench_harness import positive_ints
from bench_serve import StreamFailed, drive_streams, summarize
from bench_ttft import against_daemon, token_prompt, write_report

from rocforge_client import ClientError, connect
from rocforge_rt.cli.local_daemon import free_loopback_port
from rocforge_rt.server.config import ServerError

PATHS = ("zeromq", "http")
FRONT_START_S = 60.0  # a spawned daemon's front answers /health by then


async def http_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """One streamed completion; its figures in bench_serve's Stream.result shape."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, int] = {}
    reason = None
    async with client.stream("POST", url, json=body, timeout=timeout) as response:
        if response.status_code != 200:
            raise StreamFailed(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise StreamFailed(f"the stream failed: {event['error']}")
            for choice in event["choices"]:
                if choice["text"]:
                    arrivals.append(time.perf_counter())
                reason = choice["finish_reason"] or reason
            usage = event.get("usage") or usage
    if not arrivals:
        raise StreamFailed("an HTTP stream carried no text (a model without a vocabulary?)")
    return {
        "ttft_ms": (arrivals[0] - sent) * 1000.0,
        "itl_ms": [(b - a) * 1000.0 for a, b in zip(arrivals, arrivals[1:], strict=False)],
        "e2e_ms": (arrivals[-1] - sent) * 1000.0,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", len(arrivals)),
        "finish_reason": reason,
        "sent_at": sent,
        "first_token_at": arrivals[0],
        "last_token_at": arrivals[-1],
        "arrivals": arrivals,
    }


async def http_round(
    base: str, model: str, prompts: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The prompts' completions streamed together, a connection each."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        bodies = [
            {"model": model, "prompt": p["tokens"], "max_tokens": args.max_tokens,
             "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            for p in prompts
        ]  # fmt: skip
        url = f"{base}/v1/completions"
        return await asyncio.gather(*(http_stream(client, url, b, args.timeout) for b in bodies))


def wait_for_front(base: str, timeout: float) -> str:
    """The front's model id, once its /health says the daemon is ready."""
    limit = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        if time.monotonic() >= limit:
            raise StreamFailed(f"the HTTP front at {base} was not ready within {timeout:g} s")
        time.sleep(0.2)


def benchmark(addr: str, args: argparse.Namespace) -> dict[str, Any]:
    model = wait_for_front(args.http, FRONT_START_S)
    with connect(addr, curve_keys=args.curve_keys, timeout=args.timeout) as client:
        info = client.info()
    n_vocab = info["model"]["n_vocab"]
    runs = []
    for streams in args.streams:
        prompts = [token_prompt(args.prompt_tokens, i, n_vocab) for i in range(streams)]
        drive_streams(addr, args, prompts, min(args.max_tokens, 8))  # warm-up, both paths
        asyncio.run(http_round(args.http, model, prompts, args))
        rounds: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
        for _ in range(args.rounds):
            rounds["zeromq"].append(summarize(drive_streams(addr, args, prompts, args.max_tokens)))
            rounds["http"].append(summarize(asyncio.run(http_round(args.http, model, prompts,
                                                                   args))))  # fmt: skip
        run = {"streams": streams, **{path: medians(rounds[path]) for path in PATHS}}
        run["ratios"] = {
            key: run["http"][key] / run["zeromq"][key]
            for key in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms")
            if run["zeromq"][key]
        }
        run["rounds"] = rounds
        runs.append(run)
        print(line(run), file=sys.stderr, flush=True)
    return {"daemon_info": info, "http": args.http, "model_id": model, "runs": runs}


def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over rounds of each round's ITL p50/p99, TTFT p50 and decode tokens/s."""
    figures = {
        "itl_p50_ms": [r["itl_ms"]["p50"] for r in rounds],
        "itl_p99_ms": [r["itl_ms"]["p99"] for r in rounds],
        "ttft_p50_ms": [r["ttft_ms"]["p50"] for r in rounds],
        "decode_tokens_per_s": [r["decode_tokens_per_s"] or 0.0 for r in rounds],
    }
    return {key: statistics.median(values) for key, values in figures.items()}


def line(run: dict[str, Any]) -> str:
    z, h, ratio = run["zeromq"], run["http"], run["ratios"]
    return (
        f"streams {run['streams']:>3}: ITL p50 {z['itl_p50_ms']:.2f} -> {h['itl_p50_ms']:.2f} ms"
        f" (x{ratio.get('itl_p50_ms', float('nan')):.3f}), p99 {z['itl_p99_ms']:.2f} ->"
        f" {h['itl_p99_ms']:.2f} ms | TTFT p50 {z['ttft_p50_ms']:.1f} -> {h['ttft_p50_ms']:.1f} ms"
        f" | decode {z['decode_tokens_per_s']:,.1f} -> {h['decode_tokens_per_s']:,.1f} tok/s"
        " (ZeroMQ -> HTTP)"
    )


def plot(report: dict[str, Any], path: Path) -> None:
    """ITL p50 (solid) and p99 (dashed) of each path against the number of streams."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    streams = [r["streams"] for r in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    for path_name, color in zip(PATHS, ("tab:blue", "tab:orange"), strict=True):
        for key, style in (("itl_p50_ms", "-"), ("itl_p99_ms", "--")):
            ax.plot(streams, [r[path_name][key] for r in runs], style, color=color, marker="o",
                    label=f"{path_name} {key.split('_')[1]}")  # fmt: skip
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title(f"ZeroMQ client vs HTTP front ({report['daemon_info']['backend']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--addr", help="a running daemon (with --http, its front)")
    target.add_argument(
        "--spawn-daemon", metavar="MODEL", help="start `rocforge serve --http` on this GGUF"
    )
    parser.add_argument("--http", help="with --addr: the front's base URL")
    parser.add_argument("--backend", default="auto", help="for --spawn-daemon")
    parser.add_argument(
        "--streams", type=positive_ints, default=positive_ints("8"), help="(default 8)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=128, help="per stream")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each path, in turn")
    parser.add_argument("--curve-keys", help="client keys folder (remote daemons)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per reply")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON")
    args = parser.parse_args()
    if args.prompt_tokens < 1 or args.max_tokens < 2 or args.rounds < 1:
        parser.error("--prompt-tokens and --rounds must be >= 1, --max-tokens >= 2")
    if args.addr and not args.http:
        parser.error("--addr needs --http, the front's base URL")
    args.ctx_size = args.prompt_tokens + args.max_tokens + 1
    serve_args: list[str] = []
    if args.spawn_daemon:
        port = free_loopback_port()
        args.http = f"http://127.0.0.1:{port}"
        serve_args = ["--http", f"127.0.0.1:{port}"]
    started = datetime.now(UTC)
    try:
        report = against_daemon(
            args, benchmark, max_sessions=max(args.streams), serve_args=serve_args
        )
    except (StreamFailed, ClientError, ServerError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write_report(started, args, report, "bench_http", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
