#!/usr/bin/env python3
"""Where a decode step's time goes while its kernels overlap: a CUPTI timeline of graph decode.

The kernel timer (profiling/kernel_timer.py) runs a step's kernels one at a time, so it
cannot show what programmatic dependent launch hides: a kernel starts while its
predecessor still runs and waits for it inside. This script records the GPU's own
timeline instead (CUPTI, through PyTorch's profiler: a developer tool for GPU machines
that have PyTorch; the runtime does not use it) for --steps batch-1 decode steps after a
--depth-token prompt, in graph mode with pipelined decode (greedy, or with --sampled drawn as
bench_decode's sampled decode), and gives per kernel name:

  - launches a step;
  - its span: first block's start to last block's end (under overlap this includes the
    time its blocks wait for the kernel before);
  - its increment: its end minus the end of the kernel launched before it, the time it adds
    to the step's critical path. A step's increments add up to the step (its last kernel's
    end minus the end of the kernel before its first), so their sums say where it goes.

Medians over the steps. CUPTI costs time too (3-13% of the 1B shape's decode tokens/s on
an H200), so compare timelines with each other, not with bench_decode's figures.

    python3 scripts/decode_timeline.py MODEL --depth 4096 --out timeline-d4096.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from bench_harness import BENCH_SAMPLING, decode_tokens_per_s

from rocforge_rt.engine.engine import Engine
from rocforge_rt.step.kv_format import KV_DTYPES
from rocforge_rt.step.sampling import SamplingParams


@dataclass(frozen=True)
class KernelSpan:
    name: str
    start_us: float
    end_us: float


# The kernel a decode step of this runtime begins with: the token's embedding row.
STEP_FIRST_KERNEL = "rf_embed"


def decode_steps(
    spans: list[KernelSpan], first_kernel: str = STEP_FIRST_KERNEL
) -> list[list[KernelSpan]]:
    """The timeline's decode steps, in launch order: runs from one kernel whose name starts
    with `first_kernel` to the next, kept where their kernels are those of the most common
    run and so were the previous run's (a prompt's chunks, the step right after them, whose
    start waited for the host, and the partial runs at either end are not). The kernel
    launched before a step's first one comes first in its run, as the predecessor of its
    first kernel, so a run has one kernel more than its step."""
    spans = sorted(spans, key=lambda s: s.start_us)
    starts = [i for i, s in enumerate(spans) if s.name.startswith(first_kernel)]
    runs = [spans[max(a - 1, 0) : b] for a, b in zip(starts, starts[1:], strict=False)]
    kinds = Counter(tuple(s.name for s in run[1:]) for run in runs)
    if not kinds:
        return []
    content = kinds.most_common(1)[0][0]
    step = [tuple(s.name for s in run[1:]) == content for run in runs]
    return [run for i, run in enumerate(runs) if i > 0 and step[i] and step[i - 1]]


def critical_path(steps: list[list[KernelSpan]]) -> dict[str, object]:
    """Per kernel name over the steps (decode_steps' runs): launches a step, median span
    and median increment (us), increments summed a step (us); and the median step: its last
    kernel's end minus the end of the kernel before its first, the increments' sum."""
    spans: dict[str, list[float]] = defaultdict(list)
    increments: dict[str, list[float]] = defaultdict(list)
    for run in steps:
        for before, kernel in zip(run, run[1:], strict=False):
            spans[kernel.name].append(kernel.end_us - kernel.start_us)
            increments[kernel.name].append(kernel.end_us - before.end_us)
    n = len(steps)
    kernels = [
        {
            "name": name,
            "per_step": len(increments[name]) / n,
            "span_us": statistics.median(spans[name]),
            "increment_us": statistics.median(increments[name]),
            "increments_per_step_us": sum(increments[name]) / n,
        }
        for name in increments
    ]
    kernels.sort(key=lambda k: -k["increments_per_step_us"])
    step_us = [run[-1].end_us - run[0].end_us for run in steps]
    return {"steps": n, "step_us": statistics.median(step_us) if steps else 0.0, "kernels": kernels}


def cupti_kernels(
    engine: Engine, n_decode: int, depth: int, sampling: SamplingParams
) -> tuple[list[KernelSpan], float]:
    """The GPU kernels of `n_decode` decode steps after a `depth`-token prompt (and of its
    prefill), with the decode tokens/s measured meanwhile."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        raise SystemExit("error: the timeline is read through PyTorch's profiler (CUPTI): "
                         "install torch on this GPU machine") from None  # fmt: skip
    rng = np.random.default_rng(0)
    decode_tokens_per_s(engine, 8, rng, sampling, depth=depth)  # warm-up: compile, capture
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tokens_per_s = decode_tokens_per_s(engine, n_decode, rng, sampling, depth=depth)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    spans = [
        KernelSpan(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("cat") == "kernel"
    ]
    return spans, tokens_per_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--depth", type=int, default=0, help="prompt tokens before the decode")
    parser.add_argument("--steps", type=int, default=24, help="decode steps profiled")
    parser.add_argument(
        "--sampled", action="store_true",
        help="draw each token (the benchmarks' sampled decode: bench_harness.BENCH_SAMPLING) "
        "instead of greedy decode",
    )  # fmt: skip
    parser.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="f16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    engine = Engine.load(
        args.model, backend="cuda", n_ctx=max(args.depth, 1) + args.steps + 16, mode="graph",
        kv_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    sampling = BENCH_SAMPLING if args.sampled else SamplingParams()
    spans, tokens_per_s = cupti_kernels(engine, args.steps, args.depth, sampling)
    result = {"model": args.model, "depth": args.depth, "sampled": args.sampled,
              "kv_dtype": args.kv_cache_dtype,
              "tokens_per_s_profiled": tokens_per_s}  # fmt: skip
    result |= critical_path(decode_steps(spans))
    print(f"depth {args.depth}: {result['steps']} steps, {result['step_us']:.1f} us a step "
          f"({tokens_per_s:.1f} tok/s under the profiler)")  # fmt: skip
    print(f"{'kernel':40s} {'a step':>6s} {'span us':>8s} {'adds us':>8s} {'us a step':>10s}")
    for k in result["kernels"]:
        print(f"{k['name']:40s} {k['per_step']:6.1f} {k['span_us']:8.2f} "
              f"{k['increment_us']:8.2f} {k['increments_per_step_us']:10.1f}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
