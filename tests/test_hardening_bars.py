"""scripts/hardening_bars.py: its pure parts (/proc parsing, the bars' `met`, the options,
the surrogate bodies, the report's table), finding a front among a process's children, and
the `origin` scenario end to end on the tiny model."""

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from script_modules import load_script

bars = load_script("hardening_bars")

STATUS = """\
Name:\tpython3
State:\tS (sleeping)
VmPeak:\t  412345 kB
VmRSS:\t   37560 kB
RssAnon:\t   20000 kB
"""


def test_vm_rss_is_read_in_bytes_and_none_without_the_line():
    assert bars.parse_vm_rss(STATUS) == 37560 * 1024
    assert bars.parse_vm_rss("Name:\tzombie\n") is None


def test_the_parent_pid_is_read_past_a_command_name_with_spaces_and_parentheses():
    assert bars.parse_stat_ppid("4242 (a (b) c) S 17 4242 4242 0 -1") == 17


def test_growth_and_ratios_are_none_without_both_figures():
    assert bars.growth_pct(1000, 1100) == 10.0
    assert bars.growth_pct(None, 1100) is None
    assert bars.growth_pct(1000, None) is None
    assert bars.ratio(3.0, 1.5) == 2.0
    assert bars.ratio(3.0, None) is None and bars.ratio(None, 1.0) is None


def test_oversized_is_met_by_fast_413s_and_streams_that_finish_every_token():
    big = [{"status": 413, "seconds": 0.2}, {"status": 413, "seconds": 0.9}]
    stream = {"finish_reason": "length", "completion_tokens": 16}
    assert bars.oversized_met(big, [stream] * 3, 16, 1.0)
    assert not bars.oversized_met(big, [stream] * 3, 17, 1.0)  # a stream short of tokens
    assert not bars.oversized_met(big, [{**stream, "finish_reason": "stop"}], 16, 1.0)
    assert not bars.oversized_met([{"status": 413, "seconds": 1.2}], [stream], 16, 1.0)
    assert not bars.oversized_met([{"status": 400, "seconds": 0.1}], [stream], 16, 1.0)
    assert not bars.oversized_met([], [stream], 16, 1.0)


def test_surrogates_is_met_by_400s_alone_little_growth_and_no_traceback():
    assert bars.surrogates_met(Counter({"400": 6000}), 9.9, 0)
    assert not bars.surrogates_met(Counter({"400": 5999, "500": 1}), 0.0, 0)
    assert not bars.surrogates_met({"400": 6000, "ReadTimeout": 1}, 0.0, 0)
    assert not bars.surrogates_met({"400": 6000}, 10.0, 0)
    assert not bars.surrogates_met({"400": 6000}, None, 0)  # no front found
    assert not bars.surrogates_met({"400": 6000}, 1.0, 1)


def test_flood_slowloris_and_origin_bars():
    assert bars.flood_met(3.0, 3.0) and not bars.flood_met(3.01, 3.0)
    assert not bars.flood_met(None, 3.0)
    ok = {"status": 200, "seconds": 0.3}
    assert bars.slowloris_met(ok, ok, 999_999, 2.0)
    assert not bars.slowloris_met(ok, ok, 1_000_000, 2.0)
    assert not bars.slowloris_met(ok, {"status": None, "seconds": 30.0}, 0, 2.0)
    assert not bars.slowloris_met({"status": 200, "seconds": 2.5}, ok, 0, 2.0)
    assert bars.origin_met(421, 415) and bars.origin_met(400, 415)
    assert not bars.origin_met(200, 415) and not bars.origin_met(421, 400)


def test_sigterm_is_met_by_clean_quick_exits_and_an_early_health_reply():
    trial = {"exit_status": 0, "exit_s": 0.4}
    health = {"first_reply_s": 0.6}
    assert bars.sigterm_met([trial] * 3, [health], 2.0, 1.0)
    assert not bars.sigterm_met([trial, {"exit_status": -15, "exit_s": 0.1}], [health], 2.0, 1.0)
    assert not bars.sigterm_met([{"exit_status": 0, "exit_s": 2.1}], [health], 2.0, 1.0)
    assert not bars.sigterm_met([trial], [{"first_reply_s": None}], 2.0, 1.0)
    assert not bars.sigterm_met([trial], [{"first_reply_s": 1.2}], 2.0, 1.0)


def test_a_slow_connections_answer_is_read_by_its_status_line():
    assert bars.status_of(b"HTTP/1.1 408 Request Timeout\r\n") == "408"
    assert bars.status_of(b"garbage") == "?"


def test_surrogate_bodies_hold_the_escape_itself_in_ascii_json():
    requests = bars.surrogate_requests("m")
    assert [path for path, _ in requests] == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions",
    ]
    for _path, body in requests:
        assert b"a\\ud800b" in body
        body.decode("ascii")
    prompt, chat, stop = (json.loads(body) for _, body in requests)
    assert prompt["prompt"] == chat["messages"][0]["content"] == stop["stop"] == "a\ud800b"


def test_options_default_to_every_scenario_in_order_and_a_dated_report(tmp_path):
    args = bars.parse_args(["--log-dir", str(tmp_path)])
    assert args.only == list(bars.SCENARIOS)
    assert args.out.parent == bars.ROOT / "docs" / "bench"
    assert args.out.name.startswith("hardening-") and args.out.suffix == ".json"
    assert args.surrogate_requests == 60_000 and args.sigterm_delays == [0.05, 0.3, 1, 2, 3]
    args = bars.parse_args(["--only", "origin", "sigterm", "--log-dir", str(tmp_path)])
    assert args.only == ["sigterm", "origin"]
    with pytest.raises(SystemExit):
        bars.parse_args(["--only", "nosuch"])


def test_serve_command_takes_a_given_rocforge_and_leaves_its_environment_alone(tmp_path):
    base = ["--log-dir", str(tmp_path), "--model", "m.gguf", "--serve-args", "--threads 1"]
    args = bars.parse_args(base)
    command = bars.serve_command(args, "tcp://127.0.0.1:5", "127.0.0.1:6")
    assert command[:4] == [sys.executable, "-m", "rocforge_rt", "serve"]
    assert command[-2:] == ["--threads", "1"] and "--http" in command
    assert str(bars.ROOT) in bars.serve_env(args)["PYTHONPATH"].split(os.pathsep)
    args = bars.parse_args([*base, "--rocforge", "/opt/venv/bin/rocforge"])
    command = bars.serve_command(args, "tcp://127.0.0.1:5", None)
    assert command[:2] == ["/opt/venv/bin/rocforge", "serve"] and "--http" not in command
    assert bars.serve_env(args).get("PYTHONPATH") == os.environ.get("PYTHONPATH")


def test_the_front_is_found_among_the_children_by_its_module():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", bars.FRONT_MODULE]
    )
    try:
        assert child.pid in bars.child_pids(os.getpid())
        limit = time.monotonic() + 10  # Popen returns before exec has set the command line
        while bars.find_front(os.getpid()) is None and time.monotonic() < limit:
            time.sleep(0.01)
        assert bars.find_front(os.getpid()) == child.pid
        assert bars.rss_bytes(child.pid) > 0
    finally:
        child.kill()
        child.wait()


def test_the_table_has_a_line_a_scenario():
    results = {
        "origin": {"met": True, "summary": "Host evil.example: 421"},
        "slowloris": {"met": None, "summary": "skipped"},
        "flood": {"met": False, "summary": "x"},
    }
    lines = bars.table(results).splitlines()
    assert lines[0].split() == ["scenario", "met", "figures"]
    assert [line.split()[:2] for line in lines[1:]] == [
        ["origin", "yes"],
        ["slowloris", "-"],
        ["flood", "NO"],
    ]


@pytest.mark.slow
def test_origin_end_to_end_on_the_tiny_model(tiny_model, tmp_path):
    out = tmp_path / "report.json"
    logs = tmp_path / "logs"
    argv = ["--only", "origin", "--model", str(tiny_model), "--out", str(out)]
    assert bars.main([*argv, "--log-dir", str(logs), "--ctx-size", "64"]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == str(tiny_model) and report["machine"]["cpu_count"] > 0
    assert set(report["git"]) == {"commit", "dirty"}
    origin = report["scenarios"]["origin"]
    assert "error" not in origin, origin
    figures = origin["figures"]
    assert figures["serve_stop"]["exit_status"] == 0
    assert origin["met"] == bars.origin_met(
        figures["foreign_host"]["status"], figures["text_plain"]["status"]
    )
    assert Path(origin["log"]).stat().st_size > 0
