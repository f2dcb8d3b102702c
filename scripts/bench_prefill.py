#!/usr/bin/env python3
"""Prompt (prefill) time to first token against prompt length, beside llama.cpp's llama-bench.

For each model and each of --lengths L: the prefill of L random token ids in the engine's
chunks, up to and including the first sampled token (bench_harness.prompt_tokens_per_s,
llama-bench's pp), as TTFT ms and tokens/s, each the median of --repeats runs after a
warm-up at L. With --llamacpp PATH-TO-llama-bench, llama-bench (-p L -n 0 -fa 1) runs on
the same GGUF in the same run, interleaved: each round times ours at L, then one
llama-bench process at L (its warm-up, then --llamacpp-reps repetitions, 3 by default,
whose median is the round's figure: on an H100 a single repetition in a fresh process ran
1.5-2.4x slower at 512 tokens than warm ones), so drift hits both sides alike. Its
-ngl follows --backend (99 on a GPU, 0 on the CPU); --llamacpp-args adds arguments. ratio =
our tokens/s / llama.cpp's (its pp times the prompt's forward passes; ours also samples the
first token). On a GPU, also one prefill at each L broken into forward ops timed with
device events (an op's time includes any gap while the host was still launching it), and
with --baseline the decode GEMV path (an engine loaded with MatmulTuning.use_prefill_gemm
False) and with --invariant-ab the batch-invariant int8 GEMM (an engine loaded with
batch_invariant=True), each an A/B in one process: a second engine of the same model, timed
beside the first.

Results go to --out as JSON, a plot of TTFT against prompt length beside it (same stem,
.png; needs matplotlib) and a table to stderr. A length the model's context cannot hold
is skipped with a warning.

example:
  python scripts/bench_prefill.py models/llama-1b.gguf --lengths 128,512,2048,4096,8192 \\
      --llamacpp /tmp/peer/llama.cpp/build/bin/llama-bench
  python scripts/bench_prefill.py models/llama-1b.gguf --n-prompt 512 --baseline
"""

import argparse
import json
import shlex
import shutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_harness import (
    LlamaBenchError,
    llama_bench,
    positive_ints,
    prompt_tokens_per_s,
)

from rocforge_rt.backends.gpu.backend import GpuBackend
from rocforge_rt.backends.gpu.matmul_plan import MatmulTuning
from rocforge_rt.engine.engine import DEFAULT_PREFILL_CHUNK, Engine
from rocforge_rt.step.forward import BracketedOps

GEMM_OPS = ("norm_qkv_rope", "matmul_add", "norm_gate_up_swiglu")  # QKV's time has RoPE's
DEFAULT_LENGTHS = "128,512,2048,4096,8192"


class EventTimes:
    """Device events around each forward op on the backend's stream (a `BracketedOps`
    bracket)."""

    def __init__(self, backend: GpuBackend) -> None:
        self._backend = backend
        self.marks: list[tuple[str, Any, Any]] = []

    def bracket(self, name: str, call: Callable[[], Any]) -> Any:
        driver, stream = self._backend.driver, self._backend.stream
        start, end = driver.create_event(), driver.create_event()
        start.record(stream)
        result = call()
        end.record(stream)
        self.marks.append((name, start, end))
        return result

    def totals_ms(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for name, start, end in self.marks:
            end.synchronize()
            totals[name] += start.elapsed_ms(end)
        return dict(totals)


def breakdown(engine: Engine, n_prompt: int, rng: np.random.Generator) -> dict[str, float]:
    timed = EventTimes(engine.backend)
    engine.ops = BracketedOps(engine.backend, timed.bracket)
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


def summary(ttft_ms: list[float], tokens_per_s: list[float]) -> dict[str, Any]:
    return {
        "ttft_ms": statistics.median(ttft_ms),
        "tokens_per_s": statistics.median(tokens_per_s),
        "ttft_ms_runs": ttft_ms,
        "tokens_per_s_runs": tokens_per_s,
    }


def llama_bench_round(
    path: str, n_prompt: int, args: argparse.Namespace, n_gpu_layers: int
) -> tuple[tuple[float, float], Any]:
    """(TTFT ms, tokens/s) of one llama-bench pp test, the median of its --llamacpp-reps
    repetitions (in one process, as ours run in one warm process), and the run."""
    run = llama_bench(args.llamacpp, path, n_prompt=n_prompt, n_gen=0,
                      repetitions=args.llamacpp_reps,
                      n_gpu_layers=n_gpu_layers, extra_args=args.llamacpp_args)  # fmt: skip
    rows = [r for r in run.rows if r.get("n_prompt") == n_prompt and not r.get("n_gen")]
    if len(rows) != 1:
        raise LlamaBenchError(
            f"llama-bench {args.llamacpp!r} gave {len(rows)} pp{n_prompt} results, not 1"
            f" (do --llamacpp-args ask for more than one test?): {shlex.join(run.command)}"
        )
    (row,) = rows
    ns = statistics.median(map(float, row.get("samples_ns") or [row["avg_ns"]]))
    return (ns / 1e6, n_prompt * 1e9 / ns), run


@dataclass(frozen=True)
class AbEngines:
    """The engines of the same model an A/B times beside the default one (GPU backends);
    None where not asked for."""

    invariant: Engine | None = None  # --invariant-ab: batch invariant (the int8 GEMM)
    gemv_path: Engine | None = None  # --baseline: prompt chunks on the GEMV path


def bench_length(
    engine: Engine, path: str, n_prompt: int, args: argparse.Namespace, peer: dict[str, Any],
    ab: AbEngines,
) -> dict[str, Any]:  # fmt: skip
    """Ours at n_prompt (and each A/B engine's), then llama-bench at n_prompt, --repeats
    times; on a GPU the ops."""
    rng = np.random.default_rng(n_prompt)
    for warmed in (engine, ab.invariant):  # warm-up: compile, first touches, handles
        if warmed is not None:
            prompt_tokens_per_s(warmed, n_prompt, rng)
    ours: list[float] = []
    invariant: list[float] = []  # --invariant-ab: the same prompts, batch invariant
    theirs: list[tuple[float, float]] = []
    point: dict[str, Any] = {"length": n_prompt}
    for _ in range(args.repeats):
        ours.append(prompt_tokens_per_s(engine, n_prompt, rng))
        if ab.invariant is not None:
            invariant.append(prompt_tokens_per_s(ab.invariant, n_prompt, rng))
        if args.llamacpp:
            sample, run = llama_bench_round(path, n_prompt, args, peer["n_gpu_layers"])
            theirs.append(sample)
            point["llamacpp_command"] = shlex.join(run.command)
            peer.setdefault("build", run.build())
    point["ours"] = summary([n_prompt / tps * 1e3 for tps in ours], ours)
    line = (
        f"{Path(path).name:>24} {n_prompt:>6}: ours {point['ours']['tokens_per_s']:10.1f} tok/s"
        f" TTFT {point['ours']['ttft_ms']:9.2f} ms"
    )
    if invariant:
        point["batch_invariant"] = summary([n_prompt / tps * 1e3 for tps in invariant], invariant)
        line += f" | batch invariant {point['batch_invariant']['tokens_per_s']:10.1f} tok/s"
    if theirs:
        point["llamacpp"] = summary([t for t, _ in theirs], [s for _, s in theirs])
        point["ratio"] = point["ours"]["tokens_per_s"] / point["llamacpp"]["tokens_per_s"]
        line += (
            f" | llama.cpp {point['llamacpp']['tokens_per_s']:10.1f} tok/s"
            f" TTFT {point['llamacpp']['ttft_ms']:9.2f} ms | x{ratio_text(point['ratio'])}"
        )
    if isinstance(engine.backend, GpuBackend):
        ops = breakdown(engine, n_prompt, rng)
        point["breakdown_ms"] = ops
        gemm_ms = ops["gemm_total"] or float("nan")
        point["gemm_tflops"] = layer_gemm_flops(engine, n_prompt) / gemm_ms / 1e9
        line += (
            f" | gemm {ops['gemm_total']:7.2f} ms ({point['gemm_tflops']:.0f} TOPS)"
            f" attention {ops.get('attention', 0.0):6.2f} ms lm_head {ops.get('lm_head', 0.0):5.2f}"
        )
    if ab.gemv_path is not None:
        prompt_tokens_per_s(ab.gemv_path, n_prompt, rng)  # warm-up
        base = [prompt_tokens_per_s(ab.gemv_path, n_prompt, rng) for _ in range(args.repeats)]
        point["gemv_path_tokens_per_s"] = statistics.median(base)
        line += f" | GEMV path {point['gemv_path_tokens_per_s']:8.1f} tok/s"
    print(line, file=sys.stderr, flush=True)
    return point


def load(path: str, args: argparse.Namespace, **options: Any) -> Engine:
    """The model on --backend with room for the longest prompt, loaded with `options`."""
    return Engine.load(path, backend=args.backend, n_ctx=max(args.lengths) + 16,
                       prefill_chunk=args.prefill_chunk, **options)  # fmt: skip


def bench_model(path: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = load(path, args)
    ab = AbEngines()
    if isinstance(engine.backend, GpuBackend):
        ab = AbEngines(
            invariant=load(path, args, batch_invariant=True)
            if args.invariant_ab and not engine.backend.batch_invariant
            else None,
            gemv_path=load(path, args, matmul_tuning=MatmulTuning(use_prefill_gemm=False))
            if args.baseline
            else None,
        )
    skipped = [n for n in args.lengths if n >= engine.n_ctx]  # a turn leaves room for one more
    if skipped:
        print(f"warning: {Path(path).name}: context {engine.n_ctx} cannot hold a prompt of"
              f" {', '.join(map(str, skipped))} tokens: skipped", file=sys.stderr)  # fmt: skip
    result: dict[str, Any] = {
        "model": Path(path).name,
        "device": engine.backend.device_info(),
        "prefill_chunk": engine.prefill_chunk,
        "n_ctx": engine.n_ctx,
        "skipped_lengths": skipped,
    }
    peer: dict[str, Any] = {}
    if args.llamacpp:
        peer = {"binary": args.llamacpp, "n_gpu_layers": 0 if engine.backend.name == "cpu" else 99}
        result["llamacpp"] = peer
    result["points"] = [
        bench_length(engine, path, n, args, peer, ab) for n in args.lengths if n not in skipped
    ]
    return result


def ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def device_label(info: dict[str, Any]) -> str:
    if info.get("backend") == "cpu":
        return f"CPU ({info.get('threads')} threads)"
    return f"{info.get('device')} ({info.get('backend')})"


def table(report: dict[str, Any]) -> str:
    lines = []
    for result in report["models"].values():
        lines += [
            f"{result['model']} on {device_label(result['device'])}:",
            "| length | ours tok/s | llama.cpp tok/s | ratio | our TTFT ms | their TTFT ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in result["points"]:
            peer = p.get("llamacpp")
            theirs = (f"{peer['tokens_per_s']:,.1f}", ratio_text(p["ratio"]),
                      f"{peer['ttft_ms']:,.2f}") if peer else ("-", "-", "-")  # fmt: skip
            lines.append(
                f"| {p['length']} | {p['ours']['tokens_per_s']:,.1f} | {theirs[0]} | {theirs[1]}"
                f" | {p['ours']['ttft_ms']:,.2f} | {theirs[2]} |"
            )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """TTFT against prompt length (both log), ours beside llama.cpp, ratio at each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = list(report["models"].values())
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        points = result["points"]
        x = [p["length"] for p in points]
        ax.plot(x, [p["ours"]["ttft_ms"] for p in points], "o-", label="rocforge-rt")
        peer = [p for p in points if "llamacpp" in p]
        if peer:
            ax.plot([p["length"] for p in peer], [p["llamacpp"]["ttft_ms"] for p in peer],
                    "s--", label="llama.cpp (llama-bench pp)")  # fmt: skip
            for p in peer:
                ax.annotate(f"x{ratio_text(p['ratio'])}", (p["length"], p["ours"]["ttft_ms"]),
                            textcoords="offset points", xytext=(0, 9), ha="center",
                            fontsize=8)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.margins(x=0.08, y=0.12)  # room for the ratios
        if x:
            ax.set_xticks(x, [str(n) for n in x])
            ax.minorticks_off()
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{result['model']} on {device_label(result['device'])}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, title="x = our tok/s / llama.cpp's" if peer else None,
                  title_fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+")
    parser.add_argument("--backend", default="auto")
    lengths = parser.add_mutually_exclusive_group()
    lengths.add_argument(
        "--lengths",
        type=positive_ints,
        default=positive_ints(DEFAULT_LENGTHS),
        help=f"comma-separated prompt lengths (default {DEFAULT_LENGTHS})",
    )
    lengths.add_argument("--n-prompt", type=positive_ints, help="one prompt length: --lengths N")
    parser.add_argument("--repeats", type=int, default=5, help="runs per length and side")
    parser.add_argument("--baseline", action="store_true", help="also time the GEMV path")
    parser.add_argument(
        "--invariant-ab",
        action="store_true",
        help="GPU: also time each prompt batch invariant (the int8 GEMM), interleaved",
    )
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--llamacpp", help="path to llama-bench, to measure it in the same run")
    parser.add_argument(
        "--llamacpp-reps",
        type=int,
        default=3,
        help="llama-bench repetitions per round (one process; the round takes their median)",
    )
    parser.add_argument(
        "--llamacpp-args", default="", help="more llama-bench arguments: --llamacpp-args='-t 16'"
    )
    parser.add_argument("--out", default="bench-results/prefill.json", help="JSON (PNG beside)")
    args = parser.parse_args()
    if args.n_prompt is not None:
        args.lengths = args.n_prompt
    if args.repeats < 1 or args.llamacpp_reps < 1:
        parser.error("--repeats and --llamacpp-reps must be >= 1")
    args.llamacpp_args = shlex.split(args.llamacpp_args)
    if args.llamacpp and shutil.which(args.llamacpp) is None:
        parser.error(f"llama-bench {args.llamacpp!r} is not an executable file")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "lengths": args.lengths,
        "repeats": args.repeats,
        "backend": args.backend,
        "llamacpp": {"binary": args.llamacpp, "args": args.llamacpp_args}
        if args.llamacpp
        else None,
        "models": {},
    }
    status = 0
    for path in args.models:
        try:
            report["models"][path] = bench_model(path, args)
        except LlamaBenchError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
            break
        out.write_text(json.dumps(report, indent=2))
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    if report["models"]:
        print(table(report), file=sys.stderr)
        try:
            plot(report, out.with_suffix(".png"))
            print(f"wrote {out.with_suffix('.png')}", file=sys.stderr)
        except ImportError:
            print("matplotlib is not installed (pip install matplotlib): no plot", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
