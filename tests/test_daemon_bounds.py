"""Bounds on what one client can make the daemon's I/O thread do: a message of a million
frames is refused at once, and other clients' streams go on while its frames are dropped;
a client that never reads its replies pins a bounded number (and bytes) of them, then is
dropped."""

import logging
import re
import threading
import time

import pytest
import zmq
from test_daemon import PROMPT, Peer, serving, slow

from rocforge_client import LimitExceeded, connect
from rocforge_rt.server import backlog as backlog_module

FLOOD_FRAMES = 1_000_000  # empty frames: 2 MB on the wire


def test_a_message_of_a_million_frames_is_refused_at_once_and_streams_go_on(tiny_model) -> None:
    with serving(tiny_model, slow(0.002)) as daemon:
        gaps: list[float] = []
        tokens: list[int] = []

        def stream() -> None:
            with connect(daemon.endpoint, timeout=10) as client:
                last = time.monotonic()
                for reply in client.generate(tokens=PROMPT, max_tokens=40):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    tokens.extend(t.token for t in reply.tokens)

        flood = Peer(daemon.endpoint)
        flood.socket.sndhwm = 0
        try:
            streamer = threading.Thread(target=stream)
            streamer.start()
            time.sleep(0.1)  # the stream is under way
            flood.send(*[b""] * FLOOD_FRAMES)
            sent = time.monotonic()
            assert flood.socket.poll(5000), "no reply to the flood"
            answered = time.monotonic() - sent
            reply = flood.recv()
            streamer.join(30)
            assert not streamer.is_alive()
        finally:
            flood.close()
        assert reply["error"]["code"] == "bad_request" and "frames" in reply["error"]["message"]
        assert answered < 0.5, f"the flood was answered after {answered:.2f} s"
        assert len(tokens) == 40 and max(gaps) < 0.5, max(gaps)
        with connect(daemon.endpoint, timeout=15) as client:  # and everyone, once it is read
            assert client.health()["in_flight"] == 0
            opened = client.open(tokens=PROMPT, max_tokens=4)
            client.close(opened.session)


def test_a_few_extra_frames_are_refused_and_the_next_message_is_read_whole(tiny_model) -> None:
    with serving(tiny_model) as daemon:
        peer = Peer(daemon.endpoint)
        try:
            for n in (3, 4, 50_000):
                peer.send(*[b"x"] * n)
                reply = peer.recv()
                assert reply["error"]["code"] == "bad_request" and "frames" in str(reply)
                peer.request(op="health", id=n)
                health = peer.recv()
                assert health["id"] == n and health["ok"], health
        finally:
            peer.close()


@pytest.mark.parametrize(
    ("bound", "value", "request_op"),
    [("MAX_MESSAGES", 50, "health"), ("MAX_BYTES", 32 << 10, "info")],
    ids=["messages", "bytes"],
)
def test_a_client_that_never_reads_is_dropped_with_a_log_line_at_either_bound(
    tiny_model, monkeypatch, caplog, bound, value, request_op
) -> None:
    """`info` replies are ~500 bytes: 32 KiB of them is fewer than the 1,000-message bound."""
    monkeypatch.setattr(backlog_module, bound, value)
    caplog.set_level(logging.WARNING, logger="rocforge.server")
    with serving(tiny_model) as daemon:
        sloth = Peer(daemon.endpoint)
        sloth.socket.rcvhwm = 1
        sloth.socket.setsockopt(zmq.RCVBUF, 4096)
        try:
            with connect(daemon.endpoint, timeout=5) as other:
                for i in range(20_000):  # its replies pile up
                    sloth.request(op=request_op, id=i)
                limit = time.monotonic() + 10
                while "does not read its replies" not in caplog.text:
                    assert time.monotonic() < limit, "the slow client was never dropped"
                    assert other.health()["live"]  # everyone else is served meanwhile
                    time.sleep(0.05)
                opened = other.open(tokens=PROMPT, max_tokens=4)
                other.close(opened.session)
        finally:
            sloth.close()
        assert caplog.text.count("does not read its replies") == 1
        waiting = re.search(r"\((\d+) messages, (\d+) bytes waiting\)", caplog.text)
        messages, nbytes = int(waiting[1]), int(waiting[2])
        if bound == "MAX_MESSAGES":
            assert messages == value + 1
        else:
            assert value < nbytes <= value + 1024 and messages < backlog_module.MAX_MESSAGES


def test_a_huge_text_prompt_is_refused_by_its_size_before_it_is_tokenized(default_model) -> None:
    from rocforge_rt.server.config import DaemonConfig
    from rocforge_rt.server.daemon import Daemon

    config = DaemonConfig(
        model=default_model, backend="cpu", bind="tcp://127.0.0.1:*", ctx_size=512,
        max_sessions=2, max_prompt_tokens=255, max_new_tokens=8,
    )  # fmt: skip
    with Daemon(config) as daemon, connect(daemon.endpoint, timeout=30) as client:
        longest = daemon.engine_loop.max_token_bytes
        assert longest is not None and longest > 1
        huge = "sea " * (1 << 17)  # 512 KiB: tokenizing it would hold the engine thread
        started = time.monotonic()
        with pytest.raises(LimitExceeded, match="bytes"):
            client.open(huge, max_tokens=4)
        assert time.monotonic() - started < 0.2
        with pytest.raises(LimitExceeded, match="bytes"):
            client.open(messages=[{"role": "user", "content": huge}], max_tokens=4)
        over = "sea " * 300  # within the byte bound, over 255 tokens: counted after tokenizing
        with pytest.raises(LimitExceeded, match="tokens exceeds"):
            client.open(over, max_tokens=4)
        opened = client.open("The sea is", max_tokens=4)
        client.close(opened.session)
        assert client.health()["slots_free"] == 2


def test_the_backlog_keeps_each_clients_replies_in_order_and_counts_both_bounds(
    monkeypatch,
) -> None:
    monkeypatch.setattr(backlog_module, "MAX_MESSAGES", 3)
    monkeypatch.setattr(backlog_module, "MAX_BYTES", 100)
    room = {b"a": 1, b"b": 0}  # messages each client's queue takes now
    sent: list[list[bytes]] = []

    def send(frames: list[bytes]) -> bool:
        if room[frames[0]] == 0:
            return False
        room[frames[0]] -= 1
        sent.append(frames)
        return True

    backlog = backlog_module.Backlog()
    assert backlog.send([b"a", b"1"], send) and backlog.send([b"a", b"2"], send)
    assert backlog.send([b"b", b"1"], send)
    assert sent == [[b"a", b"1"]] and backlog
    room[b"a"] = 5
    assert backlog.send([b"a", b"3"], send)  # behind "2", though there is room now
    backlog.flush(send)
    assert sent == [[b"a", b"1"], [b"a", b"2"], [b"a", b"3"]]
    assert backlog.send([b"b", b"2"], send) and backlog.send([b"b", b"3"], send)
    assert not backlog.send([b"b", b"4"], send)  # a fourth waiting message
    assert backlog.drop(b"b") == (4, 8) and not backlog
    assert backlog.send([b"b", b"x" * 99], send)  # 100 bytes with its routing id
    assert not backlog.send([b"b", b"y"], send)  # 102


def test_a_client_found_gone_while_its_backlog_flushes_leaves_the_others_flushing() -> None:
    backlog = backlog_module.Backlog()
    full = {b"gone", b"ok"}
    sent: list[list[bytes]] = []

    def send(frames: list[bytes]) -> bool:
        if frames[0] in full:
            return False
        if frames[0] == b"gone":  # what the daemon does on EHOSTUNREACH: drop, count as sent
            backlog.drop(b"gone")
        sent.append(frames)
        return True

    for peer in (b"gone", b"ok"):
        assert backlog.send([peer, b"1"], send) and backlog.send([peer, b"2"], send)
    full.clear()
    backlog.flush(send)
    assert sent == [[b"gone", b"1"], [b"ok", b"1"], [b"ok", b"2"]] and not backlog
