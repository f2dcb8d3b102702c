"""The fault-injection suite: one daemon takes every kind of fault in turn, and after each
one it must hold nothing (no request in flight, no session, every KV slot free), say it is
ready, and decode a control session's greedy tokens exactly as it did before the first.

The faults, in order: random frames (Hypothesis: raw bytes, oversize messages, random
msgpack values, valid-ish requests and those with one field replaced, really run on
throw-away sockets that vanish after them); every numeric boundary value of every op;
clients racing aborts and closes against their own steps and generates, from several
threads at once; clients that vanish mid-step; a client that never reads its replies;
frame floods; one client flooding invalid requests (it is held to its refusals a second while
another decodes); requests too large to decode (still answered by id) and arrays longer
than any field takes. Signals are the subprocess tests' (a SIGTERM while the socket is not bound,
while the model loads, during the warm-up and during streams: test_daemon_hardening.py,
test_daemon.py). Each test adds its figures to TALLY; the last one prints them.

CPU backend, the tiny random-weight model, loopback only; a `slow` engine (0.5 ms an op)
gives the races room to happen.
"""

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_daemon import PROMPT, TINY, Peer, serving, slow, wait_for
from test_daemon_hardening import (
    CASES,
    answered_as_expected,
    decode_steps,
    generate_on_a_session,
    probe,
    race,
)

from rocforge_client import connect
from rocforge_rt.server import backlog as backlog_module
from rocforge_rt.server.daemon import Daemon
from rocforge_rt.server.protocol import OPS

N_TOKENS = 12  # the control session's greedy tokens
MAX_REQUEST_BYTES = 1 << 16  # room for a value nested 10,000 deep
MAX_WAITING = 50  # replies waiting for a client before it counts as not reading
TALLY: Counter[str] = Counter()

FIELD_NAMES = sorted({"id", "deadline_ms", *(name for fields in OPS.values() for name in fields)})

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=16),
    st.binary(max_size=16),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
VALID = {
    "id": st.integers(0, 1000) | st.text(max_size=8),
    "deadline_ms": st.floats(0.5, 500),
    "session": st.integers(1, 8),
    "prompt": st.text(max_size=20),
    "tokens": st.lists(st.integers(0, 255), min_size=1, max_size=40),
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text()}),
        min_size=1,
        max_size=2,
    ),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, 50),
    "top_p": st.floats(0.1, 1),
    "seed": st.integers(0, 2**32),
    "logprobs": st.integers(0, 5),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "stop": st.lists(st.text(max_size=4), max_size=3),
    "max_tokens": st.integers(1, N_TOKENS),
    "n": st.integers(1, N_TOKENS),
    "request": st.integers(0, 1000),
    "reset": st.booleans(),
    "records": st.integers(0, 5),
    "steps": st.integers(1, 10),
    "launches": st.booleans(),
    "kernels": st.booleans(),
    "every": st.integers(1, 64),
    "token": st.text(max_size=32),  # never a session's: those are 128 random bits
    "operator_key": st.text(max_size=8),
}


def _requests_for(op: str) -> st.SearchStrategy[dict[str, Any]]:
    names = ("id", "deadline_ms", *OPS[op])
    return st.fixed_dictionaries({"op": st.just(op)}, optional={n: VALID[n] for n in names})


valid_ish = st.sampled_from(sorted(OPS)).flatmap(_requests_for)
runnable = st.fixed_dictionaries(
    {"op": st.sampled_from(["open", "generate"]), "tokens": VALID["tokens"]},
    optional={n: VALID[n] for n in ("id", "deadline_ms", "max_tokens", "temperature", "stop")},
)
perturbed = st.tuples(valid_ish, st.sampled_from(FIELD_NAMES), values).map(
    lambda t: {**t[0], t[1]: t[2]}
)
payloads = st.one_of(
    st.binary(max_size=2 * MAX_REQUEST_BYTES + 1000).map(lambda b: ("bytes", b)),
    values.map(lambda v: ("msgpack value", msgpack.packb(v))),
    runnable.map(lambda r: (f"runnable {r['op']}", msgpack.packb(r))),
    valid_ish.map(lambda r: (f"valid-ish {r['op']}", msgpack.packb(r))),
    perturbed.map(lambda r: (f"perturbed {r['op']}", msgpack.packb(r))),
)
single_frame = payloads.map(lambda p: [p])
multi_frame = st.lists(payloads, min_size=2, max_size=4)
messages = st.lists(st.one_of(single_frame, single_frame, multi_frame), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def suite(tiny_model: Path) -> Iterator[tuple[Daemon, list[int]]]:
    """The daemon under attack, and the control session's tokens before any fault."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backlog_module, "MAX_MESSAGES", MAX_WAITING)
        with serving(tiny_model, slow(0.0005), max_request_bytes=MAX_REQUEST_BYTES) as daemon:
            yield daemon, control_tokens(daemon.endpoint)


def control_tokens(endpoint: str) -> list[int]:
    with connect(endpoint, timeout=10) as client:
        first = client.open(tokens=PROMPT, max_tokens=N_TOKENS)
        rest = client.step(first.session, N_TOKENS - 1)
        client.close(first.session)
    return [t.token for r in (first, rest) for t in r.tokens]


@pytest.fixture(autouse=True)
def holds_nothing_after(suite: tuple[Daemon, list[int]]) -> Iterator[None]:
    yield
    daemon, reference = suite
    with connect(daemon.endpoint, timeout=10) as client:
        wait_for(lambda: (client.health()["in_flight"], client.health()["sessions"]) == (0, 0))
        health = client.health()
        assert health["ready"] and health["slots_free"] == TINY["max_sessions"], health
        assert client.stats()["kv"]["slots_in_use"] == 0
    assert control_tokens(daemon.endpoint) == reference
    TALLY["faults survived"] += 1


def test_random_frames(suite: tuple[Daemon, list[int]]) -> None:
    """A session opened before the fuzzing decodes, after it, what the control session does."""
    daemon, reference = suite
    context = zmq.Context.instance()
    owner = connect(daemon.endpoint, timeout=10)
    victim = owner.open(tokens=PROMPT, max_tokens=N_TOKENS)

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(sent=messages)
    def fuzz(sent: list[list[tuple[str, bytes]]]) -> None:
        attacker = context.socket(zmq.DEALER)
        attacker.linger = 0
        attacker.connect(daemon.endpoint)
        for message in sent:
            event(message[0][0] if len(message) == 1 else "multi-frame")
            attacker.send_multipart([frame for _, frame in message])
            TALLY["fuzzed messages"] += 1
        attacker.poll(20)  # let the daemon start on it before the socket vanishes
        attacker.close()
        with connect(daemon.endpoint, timeout=5) as client:
            assert client.health()["live"]

    try:
        fuzz()
        rest = owner.step(victim.session, N_TOKENS - 1)
        assert [t.token for r in (victim, rest) for t in r.tokens] == reference
        owner.close(victim.session)
    finally:
        owner.disconnect()


# the largest repetition penalty overflows a negative logit to -inf: that token is out, as
# meant (test_daemon_hardening.py's boundary test says the same)
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_every_numeric_boundary_value(suite: tuple[Daemon, list[int]]) -> None:
    daemon, _ = suite
    peer = Peer(daemon.endpoint)
    try:
        answers = [(case, probe(peer, *case[:3])) for case in CASES]
        wrong = [(*case, got) for case, got in answers if not answered_as_expected(got, case[3])]
    finally:
        peer.close()
    TALLY["boundary values"] += len(CASES)
    assert wrong == []


def test_aborts_and_closes_racing_steps_from_several_clients(
    suite: tuple[Daemon, list[int]],
) -> None:
    """Two clients abort, one closes (the daemon has two slots: a third client opening
    meanwhile would wait for one, which `race` does not expect, so closes run after)."""
    daemon, _ = suite
    ends: dict[int, list[tuple[Any, Any]]] = {}
    threads = [
        threading.Thread(target=lambda i=i: ends.__setitem__(i, race(daemon.endpoint, 50, "abort")))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    aborts = ends[0] + ends[1]
    closes = race(daemon.endpoint, 50, "close")
    TALLY["raced aborts"] += len(aborts)
    TALLY["raced aborts that took effect"] += sum(bool(took) for took, _ in aborts)
    TALLY["raced closes"] += len(closes)
    assert all(took for took, _ in aborts), f"{sum(t for t, _ in aborts)} of {len(aborts)}"
    assert {end for _, end in aborts} <= {("abort", "client"), "aborted"}
    assert all(took for took, _ in closes)
    assert {end for _, end in closes} <= {("abort", "close"), "aborted"}


def test_clients_that_vanish_mid_stream(suite: tuple[Daemon, list[int]]) -> None:
    """Each goes after its stream's first token: the 39 steps left of its turn are not run."""
    daemon, _ = suite
    for _ in range(4):
        before = decode_steps(daemon.endpoint)
        peer = Peer(daemon.endpoint)
        try:
            generate_on_a_session(peer)
        finally:
            peer.close()
        with connect(daemon.endpoint, timeout=5) as client:
            wait_for(lambda: client.health()["in_flight"] == 0)
        steps = decode_steps(daemon.endpoint) - before
        assert steps < 20, f"{steps} decode steps ran for a client that had gone"
        TALLY["vanished clients"] += 1
        TALLY["decode steps run for vanished clients"] += steps


def test_a_client_that_never_reads(suite: tuple[Daemon, list[int]]) -> None:
    daemon, _ = suite
    sloth = Peer(daemon.endpoint)
    sloth.socket.rcvhwm = 1
    sloth.socket.setsockopt(zmq.RCVBUF, 4096)
    try:
        sloth.request(op="open", id="open", tokens=PROMPT, max_tokens=40)
        opened = sloth.until("open")[-1]
        sloth.request(op="generate", id="gen", session=opened["session"], token=opened["token"])
        for i in range(20_000):  # its replies pile up past MAX_WAITING
            sloth.request(op="health", id=i)
        TALLY["replies a slow reader left unread"] += 20_000
        with connect(daemon.endpoint, timeout=5) as other:
            wait_for(lambda: other.health()["in_flight"] == 0, timeout=10)  # its stream stopped
    finally:
        sloth.close()


def test_frame_floods(suite: tuple[Daemon, list[int]]) -> None:
    daemon, _ = suite
    flood = Peer(daemon.endpoint)
    flood.socket.sndhwm = 0
    try:
        for n in (4, 1000, 1_000_000):
            flood.send(*[b""] * n)
            reply = flood.recv(timeout=10)
            assert reply["error"]["code"] == "bad_request" and "frames" in reply["error"]["message"]
            TALLY["flooded frames"] += n
    finally:
        flood.close()


def test_a_client_flooding_invalid_requests(suite: tuple[Daemon, list[int]]) -> None:
    """20,000 steps on a session that does not exist, sent as fast as the flooder can (its
    replies read between batches), while another client decodes: the flooder hears
    `rate_limited` once its refusals pass the budget, the rest of its second is dropped
    unread, and the other client's tokens are its own."""
    daemon, reference = suite
    flood = Peer(daemon.endpoint)
    flood.socket.sndhwm = 0
    codes: Counter[str] = Counter()

    def drain(wait_ms: int = 0) -> None:
        while flood.socket.poll(wait_ms):
            codes[msgpack.unpackb(flood.socket.recv_multipart()[-1])["error"]["code"]] += 1

    try:
        with connect(daemon.endpoint, timeout=30) as client:
            first = client.open(tokens=PROMPT, max_tokens=N_TOKENS)
            for i in range(20_000):
                flood.request(op="step", id=i, session=999_999, token="x" * 32)
                if i % 20 == 19:
                    drain()
            rest = client.step(first.session, N_TOKENS - 1)
            client.close(first.session)
            assert [t.token for r in (first, rest) for t in r.tokens] == reference
        wait_for(lambda: drain(100) or codes["rate_limited"] > 0, timeout=30)
        drain(500)
    finally:
        flood.close()
    # past its budget (the replies of a client this slow to read may be dropped as well:
    # the suite's backlog holds 50), then the rest of each second dropped unread
    assert codes["rate_limited"] > 0 and codes["unknown_session"] > 0
    assert sum(codes.values()) < 20_000
    TALLY["flooded invalid requests"] += 20_000
    TALLY["of them dropped unread"] += 20_000 - sum(codes.values())


def test_requests_too_large_to_decode_and_arrays_longer_than_any_field(
    suite: tuple[Daemon, list[int]],
) -> None:
    """A request over --max-request-bytes (up to twice it: past that ZeroMQ drops the
    connection) is refused by its id; an array longer than any field takes is refused from
    its header, so forty of them (the suite's backlog takes 50 replies) cost the daemon no
    time another client sees."""
    daemon, _ = suite
    peer = Peer(daemon.endpoint)
    try:
        peer.request(op="generate", id="big", prompt="x" * (MAX_REQUEST_BYTES + 100))
        reply = peer.until("big")[-1]
        assert reply["error"]["code"] == "too_large", reply
        wide = msgpack.packb({"op": "open", "tokens": [1] * 60_000, "id": "wide"})
        assert len(wide) < MAX_REQUEST_BYTES
        with connect(daemon.endpoint, timeout=5) as other:
            started = time.monotonic()
            for _ in range(40):
                peer.send(wide)
            other.health()
            assert time.monotonic() - started < 1.0
        for _ in range(40):
            reply = peer.until("wide")[-1]
            assert reply["error"]["code"] == "bad_request"  # by its id, read past the array
            assert "an array of over" in reply["error"]["message"]
    finally:
        peer.close()
    TALLY["requests too large or too long"] += 41


def test_zz_the_tally(suite: tuple[Daemon, list[int]]) -> None:
    """Runs last (pytest keeps file order): what the daemon took, and that it took it all."""
    print("\nfault suite:", ", ".join(f"{name} {count}" for name, count in TALLY.items()))
    assert TALLY["faults survived"] == 8
