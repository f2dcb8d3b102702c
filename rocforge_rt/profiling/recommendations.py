"""Recommendations per step and per kernel, derived from measured figures.

Inputs: the op timer's snapshot (host time of each forward op, per step kind)
and, on a GPU backend, its `runtime_stats()`: syncs and launches per step, graph
replay, and the per-kernel table (host launch statistics while the launch
tracker is on, argument-cache counters, GPU time from the kernel timer's
sampled steps). Each recommendation names its scope (`step` or `kernel`), its
target, an `action`, the `metric` it rests on with its `value`, and a message.

Actions and the thresholds they use (also in the README):
- `defer_sync` (step): more than SYNCS_PER_STEP_MAX host-blocking syncs per step.
- `use_graph_replay` (step): not in graph mode, at least GRAPH_MIN_LAUNCHES launches
  per step, and launches take at least LAUNCH_BOUND_SHARE of the step's wall time
  (or the launch tracker is off, so the share is unknown).
- `keep_args_stable` (step): argument-cache hit rate under ARG_CACHE_MIN_HIT_RATE
  over at least ARG_CACHE_MIN_LOOKUPS lookups.
- `fuse_or_batch` (kernel): launched at least FUSE_MIN_CALLS_PER_STEP times per step
  with a mean GPU time under SMALL_KERNEL_GPU_US: each launch costs about as much
  as its work, in a graph too (a small kernel's fixed GPU cost: docs/performance.md).
- `check_launch_cost` (kernel): the launch tracker flagged high_overhead or
  high_variance (see launch_tracker.py) outside graph replay.
- `no_action` (kernel): none of the above.
"""

from collections.abc import Mapping
from typing import Any

SYNCS_PER_STEP_MAX = 1.0
GRAPH_MIN_LAUNCHES = 20
LAUNCH_BOUND_SHARE = 0.25
ARG_CACHE_MIN_HIT_RATE = 0.9
ARG_CACHE_MIN_LOOKUPS = 100
FUSE_MIN_CALLS_PER_STEP = 8
SMALL_KERNEL_GPU_US = 5.0
HOST_BUDGET_US_PER_TOKEN = 40.0  # host time left per token at 2x llama.cpp on SmolLM2
TOP_OP_SHARE = 0.5


def _advice(
    scope: str, target: str, action: str, metric: str, value: float, message: str
) -> dict[str, Any]:
    return {
        "scope": scope,
        "target": target,
        "action": action,
        "metric": metric,
        "value": value,
        "message": message,
    }


def step_recommendations(runtime: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Step-level advice from a GPU backend's runtime stats."""
    advice = []
    syncs = runtime.get("syncs_per_step", 0.0)
    if syncs > SYNCS_PER_STEP_MAX:
        advice.append(_advice(
            "step", "decode step", "defer_sync", "syncs_per_step", syncs,
            f"{syncs:.1f} syncs per step: defer synchronization to one per step (the "
            "`deferred` or `graph` step mode reads back only the sampled tokens)",
        ))  # fmt: skip
    launches = runtime.get("launches_per_step", 0.0)
    share = runtime.get("launch_overhead", {}).get("launch_share_of_step")
    tracked = runtime.get("launch_tracking", False) and share is not None
    launch_bound = not tracked or share >= LAUNCH_BOUND_SHARE
    if not runtime.get("graph_replay") and launches >= GRAPH_MIN_LAUNCHES and launch_bound:
        why = f", launches take {share:.0%} of the step" if tracked else ""
        advice.append(_advice(
            "step", "decode step", "use_graph_replay", "launches_per_step", launches,
            f"{launches:.0f} launches per step without graph replay{why}: capture the step "
            "into a graph and replay it (the `graph` step mode)",
        ))  # fmt: skip
    hits, misses = runtime.get("arg_cache_hits", 0), runtime.get("arg_cache_misses", 0)
    if hits + misses >= ARG_CACHE_MIN_LOOKUPS and hits / (hits + misses) < ARG_CACHE_MIN_HIT_RATE:
        rate = hits / (hits + misses)
        advice.append(_advice(
            "step", "launch arguments", "keep_args_stable", "arg_cache_hit_rate", rate,
            f"arg-cache hit rate {rate:.0%}: arguments change between steps; keep per-step "
            "values in the device step-state buffer",
        ))  # fmt: skip
    return advice


def kernel_recommendations(runtime: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One piece of advice per kernel in the runtime's kernel table."""
    advice = []
    graph = bool(runtime.get("graph_replay"))
    for name, row in runtime.get("kernels", {}).items():
        calls = row.get("calls_per_step", 0.0)
        gpu_us = row.get("gpu_us_mean")
        flags = row.get("flags", [])
        if gpu_us is not None and calls >= FUSE_MIN_CALLS_PER_STEP and gpu_us < SMALL_KERNEL_GPU_US:
            advice.append(_advice(
                "kernel", name, "fuse_or_batch", "gpu_us_mean", gpu_us,
                f"{name}: {calls:.0f} launches per step of {gpu_us:.1f} us each: fuse it into "
                "a neighbour or batch its calls",
            ))  # fmt: skip
        elif flags and not graph:
            advice.append(_advice(
                "kernel", name, "check_launch_cost", "host_us_mean", row["host_us_mean"],
                f"{name}: launch cost {row['host_us_mean']:.1f} us mean, "
                f"{row['host_us_std']:.1f} us std ({', '.join(flags)}): look for host "
                "contention, or avoid the launch (graph replay)",
            ))  # fmt: skip
        else:
            advice.append(_advice(
                "kernel", name, "no_action", "gpu_us_mean", gpu_us or 0.0,
                f"{name}: no action",
            ))  # fmt: skip
    return advice


def recommend(overhead: Mapping[str, Any], runtime: Mapping[str, Any] | None) -> list[dict]:
    """Every recommendation: step-level first, then per kernel, then host-side notes."""
    advice: list[dict[str, Any]] = []
    if runtime is None:
        advice.append(_advice(
            "step", "backend", "no_action", "gpu", 0.0,
            "CPU backend: op times are numpy compute, not launch overhead; a GPU backend adds "
            "launch cost, arg-cache hits and syncs per step to these stats",
        ))  # fmt: skip
    else:
        advice += step_recommendations(runtime) + kernel_recommendations(runtime)
    decode = overhead.get("steps", {}).get("decode")
    if decode is None:
        advice.append(_advice(
            "step", "decode step", "no_action", "decode_steps", 0.0,
            "no decode steps recorded yet: run some requests, then ask again",
        ))  # fmt: skip
        return advice
    other = decode["other_host_us_per_step"] / max(decode["mean_batch"], 1.0)
    if runtime is None and other > HOST_BUDGET_US_PER_TOKEN:
        advice.append(_advice(
            "step", "host", "reduce_host_work", "other_host_us_per_token", other,
            f"{other:.0f} us of host time per token outside the ops (sampling, readback, "
            f"detokenization, replies) is over the ~{HOST_BUDGET_US_PER_TOKEN:.0f} us budget",
        ))  # fmt: skip
    table = overhead.get("ops", [])
    if table and table[0]["share"] >= TOP_OP_SHARE:
        top = table[0]
        advice.append(_advice(
            "step", top["op"], "optimize_op", "op_share", top["share"],
            f"op {top['op']!r} takes {top['share']:.0%} of op time: the first target for "
            "kernel work or fusion",
        ))  # fmt: skip
    return advice
