"""The daemon's stats as the text report `rocforge client stats` and `rocforge demo` print:
latency, steps, the op table, KV use, the queue, the GPU runtime and the recommendations."""

from typing import Any


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
