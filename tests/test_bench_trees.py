"""scripts/bench_trees.py: two source trees' bench_decode runs pooled per tree and compared."""

import argparse

import pytest
from script_modules import load_script

trees = load_script("bench_trees")


def report(decode: list[float], prompt: list[float]) -> dict:
    return {"modes": {"graph": {"decode_runs": decode, "prompt_runs": prompt}}}


def test_runs_pool_across_rounds_and_ratios_compare_medians_to_the_first_tree() -> None:
    runs: dict = {"old": {}, "new": {}}
    trees.collect_runs(runs["old"], report([100.0, 102.0], [1000.0]))
    trees.collect_runs(runs["new"], report([98.0, 99.0], [1100.0]))
    trees.collect_runs(runs["old"], report([101.0], [1000.0]))
    trees.collect_runs(runs["new"], report([97.0], [1100.0]))
    summary = trees.summarize(runs)
    assert summary["medians"]["old"]["graph"] == {"decode_runs": 101.0, "prompt_runs": 1000.0}
    assert summary["runs"]["new"]["graph"]["decode_runs"] == 3
    assert summary["ratios"]["new"]["graph"]["decode_runs"] == pytest.approx(98.0 / 101.0)
    assert summary["ratios"]["new"]["graph"]["prompt_runs"] == pytest.approx(1.1)
    assert "old" not in summary["ratios"]


def test_a_tree_must_be_a_checkout_with_the_bench_script(tmp_path) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=DIR"):
        trees.parse_tree(f"old={tmp_path}")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench_decode.py").write_text("")
    assert trees.parse_tree(f"old={tmp_path}") == ("old", tmp_path.resolve())
