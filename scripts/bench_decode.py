#!/usr/bin/env python3
"""Decode and prompt throughput of one model, per step mode, optionally beside llama.cpp.

Decode tokens/s: greedy batch-1 generation of --n-decode tokens after a 1-token
prompt (llama-bench's tg128); the same sampled at temperature 0.8, top-k 40, top-p
0.95 (the device sampler's cost). Prompt tokens/s: prefill of --n-prompt tokens
(llama-bench's pp512). --depth D decodes after a D-token prompt instead (llama-bench
-d D); several depths (--depth 128,4096,8192, as llama-bench's -d) are timed on the same
engines in turn each round, and each mode's JSON gains `at_depth` (the decode figures of
every depth) and `depth_cost` (the fraction of decode tokens/s each later depth loses
against the first). Each engine is loaded and warmed up once; then --rounds rounds each time
--repeats runs of every figure on every engine and, with --llamacpp
PATH-TO-llama-bench, one llama-bench call on the same file (all layers on the GPU,
or none with --backend cpu), in turn. Figures are medians over all runs (llama-bench:
over its rounds' averages), and the ratios are printed. Results go to --out as JSON.
--kernels NAME=DIR (repeatable) loads each engine once more per kernel source tree (an
A/B of kernel changes in one run, the trees' engines timed in turn each round);
--matmul-lever ATTR=VALUE[,ATTR=VALUE...] (repeatable) one more per such setting of the GPU
backend's MatmulTuning, loaded with it (a launch heuristic's A/B, e.g.
gemv_max_blocks_per_sm=4; two at once: quantize_swiglu=0,gemv_early_release_blocks_per_sm=1);
--attention-lever likewise of its AttentionTuning (e.g. quantize_out=0); --kv-cache-dtype
(repeatable) one engine per KV pool format (default f16; fp8: llama-bench's nearest is
--llamacpp-args='-ctk q8_0 -ctv q8_0').
"""

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from bench_harness import (
    BENCH_SAMPLING,
    Levers,
    LlamaBenchError,
    LlamaBenchRun,
    decode_tokens_per_s,
    lever_label,
    lever_options,
    lever_settings,
    llama_bench,
    prompt_tokens_per_s,
)

from rocforge_rt.backends import resolve_backend_name
from rocforge_rt.engine.engine import Engine
from rocforge_rt.step.kv_format import KV_DTYPES

MODES = ("per-kernel-sync", "deferred", "graph")


def decode_step_stats(engine: Engine, n_decode: int, rng: np.random.Generator, depth: int) -> dict:
    """Launches, kernels and syncs per decode step at `depth` from the backend's counters
    (GPU backends)."""
    backend = engine.backend
    if backend.runtime_stats() is None:  # the CPU: no launches to count
        return {}
    backend.reset_runtime_stats()
    decode_tokens_per_s(engine, n_decode, rng, depth=depth)
    stats = backend.runtime_stats()
    stats["launches_per_layer"] = stats["launches_per_step"] / engine.hparams.n_layer
    return stats


def arg_cache_off_step_stats(
    engine: Engine, n_decode: int, rng: np.random.Generator, depth: int
) -> dict:
    """Decode-step stats with every launch repacking its arguments (the cache's A/B)."""
    from rocforge_rt.backends.gpu.launch import set_arg_cache_enabled

    set_arg_cache_enabled(False)
    try:
        return decode_step_stats(engine, n_decode, rng, depth)
    finally:
        set_arg_cache_enabled(True)


@dataclass
class DecodeRuns:
    """An engine's decode tokens/s runs at one depth, greedy and sampled."""

    greedy: list[float] = field(default_factory=list)
    sampled: list[float] = field(default_factory=list)


class ModeBench:
    """One engine (a step mode, with or without overlap and pipelining), loaded and warmed
    up once, then timed once per round."""

    def __init__(
        self,
        args: argparse.Namespace,
        mode: str | None,
        overlap: bool = True,
        lookahead: bool = True,
        kernels: tuple[str, str] | None = None,
        lever: tuple[str, Levers] = ("matmul", ()),
        kv_dtype: str = "f16",
    ) -> None:
        options = {"mode": mode, "overlap": overlap, "lookahead": lookahead} if mode else {}
        options["kv_dtype"] = kv_dtype
        part, settings = lever
        options |= lever_options(part, settings)  # checked in main
        n_ctx = max(args.n_prompt, *args.depth) + args.n_decode + 8
        self.args = args
        self.mode = mode
        with kernel_sources(kernels[1] if kernels else None):
            self.engine = Engine.load(args.model, backend=args.backend, n_ctx=n_ctx, **options)
        self.label = mode_label(mode or self.engine.backend.name, overlap, lookahead)
        if kernels:
            self.label += f" [{kernels[0]}]"
        if kv_dtype != "f16":
            self.label += f" [kv {kv_dtype}]"
        self.label += lever_label(settings)
        self.rng = np.random.default_rng(0)
        self.prompt_runs: list[float] = []
        self.decode_runs = {d: DecodeRuns() for d in args.depth}
        engine, rng = self.engine, self.rng
        decode_tokens_per_s(engine, 8, rng)  # warm-up: compile, capture, first touches
        decode_tokens_per_s(engine, 8, rng, BENCH_SAMPLING)  # ... and the sampling step's graph
        prompt_tokens_per_s(engine, args.n_prompt, rng)  # the prompt's launch handles, too

    def round(self) -> None:
        """`repeats` runs of each figure, depth after depth."""
        args, engine, rng = self.args, self.engine, self.rng
        for depth, runs in self.decode_runs.items():
            for _ in range(args.repeats):
                runs.greedy.append(decode_tokens_per_s(engine, args.n_decode, rng, depth=depth))
            for _ in range(args.repeats):
                runs.sampled.append(
                    decode_tokens_per_s(engine, args.n_decode, rng, BENCH_SAMPLING, depth=depth)
                )
        for _ in range(args.repeats):
            self.prompt_runs.append(prompt_tokens_per_s(engine, args.n_prompt, rng))

    def decode_figures(self, depth: int) -> dict[str, object]:
        """The decode medians, runs and step counters at `depth`."""
        runs, args = self.decode_runs[depth], self.args
        figures: dict[str, object] = {
            "decode_tokens_per_s": statistics.median(runs.greedy),
            "decode_sampled_tokens_per_s": statistics.median(runs.sampled),
            "decode_runs": runs.greedy,
            "decode_sampled_runs": runs.sampled,
            "decode_step": decode_step_stats(self.engine, args.n_decode, self.rng, depth),
        }
        if self.mode == "deferred":  # host cost of issuing a step, with and without the cache
            figures["decode_step_arg_cache_off"] = arg_cache_off_step_stats(
                self.engine, args.n_decode, self.rng, depth
            )
        return figures

    def result(self) -> dict[str, object]:
        """The first depth's decode figures and the prompt's; with several depths, every
        depth's under `at_depth` and what each later one costs under `depth_cost`."""
        first, *later = self.args.depth
        at_depth = {depth: self.decode_figures(depth) for depth in self.args.depth}
        result: dict[str, object] = {
            **at_depth[first],
            "prompt_tokens_per_s": statistics.median(self.prompt_runs),
            "prompt_runs": self.prompt_runs,
            "device": self.engine.backend.device_info(),
        }
        if later:
            result["at_depth"] = {str(depth): figures for depth, figures in at_depth.items()}
            result["depth_cost"] = {
                str(depth): 1.0
                - at_depth[depth]["decode_tokens_per_s"] / at_depth[first]["decode_tokens_per_s"]
                for depth in later
            }
        decode = ", ".join(
            f"{at_depth[d]['decode_tokens_per_s']:9.1f} tok/s"
            f" (sampled {at_depth[d]['decode_sampled_tokens_per_s']:9.1f})"
            + (f" at depth {d}" if later else "")
            for d in self.args.depth
        )
        print(
            f"{self.label:>28}: decode {decode}"
            f" | prompt {result['prompt_tokens_per_s']:10.1f} tok/s",
            file=sys.stderr,
        )
        return result


@contextlib.contextmanager
def kernel_sources(directory: str | None) -> Iterator[None]:
    """Engines loaded inside compile the kernel sources in `directory` (None: the default)."""
    before = os.environ.get("ROCFORGE_KERNELS_DIR")
    if directory is not None:
        os.environ["ROCFORGE_KERNELS_DIR"] = directory
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ROCFORGE_KERNELS_DIR", None)
        else:
            os.environ["ROCFORGE_KERNELS_DIR"] = before


def kernels_variant(text: str) -> tuple[str, str]:
    """NAME=DIR of --kernels."""
    name, sep, directory = text.partition("=")
    if not sep or not name or not Path(directory).is_dir():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with DIR a folder, got {text!r}")
    return name, directory


def mode_label(mode: str, overlap: bool, lookahead: bool) -> str:
    return mode + ("" if overlap else " (no overlap)") + ("" if lookahead else " (not pipelined)")


def llama_bench_figures(run: LlamaBenchRun, depths: list[int]) -> dict[int, dict[str, float]]:
    """tg and pp tokens/s of a llama-bench run by depth (its rows' n_depth; a build that
    prints none ran the one depth asked for)."""
    key = {True: "decode_tokens_per_s", False: "prompt_tokens_per_s"}
    figures: dict[int, dict[str, float]] = {}
    for row in run.rows:
        if "n_depth" not in row and len(depths) > 1:
            raise LlamaBenchError("llama-bench printed no n_depth: too old for several depths")
        depth = int(row.get("n_depth", depths[0]))
        figures.setdefault(depth, {})[key[bool(row["n_gen"])]] = float(row["avg_ts"])
    if missing := sorted(set(depths) - set(figures)):
        raise LlamaBenchError(f"llama-bench printed no figures at depth {missing}")
    return figures


def depth_list(text: str) -> list[int]:
    """--depth: one depth or several, comma separated (llama-bench's -d)."""
    try:
        depths = [int(part) for part in text.split(",")]
    except ValueError:
        depths = []
    if not depths or min(depths) < 0 or len(set(depths)) < len(depths):
        raise argparse.ArgumentTypeError(
            f"expected depths >= 0, comma separated, none twice, got {text!r}"
        )
    return depths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--mode", action="append", choices=MODES, help="GPU step mode(s)")
    parser.add_argument("--n-decode", type=int, default=128)
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--depth", type=depth_list, default=[0],
        help="decode after a prompt of this many tokens (llama-bench -d; several: 128,4096);"
        " 0: after one token",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="rounds of ours then llama-bench in turn; figures are medians over all runs",
    )  # fmt: skip
    parser.add_argument("--llamacpp", help="path to llama-bench, to measure it in the same run")
    parser.add_argument(
        "--llamacpp-args", default="", help="more llama-bench arguments: --llamacpp-args='-t 16'"
    )
    parser.add_argument(
        "--overlap-ab",
        action="store_true",
        help="also run each GPU mode without programmatic dependent launch",
    )
    parser.add_argument(
        "--pipelined-ab",
        action="store_true",
        help="also run graph mode with each decode step read back before the next is issued",
    )
    parser.add_argument(
        "--kernels", action="append", type=kernels_variant, default=[], metavar="NAME=DIR",
        help="also load each engine with the kernel sources in DIR (an A/B of kernel trees)",
    )  # fmt: skip
    parser.add_argument(
        "--matmul-lever", action="append", type=lever_settings, default=[], metavar="ATTR=VALUE",
        help="also load each GPU engine with its MatmulTuning's ATTR at VALUE (a launch A/B)",
    )  # fmt: skip
    parser.add_argument(
        "--attention-lever", action="append", type=lever_settings, default=[],
        metavar="ATTR=VALUE", help="the same for the GPU backend's AttentionTuning",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", action="append", choices=KV_DTYPES,
        help="KV pool format (repeatable: one engine each; default f16)",
    )  # fmt: skip
    parser.add_argument("--out", default="bench-results/decode.json")
    args = parser.parse_args()

    on_gpu = resolve_backend_name(args.backend) != "cpu"
    levers = [("matmul", s) for s in args.matmul_lever]
    levers += [("attention", s) for s in args.attention_lever]
    if levers and not on_gpu:
        parser.error("--matmul-lever and --attention-lever tune the GPU backends' kernels;"
                     " the cpu backend has none")  # fmt: skip
    for part, settings in levers:
        try:
            lever_options(part, settings)
        except ValueError as exc:
            parser.error(str(exc))
    benches = []
    for mode in (args.mode or list(MODES)) if on_gpu else [None]:
        benches += [ModeBench(args, mode, kv_dtype=d) for d in args.kv_cache_dtype or ["f16"]]
        benches += [ModeBench(args, mode, kernels=variant) for variant in args.kernels]
        benches += [ModeBench(args, mode, lever=lever) for lever in levers]
        if mode and args.overlap_ab:
            benches.append(ModeBench(args, mode, overlap=False))
        if mode == "graph" and args.pipelined_ab:
            benches.append(ModeBench(args, mode, lookahead=False))
    seen: dict[str, int] = {}
    for bench in benches:  # an engine asked for twice (its spread: the run's noise) keeps both
        seen[bench.label] = seen.get(bench.label, 0) + 1
        if seen[bench.label] > 1:
            bench.label += f" #{seen[bench.label]}"
    first_depth, *later_depths = args.depth
    report: dict[str, object] = {"model": args.model, "backend": args.backend,
                                 "depth": args.depth if later_depths else first_depth,
                                 "rounds": args.rounds}  # fmt: skip
    peer_rounds: list[dict[int, dict[str, float]]] = []
    status = 0
    for _ in range(args.rounds):  # ours, then llama-bench, in turn
        for bench in benches:
            bench.round()
        if args.llamacpp and status == 0:
            extra = shlex.split(args.llamacpp_args) + (
                ["-d", ",".join(map(str, args.depth))] if args.depth != [0] else []
            )
            try:
                run = llama_bench(args.llamacpp, args.model, n_prompt=args.n_prompt,
                                  n_gen=args.n_decode, n_gpu_layers=99 if on_gpu else 0,
                                  extra_args=extra)  # fmt: skip
            except LlamaBenchError as e:
                print(f"error: {e}", file=sys.stderr)
                status = 1
            else:
                try:
                    peer_rounds.append(llama_bench_figures(run, args.depth))
                except LlamaBenchError as e:
                    print(f"error: {e}", file=sys.stderr)
                    status = 1
                report["llamacpp_command"] = shlex.join(run.command)
                report["llamacpp_build"] = run.build()
    report["modes"] = {bench.label: bench.result() for bench in benches}
    if peer_rounds and status == 0:
        report.update(peer_report(report["modes"], peer_rounds, args.depth))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return status


def peer_report(
    modes: dict[str, dict], peer_rounds: list[dict[int, dict[str, float]]], depths: list[int]
) -> dict[str, object]:
    """llama.cpp's medians over its rounds and our ratios to them (printed too), laid out
    as the modes are: the first depth's flat, every depth's under `at_depth` when several."""
    first, *later = depths
    peer = {
        d: {k: statistics.median(r[d][k] for r in peer_rounds) for k in peer_rounds[0][d]}
        for d in depths
    }
    report: dict[str, object] = {"llamacpp": dict(peer[first]), "ratios": {}}
    if later:
        report["llamacpp"]["at_depth"] = {str(d): peer[d] for d in depths}
        report["llamacpp_rounds"] = [{str(d): r[d] for d in depths} for r in peer_rounds]
    else:
        report["llamacpp_rounds"] = [r[first] for r in peer_rounds]
    for name, figures in modes.items():
        at_depth = figures.get("at_depth", {})
        ratios = {d: ratios_to_peer({**figures, **at_depth.get(str(d), {})}, peer[d], d)
                  for d in depths}  # fmt: skip
        report["ratios"][name] = dict(ratios[first])
        if later:
            report["ratios"][name]["at_depth"] = {str(d): ratios[d] for d in depths}
        for d, ratio in ratios.items():
            line = ", ".join(f"x{v:.2f} {k.split('_')[0]}" for k, v in ratio.items())
            where = f" at depth {d}" if later else ""
            print(f"{name:>28}: {line} vs llama.cpp{where}", file=sys.stderr)
    return report


def ratios_to_peer(ours: dict, peer: dict[str, float], depth: int) -> dict[str, float]:
    """Our figures over llama.cpp's at one depth: decode, and the prompt at depth 0 only
    (at a depth llama-bench's pp test starts there too, ours does not)."""
    compared = ["decode_tokens_per_s"] + ([] if depth else ["prompt_tokens_per_s"])
    return {k: ours[k] / peer[k] for k in compared}


if __name__ == "__main__":
    sys.exit(main())
