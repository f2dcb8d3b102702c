"""Requests that wait for a session slot, as vLLM's and llama-server's users expect: an `open` or
one-shot `generate` that finds every slot in use waits in a bounded first-come queue
(--max-queue) for at most --max-queue-time, and takes the first slot that frees; past the queue's
bound, or its time, it is `busy`, with a message naming what was full. Whatever ends a waiting
request (abort, disconnect, deadline, shutdown) answers it at once, as a request that had not
started, and leaves the queue empty and every slot free. Over real loopback sockets, on the tiny
random-weight model; the board's first-come rule is also tested alone, without sockets.
"""

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_daemon import OTHER_PROMPT, PROMPT, Peer, serving, slow, wait_for
from test_daemon_hardening import replies_to

from rocforge_client import Busy, connect
from rocforge_rt.cli.stats_report import format_stats
from rocforge_rt.engine.kv_cache import SlotAllocator
from rocforge_rt.server.jobs import Job, JobBoard
from rocforge_rt.server.protocol import parse_request


def queue_is_empty_and_every_slot_free(endpoint: str, n_slots: int) -> None:
    """Nothing waiting or in flight, no session, and an `open` of every slot succeeds at once."""
    with connect(endpoint, timeout=5) as client:
        wait_for(lambda: client.health()["in_flight"] == 0, timeout=3)
        health = client.health()
        assert (health["waiting"], health["sessions"], health["slots_free"]) == (0, 0, n_slots)
        sessions = [client.open(tokens=[1], max_tokens=1).session for _ in range(n_slots)]
        assert client.health()["waiting"] == 0  # none of them had to wait
        for session in sessions:
            client.close(session)


def request_lines(caplog: pytest.LogCaptureFixture) -> dict[Any, logging.LogRecord]:
    return {
        r.fields["request_id"]: r
        for r in caplog.records
        if "request_id" in getattr(r, "fields", {})
    }


# --- waiting for a slot, and taking it --------------------------------------------------------
def test_a_second_open_with_one_slot_waits_and_completes_once_the_first_session_closes(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.server")
    with (
        serving(tiny_model, max_sessions=1) as daemon,
        connect(daemon.endpoint, timeout=5) as first,
    ):
        held = first.open(tokens=PROMPT, max_tokens=4)
        second = Peer(daemon.endpoint)
        try:
            second.request(op="open", id="second", tokens=OTHER_PROMPT, max_tokens=4)
            wait_for(lambda: first.health()["waiting"] == 1)
            assert not second.socket.poll(300)  # it waits: no `busy`, no reply yet
            assert first.info()["limits"]["max_queue"] == 128  # the default
            closed = time.monotonic()
            first.close(held.session)
            (reply,) = second.until("second")
            took = time.monotonic() - closed
            health = first.health()
            second.request(op="close", id="c", session=reply["session"], token=reply["token"])
            assert second.until("c")[-1]["closed"]
        finally:
            second.close()
        assert reply["ok"] and reply["usage"]["prompt_tokens"] == len(OTHER_PROMPT), reply
        assert took < 0.5  # the close's iteration started it: no wait for the idle timeout
        assert reply["timings"]["wait_ms"] >= 300
        assert (health["waiting"], health["sessions"], health["slots_free"]) == (0, 1, 0)
        wait = first.stats()["latency"]["wait_ms"]
        assert wait["n"] == 2 and wait["max"] == pytest.approx(reply["timings"]["wait_ms"])
        line = request_lines(caplog)["second"]
        assert line.fields["wait_ms"] == round(reply["timings"]["wait_ms"], 3)
        assert "waited" in line.getMessage() and "ms for a slot" in line.getMessage()
        queue_is_empty_and_every_slot_free(daemon.endpoint, 1)


def finals_of(peers: dict[str, Peer], timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """The final reply of each peer's request (the peer's key is its request id)."""
    poller = zmq.Poller()
    for peer in peers.values():
        poller.register(peer.socket, zmq.POLLIN)
    by_socket = {peer.socket: peer for peer in peers.values()}
    finals: dict[str, dict[str, Any]] = {}
    limit = time.monotonic() + timeout
    while len(finals) < len(peers):
        assert time.monotonic() < limit, f"{len(finals)} of {len(peers)} ended in time"
        for socket, _ in poller.poll(100):
            reply = by_socket[socket].recv()
            if not reply["ok"] or reply.get("done", True):
                finals[reply["id"]] = reply
    return finals


def test_three_waiting_requests_start_in_the_order_they_arrived(tiny_model: Path) -> None:
    with (
        serving(tiny_model, max_sessions=1) as daemon,
        connect(daemon.endpoint, timeout=5) as holder,
    ):
        held = holder.open(tokens=PROMPT, max_tokens=4)
        peers = {f"w{i}": Peer(daemon.endpoint) for i in range(3)}
        try:
            for i, (rid, peer) in enumerate(peers.items()):
                op = "open" if i == 2 else "generate"  # an open keeps its slot: last
                peer.request(op=op, id=rid, tokens=PROMPT, max_tokens=3)
                wait_for(lambda n=i + 1: holder.health()["waiting"] == n)  # arrived in order
            holder.close(held.session)
            finals = finals_of(peers)
            opened = finals["w2"]
            peers["w2"].request(
                op="close", id="c", session=opened["session"], token=opened["token"]
            )
            assert peers["w2"].until("c")[-1]["closed"]
        finally:
            for peer in peers.values():
                peer.close()
        assert all(r["ok"] and r["timings"]["wait_ms"] > 0 for r in finals.values()), finals
        sessions = [finals[rid]["session"] for rid in peers]  # ids count up as sessions open
        assert sessions == sorted(sessions)
        queue_is_empty_and_every_slot_free(daemon.endpoint, 1)


def open_job(rid: int) -> Job:
    return Job(
        parse_request({"op": "open", "id": rid, "tokens": [1]}), (b"p",), time.perf_counter()
    )


def test_no_new_request_takes_a_slot_ahead_of_one_waiting_even_when_a_slot_frees_between() -> None:
    """The board alone: a slot frees while a request waits (the engine thread has not given it
    yet); a request arriving then waits behind it, and the slot goes to the one that came first."""
    board = JobBoard(SlotAllocator(1), max_queue=4)
    holder, first, later = open_job(1), open_job(2), open_job(3)
    board.admit(holder)
    assert holder.slot is not None and not holder.waits
    board.admit(first)
    assert first.waits and first.slot is None
    board.retire(holder)  # its slot is free now
    assert board.counts()["slots_free"] == 1
    board.admit(later)
    assert later.waits and later.slot is None  # it did not take the free slot
    assert board.grant(first) and first.slot is not None and not first.waits
    assert not board.grant(later)  # no slot left for it
    assert board.counts() == {"in_flight": 2, "sessions": 0, "slots_free": 0, "waiting": 1}
    board.retire(first)
    assert board.grant(later)
    board.retire(later)
    assert board.counts() == {"in_flight": 0, "sessions": 0, "slots_free": 1, "waiting": 0}
    assert board.queue() == {"waiting": 0, "peak_waiting": 2, "max_queue": 4}


# --- the queue's bounds ---------------------------------------------------------------------------
def test_past_max_queue_a_request_is_busy_at_once_naming_the_slots_the_waiting_and_the_flag(
    tiny_model: Path,
) -> None:
    with (
        serving(tiny_model, max_sessions=1, max_queue=2) as daemon,
        connect(daemon.endpoint, timeout=5) as client,
    ):
        held = client.open(tokens=PROMPT, max_tokens=4)
        peers = {f"w{i}": Peer(daemon.endpoint) for i in range(2)}
        try:
            for rid, peer in peers.items():
                peer.request(op="generate", id=rid, tokens=PROMPT, max_tokens=2)
            wait_for(lambda: client.health()["waiting"] == 2)
            started = time.monotonic()
            expected = (
                r"busy: the only session slot \(--max-sessions 1\) is in use and 2 requests are"
                r" waiting, the queue's limit \(--max-queue 2\); retry later"
            )
            with pytest.raises(Busy, match=expected):
                client.open(tokens=PROMPT)
            with pytest.raises(Busy, match=r"--max-queue 2"):
                next(client.generate(tokens=PROMPT))
            assert time.monotonic() - started < 1.0
            health = client.health()
            assert (health["waiting"], health["max_queue"]) == (2, 2)  # the refusals took nothing
            client.close(held.session)
            finals = finals_of(peers)
        finally:
            for peer in peers.values():
                peer.close()
        assert all(r["ok"] and r["finish_reason"] == "length" for r in finals.values()), finals
        queue_is_empty_and_every_slot_free(daemon.endpoint, 1)


def test_a_request_that_waits_past_max_queue_time_is_busy_naming_its_wait_and_the_limit(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rocforge.server")
    with (
        serving(tiny_model, max_sessions=1, max_queue_time_s=0.3) as daemon,
        connect(daemon.endpoint, timeout=5) as client,
    ):
        held = client.open(tokens=PROMPT, max_tokens=4)
        started = time.monotonic()
        with pytest.raises(
            Busy,
            match=r"busy: waited 0\.[3-9] s for a session slot, the limit \(--max-queue-time"
            r" 0\.3\): the only session slot \(--max-sessions 1\) is in use; retry later",
        ):
            next(client.generate(tokens=PROMPT, max_tokens=2))
        waited = time.monotonic() - started
        assert 0.3 <= waited < 1.0  # the idle engine thread woke for it
        assert client.stats()["queue"]["max_queue_time_s"] == 0.3
        client.close(held.session)
        queue_is_empty_and_every_slot_free(daemon.endpoint, 1)
    (line,) = [r for r in request_lines(caplog).values() if r.fields.get("error") == "busy"]
    assert line.fields["wait_ms"] >= 300 and "failed (busy), waited" in line.getMessage()


# --- whatever ends a waiting request answers it at once and leaves nothing behind ----------------
@pytest.mark.parametrize("cut", ["abort", "disconnect", "deadline"])
def test_a_waiting_request_cut_short_is_answered_at_once_and_leaves_the_queue_empty(
    tiny_model: Path, cut: str
) -> None:
    with (
        serving(tiny_model) as daemon,  # two slots
        connect(daemon.endpoint, timeout=5) as client,
    ):
        held = [client.open(tokens=PROMPT, max_tokens=4).session for _ in range(2)]
        peer = Peer(daemon.endpoint)
        try:
            deadline = {"deadline_ms": 300} if cut == "deadline" else {}
            sent = time.monotonic()
            peer.request(op="generate", id="w", tokens=PROMPT, max_tokens=4, **deadline)
            wait_for(lambda: client.health()["waiting"] == 1)
            started = sent + 0.3 if cut == "deadline" else time.monotonic()  # when it is cut
            if cut == "abort":
                peer.request(op="abort", id="a", request="w")
                got = replies_to(peer, "w", "a")
                assert got["a"][0]["aborted"] is True
                error = got["w"][-1]["error"]
                assert error == {"code": "aborted", "message": "aborted (client) before it started"}
            elif cut == "deadline":
                (reply,) = peer.until("w")
                assert reply["done"] is True
                assert reply["error"] == {
                    "code": "deadline_exceeded", "message": "aborted (deadline) before it started",
                }  # fmt: skip
            else:
                peer.close()
                wait_for(lambda: client.health()["waiting"] == 0)
            assert time.monotonic() - started < 0.5  # not at the engine thread's next wake-up
        finally:
            peer.close()
        assert client.health()["waiting"] == 0
        for session in held:
            client.close(session)
        queue_is_empty_and_every_slot_free(daemon.endpoint, 2)


def test_stopping_the_daemon_answers_every_waiting_request(tiny_model: Path) -> None:
    with serving(tiny_model, max_sessions=1) as daemon:
        with connect(daemon.endpoint, timeout=5) as client:
            client.open(tokens=PROMPT, max_tokens=4)
            peers = {"g": Peer(daemon.endpoint), "o": Peer(daemon.endpoint)}
            try:
                peers["g"].request(op="generate", id="g", tokens=PROMPT, max_tokens=4)
                peers["o"].request(op="open", id="o", tokens=PROMPT, max_tokens=4)
                wait_for(lambda: client.health()["waiting"] == 2)
                daemon.stop()
                finals = finals_of(peers, timeout=3)
            finally:
                for peer in peers.values():
                    peer.close()
        daemon.join(5)
    for rid in ("g", "o"):
        assert finals[rid]["error"] == {
            "code": "aborted", "message": "aborted (shutdown) before it started",
        }  # fmt: skip
    assert finals["g"]["done"] is True
    assert daemon.board.counts()["waiting"] == 0


# --- the bar: 32 one-shot generates against 4 slots ---------------------------------------
def test_32_concurrent_generates_against_4_slots_all_complete_and_the_queue_shows_its_depth(
    tiny_model: Path,
) -> None:
    n_requests, n_slots, max_tokens = 32, 4, 4
    with (
        serving(tiny_model, slow(0.0005), max_sessions=n_slots) as daemon,
        connect(daemon.endpoint, timeout=5) as watcher,
    ):
        peers = [Peer(daemon.endpoint) for _ in range(n_requests)]
        poller = zmq.Poller()
        for peer in peers:
            poller.register(peer.socket, zmq.POLLIN)
        by_socket = {peer.socket: peer for peer in peers}
        try:
            for i, peer in enumerate(peers):
                peer.request(op="generate", id=i, tokens=PROMPT, max_tokens=max_tokens)
            finals: dict[int, dict[str, Any]] = {}
            seen_waiting = []
            limit = time.monotonic() + 30
            while len(finals) < n_requests:
                assert time.monotonic() < limit, f"{len(finals)} of {n_requests} done"
                seen_waiting.append(watcher.health()["waiting"])
                for socket, _ in poller.poll(20):
                    reply = by_socket[socket].recv()
                    if not reply["ok"] or reply["done"]:
                        finals[reply["id"]] = reply
        finally:
            for peer in peers:
                peer.close()
        refused = [r for r in finals.values() if not r["ok"]]
        assert refused == []
        assert all(r["usage"]["completion_tokens"] == max_tokens for r in finals.values())
        assert 0 < max(seen_waiting) <= n_requests - n_slots
        stats = watcher.stats()
        queue = stats["queue"]
        assert max(seen_waiting) <= queue["peak_waiting"] <= n_requests - n_slots
        assert (queue["waiting"], queue["max_queue"], queue["max_queue_time_s"]) == (0, 128, 60.0)
        wait = stats["latency"]["wait_ms"]
        assert wait["n"] == n_requests and wait["max"] > 0
        assert wait["max"] == pytest.approx(max(r["timings"]["wait_ms"] for r in finals.values()))
        report = format_stats(stats)
        assert f"queue: 0 waiting for a session slot (peak {queue['peak_waiting']})" in report
        assert "queue wait" in report
        queue_is_empty_and_every_slot_free(daemon.endpoint, n_slots)
