"""scripts/bench_serve.py: concurrent streams through a daemon it spawns on the tiny model (CPU
backend), beside llama-batched-bench; and the llama-batched-bench runner it uses.

A fake llama-batched-bench (a Python script written into tmp_path) stands in for llama.cpp's:
it logs its arguments and prints what tools/batched-bench/batched-bench.cpp prints with
--output-format jsonl (one JSON object a line on stdout, its build line on stderr), timing
the prefill at 10 us a prompt token and a decode step at 1 ms + 0.1 ms a sequence; like the
real one it skips a sequence count whose tokens do not fit in -c.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_executables import LOGGED_ARGS, failing_tool, write_executable
from script_modules import import_script

bench_harness = import_script("bench_harness")
LlamaBenchError = bench_harness.LlamaBenchError
llama_batched_bench = bench_harness.llama_batched_bench

ROOT = Path(__file__).resolve().parents[1]

FAKE_LLAMA_BATCHED_BENCH = (
    LOGGED_ARGS
    + """\
print("build: 4321 (fa4e1c0) with cc (GCC) 13.2.0 for x86_64-linux-gnu", file=sys.stderr)
n_kv_max, pp, tg = int(arg["-c"]), int(arg["-npp"]), int(arg["-ntg"])
for pl in map(int, arg["-npl"].split(",")):
    n_kv = pl * (pp + tg)
    if n_kv > n_kv_max:
        continue
    t_pp, t_tg = pl * pp * 1e-5, tg * (1e-3 + pl * 1e-4)
    print(
        '{{"n_kv_max": %d, "n_batch": %d, "n_ubatch": %d, "flash_attn": %d, "is_pp_shared": %d, '
        '"n_gpu_layers": %d, "n_threads": %u, "n_threads_batch": %u, "pp": %d, "tg": %d, '
        '"pl": %d, "n_kv": %d, "t_pp": %f, "speed_pp": %f, "t_tg": %f, "speed_tg": %f, '
        '"t": %f, "speed": %f}}'
        % (n_kv_max, int(arg["-b"]), int(arg["-ub"]), arg["-fa"] == "on", 0, int(arg["-ngl"]),
           2, 2, pp, tg, pl, n_kv, t_pp, pl * pp / t_pp, t_tg, pl * tg / t_tg,
           t_pp + t_tg, n_kv / (t_pp + t_tg))
    )
print()
print("llama_perf_context_print:        load time =       1.00 ms", file=sys.stderr)
"""
)


@pytest.fixture
def fake_batched_bench(tmp_path: Path) -> Path:
    return write_executable(tmp_path / "llama-batched-bench", FAKE_LLAMA_BATCHED_BENCH)


def fake_decode_tokens_per_s(streams: int) -> float:
    return 1 / (1e-3 + streams * 1e-4) * streams  # the fake's S_TG


def run_bench_serve(*args: object) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / "bench_serve.py"), *map(str, args)]
    return subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_serve_bench_runs_each_stream_count_and_llama_batched_bench_into_json_table_and_png(
    tiny_model, fake_batched_bench, tmp_path
):
    out = tmp_path / "results"
    result = run_bench_serve("--spawn-daemon", tiny_model, "--backend", "cpu", "--streams", "1,2",
                             "--prompt-tokens", "4", "--max-tokens", "4", "--engine",
                             "--llamacpp-batched", fake_batched_bench, "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (path,) = out.glob("bench_serve-cpu-*.json")
    report = json.loads(path.read_text())

    assert report["daemon_info"]["limits"]["max_sessions"] == 2  # max(--streams)
    assert report["daemon_info"]["limits"]["ctx_size"] == 4 + 4 + 1
    assert [run["streams"] for run in report["runs"]] == [1, 2]
    for run in report["runs"]:
        s = run["streams"]
        assert run["prompt_tokens_mean"] == 4 and run["completion_tokens"] == s * 4
        assert run["decode_tokens"] == s * 3 and run["finish_reasons"] == ["length"]
        assert run["decode_tokens_per_s"] == pytest.approx(s * 3 / run["decode_window_s"])
        if s == 1:  # all streams decode from its first token to its last
            assert run["steady_tokens_per_s"] == pytest.approx(run["decode_tokens_per_s"])
        assert run["ttft_ms"]["n"] == s and run["itl_ms"]["n"] == s * 3
        assert 0 < run["ttft_ms"]["p50"] <= run["prefill_all_ms"] <= run["wall_s"] * 1000
        assert run["daemon"]["decode_mean_batch"] >= 1
        assert run["daemon"]["decode_loop_ms"] >= run["daemon"]["decode_step_ms"]
        assert run["daemon"]["decode_loop_host_us"] > 0  # the daemon's loop beyond Engine.step
        assert 0 < run["client_busy"] <= 1
        engine = run["engine"]  # the same round on an in-process Engine
        assert engine["completion_tokens"] == s * 4 and engine["decode_tokens"] == s * 3
        assert engine["ttft_ms"]["n"] == s and engine["itl_ms"]["n"] == s * 3
        host = engine["host_per_decode_step"]
        assert host["steps"] == 3 and host["engine_us"] > 0  # tokens 2..4: decode-only steps
        assert host["issue_us"] is None  # a GPU backend's issue time; none on the CPU
        peer = run["llamacpp"]
        assert peer["decode_tokens_per_s"] == pytest.approx(fake_decode_tokens_per_s(s), rel=1e-5)
        assert peer["t_pp_ms"] == pytest.approx(s * 4 * 1e-2)  # 10 us a prompt token
        assert peer["itl_ms"] == pytest.approx(1 + s * 0.1)  # a decode step
        assert run["ratio"] == pytest.approx(
            run["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
        )
        steady = run["steady_tokens_per_s"]  # None: the round's streams never all decoded at once
        assert run["steady_ratio"] == (
            None if steady is None else pytest.approx(steady / peer["decode_tokens_per_s"])
        )

    llamacpp = report["llamacpp"]
    assert llamacpp["build"] == {"build_number": 4321, "build_commit": "fa4e1c0"}
    assert llamacpp["n_gpu_layers"] == 0  # the daemon runs on the CPU
    assert llamacpp["command"].endswith(
        "-c 16 -b 2048 -ub 512 -npp 4 -ntg 4 -npl 1,2 -ngl 0 -fa on --output-format jsonl"
    )  # -c: 2 streams x (4 + 4) tokens
    assert len(fake_batched_bench.with_suffix(".log").read_text().splitlines()) == 1  # one run

    assert (
        "| streams | engine decode tok/s | ours decode tok/s | llama.cpp decode tok/s | ratio"
        " | engine / ours steady tok/s | steady ratio"
        " | TTFT p50/p99 ms | ITL p50/p99 ms | our prefill-all ms | llama.cpp T_PP ms |"
    ) in result.stderr
    assert "| 2 | " in result.stderr and f"| {fake_decode_tokens_per_s(2):,.1f} |" in result.stderr
    assert (
        "| streams | engine host us/step | daemon loop host us/step | daemon loop ms/step"
        " | daemon-side decode tok/s | clients' decode tok/s | client thread busy |"
    ) in result.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in result.stderr
    else:
        assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_bench_times_a_long_prompt_alone_and_while_streams_decode(tiny_model, tmp_path):
    result = run_bench_serve("--spawn-daemon", tiny_model, "--backend", "cpu", "--streams", "1",
                             "--prompt-tokens", "4", "--max-tokens", "24", "--long-prompt", "40",
                             "--long-prompt-streams", "2", "--out", tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.glob("bench_serve-cpu-*.json")
    report = json.loads(path.read_text())
    assert report["daemon_info"]["limits"]["max_sessions"] == 3  # 2 streams + the long prompt
    assert report["daemon_info"]["limits"]["ctx_size"] == 40 + 2 + 1
    lp = report["long_prompt"]
    assert lp["prompt_tokens"] == 40 and lp["streams"] == 2
    assert lp["idle_ttft_ms"] > 0 and lp["loaded_ttft_ms"] > 0
    assert lp["ratio"] == pytest.approx(lp["loaded_ttft_ms"] / lp["idle_ttft_ms"])
    assert lp["itl_during_ms"]["n"] >= 1  # the streams kept decoding while it waited
    assert "40-token prompt: TTFT idle" in result.stderr


def test_serve_bench_engine_needs_a_model_to_load(tmp_path):
    result = run_bench_serve("--addr", "tcp://127.0.0.1:9", "--engine", "--out", tmp_path)
    assert result.returncode != 0 and "--engine needs --spawn-daemon" in result.stderr


def test_serve_bench_names_a_missing_llama_batched_bench_and_exits_without_a_traceback(
    tiny_model, tmp_path
):
    missing = tmp_path / "no-such-llama-batched-bench"
    result = run_bench_serve("--spawn-daemon", tiny_model, "--backend", "cpu",
                             "--llamacpp-batched", missing, "--out", tmp_path)  # fmt: skip
    assert result.returncode != 0
    assert str(missing) in result.stderr and "Traceback" not in result.stderr


def test_serve_bench_names_a_failing_llama_batched_bench_shows_its_error_and_keeps_our_results(
    tiny_model, tmp_path
):
    failing = failing_tool(tmp_path / "llama-batched-bench", "main: error: unable to load model")
    result = run_bench_serve("--spawn-daemon", tiny_model, "--backend", "cpu", "--streams", "1",
                             "--prompt-tokens", "4", "--max-tokens", "4",
                             "--llamacpp-batched", failing, "--out", tmp_path)  # fmt: skip
    assert result.returncode == 1
    assert f"llama-batched-bench {str(failing)!r} exited with code 1" in result.stderr
    assert "unable to load model" in result.stderr and "Traceback" not in result.stderr
    ((run,),) = [json.loads(p.read_text())["runs"] for p in tmp_path.glob("bench_serve-*.json")]
    assert run["decode_tokens_per_s"] > 0 and "llamacpp" not in run


def test_llama_batched_bench_reads_one_jsonl_row_per_parallel_count_and_its_build(
    fake_batched_bench,
):
    run = llama_batched_bench(str(fake_batched_bench), "m.gguf", n_prompt=128, n_gen=128,
                              n_parallel=[1, 8, 64], n_gpu_layers=99)  # fmt: skip
    assert run.command[run.command.index("-c") + 1] == str(64 * 256)
    assert list(run.rows) == [1, 8, 64]
    assert run.rows[8]["speed_tg"] == pytest.approx(fake_decode_tokens_per_s(8), rel=1e-5)
    assert run.rows[64]["t_pp"] == pytest.approx(64 * 128 * 1e-5)
    assert run.build == {"build_number": 4321, "build_commit": "fa4e1c0"}


def test_llama_batched_bench_names_the_parallel_counts_it_skipped_for_lack_of_context(
    fake_batched_bench,
):
    with pytest.raises(LlamaBenchError, match=r"no result for 8, 64 parallel sequences"):
        llama_batched_bench(str(fake_batched_bench), "m.gguf", n_prompt=128, n_gen=128,
                            n_parallel=[1, 8, 64], n_ctx=256)  # fmt: skip


def test_http_bench_times_the_same_streams_through_zeromq_and_the_front_in_turn(
    default_model, tmp_path
):
    command = [sys.executable, str(ROOT / "scripts" / "bench_http.py"), "--spawn-daemon",
               str(default_model), "--backend", "cpu", "--streams", "2", "--prompt-tokens", "4",
               "--max-tokens", "4", "--rounds", "2", "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.glob("bench_http-cpu-*.json")
    ((run,),) = [json.loads(path.read_text())["runs"]]
    assert run["streams"] == 2 and len(run["rounds"]["zeromq"]) == len(run["rounds"]["http"]) == 2
    for name in ("zeromq", "http"):
        assert all(r["completion_tokens"] >= 2 for r in run["rounds"][name])  # 2 streams x 1+
        assert run[name]["itl_p50_ms"] > 0 and run[name]["decode_tokens_per_s"] > 0
    assert run["ratios"]["itl_p50_ms"] == pytest.approx(
        run["http"]["itl_p50_ms"] / run["zeromq"]["itl_p50_ms"])  # fmt: skip
    assert path.with_suffix(".png").is_file() and "ZeroMQ -> HTTP" in result.stderr
