"""scripts/bench_cpu.py beside a fake llama.cpp peer, on the tiny model (CPU), and the real
peer script (scripts/llamacpp_cpu_peer.py) over a fake llama_cpp module.

The fake peer is an executable Python script standing in for the llama-cpp-python
interpreter: it ignores its arguments (the peer script's path), logs each request, and
answers with fixed timings: a prompt at 1 ms a token (1,000 tok/s), a decode step 10 ms
(100 tok/s).
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from fake_executables import failing_tool, write_executable
from script_modules import import_script, load_script

ROOT = Path(__file__).resolve().parents[1]

FAKE_PEER = """\
#!{python}
import json, os, sys
from pathlib import Path

log = open(Path(__file__).with_suffix(".log"), "a")
for line in sys.stdin:
    request = json.loads(line)
    log.write(json.dumps(request) + "\\n")
    log.flush()
    op = request["op"]
    if op == "quit":
        break
    if op == "load":
        reply = {{"pid": os.getpid(), "load_s": 0.5, "n_vocab": 256, "version": "fake-0.1",
                  "system_info": "CPU : FAKE = 1"}}
    elif op == "prompt":
        reply = {{"seconds": len(request["tokens"]) * 1e-3, "first_token": 1}}
    elif op == "decode" and "FAIL_DECODE" not in os.environ:
        reply = {{"seconds": request["n_decode"] * 1e-2, "last_token": 1}}
    else:
        reply = None
    answer = {{"ok": True, **reply}} if reply else {{"ok": False, "error": "no decode today"}}
    print(json.dumps(answer), flush=True)
"""


@pytest.fixture
def fake_peer(tmp_path: Path) -> Path:
    return write_executable(tmp_path / "peer-python", FAKE_PEER)


def requests_of(fake: Path) -> list[dict]:
    return [json.loads(line) for line in fake.with_suffix(".log").read_text().splitlines()]


def run_bench(*args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / "bench_cpu.py"), *map(str, args)]
    return subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_bench_cpu_times_both_sides_and_writes_medians_ratios_memory_and_a_table(
    tiny_model, fake_peer, tmp_path
):
    out = tmp_path / "results" / "cpu.json"
    result = run_bench(tiny_model, "--llamacpp-python", fake_peer, "--threads", "1",
                       "--n-decode", "4", "--n-prompt", "8", "--rounds", "2", "--repeats", "2",
                       "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    ours, theirs, ratios = report["ours"], report["llamacpp"], report["ratios"]

    assert theirs["decode_tokens_per_s"] == pytest.approx(100.0)
    assert theirs["prompt_tokens_per_s"] == pytest.approx(1000.0)
    assert theirs["ttft_ms"] == pytest.approx(8.0)
    assert theirs["version"] == "fake-0.1" and theirs["threads"] == 1
    assert theirs["n_batch"] == 512 and theirs["flash_attn"] is False
    for figures in (ours, theirs):  # 2 rounds x 2 repeats
        assert len(figures["decode_tokens_per_s_runs"]) == len(figures["ttft_ms_runs"]) == 4
        assert figures["rss_after_load_bytes"] > 0 and figures["peak_rss_bytes"] > 0
    assert ours["decode_tokens_per_s"] == pytest.approx(
        statistics.median(ours["decode_tokens_per_s_runs"])
    )
    assert ours["ttft_ms_runs"] == pytest.approx(
        [8 / s * 1e3 for s in ours["prompt_tokens_per_s_runs"]]
    )
    for key in ("decode_tokens_per_s", "prompt_tokens_per_s", "ttft_ms", "rss_after_load_bytes"):
        assert ratios[key] == pytest.approx(ours[key] / theirs[key])

    assert report["threads"] == 1 and report["threading"]["threads"] == 1
    assert report["threading"]["environment"]["OPENBLAS_NUM_THREADS"] == "1"
    assert report["threading"]["numpy_imported_before"] is False
    assert report["n_ctx"] >= 8 and len(report["load_average_at_start"]) == 3
    for share in report["other_cpu_share"]["ours"] + report["other_cpu_share"]["llamacpp"]:
        assert share is None or 0.0 <= share <= 1.0  # None: no clock tick passed
    assert len(report["other_cpu_share"]["ours"]) == len(report["other_cpu_share"]["llamacpp"]) == 2

    # The peer: loaded once, warmed up, then each round's runs; told to quit at the end.
    requests = requests_of(fake_peer)
    assert requests[0]["op"] == "load" and requests[0]["model"] == str(Path(tiny_model).resolve())
    assert requests[0]["threads"] == 1
    ops = [(r["op"], r.get("n_decode", len(r.get("tokens", [])))) for r in requests[1:]]
    round_ops = [("decode", 4)] * 2 + [("prompt", 8)] * 2
    assert ops == [("decode", 8), ("prompt", 8)] + round_ops * 2 + [("quit", 0)]
    assert all(len(r["tokens"]) == 1 for r in requests if r["op"] == "decode")

    assert "| side | decode tok/s | prompt tok/s | TTFT ms |" in result.stderr
    assert "| ours / llama.cpp |" in result.stderr and "Traceback" not in result.stderr


def load_bench_cpu():
    return load_script("bench_cpu")


def test_bench_cpu_alternates_ours_and_llamacpp_round_by_round_on_the_same_tokens(
    tiny_model, fake_peer, tmp_path, monkeypatch
):
    bench_harness = import_script("bench_harness")
    bench = load_bench_cpu()
    order = []

    def ours_decode(engine, n, rng, *args, **kwargs):
        order.append(("ours", "decode", rng.integers(0, engine.hparams.n_vocab, 1).tolist()))
        return 50.0

    def ours_prompt(engine, n, rng):
        order.append(("ours", "prompt", rng.integers(0, engine.hparams.n_vocab, n).tolist()))
        return 500.0

    real_request = bench.Peer.request

    def theirs(self, **message):
        if message["op"] in ("decode", "prompt"):
            order.append(("llama.cpp", message["op"], message["tokens"]))
        return real_request(self, **message)

    monkeypatch.setattr(bench_harness, "decode_tokens_per_s", ours_decode)
    monkeypatch.setattr(bench_harness, "prompt_tokens_per_s", ours_prompt)
    monkeypatch.setattr(bench.Peer, "request", theirs)
    for name in bench.THREAD_VARIABLES:
        monkeypatch.setenv(name, "9")  # restored afterwards
    out = tmp_path / "cpu.json"
    monkeypatch.setattr(sys, "argv", ["bench_cpu.py", str(tiny_model), "--llamacpp-python",
                        str(fake_peer), "--threads", "2", "--n-decode", "4", "--n-prompt", "8",
                        "--rounds", "3", "--out", str(out)])  # fmt: skip
    assert bench.main() == 0

    expected = [("ours", "decode"), ("ours", "prompt"), ("llama.cpp", "decode"),
                ("llama.cpp", "prompt")] * 4  # the warm-up, then 3 rounds  # fmt: skip
    assert [entry[:2] for entry in order] == expected
    for i in range(0, len(order), 4):  # each figure's tokens are the same on both sides
        assert order[i][2] == order[i + 2][2] and order[i + 1][2] == order[i + 3][2]
    assert len({tuple(order[i][2]) for i in range(5, len(order), 4)}) == 3  # new ones a round

    report = json.loads(out.read_text())
    assert report["ratios"]["decode_tokens_per_s"] == pytest.approx(0.5)  # 50 / 100
    assert report["ratios"]["prompt_tokens_per_s"] == pytest.approx(0.5)  # 500 / 1000
    assert report["ratios"]["ttft_ms"] == pytest.approx(2.0)
    assert report["threading"]["environment_before"]["OMP_NUM_THREADS"] == "9"
    assert report["threading"]["numpy_imported_before"] is True  # the same process


def test_other_processes_share_of_the_cpu_is_the_busy_time_neither_side_ran():
    bench = load_bench_cpu()
    # 200 ticks passed, 200 busy, 150 of them the two sides': 50 someone else's
    assert bench.other_cpu_share((100, 1000, 50), (300, 1200, 200)) == 0.25
    assert bench.other_cpu_share((100, 1000, 50), (120, 1200, 200)) == 0.0  # never below 0
    assert bench.other_cpu_share(None, (1, 2, 3)) is None
    ticks = bench.cpu_ticks([os.getpid()])
    assert ticks is None or (ticks[1] >= ticks[0] >= 0 and ticks[2] >= 0)


def test_bench_cpu_reports_a_peer_that_cannot_load_and_still_times_ours(tiny_model, tmp_path):
    failing = failing_tool(tmp_path / "python", "ModuleNotFoundError: No module named 'llama_cpp'")
    out = tmp_path / "cpu.json"
    result = run_bench(tiny_model, "--llamacpp-python", failing, "--n-decode", "4",
                       "--n-prompt", "8", "--rounds", "1", "--out", out)  # fmt: skip
    assert result.returncode == 1
    assert str(failing) in result.stderr and "exited with code 1" in result.stderr
    assert "No module named 'llama_cpp'" in result.stderr and "Traceback" not in result.stderr
    report = json.loads(out.read_text())
    assert "exited with code 1" in report["llamacpp_error"] and "ratios" not in report
    assert report["ours"]["decode_tokens_per_s"] > 0


def test_bench_cpu_reports_a_missing_peer_interpreter(tiny_model, tmp_path):
    missing = tmp_path / "no-such-python"
    result = run_bench(tiny_model, "--llamacpp-python", missing, "--n-decode", "4",
                       "--n-prompt", "8", "--out", tmp_path / "c.json")  # fmt: skip
    assert result.returncode == 1
    assert f"cannot run the llama.cpp peer {str(missing)!r}" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_cpu_reports_a_peer_run_that_fails_and_keeps_ours(tiny_model, fake_peer, tmp_path):
    out = tmp_path / "cpu.json"
    result = run_bench(tiny_model, "--llamacpp-python", fake_peer, "--n-decode", "4",
                       "--n-prompt", "8", "--rounds", "2", "--out", out,
                       env={"FAIL_DECODE": "1"})  # fmt: skip
    assert result.returncode == 1
    assert "failed 'decode': no decode today" in result.stderr and "Traceback" not in result.stderr
    report = json.loads(out.read_text())
    assert "no decode today" in report["llamacpp_error"] and "ratios" not in report
    assert len(report["ours"]["decode_tokens_per_s_runs"]) == 2
    assert [r["op"] for r in requests_of(fake_peer)] == ["load", "decode", "quit"]


def test_bench_cpu_without_a_peer_times_ours_alone(tiny_model, tmp_path):
    out = tmp_path / "cpu.json"
    result = run_bench(tiny_model, "--n-decode", "4", "--n-prompt", "8", "--rounds", "1",
                       "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["ours"]["prompt_tokens_per_s"] > 0 and "llamacpp" not in report
    assert report["threads"] >= 1


FAKE_LLAMA_CPP = """\
import ctypes, json, os

__version__ = "0.0-fake"
N_VOCAB = 8
calls = []


class Llama:
    def __init__(self, model_path, **options):
        print("llama.cpp chatter on stdout")  # must not reach the protocol
        self.options = options
        self.ctx = object()
        self.n_tokens = 0
        self.evaluated = []
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as log:
            log.write(json.dumps({"model_path": model_path, **options}) + "\\n")

    def n_vocab(self):
        return N_VOCAB

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        self.n_tokens += len(tokens)
        self.evaluated.append(list(tokens))
        global last
        last = self


def llama_get_logits_ith(ctx, i):
    # the argmax is the next id after the last evaluated one
    values = (ctypes.c_float * N_VOCAB)()
    values[(last.evaluated[-1][-1] + 1) % N_VOCAB] = 1.0
    return ctypes.cast(values, ctypes.POINTER(ctypes.c_float))


def llama_print_system_info():
    return b"CPU : FAKE = 1"
"""


def test_the_peer_script_loads_once_times_prompts_and_greedy_decodes_and_answers_failures(
    tmp_path,
):
    package = tmp_path / "site" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_LLAMA_CPP)
    log = tmp_path / "llama.log"
    requests = [
        {"op": "decode", "tokens": [1], "n_decode": 2},  # before a load
        {"op": "load", "model": "m.gguf", "threads": 3, "n_ctx": 64, "n_batch": 512},
        {"op": "prompt", "tokens": [3, 4, 5]},
        {"op": "decode", "tokens": [5], "n_decode": 4},
        {"op": "frobnicate"},
        {"op": "quit"},
    ]
    done = subprocess.run(
        [sys.executable, "-u", str(ROOT / "scripts" / "llamacpp_cpu_peer.py")],
        input="".join(json.dumps(r) + "\n" for r in requests),
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "FAKE_LLAMA_LOG": str(log)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(replies) == 5  # the chatter went to stderr
    assert "llama.cpp chatter on stdout" in done.stderr
    assert replies[0] == {"ok": False, "error": "RuntimeError: no model loaded"}
    loaded = replies[1]
    assert loaded["ok"] and loaded["n_vocab"] == 8 and loaded["version"] == "0.0-fake"
    assert loaded["system_info"] == "CPU : FAKE = 1" and loaded["pid"] > 0
    assert replies[2]["ok"] and replies[2]["first_token"] == 6 and replies[2]["seconds"] >= 0
    assert replies[3]["ok"] and replies[3]["last_token"] == (5 + 1 + 4) % 8
    assert replies[4] == {"ok": False, "error": "ValueError: unknown op 'frobnicate'"}
    (options,) = map(json.loads, log.read_text().splitlines())
    assert options == {"model_path": "m.gguf", "n_threads": 3, "n_threads_batch": 3, "n_ctx": 64,
                       "n_batch": 512, "flash_attn": False, "verbose": False}  # fmt: skip
