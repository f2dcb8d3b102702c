#!/usr/bin/env python3
"""An A/B of two source trees: bench_decode.py from each, interleaved, on the same file.

Each round runs `scripts/bench_decode.py` once from every --tree NAME=DIR in turn (DIR's
own package first on PYTHONPATH), with the arguments after `--`, and keeps every run's
decode and prompt figures (`decode_runs`, `prompt_runs` of each step mode). The report
gives, per tree and mode, the median over all rounds' runs, and each tree's ratio to the
first tree's. Use it where a change touches the host code too (a --kernels A/B in
bench_decode swaps kernel sources only).

example (the checkout against an older commit's tree):
  git archive OLD rocforge_rt kernels scripts | tar -x -C /tmp/old
  python scripts/bench_trees.py --tree old=/tmp/old --tree new=. --rounds 3 \\
      --out ab.json -- models/llama-1b.gguf --mode graph --repeats 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FIGURES = ("decode_runs", "prompt_runs")


def parse_tree(text: str) -> tuple[str, Path]:
    """NAME=DIR, DIR a folder holding rocforge_rt/ and scripts/bench_decode.py."""
    name, sep, folder = text.partition("=")
    path = Path(folder).resolve()
    if not sep or not name or not (path / "scripts" / "bench_decode.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: want NAME=DIR, DIR holding scripts/")
    return name, path


def collect_runs(into: dict[str, dict[str, list[float]]], report: dict[str, Any]) -> None:
    """Append one bench_decode report's runs to `into`[mode][figure]."""
    for mode, figures in report["modes"].items():
        for figure in FIGURES:
            into.setdefault(mode, {}).setdefault(figure, []).extend(figures.get(figure, []))


def summarize(runs: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    """Per tree and mode, each figure's median and run count; per later tree, its ratio to
    the first tree's median (a mode or figure the first lacks has no ratio)."""
    trees = list(runs)
    medians = {
        tree: {
            mode: {fig: statistics.median(values) for fig, values in figs.items() if values}
            for mode, figs in modes.items()
        }
        for tree, modes in runs.items()
    }
    base = medians[trees[0]]
    ratios = {
        tree: {
            mode: {
                fig: value / base[mode][fig]
                for fig, value in figs.items()
                if fig in base.get(mode, {})
            }
            for mode, figs in medians[tree].items()
        }
        for tree in trees[1:]
    }
    counts = {
        tree: {mode: {fig: len(v) for fig, v in figs.items()} for mode, figs in modes.items()}
        for tree, modes in runs.items()
    }
    return {"medians": medians, "ratios": ratios, "runs": counts}


def run_tree(folder: Path, bench_args: list[str], out: Path) -> dict[str, Any]:
    """One bench_decode.py run from `folder`'s checkout; its JSON report."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    command = [sys.executable, str(folder / "scripts" / "bench_decode.py"), *bench_args]
    subprocess.run([*command, "--out", str(out)], env=env, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", type=parse_tree, action="append", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_decode's")
    args = parser.parse_args()
    if len(args.tree) < 2:
        parser.error("name at least two trees")
    bench_args = [a for a in args.bench_args if a != "--"]
    runs: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name, _ in args.tree}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, folder in args.tree:
                out = Path(scratch) / f"{name}-{round_index}.json"
                collect_runs(runs[name], run_tree(folder, bench_args, out))
    summary = summarize(runs)
    report = {"trees": {n: str(f) for n, f in args.tree}, "bench_args": bench_args,
              "rounds": args.rounds, **summary}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2))
    for tree, modes in summary["ratios"].items():
        for mode, figs in modes.items():
            line = ", ".join(f"{fig} {ratio:.4f}" for fig, ratio in figs.items())
            print(f"{tree} / {args.tree[0][0]} [{mode}]: {line}")


if __name__ == "__main__":
    main()
