"""scripts/bench_attention.py on a small shape: each lever timed, its bits and the CPU checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.gpu


def test_attention_bench_times_each_lever_with_the_same_bits_and_the_cpu_answer(
    gpu_driver, tmp_path
):
    out = tmp_path / "attention.json"
    script = str(ROOT / "scripts/bench_attention.py")
    lever = ["--attention-lever", "decode_wave=1"]
    command = [sys.executable, script, "--shape", "tiny-k", "--depths", "200", "--rows", "1,3"]
    command += ["--rounds", "2", "--reps", "2", "--max-layers", "4", *lever, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [(case["depth"], case["rows"]) for case in report["results"]] == [(200, 1), (200, 3)]
    for case in report["results"]:
        assert case["rel_error_vs_cpu"] <= 2e-3
        assert case["layers_rotated"] == 4  # the cap: 4 x 64 MiB would need far more
        device, always_two = case["settings"]  # 4 tiles a context: two a block with wave 1
        assert device["levers"] == {} and always_two["levers"] == {"decode_wave": 1}
        assert always_two["same_bits_as_first"]
        for setting in (device, always_two):
            assert len(setting["runs_us"]) == 2 and setting["us"] > 0
    assert "depth    200 rows   3" in result.stdout


def test_attention_bench_refuses_a_lever_the_attention_lacks(gpu_driver, tmp_path):
    script = str(ROOT / "scripts/bench_attention.py")
    command = [sys.executable, script, "--shape", "tiny-k", "--depths", "64", "--rows", "1"]
    command += ["--attention-lever", "no_such_lever=1", "--out", str(tmp_path / "a.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2
    assert "AttentionTuning has no lever 'no_such_lever'" in result.stderr
    assert not (tmp_path / "a.json").exists()
