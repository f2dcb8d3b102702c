"""scripts/bench_ttft.py against a daemon it spawns on the tiny model (CPU backend)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_ttft_measures_a_spawned_daemon_and_writes_json_and_a_png(tiny_model, tmp_path):
    command = [sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--spawn-daemon",
               str(tiny_model), "--backend", "cpu", "--ctx-size", "64", "--requests", "2",
               "--concurrency", "1,2", "--prompt-lengths", "4,8", "--max-tokens", "3",
               "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (report,) = tmp_path.glob("bench_ttft-*.json")
    (plot,) = tmp_path.glob("bench_ttft-*.png")
    runs = json.loads(report.read_text())["runs"]
    assert {(r["prompt_length"], r["concurrency"]) for r in runs} == {
        (4, 1),
        (4, 2),
        (8, 1),
        (8, 2),
    }
    for run in runs:
        assert run["requests"] == 2 and run["completion_tokens"] == 2 * 3
        assert run["ttft_ms"]["n"] == 2 and 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["max"]
        assert run["itl_ms"]["n"] == 2 * 2 and run["tokens_per_s"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
