#!/usr/bin/env python3
"""Time to the first token from a fresh process, split by stage: cold and warm starts.

Each run is a new Python process that imports rocforge_rt (whichever its PYTHONPATH or
installation gives: run it with an installed wheel's interpreter to time the wheel), reads
the model file, loads the engine (kernels compiled or found, weights uploaded) and
prefills a four-token prompt. A cold run starts with an empty kernel cache
(ROCFORGE_CACHE_DIR) and an empty CUDA compute cache (CUDA_CACHE_PATH, where NVRTC's
and the driver's compiles are kept); the warm runs after it reuse both. The report gives
each run's stages (seconds): `spawn` (interpreter start to our first line), `import`,
`read` (the GGUF header), `compile` and `upload` (from the load's progress), the rest of
`load` (device, workspace, modules), `first_token`, and `total` from the spawn.

example:
  python scripts/bench_start.py models/smollm2-135m-instruct-q4_0.gguf models/llama-8b.gguf \\
      --backend cuda --warm 3 --out bench-results/start.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
started = time.time()
from rocforge_rt.engine.engine import Engine
from rocforge_rt.model.gguf_file import load_model_file
imported = time.time()
spans = {}
def progress(stage, done, total):
    span = spans.setdefault(stage, [time.time(), 0.0])
    span[1] = time.time()
model = load_model_file(sys.argv[1])
read = time.time()
engine = Engine.load(model, backend=sys.argv[2], n_ctx=512, progress=progress)
loaded = time.time()
session = engine.open_session([1, 2, 3, 4], max_tokens=2)
engine.prefill(session)
first = time.time()
stages = {stage: end - start for stage, (start, end) in spans.items()}
print(json.dumps({"started": started, "first": first, "import": imported - started,
                  "read": read - imported, "load": loaded - read, "first_token": first - loaded,
                  "stages": stages}))
"""


def run_once(model: Path, backend: str, env: dict[str, str]) -> dict[str, float]:
    """One fresh process's start, by stage (seconds)."""
    spawned = time.time()
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), backend], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{model}: the start failed:\n{done.stderr}")
    child = json.loads(done.stdout.strip().splitlines()[-1])
    compile_s = child["stages"].get("compiling kernels", 0.0)
    upload_s = child["stages"].get("uploading weights", 0.0)
    return {
        "spawn": child["started"] - spawned,
        "import": child["import"],
        "read": child["read"],
        "compile": compile_s,
        "upload": upload_s,
        "load_rest": child["load"] - compile_s - upload_s,
        "first_token": child["first_token"],
        "total": child["first"] - spawned,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--warm", type=int, default=3, help="warm runs after the cold one")
    parser.add_argument("--out", type=Path, default=Path("bench-results/start.json"))
    args = parser.parse_args()

    report: dict[str, object] = {"backend": args.backend, "python": sys.executable, "models": {}}
    with tempfile.TemporaryDirectory() as caches:
        env = {**os.environ, "ROCFORGE_CACHE_DIR": f"{caches}/rocforge",
               "CUDA_CACHE_PATH": f"{caches}/cuda"}  # fmt: skip
        for model in args.models:  # the first model's cold start fills the caches
            cold = run_once(model, args.backend, env)
            warm = [run_once(model, args.backend, env) for _ in range(args.warm)]
            median = {k: statistics.median(w[k] for w in warm) for k in cold} if warm else {}
            report["models"][str(model)] = {"cold": cold, "warm_runs": warm, "warm": median}
            for name, stages in (("cold", cold), ("warm", median)):
                if stages:
                    line = " ".join(f"{k} {v:.2f}" for k, v in stages.items())
                    print(f"{model.name} {name}: {line}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
