"""The daemon over real loopback sockets: ops, sessions, limits, robustness, lifecycle.

Each test runs a daemon on the random-weight `tiny` model in a background thread
on an ephemeral port (subprocess tests: one per lifecycle behaviour). `slow`
engines sleep in every op so that long prefills and overlapping generations are
certain rather than lucky.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from rocforge_client import (
    BadRequest,
    Busy,
    ClientError,
    ContextFull,
    LimitExceeded,
    SessionBusy,
    ShuttingDown,
    Timeout,
    TurnFinished,
    UnknownSession,
    connect,
)
from rocforge_rt.engine.engine import Engine
from rocforge_rt.model.gguf_file import load_model_file
from rocforge_rt.profiling.latency import distribution
from rocforge_rt.server.config import DaemonConfig, ServerError
from rocforge_rt.server.daemon import Daemon
from rocforge_rt.server.engine_loop import END_OF_REPLIES
from rocforge_rt.server.io_ops import State
from rocforge_rt.server.replies import Outbox, pack_batch, unpack_batch
from rocforge_rt.server.security import SecurityError, generate_keys
from rocforge_rt.step.forward import LAYER_OPS, BracketedOps

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]
OPS_PER_TINY_STEP = 1 + 2 * len(LAYER_OPS) + 1  # embed, two layers, LM head
OTHER_PROMPT = [200, 201, 202, 203, 204, 205]
LONG_PROMPT = list(range(1, 49))  # 12 prefill chunks of 4
TINY = {
    "backend": "cpu",
    "bind": "tcp://127.0.0.1:*",
    "ctx_size": 64,
    "max_sessions": 2,
    "max_prompt_tokens": 56,
    "max_new_tokens": 40,
    "max_request_bytes": 4096,
    "prefill_chunk": 4,
}


def slow(delay: float = 0.002) -> Callable[[Engine], None]:
    def delayed(name: str, call: Callable[[], Any]) -> Any:
        time.sleep(delay)  # a slow device
        return call()

    def hook(engine: Engine) -> None:
        engine.ops = BracketedOps(engine.ops, delayed)

    return hook


@contextmanager
def serving(model: Path, hook: Callable[[Engine], None] | None = None, **config: Any):
    with Daemon(DaemonConfig(model=model, **{**TINY, **config}), engine_hook=hook) as daemon:
        yield daemon


@pytest.fixture()
def daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving(tiny_model) as d:
        yield d


@pytest.fixture()
def slow_daemon(tiny_model: Path) -> Iterator[Daemon]:
    with serving(tiny_model, slow()) as d:
        yield d


@pytest.fixture()
def client(daemon: Daemon):
    with connect(daemon.endpoint, timeout=10) as c:
        yield c


class Peer:
    """A raw socket to the daemon: frames in, decoded replies out."""

    def __init__(
        self, endpoint: str, kind: int = zmq.DEALER, *, routing_id: bytes | None = None
    ) -> None:
        self.socket = zmq.Context.instance().socket(kind)
        self.socket.linger = 0
        if routing_id is not None:  # else the daemon's ROUTER makes one up per connection
            self.socket.routing_id = routing_id
        self.socket.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def request(self, **fields: Any) -> None:
        self.send(msgpack.packb(fields))

    def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        assert self.socket.poll(int(timeout * 1000)), "no reply"
        return msgpack.unpackb(self.socket.recv_multipart()[-1])

    def until(self, rid: Any, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Replies to `rid` up to its final one (others are dropped)."""
        replies = []
        while True:
            reply = self.recv(timeout)
            if reply["id"] == rid:
                replies.append(reply)
                if not reply["ok"] or reply.get("done", True):
                    return replies

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture()
def peer(daemon: Daemon) -> Iterator[Peer]:
    p = Peer(daemon.endpoint)
    yield p
    p.close()


def token_ids(replies: Any) -> list[int]:
    return [t.token for r in replies for t in r.tokens]


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    limit = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < limit, "condition not met in time"
        time.sleep(0.02)


# --- ops ----------------------------------------------------------------------------------------
def test_health_is_live_but_not_ready_until_the_warm_up_is_done_and_tells_the_load_stage(
    tiny_model: Path,
) -> None:
    loading = threading.Event()
    release = threading.Event()

    def hold(_engine: Engine) -> None:
        loading.set()
        release.wait(10)

    daemon = Daemon(DaemonConfig(model=tiny_model, **TINY), engine_hook=hold)
    daemon.start()
    try:
        with connect(daemon.endpoint, timeout=5) as client:
            assert loading.wait(5)
            health = client.health()
            assert health["live"] and not health["ready"] and health["state"] == "loading"
            layers_and_head = load_model_file(tiny_model).hparams.n_layer + 1  # all uploaded
            assert health["loading"] == {
                "stage": "uploading weights",
                "done": layers_and_head,
                "total": layers_and_head,
            }
            with pytest.raises(Exception, match="not_ready"):
                client.open(tokens=PROMPT)
            release.set()
            ready = client.wait_ready(5)
            assert ready["state"] == "ready" and "loading" not in ready
            assert client.stats()["latency"]["requests"] == 0  # the warm-up is not a request
    finally:
        release.set()
        daemon.stop()
        daemon.join()


def test_info_reports_protocol_model_backend_and_limits(client) -> None:
    info = client.info()
    assert info["protocol_version"] == 1
    assert info["model"]["n_vocab"] == 256 and info["model"]["tokenizer"] is False
    assert info["backend"] == "cpu" and info["device"]["batch_invariant"] is True
    assert info["limits"]["ctx_size"] == 64 and info["limits"]["max_sessions"] == 2
    assert info["kv"]["pool_bytes"] == 2 * 64 * info["kv"]["bytes_per_token"]
    assert info["kv"]["dtype"] == "f16"


def test_request_ids_are_echoed(peer: Peer) -> None:
    for rid in (7, "req-x", -3):
        peer.request(op="health", id=rid)
        assert peer.recv()["id"] == rid
    peer.request(op="health")
    assert peer.recv()["id"] is None


def test_open_then_step_gives_the_tokens_of_a_one_shot_generate(client) -> None:
    first = client.open(tokens=PROMPT, max_tokens=8)
    rest = client.step(first.session, 7)
    stream = list(client.generate(tokens=PROMPT, max_tokens=8))
    assert token_ids([first, rest]) == token_ids(stream)
    assert first.timings["ttft_ms"] > 0 and first.usage["prompt_tokens"] == len(PROMPT)
    assert rest.finish_reason == "length" and len(rest.tokens) == 7


def test_generate_streams_then_ends_with_finish_reason_usage_and_timings(client) -> None:
    stream = list(client.generate(tokens=PROMPT, max_tokens=5))
    assert [r.done for r in stream] == [False] * 4 + [True]
    assert [len(r.tokens) for r in stream] == [1] * 5
    final = stream[-1]
    assert final.finish_reason == "length"
    assert final.usage == {
        "prompt_tokens": 10, "completion_tokens": 5, "context_tokens": 15, "context_size": 64,
    }  # fmt: skip
    assert {"ttft_ms", "itl_ms_mean", "e2e_ms"} <= set(final.timings)
    assert stream[0].timings["ttft_ms"] == final.timings["ttft_ms"]


def test_generate_continues_an_open_session(client) -> None:
    first = client.open(tokens=PROMPT, max_tokens=6)
    rest = list(client.generate(session=first.session))
    assert token_ids([first, *rest]) == token_ids(client.generate(tokens=PROMPT, max_tokens=6))
    with pytest.raises(TurnFinished):
        client.step(first.session)


def test_append_continues_the_session_with_another_turn(client) -> None:
    first = client.open(tokens=PROMPT, max_tokens=1)
    assert first.finish_reason == "length"
    second = client.append(first.session, tokens=OTHER_PROMPT, max_tokens=3)
    assert second.usage["context_tokens"] == len(PROMPT) + 1 + len(OTHER_PROMPT) + 1
    whole = client.open(tokens=PROMPT + token_ids([first]) + OTHER_PROMPT, max_tokens=3)
    assert token_ids([second]) == token_ids([whole])


def test_append_ends_a_turn_that_is_still_running(client) -> None:
    first = client.open(tokens=PROMPT, max_tokens=10)
    again = client.append(first.session, tokens=[1, 2], max_tokens=2)
    assert again.usage["context_tokens"] == len(PROMPT) + 1 + 2 + 1


def test_logprobs_are_reported_when_asked(client) -> None:
    reply = client.open(tokens=PROMPT, max_tokens=2, logprobs=3)
    top = reply.tokens[0].top_logprobs
    assert len(top) == 3 and top[0][0] == reply.tokens[0].token  # greedy: the best one


def test_close_frees_the_session(client) -> None:
    opened = client.open(tokens=PROMPT)
    assert client.close(opened.session)["closed"]
    with pytest.raises(UnknownSession):
        client.step(opened.session)
    assert client.health()["in_flight"] == client.health()["sessions"] == 0


# --- batching -----------------------------------------------------------------------------------
def test_concurrent_generations_share_decode_steps_and_match_solo_runs(slow_daemon: Daemon) -> None:
    with connect(slow_daemon.endpoint, timeout=10) as c:
        solo = [token_ids(c.generate(tokens=p, max_tokens=6)) for p in (PROMPT, OTHER_PROMPT)]
        c.stats(reset=True)
    together: dict[int, list[int]] = {}

    def run(i: int, prompt: list[int]) -> None:
        with connect(slow_daemon.endpoint, timeout=10) as c:
            together[i] = token_ids(c.generate(tokens=prompt, max_tokens=6))

    threads = [threading.Thread(target=run, args=a) for a in enumerate((PROMPT, OTHER_PROMPT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[0], together[1]] == solo
    with connect(slow_daemon.endpoint) as c:
        decode = c.stats()["overhead"]["steps"]["decode"]
    assert decode["mean_batch"] > 1.0  # at least some steps decoded both sessions at once


def test_streams_scheduled_together_keep_their_own_tokens_when_one_is_aborted(
    tiny_model: Path,
) -> None:
    """Four sampled generations arriving together share steps (prompt chunks beside decode
    rows): each gets the tokens it gets alone, and aborting one mid-stream changes no other's."""
    prompts = [PROMPT, OTHER_PROMPT, LONG_PROMPT[:23], LONG_PROMPT[5:18]]
    sampling = {"temperature": 0.8, "top_k": 40, "seed": 11}
    with serving(tiny_model, slow(), max_sessions=4) as daemon:
        with connect(daemon.endpoint, timeout=10) as c:
            alone = [token_ids(c.generate(tokens=p, max_tokens=12, **sampling)) for p in prompts]
            c.stats(reset=True)
        together: dict[int, list[int]] = {}
        start = threading.Barrier(len(prompts))

        def run(i: int) -> None:
            with connect(daemon.endpoint, timeout=10) as c:
                start.wait()
                got = together[i] = []
                for reply in c.generate(tokens=prompts[i], max_tokens=12, **sampling):
                    got += [t.token for t in reply.tokens]
                    if i == 0 and len(got) >= 3:
                        break  # leaving the stream aborts it

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with connect(daemon.endpoint) as c:
            steps = c.stats()["overhead"]["steps"]
    assert together[0] == alone[0][: len(together[0])] and len(together[0]) < 12
    assert [together[i] for i in (1, 2, 3)] == alone[1:]
    assert "mixed" in steps or steps["prefill"]["mean_batch"] > 1.0  # prompts shared steps


# --- admission and limits -----------------------------------------------------------------------
def test_without_a_queue_a_full_daemon_answers_busy_at_once(tiny_model: Path) -> None:
    with (
        serving(tiny_model, max_queue=0) as daemon,
        connect(daemon.endpoint, timeout=10) as client,
    ):
        sessions = [client.open(tokens=PROMPT).session for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(Busy, match=r"all 2 session slots .* queue is off \(--max-queue 0\)"):
            client.open(tokens=PROMPT)
        with pytest.raises(Busy):
            next(client.generate(tokens=PROMPT))
        assert time.monotonic() - started < 1.0
        assert client.health()["waiting"] == 0
        client.close(sessions[0])
        assert client.open(tokens=PROMPT).session


def test_a_turn_that_does_not_fit_is_context_full(client) -> None:
    with pytest.raises(ContextFull, match="ctx size 64"):
        client.open(tokens=[1] * 64)
    opened = client.open(tokens=[1] * 50, max_tokens=40)
    with pytest.raises(ContextFull, match="ctx size 64"):
        client.append(opened.session, tokens=[2] * 14)
    assert client.step(opened.session, 20).finish_reason == "length"  # at the window's end
    assert client.stats()["kv"]["tokens_cached"] == 64


def test_per_request_limits_are_limit_exceeded(client) -> None:
    with pytest.raises(LimitExceeded, match="--max-prompt-tokens"):
        client.open(tokens=[1] * 57)  # fits in the context, but over the daemon's limit
    with pytest.raises(LimitExceeded, match="--max-new-tokens"):
        client.open(tokens=PROMPT, max_tokens=41)
    assert client.health()["sessions"] == 0  # nothing was left behind


def test_token_ids_outside_the_vocabulary_are_bad_requests(peer: Peer) -> None:
    peer.request(op="open", id=1, tokens=[1, 256])
    reply = peer.recv()
    assert reply["error"]["code"] == "bad_request" and "vocabulary" in reply["error"]["message"]


def test_text_prompts_need_a_vocabulary(peer: Peer) -> None:
    peer.request(op="open", id=1, prompt="hello")
    assert "no vocabulary" in peer.recv()["error"]["message"]


def test_sessions_belong_to_the_client_that_opened_them(daemon: Daemon, client) -> None:
    opened = client.open(tokens=PROMPT, max_tokens=4)
    with connect(daemon.endpoint, timeout=5) as stranger:
        for call in (
            lambda: stranger.step(opened.session),
            lambda: stranger.close(opened.session),
            lambda: stranger.abort(session=opened.session),
            lambda: stranger.append(opened.session, tokens=[1]),
        ):
            with pytest.raises(UnknownSession):
                call()
    assert len(client.step(opened.session, 3).tokens) == 3


def test_idle_sessions_are_reclaimed(tiny_model: Path) -> None:
    with (
        serving(tiny_model, idle_timeout_s=0.3) as daemon,
        connect(daemon.endpoint, timeout=5) as client,
    ):
        opened = client.open(tokens=PROMPT)
        wait_for(lambda: client.health()["sessions"] == 0)
        with pytest.raises(UnknownSession, match="expired"):
            client.step(opened.session)


def test_kv_use_is_reported(client) -> None:
    client.open(tokens=PROMPT, max_tokens=4)
    stats = client.stats()
    assert stats["sessions"]["open"] == 1
    kv = stats["kv"]
    assert kv["slots_in_use"] == 1 and kv["tokens_cached"] == len(PROMPT)
    assert kv["bytes_used"] == len(PROMPT) * client.info()["kv"]["bytes_per_token"]
    assert kv["dtype"] == "f16"


def test_an_fp8_kv_cache_is_half_the_bytes_in_the_log_info_and_stats(tiny_model, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.server")
    with serving(tiny_model, kv_dtype="fp8") as daemon, connect(daemon.endpoint, timeout=10) as c:
        hp = load_model_file(tiny_model).hparams
        per_token = hp.n_layer * (hp.kv_dim_k + hp.kv_dim_v)  # a byte an element
        assert c.info()["kv"] == {"dtype": "fp8", "bytes_per_token": per_token,
                                  "pool_bytes": 2 * 64 * per_token}  # fmt: skip
        assert f"KV pool: 2 sessions x 64 tokens x {per_token} bytes (fp8)" in caplog.text
        assert len(token_ids(c.generate(tokens=PROMPT, max_tokens=3))) == 3
        c.open(tokens=PROMPT, max_tokens=4)
        kv = c.stats()["kv"]
        assert kv["dtype"] == "fp8" and kv["pool_bytes"] == 2 * 64 * per_token
        assert kv["bytes_used"] == len(PROMPT) * per_token


# --- responsiveness, abort, deadlines -----------------------------------------------------------
def test_health_and_abort_are_answered_during_a_long_prefill(slow_daemon: Daemon) -> None:
    peer = Peer(slow_daemon.endpoint)
    try:
        peer.request(op="open", id="long", tokens=LONG_PROMPT)
        time.sleep(0.15)  # a few chunks in
        peer.request(op="health", id="h")
        assert peer.recv(timeout=1)["id"] == "h"  # before the prefill's reply
        peer.request(op="abort", id="a", request="long")
        abort = peer.recv(timeout=1)
        assert abort["id"] == "a" and abort["aborted"] is True
        (reply,) = peer.until("long")
        assert reply["error"]["code"] == "aborted"
    finally:
        peer.close()
    with connect(slow_daemon.endpoint) as client:
        prefill = client.stats()["overhead"]["steps"]["prefill"]
        assert prefill["steps"] < 11  # stopped well before its 12 chunks
        assert client.health()["sessions"] == 0


def test_an_abort_ends_a_generation_within_one_step(slow_daemon: Daemon) -> None:
    with connect(slow_daemon.endpoint, timeout=5) as client:
        opened = client.open(tokens=PROMPT, max_tokens=40)
        stream = client.generate(session=opened.session)
        next(stream)
        with connect(slow_daemon.endpoint) as other, pytest.raises(UnknownSession):
            other.abort(session=opened.session)  # a different client cannot abort it
        assert client.abort(session=opened.session) is True
        rest = list(stream)
        assert rest[-1].done and rest[-1].finish_reason == "abort"
        assert rest[-1].abort_reason == "client"
        assert len(rest) <= 3  # replies already on their way, then the final one
        assert client.abort(session=opened.session) is False  # nothing runs any more
        with pytest.raises(TurnFinished):
            client.step(opened.session)


def test_a_deadline_stops_the_work_of_a_request(slow_daemon: Daemon) -> None:
    with connect(slow_daemon.endpoint, timeout=5) as client:
        with pytest.raises(Exception, match="deadline_exceeded"):
            client.open(tokens=LONG_PROMPT, deadline=0.1)
        stream = list(client.generate(tokens=PROMPT, max_tokens=40, deadline=0.3))
        assert stream[-1].finish_reason == "abort" and stream[-1].abort_reason == "deadline"
        assert 1 < len(stream) < 40
        assert client.health()["sessions"] == 0


def test_one_request_at_a_time_per_session(slow_daemon: Daemon) -> None:
    with connect(slow_daemon.endpoint, timeout=5) as client:
        opened = client.open(tokens=PROMPT, max_tokens=40)
        rid = client.send("step", session=opened.session, token=opened.token, n=20)
        with pytest.raises(SessionBusy):
            client.step(opened.session)
        assert len(client.receive(rid)["tokens"]) == 20


def test_closing_a_session_cuts_its_running_request(slow_daemon: Daemon) -> None:
    with connect(slow_daemon.endpoint, timeout=5) as client:
        opened = client.open(tokens=PROMPT, max_tokens=40)
        stream = client.generate(session=opened.session)
        next(stream)
        rid = client.send("close", session=opened.session, token=opened.token)
        last = list(stream)[-1]
        assert last.finish_reason == "abort" and last.abort_reason == "close"
        assert client.receive(rid)["closed"]


def test_a_client_that_vanishes_mid_stream_frees_its_work(slow_daemon: Daemon) -> None:
    peer = Peer(slow_daemon.endpoint)
    peer.request(op="generate", id=1, tokens=PROMPT, max_tokens=40)
    assert peer.recv()["ok"]
    peer.close()
    with connect(slow_daemon.endpoint, timeout=5) as client:
        wait_for(lambda: client.health()["in_flight"] == 0)
        assert client.health()["sessions"] == 0
        # stopped before its 40 tokens: fewer decode steps, none at all if it went before one
        steps = client.stats()["overhead"]["steps"]
        assert steps.get("decode", {"steps": 0})["steps"] < 39


def test_an_engine_failure_fails_its_request_only(tiny_model: Path) -> None:
    class FailOnToken13(BracketedOps):
        def embed(self, table: Any, batch: Any) -> Any:
            if 13 in batch.tokens.tolist():
                raise RuntimeError("injected fault")
            return super().embed(table, batch)

    def fail_on_token_13(engine: Engine) -> None:
        engine.ops = FailOnToken13(engine.ops, lambda name, call: call())

    with serving(tiny_model, fail_on_token_13) as daemon, connect(daemon.endpoint) as client:
        healthy = client.open(tokens=PROMPT, max_tokens=6)
        with pytest.raises(Exception, match="internal: engine error: injected fault"):
            client.open(tokens=[1, 13])
        assert len(client.step(healthy.session, 5).tokens) == 5
        assert client.health()["sessions"] == 1


def test_a_bug_in_a_request_handler_fails_that_request_only(daemon: Daemon, client) -> None:
    def broken(_request: Any) -> dict[str, Any]:
        raise KeyError("a bug")

    daemon.ops.info = broken  # the I/O thread looks handlers up per request
    with pytest.raises(ClientError, match="KeyError") as info:
        client.info()
    assert info.value.code == "internal"
    assert client.health()["ready"] is True
    assert len(token_ids(client.generate(tokens=PROMPT, max_tokens=3))) == 3


# --- malformed input ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\xc1\xc1", "bad_request"),  # not msgpack
        (msgpack.packb([1, 2, 3]), "bad_request"),  # not a map
        (msgpack.packb({"op": "step", "id": 9, "session": "one"}), "bad_request"),
        (msgpack.packb({"op": "reboot", "id": 9}), "unknown_op"),
        (msgpack.packb({"op": "step", "id": 9, "session": 12345}), "unknown_session"),
        (msgpack.packb({"op": "open", "id": 9, "prompt": "x" * 5000}), "too_large"),
    ],
)
def test_malformed_requests_get_clear_errors(peer: Peer, payload: bytes, code: str) -> None:
    peer.send(payload)
    reply = peer.recv()
    assert reply["ok"] is False and reply["error"]["code"] == code
    peer.request(op="health", id="after")
    assert peer.recv()["ok"]


def test_odd_frame_layouts_get_an_error_reply(peer: Peer) -> None:
    peer.send(b"x", msgpack.packb({"op": "health"}))
    assert "frame" in peer.recv()["error"]["message"]
    peer.send(*[b""] * 10)
    assert peer.recv()["error"]["code"] == "bad_request"


def test_oversize_frames_drop_only_their_sender(daemon: Daemon, peer: Peer) -> None:
    bully = Peer(daemon.endpoint)
    bully.send(b"\x00" * 20_000)  # over twice --max-request-bytes: ZMQ_MAXMSGSIZE drops it
    assert not bully.socket.poll(300)
    bully.close()
    peer.request(op="health", id=1)
    assert peer.recv()["live"]


def test_a_flush_reaches_the_io_thread_as_one_message_of_every_reply_in_order() -> None:
    replies = [((b"dealer",), {"id": 1, "ok": True}), ((b"req", b""), {"id": 2, "ok": False})]
    assert unpack_batch(pack_batch(replies)) == [
        [b"dealer", msgpack.packb(replies[0][1])],
        [b"req", b"", msgpack.packb(replies[1][1])],
    ]
    assert pack_batch(replies[:0]) != END_OF_REPLIES  # even an empty batch is not the end
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://batch")
    push.connect("inproc://batch")
    outbox = Outbox()
    outbox.pending.extend(replies)
    outbox.send(push)
    assert outbox.pending == []
    assert unpack_batch(pull.recv()) == unpack_batch(pack_batch(replies))
    assert not pull.poll(0)  # one message
    push.close(linger=0)
    pull.close(linger=0)
    context.term()


def test_req_sockets_are_served_too(daemon: Daemon) -> None:
    req = Peer(daemon.endpoint, zmq.REQ)
    req.request(op="health", id=1)
    assert req.recv()["ready"]
    req.close()


# --- stats and trace ----------------------------------------------------------------------------
def test_stats_has_latency_percentiles_op_table_and_records(client) -> None:
    list(client.generate(tokens=PROMPT, max_tokens=4))
    stats = client.stats(records=5)
    latency = stats["latency"]
    assert latency["requests"] == 1 and latency["ttft_ms"]["n"] == 1
    assert latency["itl_ms"]["n"] == 3
    assert set(latency["e2e_ms"]) == {"n", "mean", "max", "p50", "p90", "p99"}
    ops = {row["op"] for row in stats["overhead"]["ops"]}
    assert {"embed", "norm_qkv_rope", "attention", "matmul_add", "lm_head"} <= ops
    decode = stats["overhead"]["steps"]["decode"]
    assert decode["ops_per_step"] == OPS_PER_TINY_STEP
    assert decode["loop_ms"] >= decode["mean_ms"]  # the iteration holds the step
    assert decode["loop_host_us_per_step"] > 0  # replies sent, usage published
    assert stats["records"][0]["op"] == "generate"
    assert stats["recommendations"]
    assert client.stats(reset=True)["latency"]["requests"] == 1
    assert client.stats()["latency"]["requests"] == 0


def test_percentiles_interpolate_between_samples_as_numpy_does() -> None:
    d = distribution([4.0, 1.0, 3.0, 2.0])
    assert (d["n"], d["mean"], d["max"]) == (4, 2.5, 4.0)
    assert d["p50"] == pytest.approx(2.5) and d["p90"] == pytest.approx(3.7)
    assert distribution([])["p99"] == 0.0


def test_trace_is_chrome_trace_json_of_recent_steps(client) -> None:
    list(client.generate(tokens=PROMPT, max_tokens=3))
    trace = client.trace(steps=2)
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "op"]
    assert [e["name"] for e in steps] == ["decode step", "decode step"]
    assert len(ops) == 2 * OPS_PER_TINY_STEP and all(e["ph"] == "X" and e["dur"] >= 0 for e in ops)


def test_profiling_switches_answer_that_the_cpu_backend_has_none(client) -> None:
    state = client.profile(launches=True, kernels=True, every=4)
    assert {k: state[k] for k in ("available", "launches", "kernels")} == {
        "available": False, "launches": False, "kernels": False,
    }  # fmt: skip
    with pytest.raises(BadRequest, match="every"):
        client.profile(every=0)


# --- start-up and security ----------------------------------------------------------------------
def test_a_kv_pool_over_the_memory_limit_fails_fast(tiny_model: Path) -> None:
    """Before the weights load: the check is the first thing the engine thread does once it
    has read the model file (the socket already answers `health` meanwhile)."""
    with (
        pytest.raises(ServerError) as info,
        Daemon(DaemonConfig(model=tiny_model, **{**TINY, "memory_limit": 100_000})),
    ):
        pass
    message = str(info.value)
    assert "--max-sessions 2 x --ctx-size 64" in message and "(32768 bytes)" in message
    assert "memory limit of" in message and "(100000 bytes)" in message
    assert "f16 KV pool" in message and "or --kv-cache-dtype fp8" in message
    with (
        pytest.raises(ServerError) as info,
        Daemon(DaemonConfig(model=tiny_model, **{**TINY, "memory_limit": 1, "kv_dtype": "fp8"})),
    ):
        pass
    message = str(info.value)
    assert "the fp8 KV pool" in message and "(16384 bytes)" in message
    assert "--kv-cache-dtype" not in message  # fp8 already


def test_an_engine_that_cannot_start_stops_the_daemon_with_its_reason(tiny_model: Path) -> None:
    def broken_device(_engine: Engine) -> None:
        raise RuntimeError("no device memory")

    with (
        pytest.raises(ServerError, match="engine start-up failed: no device memory"),
        serving(tiny_model, broken_device),
    ):
        pass


def test_binding_beyond_loopback_needs_curve_keys(tiny_model: Path) -> None:
    with pytest.raises(SecurityError, match="--curve-keys"):
        Daemon(DaemonConfig(model=tiny_model, **{**TINY, "bind": "tcp://0.0.0.0:*"}))


def test_curve_keys_admit_only_clients_with_keys(tiny_model: Path, tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys")
    assert oct(keys.server_secret.stat().st_mode & 0o777) == "0o600"
    with serving(tiny_model, curve_keys=tmp_path / "keys") as daemon:
        with connect(daemon.endpoint, curve_keys=tmp_path / "keys", timeout=5) as client:
            assert client.health()["ready"]
        with connect(daemon.endpoint, timeout=0.5) as stranger, pytest.raises(Timeout):
            stranger.health()


def test_stopping_cuts_requests_in_flight_and_refuses_new_ones(tiny_model: Path) -> None:
    with (
        serving(tiny_model, slow(0.05)) as daemon,
        connect(daemon.endpoint, timeout=20) as client,
        connect(daemon.endpoint) as other,
    ):
        stream = client.generate(tokens=PROMPT, max_tokens=40)
        next(stream)
        daemon.stop()  # what SIGTERM and SIGINT do
        wait_for(lambda: daemon.state is State.DRAINING)
        with pytest.raises(ShuttingDown):
            other.info()
        assert other.health()["state"] == "draining"
        last = list(stream)[-1]
        assert (last.done, last.finish_reason, last.abort_reason) == (True, "abort", "shutdown")


def spawn_serve(launcher: list[str], model: Path, *extra: str, ctx_size: int) -> tuple[Any, str]:
    """`python LAUNCHER serve` of a one-session CPU daemon on a free loopback port (and `extra`
    options), stderr piped."""
    from rocforge_rt.cli.local_daemon import free_loopback_port

    addr = f"tcp://127.0.0.1:{free_loopback_port()}"
    root = str(Path(__file__).resolve().parents[1])
    process = subprocess.Popen(
        [sys.executable, *launcher, "serve", "--model", str(model), "--backend", "cpu",
         "--bind", addr, "--ctx-size", str(ctx_size), "--max-sessions", "1", *extra],
        env={**os.environ, "PYTHONPATH": root},
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    return process, addr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_in_flight_replies_and_exits_0(tiny_model: Path, signum) -> None:
    process, addr = spawn_serve(["-m", "rocforge_rt.cli"], tiny_model, ctx_size=256)
    try:
        with connect(addr, timeout=10) as client:
            client.wait_ready(30)
            stream = client.generate(tokens=PROMPT, max_tokens=250)
            next(stream)
            process.send_signal(signum)
            last = list(stream)[-1]
            assert last.done and last.finish_reason in ("abort", "length")
        assert process.wait(10) == 0
        assert f"{signal.Signals(signum).name} received" in process.stderr.read()
    finally:
        process.kill()
        process.wait()
