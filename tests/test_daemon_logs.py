"""What the daemon logs, as llama-server and vLLM log: a start-up line naming the model, backend,
device and limits; one line per finished request with its figures, whatever ended it; a
throughput line at intervals while tokens flow; text or, for machines, one JSON object a line.
A client's request id cannot forge a line."""

import json
import logging
from pathlib import Path

import pytest
from test_daemon import PROMPT, Peer, serving, spawn_serve

from rocforge_client import connect
from rocforge_rt.server import logs, refusals
from rocforge_rt.server.fields import ErrorCode
from rocforge_rt.server.refusals import Refusals


def request_records(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.fields for r in caplog.records if "request_id" in getattr(r, "fields", {})]


def generate(endpoint: str, request_id: str, max_tokens: int) -> list[dict]:
    """A one-shot generate under the request id given; its replies."""
    peer = Peer(endpoint)
    try:
        peer.request(op="generate", id=request_id, tokens=PROMPT, max_tokens=max_tokens)
        return peer.until(request_id)
    finally:
        peer.close()


def test_every_finished_request_logs_one_line_with_its_figures(tiny_model: Path, caplog) -> None:
    """A refused request's line is at debug level: the summary at info counts it."""
    caplog.set_level(logging.DEBUG, logger="rocforge.server")
    with serving(tiny_model, max_new_tokens=3) as daemon:
        replies = generate(daemon.endpoint, "gen-1", max_tokens=3)
        refused = generate(daemon.endpoint, "too-long", max_tokens=64)
    assert refused[-1]["error"]["code"] == "limit_exceeded"
    lines = {f["request_id"]: f for f in request_records(caplog)}
    assert len(request_records(caplog)) == len(lines) == 2  # one line a request
    line = lines["gen-1"]
    assert (line["op"], line["prompt_tokens"], line["completion_tokens"]) == (
        "generate", len(PROMPT), 3)  # fmt: skip
    assert line["finish_reason"] == replies[-1]["finish_reason"] == "length"
    assert 0 < line["ttft_ms"] <= line["e2e_ms"] and line["decode_tokens_per_s"] > 0
    assert lines["too-long"]["error"] == "limit_exceeded"
    levels = {r.fields["request_id"]: r.levelno for r in caplog.records if hasattr(r, "fields")}
    assert levels == {"gen-1": logging.INFO, "too-long": logging.DEBUG}
    (ready,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]
    assert "backend cpu on cpu" in ready and "layers" in ready and "sessions x" in ready


def test_refusals_are_summed_up_at_info_at_most_once_an_interval(caplog) -> None:
    """Each a debug line where it is refused; at info, one line every SUMMARY_INTERVAL_S: the
    count by code, the client refused most, the messages dropped unread."""
    caplog.set_level(logging.INFO, logger="rocforge.server")
    count = Refusals(max_per_client_s=3)
    start = 1000.0
    for i in range(5):
        count.note(b"\x01", ErrorCode.UNKNOWN_SESSION, now=start + i * 0.01)
    count.note(b"\x02", ErrorCode.BUSY, now=start + 0.1)
    assert count.drop(b"\x01", start + 0.2) == 1  # past its 3 a second
    assert count.drop(b"\x02", start + 0.2) == 0  # `busy` is not the client's doing
    assert not caplog.records  # not yet: the interval has not passed
    count.note(b"\x02", ErrorCode.BAD_REQUEST, now=start + refusals.SUMMARY_INTERVAL_S)
    (record,) = caplog.records
    message = record.getMessage()
    assert "refused 7 requests" in message and "unknown_session 5" in message
    assert "busy 1" in message and "bad_request 1" in message
    assert "5 of them client 01's" in message and "1 messages dropped unread" in message
    assert count.drop(b"\x01", start + 1.5) == 0  # its second is over


def test_a_request_id_cannot_forge_a_log_line(tiny_model: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.server")
    forged = "x\n2026-01-01 00:00:00,000 INFO rocforge.server: request 'admin' (close)"
    with serving(tiny_model) as daemon:
        generate(daemon.endpoint, forged, max_tokens=2)
    (record,) = [r for r in caplog.records if getattr(r, "fields", {}).get("request_id") == forged]
    assert "\n" not in record.getMessage() and repr(forged) in record.getMessage()


def test_a_throughput_line_sums_up_the_tokens_of_each_interval(monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.server")
    usage = {"sessions": {"generating": 3, "prefilling": 1}, "kv": {"use": 0.25}}
    throughput = logs.ThroughputLog(now=100.0)
    throughput.add(prompt_tokens=400, generated_tokens=30)
    throughput.maybe_log(100.0 + logs.THROUGHPUT_INTERVAL_S / 2, usage)
    assert not caplog.records  # not yet
    throughput.maybe_log(100.0 + 2 * logs.THROUGHPUT_INTERVAL_S, usage)
    (record,) = caplog.records
    seconds = 2 * logs.THROUGHPUT_INTERVAL_S
    assert record.fields == {
        "prompt_tokens_per_s": round(400 / seconds, 1),
        "generation_tokens_per_s": round(30 / seconds, 1),
        "generating": 3,
        "prefilling": 1,
        "kv_use": 0.25,
    }
    throughput.maybe_log(100.0 + 4 * logs.THROUGHPUT_INTERVAL_S, usage)
    assert len(caplog.records) == 1  # an idle interval says nothing


def test_the_daemon_logs_throughput_while_it_generates(tiny_model: Path, monkeypatch, caplog):
    monkeypatch.setattr(logs, "THROUGHPUT_INTERVAL_S", 0.0)
    caplog.set_level(logging.INFO, logger="rocforge.server")
    with serving(tiny_model) as daemon, connect(daemon.endpoint, timeout=10) as client:
        list(client.generate(tokens=PROMPT, max_tokens=8))
    lines = [
        r.fields for r in caplog.records if "generation_tokens_per_s" in getattr(r, "fields", {})
    ]
    assert lines and sum(f["generation_tokens_per_s"] > 0 for f in lines) >= 1


def test_log_format_json_writes_one_object_a_line(tiny_model: Path) -> None:
    process, addr = spawn_serve(["-m", "rocforge_rt.cli"], tiny_model, "--log-format", "json",
                                ctx_size=64)  # fmt: skip
    try:
        with connect(addr, timeout=10) as client:
            client.wait_ready(timeout=30)
        generate(addr, "json-1", max_tokens=2)
        process.terminate()
        _, stderr = process.communicate(timeout=20)
    finally:
        process.kill()
        process.wait()
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    (request,) = [line for line in lines if line.get("request_id") == "json-1"]
    assert request["op"] == "generate" and request["completion_tokens"] == 2
    assert process.returncode == 0
