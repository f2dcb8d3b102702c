"""scripts/bench_start.py on the tiny model (CPU backend): a cold start and warm ones, each a
fresh process, split by stage into JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

from rocforge_rt import dirs

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"spawn", "import", "read", "compile", "upload", "load_rest", "first_token", "total"}


def test_bench_start_times_each_stage_of_a_cold_and_warm_starts(tiny_model, tmp_path):
    out = tmp_path / "start.json"
    command = [sys.executable, str(ROOT / "scripts" / "bench_start.py"), str(tiny_model),
               "--backend", "cpu", "--warm", "2", "--out", str(out)]  # fmt: skip
    # numba's compiled kernels stay where the suite keeps them (the script empties the rest)
    env = {**os.environ, "PYTHONPATH": str(ROOT), dirs.NUMBA_CACHE_ENV: str(dirs.numba_cache_dir())}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    (timings,) = report["models"].values()
    assert len(timings["warm_runs"]) == 2
    for run in (timings["cold"], *timings["warm_runs"], timings["warm"]):
        assert set(run) == STAGES and all(value >= 0 for value in run.values())
        assert run["compile"] == 0  # the CPU compiles at its first step, not at the load
        parts = sum(value for stage, value in run.items() if stage != "total")
        assert abs(run["total"] - parts) < 0.05  # the stages cover the start
    assert "tiny" in result.stdout and "warm:" in result.stdout
