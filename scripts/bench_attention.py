#!/usr/bin/env python3
"""Decode attention micro-benchmark: µs a launch and K/V read rate, by depth and rows.

Times the GPU backend's attention op (kernels/attention.hip, as a decode step launches
it) on one layer of a synthetic model shape (scripts/make_synthetic_model.py's): B rows
of B slots, every row at the same depth (its context: depth positions, the newest its
own), the caches filled with random fp16. Launches are replayed as one graph, each
overlapping its predecessor's tail as in a decode step, rotating over enough layers'
caches that a replay reads more than --l2-mib x 4 (the caches come from memory, not L2).
--attention-lever ATTR=VALUE[,ATTR=VALUE...] (repeatable) times the same cases once more
per setting of the backend's AttentionTuning (e.g. decode_wave=0: one tile a block), on a
backend built with it, each setting in turn every round; figures are medians over --rounds.
Every setting's output must equal the first's bit for bit, and the first's the CPU
backend's attention within --tolerance (max |error| / max |output|), else the script
fails. JSON to --out.

    python3 scripts/bench_attention.py --shape llama-1b --depths 512,4096 --rows 1,8,32 \\
        --attention-lever decode_wave=0 --out bench-results/attention.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from bench_harness import Levers, lever_options, lever_settings, positive_ints

from rocforge_rt.backends import BackendOptions, create_backend
from rocforge_rt.backends.gpu.graph import replay_us_per_launch
from rocforge_rt.backends.gpu.launcher import IssueSettings
from rocforge_rt.model.hparams import HParams
from rocforge_rt.model.synthetic import SHAPES
from rocforge_rt.step.batch import StepBatch

FP16 = 2


def shape_hparams(name: str, n_layer: int) -> HParams:
    """The attention widths of a synthetic shape, with `n_layer` layers (cache copies)."""
    s = SHAPES[name]
    return HParams(
        arch="llama", n_layer=n_layer, n_embd=s.n_embd, n_ff=s.n_ff, n_head=s.n_head,
        n_head_kv=s.n_head_kv, head_dim_k=s.head_dim_k, head_dim_v=s.head_dim_k,
        n_vocab=s.n_vocab, n_ctx_train=s.n_ctx, rope_base=s.rope_base,
        rope_dims=s.head_dim_k, rms_eps=s.rms_eps, tied_embeddings=s.output_type is None,
    )  # fmt: skip


def read_bytes(hp: HParams, rows: int, depth: int) -> int:
    """K and V bytes one launch reads: every row's context in its own slot."""
    return rows * depth * (hp.kv_dim_k + hp.kv_dim_v) * FP16


def run_case(args: argparse.Namespace, depth: int, rows: int, rng: np.random.Generator) -> dict:
    """One (depth, rows) case on a backend of its own for each lever setting (the first with
    none), the same caches and queries in each, timed in turn."""
    one = shape_hparams(args.shape, 1)
    copies = min(args.max_layers, math.ceil(4 * (args.l2_mib << 20) / read_bytes(one, rows, depth)))
    hp = replace(one, n_layer=copies)
    n_ctx = depth + 1
    shape = (rows, n_ctx, hp.n_head_kv, hp.head_dim_k)
    keys = rng.standard_normal(shape).astype(np.float16)
    values = rng.standard_normal(shape).astype(np.float16)
    queries = rng.standard_normal((rows, hp.q_dim)).astype(np.float32)
    batch = StepBatch.decode([0] * rows, [depth - 1] * rows, list(range(rows)))
    settings: list[Levers] = [(), *args.attention_lever]
    backends = []
    with contextlib.ExitStack() as stack:
        for setting in settings:
            options = BackendOptions(max_tokens=max(rows, 8), mode="deferred",
                                     **lever_options("attention", setting))  # fmt: skip
            gpu = create_backend("cuda", hp, n_slots=rows, n_ctx=n_ctx, options=options)
            backends.append(gpu)
            stack.callback(gpu.driver.close)  # every buffer of that backend
            as_in_decode = IssueSettings(overlap=gpu.driver.supports_overlap)
            stack.enter_context(gpu.launcher.issuing(as_in_decode))
            for layer in range(copies):
                gpu.driver.copy_htod(gpu.workspace.k_cache[layer], keys)
                gpu.driver.copy_htod(gpu.workspace.v_cache[layer], values)
            gpu.write_step_state(batch)
        inputs = [gpu.load_activation(queries) for gpu in backends]
        times: dict[int, list[float]] = {i: [] for i in range(len(settings))}
        outputs = []
        for round_ in range(args.rounds):
            for i, (gpu, q) in enumerate(zip(backends, inputs, strict=True)):
                out = gpu.attention(q, 0, batch)
                if round_ == 0:
                    outputs.append(gpu.to_host(out).copy())
                times[i].append(replay_us_per_launch(
                    gpu.driver, gpu.stream,
                    lambda j, gpu=gpu, q=q: gpu.attention(q, j, batch), copies, args.reps,
                ))  # fmt: skip
        error = cpu_error(hp, keys, values, queries, batch, outputs[0])
        device = backends[0].driver.info.name
    moved = read_bytes(hp, rows, depth)
    result = {"device": device, "depth": depth, "rows": rows, "layers_rotated": copies,
              "read_bytes": moved, "rel_error_vs_cpu": error, "settings": []}  # fmt: skip
    for i, setting in enumerate(settings):
        us = statistics.median(times[i])
        same = bool(np.array_equal(outputs[i], outputs[0]))
        result["settings"].append({
            "levers": dict(setting), "us": us, "runs_us": times[i],
            "read_tb_s": moved / us / 1e6, "same_bits_as_first": same,
        })  # fmt: skip
    return result


def cpu_error(hp: HParams, keys: np.ndarray, values: np.ndarray, queries: np.ndarray,
              batch: StepBatch, got: np.ndarray) -> float:  # fmt: skip
    """max |GPU - CPU| / max |CPU| of the CPU backend's attention over the same cache."""
    rows, n_ctx = keys.shape[:2]
    cpu = create_backend("cpu", replace(hp, n_layer=1), n_slots=rows, n_ctx=n_ctx)
    cpu.k_cache[0][...] = keys
    cpu.v_cache[0][...] = values
    want = cpu.attention(queries, 0, batch)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--depths", type=positive_ints, default=[512, 2048, 4096, 8192])
    parser.add_argument("--rows", type=positive_ints, default=[1, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10, help="graph replays a round")
    parser.add_argument(
        "--attention-lever", action="append", type=lever_settings, default=[],
        metavar="ATTR=VALUE", help="also time each case with the AttentionTuning's ATTR at VALUE",
    )  # fmt: skip
    parser.add_argument("--l2-mib", type=int, default=64, help="the L2 cache a replay overflows")
    parser.add_argument("--max-layers", type=int, default=256, help="cache copies at most")
    parser.add_argument("--tolerance", type=float, default=2e-3)
    parser.add_argument("--out", type=Path, default=Path("bench-results/attention.json"))
    args = parser.parse_args()
    for setting in args.attention_lever:
        try:
            lever_options("attention", setting)
        except ValueError as exc:
            parser.error(str(exc))

    rng = np.random.default_rng(0)
    results, failures = [], []
    for depth in args.depths:
        for rows in args.rows:
            case = run_case(args, depth, rows, rng)
            results.append(case)
            print(summary(case), flush=True)
            failures += case_failures(case, args.tolerance)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": results[0]["device"], "shape": args.shape, "rounds": args.rounds,
              "reps": args.reps, "results": results}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1))
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def lever_label(setting: dict) -> str:
    return ",".join(f"{attr}={value}" for attr, value in setting["levers"].items())


def summary(case: dict) -> str:
    """One line a case: the first setting's time, rate and error, then each lever's time."""
    first = case["settings"][0]
    line = (f"depth {case['depth']:6} rows {case['rows']:3}: {first['us']:8.2f} us "
            f"{first['read_tb_s']:5.2f} TB/s, vs CPU {case['rel_error_vs_cpu']:.1e}")  # fmt: skip
    for s in case["settings"][1:]:
        line += f" | [{lever_label(s)}] {s['us']:8.2f} us ({s['us'] / first['us'] - 1:+.1%} time)"
    return line


def case_failures(case: dict, tolerance: float) -> list[str]:
    """What a case got wrong: other bits under a lever, or too far from the CPU backend."""
    where = f"depth {case['depth']} rows {case['rows']}"
    failures = [f"{where} [{lever_label(s)}]: other bits than the first setting"
                for s in case["settings"] if not s["same_bits_as_first"]]  # fmt: skip
    if not case["rel_error_vs_cpu"] <= tolerance:
        failures.append(f"{where}: relative error {case['rel_error_vs_cpu']:.1e} vs the CPU")
    return failures


if __name__ == "__main__":
    sys.exit(main())
