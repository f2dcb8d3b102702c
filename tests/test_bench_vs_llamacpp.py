"""scripts/bench_prefill.py and bench_decode.py beside llama-bench, on the tiny model (CPU).

A fake llama-bench (a Python script written into tmp_path) stands in for llama.cpp's: it
prints llama-bench-shaped JSON, timing a pp test at 10 us a token (x 1.01 per repetition,
x (1 + d / 1000) at depth d, a row per test and depth of -d), and logs its arguments.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from fake_executables import LOGGED_ARGS, failing_tool, write_executable
from script_modules import import_script, load_script

from rocforge_rt.backends import BackendOptions
from rocforge_rt.backends.gpu.attention_plan import AttentionTuning
from rocforge_rt.backends.gpu.matmul_plan import MatmulTuning

bench_harness = import_script("bench_harness")
lever_options, lever_settings = bench_harness.lever_options, bench_harness.lever_settings

ROOT = Path(__file__).resolve().parents[1]

FAKE_LLAMA_BENCH = (
    LOGGED_ARGS
    + """\
reps = int(arg["-r"])
build = {{"build_commit": "fa4e1c0", "build_number": 4321, "backends": "CPU",
         "cpu_info": "Fake CPU @ 3 GHz", "gpu_info": ""}}
rows = []
for depth in map(int, arg.get("-d", "0").split(",")):
    for kind, n in (("p", int(arg["-p"])), ("n", int(arg["-n"]))):
        if n:
            ns = [int(n * 10_000 * 1.01**i * (1 + depth / 1000)) for i in range(reps)]
            ts = [n * 1e9 / t for t in ns]
            rows.append({{**build, "model_filename": arg["-m"], "n_gpu_layers": int(arg["-ngl"]),
                         "flash_attn": arg["-fa"] == "1", "n_prompt": n if kind == "p" else 0,
                         "n_gen": n if kind == "n" else 0, "n_depth": depth,
                         "avg_ns": sum(ns) // reps, "avg_ts": sum(ts) / reps, "samples_ns": ns,
                         "samples_ts": ts}})
print(json.dumps(rows, indent=2))
"""
)


@pytest.fixture
def fake_llama_bench(tmp_path: Path) -> Path:
    return write_executable(tmp_path / "llama-bench", FAKE_LLAMA_BENCH)


def calls_of(fake: Path) -> list[dict[str, str]]:
    lines = fake.with_suffix(".log").read_text().splitlines()
    return [dict(zip(argv[::2], argv[1::2], strict=False)) for argv in map(json.loads, lines)]


def run_script(name: str, *args: object) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / name), *map(str, args)]
    return subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def decode_bench_report(model: Path, tmp_path: Path, *args: object) -> dict:
    """The JSON of a bench_decode.py run on the CPU backend (4 tokens decoded after the
    depth, prompts of 8) with `args`, which must succeed."""
    out = tmp_path / "decode.json"
    result = run_script("bench_decode.py", model, "--backend", "cpu", "--n-decode", "4",
                        "--n-prompt", "8", *args, "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def test_prefill_bench_times_both_sides_at_every_length_and_writes_json_a_table_and_a_png(
    tiny_model, fake_llama_bench, tmp_path
):
    out = tmp_path / "results" / "prefill.json"
    result = run_script("bench_prefill.py", tiny_model, "--backend", "cpu", "--lengths", "8,16",
                        "--repeats", "2", "--llamacpp", fake_llama_bench, "--out", out,
                        "--invariant-ab")  # fmt: skip
    assert result.returncode == 0, result.stderr

    report = json.loads(out.read_text())
    assert report["lengths"] == [8, 16] and report["repeats"] == 2
    (model,) = report["models"].values()
    assert model["llamacpp"]["build"]["build_commit"] == "fa4e1c0"
    assert model["llamacpp"]["build"]["cpu_info"] == "Fake CPU @ 3 GHz"
    assert model["llamacpp"]["n_gpu_layers"] == 0  # follows --backend cpu
    assert [p["length"] for p in model["points"]] == [8, 16]
    for point in model["points"]:
        n = point["length"]
        ours, theirs = point["ours"], point["llamacpp"]
        assert len(ours["tokens_per_s_runs"]) == len(theirs["tokens_per_s_runs"]) == 2
        assert ours["ttft_ms"] == pytest.approx(statistics.median(ours["ttft_ms_runs"]))
        assert ours["ttft_ms_runs"] == pytest.approx(
            [n / s * 1e3 for s in ours["tokens_per_s_runs"]]
        )
        # a round's figure: the median of its call's 3 repetitions (10, 10.1, 10.201 us a
        # token in the fake's samples_ns)
        assert theirs["ttft_ms_runs"] == pytest.approx([n * 0.0101, n * 0.0101])
        assert theirs["tokens_per_s"] == pytest.approx(1e5 / 1.01)
        assert point["ratio"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
        assert f"-p {n} -n 0 -ngl 0 -fa 1 -r 3 -o json" in point["llamacpp_command"]
        assert "batch_invariant" not in point  # the CPU backend is batch invariant already

    # one llama-bench call of 3 repetitions per round
    assert [(c["-p"], c["-n"], c["-r"]) for c in calls_of(fake_llama_bench)] == [
        ("8", "0", "3"), ("8", "0", "3"), ("16", "0", "3"), ("16", "0", "3"),
    ]  # fmt: skip

    assert "| length | ours tok/s | llama.cpp tok/s | ratio | our TTFT ms | their TTFT ms |" in (
        result.stderr
    )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in result.stderr
    else:
        assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prefill_bench_alternates_ours_and_llama_bench_at_each_length_after_a_warm_up(
    tiny_model, fake_llama_bench, tmp_path, monkeypatch
):
    bench = load_script("bench_prefill")
    order = []

    def ours(engine, n_prompt, rng):
        order.append(("ours", n_prompt))
        return 1000.0

    def theirs(binary, model, *, n_prompt, **kwargs):
        order.append(("llama.cpp", n_prompt))
        return real_llama_bench(binary, model, n_prompt=n_prompt, **kwargs)

    real_llama_bench = bench.llama_bench
    monkeypatch.setattr(bench, "prompt_tokens_per_s", ours)
    monkeypatch.setattr(bench, "llama_bench", theirs)
    monkeypatch.setattr(sys, "argv", ["bench_prefill.py", str(tiny_model), "--backend", "cpu",
                        "--lengths", "8,16", "--repeats", "2", "--llamacpp", str(fake_llama_bench),
                        "--out", str(tmp_path / "p.json")])  # fmt: skip
    assert bench.main() == 0
    expected = []
    for n in (8, 16):
        expected += [("ours", n)]  # the warm-up
        expected += [("ours", n), ("llama.cpp", n)] * 2  # a round: ours, then llama.cpp
    assert order == expected


def test_prefill_bench_passes_llamacpp_args_after_its_own(tiny_model, fake_llama_bench, tmp_path):
    result = run_script("bench_prefill.py", tiny_model, "--backend", "cpu", "--n-prompt", "8",
                        "--repeats", "1", "--llamacpp", fake_llama_bench,
                        "--llamacpp-args=-t 4", "--out", tmp_path / "p.json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    (call,) = calls_of(fake_llama_bench)
    assert call["-p"] == "8" and call["-t"] == "4"


def test_prefill_bench_without_llamacpp_times_ours_alone(tiny_model, tmp_path):
    out = tmp_path / "prefill.json"
    result = run_script("bench_prefill.py", tiny_model, "--backend", "cpu", "--lengths", "8",
                        "--repeats", "1", "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    ((point,),) = [m["points"] for m in json.loads(out.read_text())["models"].values()]
    assert point["ours"]["tokens_per_s"] > 0 and "llamacpp" not in point and "ratio" not in point


def test_prefill_bench_skips_a_length_the_models_context_cannot_hold(tiny_model, tmp_path):
    out = tmp_path / "prefill.json"
    result = run_script("bench_prefill.py", tiny_model, "--backend", "cpu", "--lengths", "8,256",
                        "--repeats", "1", "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (model,) = json.loads(out.read_text())["models"].values()
    assert [p["length"] for p in model["points"]] == [8] and model["skipped_lengths"] == [256]
    assert "cannot hold a prompt of 256 tokens" in result.stderr


def test_prefill_bench_names_a_missing_llama_bench_and_exits_without_a_traceback(
    tiny_model, tmp_path
):
    missing = tmp_path / "no-such-llama-bench"
    result = run_script("bench_prefill.py", tiny_model, "--backend", "cpu", "--lengths", "8",
                        "--llamacpp", missing, "--out", tmp_path / "p.json")  # fmt: skip
    assert result.returncode != 0
    assert str(missing) in result.stderr and "Traceback" not in result.stderr


def test_prefill_bench_names_a_failing_llama_bench_and_shows_its_error(tiny_model, tmp_path):
    failing = failing_tool(tmp_path / "llama-bench", "error: failed to load model")
    result = run_script("bench_prefill.py", tiny_model, "--backend", "cpu", "--lengths", "8",
                        "--repeats", "1", "--llamacpp", failing,
                        "--out", tmp_path / "p.json")  # fmt: skip
    assert result.returncode == 1
    assert str(failing) in result.stderr and "exited with code 1" in result.stderr
    assert "failed to load model" in result.stderr and "Traceback" not in result.stderr


def test_decode_bench_compares_with_llama_bench_through_the_same_helper(
    tiny_model, fake_llama_bench, tmp_path
):
    out = tmp_path / "decode.json"
    result = run_script("bench_decode.py", tiny_model, "--backend", "cpu", "--n-decode", "4",
                        "--n-prompt", "8", "--repeats", "1", "--llamacpp", fake_llama_bench,
                        "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["llamacpp"]["prompt_tokens_per_s"] == pytest.approx(1e5 / 1.01, rel=0.01)
    assert set(report["ratios"]["cpu"]) == {"decode_tokens_per_s", "prompt_tokens_per_s"}
    assert "-ngl 0 -fa 1 -r 3" in report["llamacpp_command"]
    assert report["llamacpp_build"]["build_commit"] == "fa4e1c0"


def test_decode_bench_alternates_rounds_with_llama_bench_at_the_same_depth(
    tiny_model, fake_llama_bench, tmp_path
):
    report = decode_bench_report(tiny_model, tmp_path, "--repeats", "2", "--rounds", "3",
                                 "--depth", "16", "--llamacpp", fake_llama_bench)  # fmt: skip
    assert [c["-d"] for c in calls_of(fake_llama_bench)] == ["16", "16", "16"]
    assert len(report["llamacpp_rounds"]) == 3 and report["depth"] == 16
    ours = report["modes"]["cpu"]
    assert len(ours["decode_runs"]) == len(ours["prompt_runs"]) == 6  # 3 rounds x 2 repeats
    assert ours["decode_tokens_per_s"] == pytest.approx(statistics.median(ours["decode_runs"]))
    assert set(report["ratios"]["cpu"]) == {"decode_tokens_per_s"}  # its pp ran at depth
    ratio = report["ratios"]["cpu"]["decode_tokens_per_s"]
    assert ratio == pytest.approx(
        ours["decode_tokens_per_s"] / report["llamacpp"]["decode_tokens_per_s"]
    )


def test_decode_bench_times_every_depth_on_one_engine_and_reports_what_each_later_one_costs(
    tiny_model, fake_llama_bench, tmp_path
):
    report = decode_bench_report(tiny_model, tmp_path, "--repeats", "2", "--rounds", "2",
                                 "--depth", "0,24", "--llamacpp", fake_llama_bench)  # fmt: skip
    assert report["depth"] == [0, 24]
    assert [c["-d"] for c in calls_of(fake_llama_bench)] == ["0,24", "0,24"]  # one call a round
    ours = report["modes"]["cpu"]
    assert set(ours["at_depth"]) == {"0", "24"}
    for figures in ours["at_depth"].values():
        assert len(figures["decode_runs"]) == len(figures["decode_sampled_runs"]) == 4
        assert figures["decode_tokens_per_s"] == statistics.median(figures["decode_runs"])
    assert ours["decode_runs"] == ours["at_depth"]["0"]["decode_runs"]  # the first depth's, flat
    assert len(ours["prompt_runs"]) == 4  # the prompt once a round, whatever the depths
    at_0, at_24 = (ours["at_depth"][d]["decode_tokens_per_s"] for d in ("0", "24"))
    assert ours["depth_cost"] == {"24": pytest.approx(1 - at_24 / at_0)}

    peer = report["llamacpp"]["at_depth"]
    assert peer["24"]["decode_tokens_per_s"] == pytest.approx(
        peer["0"]["decode_tokens_per_s"] / 1.024, rel=1e-4
    )  # the fake's tg row at depth 24, from the one call of each round
    ratios = report["ratios"]["cpu"]
    assert set(ratios["at_depth"]["0"]) == {"decode_tokens_per_s", "prompt_tokens_per_s"}
    assert set(ratios["at_depth"]["24"]) == {"decode_tokens_per_s"}  # its pp ran at depth
    assert ratios["at_depth"]["24"]["decode_tokens_per_s"] == pytest.approx(
        at_24 / peer["24"]["decode_tokens_per_s"]
    )
    assert ratios["decode_tokens_per_s"] == ratios["at_depth"]["0"]["decode_tokens_per_s"]


def test_decode_bench_refuses_a_depth_list_it_cannot_time(tiny_model):
    for depths in ("4096,", "-1", "128,128", "deep"):
        result = run_script("bench_decode.py", tiny_model, "--backend", "cpu", "--depth", depths)
        assert result.returncode == 2 and "comma separated" in result.stderr, depths


def test_decode_bench_times_an_engine_per_kernel_tree_in_every_round(tiny_model, tmp_path):
    out = tmp_path / "decode.json"
    result = run_script("bench_decode.py", tiny_model, "--backend", "cpu", "--n-decode", "4",
                        "--n-prompt", "8", "--repeats", "1", "--rounds", "2",
                        "--kernels", f"before={ROOT / 'kernels'}", "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"cpu", "cpu [before]"}
    assert all(len(figures["decode_runs"]) == 2 for figures in modes.values())


def test_decode_bench_times_an_engine_per_kv_cache_dtype_and_keeps_a_repeated_one_apart(
    tiny_model, tmp_path
):
    out = tmp_path / "decode.json"
    result = run_script("bench_decode.py", tiny_model, "--backend", "cpu", "--n-decode", "4",
                        "--n-prompt", "8", "--repeats", "1", "--kv-cache-dtype", "f16",
                        "--kv-cache-dtype", "fp8", "--kv-cache-dtype", "f16",
                        "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"cpu", "cpu [kv fp8]", "cpu #2"}
    assert [modes[m]["device"]["kv_dtype"] for m in sorted(modes)] == ["f16", "f16", "fp8"]


def test_decode_bench_refuses_a_kernel_tree_that_is_not_a_folder(tiny_model, tmp_path):
    result = run_script("bench_decode.py", tiny_model, "--backend", "cpu",
                        "--kernels", f"before={tmp_path / 'absent'}")  # fmt: skip
    assert result.returncode == 2 and "NAME=DIR" in result.stderr


def test_decode_bench_refuses_a_lever_that_is_not_a_number_or_not_a_tuning_field(tiny_model):
    result = run_script("bench_decode.py", tiny_model, "--backend", "cpu",
                        "--matmul-lever", "gemv_max_blocks_per_sm=many")  # fmt: skip
    assert result.returncode == 2 and "ATTR=NUMBER" in result.stderr
    result = run_script("bench_decode.py", tiny_model, "--backend", "cuda",
                        "--matmul-lever", "gemv_max_blocks=2")  # fmt: skip
    assert result.returncode == 2
    assert "MatmulTuning has no lever 'gemv_max_blocks'" in result.stderr
    result = run_script("bench_decode.py", tiny_model, "--backend", "cuda",
                        "--attention-lever", "quantize_out=2")  # fmt: skip
    assert result.returncode == 2
    assert "AttentionTuning.quantize_out takes 0 or 1, not 2" in result.stderr


def test_decode_bench_refuses_levers_on_the_cpu_backend_which_has_none(tiny_model):
    for flag, lever in (("--matmul-lever", "gemv_max_blocks_per_sm=2"),
                        ("--attention-lever", "quantize_out=0")):  # fmt: skip
        result = run_script("bench_decode.py", tiny_model, "--backend", "cpu", flag, lever)
        assert result.returncode == 2
        assert "the cpu backend has none" in result.stderr


def test_one_lever_sets_several_attributes_of_one_engine():
    both = lever_settings("quantize_swiglu=0,gemv_max_blocks_per_sm=2.5")
    assert both == (("quantize_swiglu", 0), ("gemv_max_blocks_per_sm", 2.5))


def test_a_lever_flag_becomes_the_tuning_an_engine_is_loaded_with():
    """A lever flag's settings replace fields of the default tuning, each of its field's kind
    (a bool from 0 or 1); the engine takes it as the backend option of that tuning."""
    options = lever_options("matmul", lever_settings("quantize_swiglu=0,vendor_min_flop=2"))
    assert options == {"matmul_tuning": MatmulTuning(quantize_swiglu=False, vendor_min_flop=2.0)}
    assert lever_options("attention", lever_settings("decode_wave=0")) == {
        "attention_tuning": AttentionTuning(decode_wave=0)
    }
    assert lever_options("matmul", ()) == {}
    with pytest.raises(ValueError, match="gemv_max_blocks_per_sm takes a whole number, not 2.5"):
        lever_options("matmul", lever_settings("gemv_max_blocks_per_sm=2.5"))
    assert BackendOptions.of(**options).matmul_tuning.quantize_swiglu is False


def test_engines_loaded_inside_kernel_sources_compile_that_tree_and_nothing_else_does(
    monkeypatch, tmp_path
):
    bench_decode = load_script("bench_decode")
    from rocforge_rt.backends.gpu.kernel_library import kernels_dir

    monkeypatch.delenv("ROCFORGE_KERNELS_DIR", raising=False)
    default = kernels_dir()
    with bench_decode.kernel_sources(str(tmp_path)):
        assert kernels_dir() == tmp_path
    assert kernels_dir() == default
