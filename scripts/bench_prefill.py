#!/usr/bin/env python3
"""Prompt (prefill) throughput per model, with the GPU time of each forward op.

For each model: prompt tokens/s of a --n-prompt prompt (median of --repeats, after a
warm-up), measured as scripts/bench_decode.py does; with --baseline also through the
decode GEMV path (GpuBackend.use_prefill_gemm = False) for an A/B in one process; and
a breakdown of one prefill into forward ops timed with device events (an op's time
includes any gap while the host was still launching it). Results go to --out as JSON.

example: python scripts/bench_prefill.py models/llama-1b.gguf --baseline
"""

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.workloads import prompt_tokens_per_s

GEMM_OPS = ("norm_qkv_rope", "matmul_add", "norm_gate_up_swiglu")  # QKV's time has RoPE's
TIMED_OPS = ("embed", *GEMM_OPS, "attention", "lm_head")


class EventTimedOps:
    """Stands in for engine.ops: brackets each op call with device events on the stream."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.marks: list[tuple[str, Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name not in TIMED_OPS:
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            driver, stream = self._backend.driver, self._backend.stream
            start, end = driver.create_event(), driver.create_event()
            start.record(stream)
            result = attr(*args, **kwargs)
            end.record(stream)
            self.marks.append((name, start, end))
            return result

        return timed

    def totals_ms(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for name, start, end in self.marks:
            end.synchronize()
            totals[name] += start.elapsed_ms(end)
        return dict(totals)


def breakdown(engine: Engine, n_prompt: int, rng: np.random.Generator) -> dict[str, float]:
    timed = EventTimedOps(engine.backend)
    engine.ops = timed
    try:
        start = time.perf_counter()
        prompt_tokens_per_s(engine, n_prompt, rng)
        wall_ms = (time.perf_counter() - start) * 1e3
    finally:
        engine.ops = engine.backend
    totals = timed.totals_ms()
    totals["gemm_total"] = sum(totals.get(op, 0.0) for op in GEMM_OPS)
    totals["wall"] = wall_ms
    return totals


def layer_gemm_flops(engine: Engine, n_tokens: int) -> float:
    """Multiply-adds x 2 of the layer matmuls for n_tokens rows."""
    hp = engine.hparams
    qkv = hp.q_dim + hp.kv_dim_k + hp.kv_dim_v
    per_token = hp.n_embd * qkv + hp.n_head * hp.head_dim_v * hp.n_embd + 3 * hp.n_embd * hp.n_ff
    return 2.0 * per_token * hp.n_layer * n_tokens


def bench_model(path: str, args: argparse.Namespace) -> dict[str, object]:
    engine = Engine.load(path, backend=args.backend, n_ctx=args.n_prompt + 16)
    rng = np.random.default_rng(0)
    prompt_tokens_per_s(engine, 64, rng)  # warm-up: compile, first touches, handles
    prompt_tokens_per_s(engine, args.n_prompt, rng)
    runs = [prompt_tokens_per_s(engine, args.n_prompt, rng) for _ in range(args.repeats)]
    result: dict[str, object] = {
        "device": engine.backend.device_info(),
        "prefill_chunk": engine.prefill_chunk,
        "prompt_tokens_per_s": statistics.median(runs),
        "prompt_runs": runs,
    }
    ops = breakdown(engine, args.n_prompt, rng) if hasattr(engine.backend, "driver") else {}
    result["breakdown_ms"] = ops
    gemm_ms = ops.get("gemm_total", float("nan"))
    result["gemm_tflops"] = layer_gemm_flops(engine, args.n_prompt) / gemm_ms / 1e9
    line = (
        f"{Path(path).name:>24}: prompt {result['prompt_tokens_per_s']:10.1f} tok/s"
        f" | gemm {gemm_ms:7.2f} ms ({result['gemm_tflops']:.0f} TOPS)"
        f" attention {ops.get('attention', 0.0):6.2f} ms"
        f" lm_head {ops.get('lm_head', 0.0):5.2f} | wall {ops.get('wall', 0.0):7.2f} ms"
    )
    if args.baseline and hasattr(engine.backend, "use_prefill_gemm"):
        engine.backend.use_prefill_gemm = False
        base = [prompt_tokens_per_s(engine, args.n_prompt, rng) for _ in range(args.repeats)]
        engine.backend.use_prefill_gemm = True
        result["gemv_path_prompt_tokens_per_s"] = statistics.median(base)
        line += f" | GEMV path {statistics.median(base):8.1f} tok/s"
    print(line, file=sys.stderr, flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", action="store_true", help="also time the GEMV path")
    parser.add_argument("--out", default="bench-results/prefill.json")
    args = parser.parse_args()
    report = {"n_prompt": args.n_prompt, "models": {}}
    for path in args.models:
        report["models"][path] = bench_model(path, args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
