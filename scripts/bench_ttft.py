#!/usr/bin/env python3
"""TTFT, inter-token latency and throughput of a rocforge daemon, over real sockets.

For each prompt length and concurrency: --requests streamed generations of
--max-tokens tokens, --concurrency at a time (one client socket per worker),
after one warm-up request. Per request, measured by the client: TTFT (request
sent -> first token received), the gaps between tokens, end to end. Reported:
mean/p50/p90/p99 of each, requests/s and generated tokens/s, and the daemon's
own view from `stats` (its TTFT, decode batch sizes). Prompts are text when
the model has a vocabulary (words, ~1 token each: the real count is reported),
else token ids; the same prompts on every backend. Writes JSON and a PNG.

    python scripts/bench_ttft.py --spawn-daemon models/smollm2-135m-instruct-q4_0.gguf \\
        --backend cpu --requests 8 --concurrency 1,4 --prompt-lengths 16,128,512
    python scripts/bench_ttft.py --addr tcp://127.0.0.1:5555 ...   # a daemon already running
"""

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rocforge_client import Client, connect
from rocforge_rt.cli.local_daemon import LocalDaemon
from rocforge_rt.profiling.latency import distribution

# fmt: off
WORDS = (
    "the", "sea", "is", "wide", "and", "the", "wind", "is", "cold", "over", "grey", "water",
    "where", "ships", "sail", "past", "old", "harbours", "and", "light", "towers", "while",
    "birds", "call", "above", "the", "waves", "at", "the", "end", "of", "day",
)
# fmt: on


def token_prompt(length: int, index: int, n_vocab: int) -> dict[str, Any]:
    """Request fields of a prompt of exactly `length` token ids, varied by `index`."""
    return {"tokens": [(13 * index + 7 * i + 1) % n_vocab for i in range(length)]}


def prompt_for(length: int, index: int, info: dict[str, Any]) -> dict[str, Any]:
    """Request fields of a prompt of about `length` tokens, varied by `index`."""
    if info["model"]["tokenizer"]:
        words = [WORDS[(index + i) % len(WORDS)] for i in range(length)]
        return {"prompt": " ".join(words)}
    return token_prompt(length, index, info["model"]["n_vocab"])


def one_request(client: Client, fields: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """One streamed generation, timed by the client. The `*_at` fields are its
    time.perf_counter() seconds: request sent, first and last reply with tokens."""
    sent = time.perf_counter()
    arrivals, last = [], None
    for reply in client.generate(**fields, max_tokens=max_tokens):
        if reply.tokens:
            arrivals.append(time.perf_counter())
        last = reply
    return {
        "ttft_ms": (arrivals[0] - sent) * 1000.0,
        "itl_ms": [(b - a) * 1000.0 for a, b in zip(arrivals, arrivals[1:], strict=False)],
        "e2e_ms": (time.perf_counter() - sent) * 1000.0,
        "prompt_tokens": last.usage["prompt_tokens"],
        "completion_tokens": last.usage["completion_tokens"],
        "finish_reason": last.finish_reason,
        "sent_at": sent,
        "first_token_at": arrivals[0],
        "last_token_at": arrivals[-1],
    }


def daemon_view(server: dict[str, Any]) -> dict[str, Any]:
    """The daemon's own view of a run, from its `stats`: latencies and decode batching."""
    decode = server["overhead"]["steps"].get("decode", {})
    return {
        "ttft_ms": server["latency"]["ttft_ms"],
        "itl_ms": server["latency"]["itl_ms"],
        "decode_mean_batch": decode.get("mean_batch"),
        "decode_step_ms": decode.get("mean_ms"),
        "decode_loop_ms": decode.get("loop_ms"),  # the engine thread's iteration per decode step
        "decode_loop_host_us": decode.get("loop_host_us_per_step"),  # of which outside Engine.step
        "steps": server["overhead"]["steps"],
        "runtime": server.get("runtime"),
    }


def run_config(
    addr: str, curve_keys: str | None, info: dict[str, Any], args: argparse.Namespace,
    length: int, concurrency: int,
) -> dict[str, Any]:  # fmt: skip
    with connect(addr, curve_keys=curve_keys, timeout=args.timeout) as client:
        one_request(client, prompt_for(length, 0, info), args.max_tokens)  # warm-up
        client.stats(reset=True)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    next_index = iter(range(args.requests))

    def worker() -> None:
        with connect(addr, curve_keys=curve_keys, timeout=args.timeout) as client:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                result = one_request(client, prompt_for(length, index + 1, info), args.max_tokens)
                with lock:
                    results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    with connect(addr, curve_keys=curve_keys, timeout=args.timeout) as client:
        server = client.stats()
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "prompt_length": length,
        "prompt_tokens_mean": sum(r["prompt_tokens"] for r in results) / len(results),
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": tokens / wall,
        "completion_tokens": tokens,
        "ttft_ms": distribution(r["ttft_ms"] for r in results),
        "itl_ms": distribution(g for r in results for g in r["itl_ms"]),
        "e2e_ms": distribution(r["e2e_ms"] for r in results),
        "finish_reasons": sorted({r["finish_reason"] for r in results}),
        "daemon": daemon_view(server),
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("ttft_ms", "TTFT (ms)"), ("itl_ms", "inter-token latency (ms)"))
    for concurrency in sorted({r["concurrency"] for r in report["runs"]}):
        runs = [r for r in report["runs"] if r["concurrency"] == concurrency]
        x = [r["prompt_tokens_mean"] for r in runs]
        for ax, (key, label) in zip(axes, panels, strict=False):
            (line,) = ax.plot(x, [r[key]["p50"] for r in runs], "o-", label=f"c={concurrency} p50")
            ax.plot(x, [r[key]["p99"] for r in runs], "x--", color=line.get_color(),
                    label=f"c={concurrency} p99")  # fmt: skip
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(label)
        axes[2].plot(x, [r["tokens_per_s"] for r in runs], "o-", label=f"c={concurrency}")
    axes[2].set_xlabel("prompt tokens")
    axes[2].set_ylabel("generated tokens/s (all requests)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    info = report["daemon_info"]
    fig.suptitle(
        f"{info['model']['name']} on {info['backend']}: {report['config']['requests']} requests"
        f" x {report['config']['max_tokens']} tokens per point"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def benchmark(addr: str, args: argparse.Namespace) -> dict[str, Any]:
    with connect(addr, curve_keys=args.curve_keys, timeout=args.timeout) as client:
        info = client.info()
    runs = []
    for length in args.prompt_lengths:
        for concurrency in args.concurrency:
            run = run_config(addr, args.curve_keys, info, args, length, concurrency)
            runs.append(run)
            print(
                f"prompt {run['prompt_tokens_mean']:6.0f} tok  c={concurrency:<3}"
                f" TTFT p50 {run['ttft_ms']['p50']:8.1f} p99 {run['ttft_ms']['p99']:8.1f} ms"
                f" | ITL p50 {run['itl_ms']['p50']:6.1f} p99 {run['itl_ms']['p99']:6.1f} ms"
                f" | {run['requests_per_s']:6.2f} req/s {run['tokens_per_s']:7.1f} tok/s",
                file=sys.stderr,
            )
    return {"daemon_info": info, "runs": runs}


def against_daemon(
    args: argparse.Namespace,
    benchmark: Callable[[str, argparse.Namespace], dict[str, Any]],
    *,
    max_sessions: int,
    serve_args: Sequence[str] = (),
) -> dict[str, Any]:
    """benchmark(addr, args) against --addr, or a daemon spawned on --spawn-daemon with
    --backend, --ctx-size, `max_sessions` and `serve_args` (stopped afterwards)."""
    if not args.spawn_daemon:
        return benchmark(args.addr, args)
    serve_args = [
        "--backend", args.backend, "--ctx-size", str(args.ctx_size),
        "--max-sessions", str(max_sessions), "--log-level", "warning", *serve_args,
    ]  # fmt: skip
    with LocalDaemon(Path(args.spawn_daemon), serve_args) as daemon:
        report = benchmark(daemon.addr, args)
        if daemon.stop() != 0:
            print("warning: the daemon did not exit with code 0", file=sys.stderr)
    return report


def write_report(
    started: datetime,
    args: argparse.Namespace,
    report: dict[str, Any],
    name: str,
    plot: Callable[[dict[str, Any], Path], None],
) -> Path:
    """NAME-BACKEND-TIME.json (the run's config first) and .png (needs matplotlib) in --out."""
    config = {k: v for k, v in vars(args).items() if k != "curve_keys"}
    report = {"started": started.isoformat(), "config": config, **report}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{name}-{report['daemon_info']['backend']}-{started:%Y%m%dT%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(f"wrote {stem}.json", file=sys.stderr)
    try:
        plot(report, stem.with_suffix(".png"))
        print(f"wrote {stem}.png", file=sys.stderr)
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", file=sys.stderr)
    return stem.with_suffix(".json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--addr", help="a running daemon")
    target.add_argument("--spawn-daemon", metavar="MODEL", help="start a daemon on this GGUF")
    parser.add_argument("--backend", default="auto", help="for --spawn-daemon")
    parser.add_argument("--ctx-size", type=int, default=1024, help="for --spawn-daemon")
    parser.add_argument("--requests", type=int, default=8, help="per prompt length and concurrency")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated list")
    parser.add_argument("--prompt-lengths", default="16,128,512", help="comma-separated tokens")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--curve-keys", help="client keys folder (remote daemons)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per reply")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON and PNG")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.prompt_lengths = [int(n) for n in args.prompt_lengths.split(",")]

    started = datetime.now(UTC)
    report = against_daemon(args, benchmark, max_sessions=max(args.concurrency))
    write_report(started, args, report, "bench_ttft", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
