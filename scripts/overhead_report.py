#!/usr/bin/env python3
"""Launch overhead A/B: decode in each step mode, argument cache on and off (GPU backends).

For every mode (per-kernel-sync, deferred, graph) and the argument cache on and
off, batch-1 greedy decode of --n-decode tokens runs twice: once with every
profiler off (tokens/s, the backend's host us of issue per step), once with the
launch tracker on and the kernel timer timing every --every-th step (CPU launch
overhead per step, syncs and launches per step, GPU-busy time per step, the
per-kernel table). GPU-busy share = GPU-busy us per step / wall us per token of
the clean run. The tracker's own cost is the clean run against a run with only
the tracker on (graph and deferred modes). Writes JSON and a PNG.

    python scripts/overhead_report.py models/smollm2-135m-instruct-q4_0.gguf
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_harness import decode_tokens_per_s

from rocforge_rt.backends.gpu.backend import GpuBackend
from rocforge_rt.backends.gpu.launch import set_arg_cache_enabled
from rocforge_rt.engine.engine import Engine

MODES = ("per-kernel-sync", "deferred", "graph")


def clean_run(engine: Engine, n_decode: int, rng: np.random.Generator) -> dict[str, float]:
    backend = engine.backend
    backend.reset_runtime_stats()
    tokens_per_s = decode_tokens_per_s(engine, n_decode, rng)
    runtime = backend.runtime_stats()
    return {"tokens_per_s": tokens_per_s, "host_issue_us_per_step": runtime["host_us_per_step"]}


def profiled_run(
    engine: Engine, n_decode: int, rng: np.random.Generator, *, timer_every: int | None
) -> dict[str, Any]:
    backend = engine.backend
    backend.reset_runtime_stats()
    backend.launch_tracker.enabled = True
    if timer_every:
        backend.kernel_timer.every = timer_every
        backend.kernel_timer.enabled = True
    try:
        tokens_per_s = decode_tokens_per_s(engine, n_decode, rng)
    finally:
        backend.launch_tracker.enabled = backend.kernel_timer.enabled = False
    return {"tokens_per_s": tokens_per_s, **backend.profile()}


def measure(engine: Engine, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    clean = clean_run(engine, args.n_decode, rng)
    profiled = profiled_run(engine, args.n_decode, rng, timer_every=args.every)
    launches, gpu = profiled["launch_overhead"], profiled["gpu_time"]
    wall_us = 1e6 / clean["tokens_per_s"]
    return {
        **clean,
        "wall_us_per_token": wall_us,
        "cpu_launch_us_per_step": launches["launch_us_per_step"],
        "launches_per_step": launches["launches_per_step"],
        "syncs_per_step": launches["syncs_per_step"],
        "kernels_per_step": sum(k.get("calls_per_step", 0) for k in profiled["kernels"].values()),
        "gpu_busy_us_per_step": gpu["gpu_busy_us_per_step"],
        "gpu_gaps_us_per_step_timed": gpu["gpu_gaps_us_per_step"],
        "gpu_busy_share": gpu["gpu_busy_us_per_step"] / wall_us,
        "graph_replay_gpu_us": gpu["graph_replay_us_mean"],
        "kernels": profiled["kernels"],
    }


def tracker_cost(engine: Engine, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    """Tokens/s and host issue us per step with the tracker off, on, off again."""
    off = clean_run(engine, args.n_decode, rng)
    on = profiled_run(engine, args.n_decode, rng, timer_every=None)
    on["host_issue_us_per_step"] = engine.backend.runtime_stats()["host_us_per_step"]
    off_again = clean_run(engine, args.n_decode, rng)
    keep = ("tokens_per_s", "host_issue_us_per_step")
    return {
        "off": {k: (off[k] + off_again[k]) / 2 for k in keep},
        "on": {k: on[k] for k in keep},
    }


def launch_cost_ns(backend: Any, launches: int = 30_000, per_step: int = 180) -> dict:
    """Host ns per launch of a near-empty kernel (an open gate), tracker off and on.

    Steps of `per_step` launches, as a decode step makes; the tracker's per-step
    folding is included. Off and on alternate in blocks, and each takes its median.
    """
    gate = backend.workspace.gate
    gate.view(np.uint32, 1)[0] = 1  # open: rf_hold returns at once
    handle = backend.launcher.new_handle("rf_hold", (1, 1, 1), (1, 1, 1))
    handle.set_args(gate.device_ptr, 1, 1)
    tracker = backend.launch_tracker
    samples: dict[bool, list[float]] = {False: [], True: []}
    for block in range(2 * launches // per_step):
        tracker.enabled = on = block % 2 == 1
        start = time.perf_counter_ns()
        tracker.begin_step(start)
        for _ in range(per_step):
            handle.launch()
        tracker.end_step(time.perf_counter_ns(), 0)
        samples[on].append((time.perf_counter_ns() - start) / per_step)
        backend.stream.synchronize()
    tracker.enabled = False
    tracker.reset()
    off, on = statistics.median(samples[False]), statistics.median(samples[True])
    return {"off_ns": off, "on_ns": on, "tracker_ns_per_launch": on - off}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["runs"]
    labels = [f"{r['mode']}\ncache {'on' if r['arg_cache'] else 'off'}" for r in rows]
    panels = (
        ("tokens_per_s", "decode tokens/s"),
        ("cpu_launch_us_per_step", "CPU launch us / step"),
        ("syncs_per_step", "syncs / step"),
        ("gpu_busy_share", "GPU-busy share of wall time"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.bar(range(len(rows)), [r[key] for r in rows], color="#4477aa")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"{Path(report['model']).name} on {report['device'].get('device', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--n-decode", type=int, default=128)
    parser.add_argument("--every", type=int, default=4, help="time every Nth step's kernels")
    parser.add_argument(
        "--mode", action="append", choices=MODES, help="step mode(s); all by default"
    )
    parser.add_argument("--out", default="bench-results/overhead.json")
    args = parser.parse_args()

    report: dict[str, Any] = {"model": args.model, "n_decode": args.n_decode, "runs": []}
    for mode in args.mode or MODES:
        engine = Engine.load(args.model, backend=args.backend, n_ctx=args.n_decode + 64, mode=mode)
        if not isinstance(engine.backend, GpuBackend):
            print("overhead_report: needs a GPU backend (cuda or hip)", file=sys.stderr)
            return 2
        report["device"] = engine.backend.device_info()
        rng = np.random.default_rng(0)
        decode_tokens_per_s(engine, 8, rng)  # warm-up: compile, capture, first touches
        for cache in (True, False):
            set_arg_cache_enabled(cache)
            try:
                run = {"mode": mode, "arg_cache": cache, **measure(engine, args, rng)}
            finally:
                set_arg_cache_enabled(True)
            report["runs"].append(run)
            print(
                f"{mode:>16} cache {'on ' if cache else 'off'}: {run['tokens_per_s']:8.1f} tok/s"
                f" | launch {run['cpu_launch_us_per_step']:7.1f} us/step"
                f" ({run['launches_per_step']:5.1f} launches, {run['syncs_per_step']:5.1f} syncs)"
                f" | issue {run['host_issue_us_per_step']:7.1f} us"
                f" | GPU busy {run['gpu_busy_us_per_step']:7.1f} us"
                f" = {run['gpu_busy_share']:.0%} of {run['wall_us_per_token']:.0f} us/token"
                + (f" | replay {run['graph_replay_gpu_us']:.0f} us" if mode == "graph" else ""),
                file=sys.stderr,
                flush=True,
            )
        if mode == "deferred":
            report["launch_cost"] = cost = launch_cost_ns(engine.backend)
            print(
                f"{'launch':>16}: {cost['off_ns']:.0f} ns tracker off, {cost['on_ns']:.0f} ns on"
                f" = {cost['tracker_ns_per_launch']:.0f} ns per launch for the tracker",
                file=sys.stderr,
            )
        if mode != "per-kernel-sync":
            report.setdefault("tracker_cost", {})[mode] = cost = tracker_cost(engine, args, rng)
            print(
                f"{mode:>16} tracker off/on: {cost['off']['tokens_per_s']:.1f} / "
                f"{cost['on']['tokens_per_s']:.1f} tok/s, issue "
                f"{cost['off']['host_issue_us_per_step']:.1f} / "
                f"{cost['on']['host_issue_us_per_step']:.1f} us/step",
                file=sys.stderr,
            )
        del engine
    table = next((r for r in report["runs"] if r["mode"] == "deferred"), report["runs"][0])
    kernels = table["kernels"]
    title = f"kernel ({table['mode']})"
    print(f"{title:<34}{'calls':>7}{'GPU us':>9}{'GPU us/step':>13}{'launch us':>11}",
          file=sys.stderr)  # fmt: skip
    for name, row in sorted(kernels.items(), key=lambda kv: -kv[1].get("gpu_us_per_step", 0)):
        print(
            f"{name:<34}{row.get('calls_per_step', 0):7.0f}{row.get('gpu_us_mean', 0):9.2f}"
            f"{row.get('gpu_us_per_step', 0):13.1f}{row.get('host_us_mean', 0):11.2f}",
            file=sys.stderr,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
