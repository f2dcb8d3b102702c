"""What the daemon promises its operators, as Redis and vLLM promise theirs, over real sockets.

- Capacity never leaks: a request the engine cannot hold is a `bad_request` (never
  `internal`) and takes nothing; whatever ends a request gives back the slot it took.
- An `abort` reaches a request from the moment the daemon accepted it.
- `close` ends the request running on its session (even one still in prefill, or a one-shot
  generate) and frees the slot once.
- A client whose connection closes has its work stopped within a step of the daemon noticing
  (about at once for a closed TCP connection); its sessions are closed, unless it named its own
  routing id (it may reconnect under it: then they wait for the idle timeout).
- Stopping while the model file is read, loads or warms up does not wait for any of them:
  SIGTERM at any moment of the start exits 0 within 2 s, and `health` answers from the
  first second.

The tiny random-weight model serves; a `slow` engine sleeps in every op so that the timing of
each case is certain rather than lucky.
"""

import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from test_daemon import LONG_PROMPT, PROMPT, Peer, serving, slow, spawn_serve, wait_for

from rocforge_client import BadRequest, UnknownSession, connect
from rocforge_rt.engine.engine import Engine
from rocforge_rt.server.config import DaemonConfig
from rocforge_rt.server.daemon import Daemon

N_SLOTS = 2  # TINY's --max-sessions


def assert_every_slot_is_free(endpoint: str) -> None:
    """Nothing in flight, no session, and an `open` of every slot succeeds."""
    with connect(endpoint, timeout=5) as client:
        wait_for(lambda: client.health()["in_flight"] == 0, timeout=3)
        health = client.health()
        assert (health["sessions"], health["slots_free"]) == (0, N_SLOTS), health
        assert client.stats()["kv"]["slots_in_use"] == 0
        sessions = [client.open(tokens=[1], max_tokens=1).session for _ in range(N_SLOTS)]
        for session in sessions:
            client.close(session)


# --- 1. capacity: what the engine cannot hold is a bad request that takes nothing --------------
@pytest.fixture(scope="module")
def shared(tiny_model: Path) -> Iterator[Daemon]:
    """One daemon for the module's requests (room for a value nested 10,000 deep)."""
    with serving(tiny_model, max_request_bytes=1 << 16) as daemon:
        yield daemon


@pytest.mark.parametrize(
    "fields",
    [{"top_k": 2**31}, {"top_k": 2**31 - 1}, {"top_k": 257}, {"top_p": 1e-46}, {"top_p": 1e-40},
     {"temperature": 1e-46}, {"repetition_penalty": 1e-46}, {"presence_penalty": -1e-40}],
    ids=["top_k=2**31", "top_k=int32 max", "top_k=vocab+1", "top_p=1e-46", "top_p=f32 subnormal",
         "temperature=1e-46", "repetition_penalty=1e-46", "presence_penalty=-f32 subnormal"],
)  # fmt: skip
def test_sampling_the_engine_cannot_hold_is_a_bad_request_and_takes_no_slot(
    shared: Daemon, fields: dict[str, Any]
) -> None:
    with connect(shared.endpoint, timeout=5) as client:
        for _ in range(2 * N_SLOTS):  # more than there are slots: a leak would show as `busy`
            with pytest.raises(BadRequest):
                client.open(tokens=PROMPT, **fields)
            with pytest.raises(BadRequest):
                next(client.generate(tokens=PROMPT, **fields))
    assert_every_slot_is_free(shared.endpoint)


def deep_stop(depth: int) -> bytes:
    """An `open` whose `stop` is a list nested `depth` deep (msgpack's own packer refuses)."""
    head = msgpack.packb({"op": "open", "id": 1, "tokens": [1]})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("stop") + b"\x91" * depth + b"\xa1x"


@pytest.mark.parametrize("depth", [100, 1000, 1023, 10_000])
def test_deeply_nested_values_are_bad_requests(shared: Daemon, depth: int) -> None:
    peer = Peer(shared.endpoint)
    try:
        peer.send(deep_stop(depth))
        reply = peer.recv()
        assert reply["error"]["code"] == "bad_request", reply
        assert "nested" in reply["error"]["message"]
    finally:
        peer.close()
    assert_every_slot_is_free(shared.endpoint)


F32_TINY = 2.0**-126  # float32's smallest normal number
F32_MAX = (2.0 - 2.0**-23) * 2.0**127  # and its largest finite one
I64_MIN, I64_MAX, U64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
NAN, INF = float("nan"), float("inf")
BAD, OK = "bad_request", "ok"


def int_edges(lo: int, hi: int, *, above_hi: str = BAD) -> list[tuple[Any, str]]:
    """An integer field in [lo, hi]: just below, at and just above each bound, the int64 and
    uint64 extremes, 2**31, and values of other types."""
    edges = [(lo - 1, BAD), (lo, OK), (lo + 1, OK), (hi - 1, OK), (hi, OK), (hi + 1, above_hi)]
    edges += [(v, OK if lo <= v <= hi else BAD) for v in (I64_MIN, -1, I64_MAX, 2**31, U64_MAX)]
    edges += [(1.0, BAD), (NAN, BAD), (True, BAD), ("1", BAD), (None, BAD)]
    return [(v, e) for v, e in edges if not isinstance(v, int) or I64_MIN <= v <= U64_MAX]


def float_edges(lo: float, hi: float, *, at_lo: str = OK) -> list[tuple[Any, str]]:
    """A number field in [lo, hi]: the neighbours of each bound, NaN, the infinities, the
    integer extremes, 2**31, and values of other types."""
    below, above = math.nextafter(lo, -INF), math.nextafter(hi, INF)
    edges = [(below, BAD), (lo, at_lo), (math.nextafter(lo, INF), OK)]
    edges += [(math.nextafter(hi, -INF), OK), (hi, OK), (above, BAD)]
    edges += [(v, BAD) for v in (NAN, INF, -INF)]
    edges += [(v, OK if lo <= v <= hi else BAD) for v in (I64_MIN, I64_MAX, U64_MAX, 2**31)]
    return edges + [(True, BAD), ("1", BAD), (None, BAD)]


def signed_float_edges(lo: float, hi: float) -> list[tuple[Any, str]]:
    """A number field 0 or in [lo, hi] in magnitude (0 < lo): float_edges and their negatives,
    and 0 with the values between 0 and lo."""
    edges = float_edges(lo, hi)
    mirrored = [(-v, e) for v, e in edges if isinstance(v, float) and math.isfinite(v)]
    return [(0.0, OK), (-0.0, OK), (5e-324, BAD), (-1e-46, BAD), *edges, *mirrored]


# Every numeric field of open/generate/append (the turn's) and of step, with the answer each
# value gets from a daemon of the TINY configuration: vocabulary 256, --max-new-tokens 40.
TURN_EDGES: dict[str, list[tuple[Any, str]]] = {
    # 0 is greedy; otherwise at least float32's smallest normal (the device divides by it)
    "temperature": [(0.0, OK), (-0.0, OK), (5e-324, BAD), (1e-46, BAD)]
    + float_edges(F32_TINY, 100.0),
    "top_k": int_edges(0, 256) + [(2**31 - 1, BAD)],  # at most the vocabulary
    "top_p": [(0.0, BAD), (5e-324, BAD), (1e-46, BAD)] + float_edges(F32_TINY, 1.0),
    "seed": int_edges(0, U64_MAX),
    "logprobs": int_edges(0, 20),
    # float32 on the device, 0 where it means off: greedy turns, the penalties still apply
    "min_p": [(0.0, OK), (-0.0, OK), (5e-324, BAD), (1e-46, BAD)] + float_edges(F32_TINY, 1.0),
    "repetition_penalty": [(0.0, BAD), (-1.0, BAD), (1e-46, BAD)]
    + float_edges(F32_TINY, F32_MAX),  # the device divides by it
    "frequency_penalty": signed_float_edges(F32_TINY, 2.0),
    "presence_penalty": signed_float_edges(F32_TINY, 2.0),
    "max_tokens": int_edges(1, 40, above_hi="limit_exceeded")
    + [(2**24, "limit_exceeded"), (2**24 + 1, BAD)],
    # a deadline of 5e-324 ms has passed before the first step
    "deadline_ms": [(e[0], "deadline_exceeded" if e[0] == 5e-324 else e[1])
                    for e in float_edges(0.0, 24 * 3600 * 1000.0, at_lo=BAD)],
    "tokens": [([v], BAD if v == 256 else e) for v, e in int_edges(0, 255)]
    + [([2**31 - 1], BAD), ([2**31], BAD)],
}  # fmt: skip
# A step of 1 ms is valid: it ends in time, or (a busy machine) past its deadline.
IN_TIME_OR_LATE = f"{OK}|deadline_exceeded"
STEP_EDGES = {
    "n": int_edges(1, 4096),
    "deadline_ms": [(1.0, IN_TIME_OR_LATE), (0.0, BAD), (NAN, BAD)],
}
# a session id in range that is not open for this client
SESSION_EDGES = [(v, "unknown_session" if e == OK else e) for v, e in int_edges(1, I64_MAX)]
CASES = (
    [(op, name, v, e) for op in ("open", "generate", "append")
     for name, edges in TURN_EDGES.items() for v, e in edges]
    + [("step", name, v, e) for name, edges in STEP_EDGES.items() for v, e in edges]
    + [(op, "session", v, e) for op in ("append", "step", "generate", "close", "abort")
       for v, e in SESSION_EDGES]
)  # fmt: skip


def answered_as_expected(answer: str, expected: str) -> bool:
    """Whether `answer` is one that `expected` allows (answers apart by '|')."""
    return answer in expected.split("|")


def _case_id(case: tuple) -> str:
    op, name, value, expected = case
    return f"{op}-{name}={value!r:.24}-{expected}"


def probe(peer: Peer, op: str, name: str, value: Any) -> str:
    """Send `op` with field `name` = `value`, its other fields valid (a session of the peer's
    own where it needs one); return the answer; leave no session behind."""
    own = None
    if name == "session":  # the session is the field under test
        fields: dict[str, Any] = {"tokens": [1]} if op == "append" else {}
    elif op == "step":
        fields = {}
    else:  # open, generate, append: a turn
        fields = {"tokens": PROMPT, "max_tokens": 3}
    if op in ("append", "step") and name != "session":
        peer.request(op="open", id="setup", tokens=PROMPT, max_tokens=4)
        setup = peer.until("setup")[-1]
        own = fields["session"] = setup["session"]
        token = fields["token"] = setup["token"]
    peer.request(op=op, id="probe", **{**fields, name: value})
    final = peer.until("probe")[-1]
    if op == "open" and final["ok"]:
        own, token = final["session"], final["token"]
    if own is not None:
        peer.request(op="close", id="cleanup", session=own, token=token)
        assert peer.until("cleanup")[-1]["ok"]
    return "ok" if final["ok"] else final["error"]["code"]


# At the smallest temperature numpy's float32 division overflows to -inf for every token but
# the best, whose weight exp(0) = 1 is the only one left: greedy, as meant, with a warning.
# At the largest repetition penalty a negative logit times it overflows to -inf: that token
# is out, as meant, with a warning too.
@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize(("op", "name", "value", "expected"), CASES, ids=map(_case_id, CASES))
def test_every_numeric_boundary_gets_a_clear_answer_and_leaves_every_slot_free(
    shared: Daemon, op: str, name: str, value: Any, expected: str
) -> None:
    peer = Peer(shared.endpoint)
    try:
        assert answered_as_expected(probe(peer, op, name, value), expected)
    finally:
        peer.close()
    assert_every_slot_is_free(shared.endpoint)


# --- 2. an abort reaches a request from the moment it is accepted ------------------------------
def replies_to(peer: Peer, *rids: Any, timeout: float = 10.0) -> dict[Any, list[dict[str, Any]]]:
    """Every reply to each of `rids`, up to its final one, whatever order they come in."""
    got: dict[Any, list[dict[str, Any]]] = {rid: [] for rid in rids}
    pending = set(rids)
    while pending:
        reply = peer.recv(timeout)
        if reply["id"] in pending:
            got[reply["id"]].append(reply)
            if not reply["ok"] or reply.get("done", True):
                pending.discard(reply["id"])
    return got


def race(endpoint: str, trials: int, cut: str) -> list[tuple[Any, Any]]:
    """`trials` times: open a session, start a step or a generate on it, and at once `abort`
    it by session or `close` it; each trial's (answer to the cut, how the work ended)."""
    peer = Peer(endpoint)
    ends = []
    try:
        for trial in range(trials):
            peer.request(op="open", id="open", tokens=PROMPT, max_tokens=40)
            opened = peer.until("open")[-1]
            session, token = opened["session"], opened["token"]
            work = {"op": "step", "n": 4096} if trial % 2 else {"op": "generate"}
            peer.request(id="work", session=session, token=token, **work)
            peer.request(op=cut, id="cut", session=session, token=token)
            got = replies_to(peer, "work", "cut")
            final, answer = got["work"][-1], got["cut"][0]
            ends.append((
                answer.get("aborted", answer.get("closed")),
                (final.get("finish_reason"), final.get("abort_reason")) if final["ok"]
                else final["error"]["code"],
            ))  # fmt: skip
            if cut == "abort":
                peer.request(op="close", id="close", session=session, token=token)
                assert peer.until("close")[-1]["ok"]
    finally:
        peer.close()
    return ends


def test_an_abort_sent_right_after_a_request_on_the_session_always_reaches_it(
    tiny_model: Path,
) -> None:
    with serving(tiny_model, slow(0.0005)) as daemon:
        ends = race(daemon.endpoint, 100, "abort")
        assert all(aborted for aborted, _ in ends), f"{sum(a for a, _ in ends)} of 100 aborted"
        assert {end for _, end in ends} <= {("abort", "client"), "aborted"}
        assert_every_slot_is_free(daemon.endpoint)


# --- 3. closing a session ends the request running on it ---------------------------------------
def test_closing_a_one_shot_generate_ends_it_with_finish_abort_and_frees_its_slot_once(
    tiny_model: Path,
) -> None:
    with serving(tiny_model, slow()) as daemon:
        peer = Peer(daemon.endpoint)
        try:
            peer.request(op="generate", id="gen", tokens=PROMPT, max_tokens=40)
            first = peer.recv()
            assert first["ok"] and first["done"] is False
            peer.request(op="close", id="close", session=first["session"], token=first["token"])
            got = replies_to(peer, "gen", "close")
        finally:
            peer.close()
        last = got["gen"][-1]
        assert last["ok"], last
        assert (last["done"], last["finish_reason"], last["abort_reason"]) == (
            True, "abort", "close",
        )  # fmt: skip
        assert got["close"][0]["ok"] and got["close"][0]["closed"] is True, got["close"]
        assert_every_slot_is_free(daemon.endpoint)


def test_an_open_still_in_prefill_cannot_be_closed_before_its_token_but_aborts_by_request_id(
    tiny_model: Path,
) -> None:
    """Its token comes with its first token: until then a `close` of its session is refused
    (server/lifecycle.py still ends such an open when its session closes: test_job_lifecycle);
    an abort by request id ends it, and its slot is freed once."""
    with serving(tiny_model, slow()) as daemon:
        peer = Peer(daemon.endpoint)
        try:
            peer.request(op="open", id="probe", tokens=[1], max_tokens=1)
            probe = peer.until("probe")[-1]
            peer.request(op="close", id="c0", session=probe["session"], token=probe["token"])
            assert peer.until("c0")[-1]["ok"]
            peer.request(op="open", id="long", tokens=LONG_PROMPT)  # 12 chunks: a while
            time.sleep(0.1)
            session = probe["session"] + 1  # ids count up
            peer.request(op="close", id="close", session=session, token=probe["token"])
            assert peer.until("close")[-1]["error"]["code"] == "unknown_session"
            peer.request(op="abort", id="abort", request="long")
            got = replies_to(peer, "long", "abort")
        finally:
            peer.close()
        assert got["long"][-1]["error"]["code"] == "aborted", got["long"]
        assert got["abort"][0]["aborted"] is True
        assert_every_slot_is_free(daemon.endpoint)


# --- 4. a client that vanishes --------------------------------------------------------------------
LONG_TURN = {"ctx_size": 256, "max_prompt_tokens": 255, "max_new_tokens": 256}


def decode_steps(endpoint: str) -> int:
    with connect(endpoint, timeout=5) as client:
        steps = client.stats()["overhead"]["steps"]
    return steps.get("decode", {}).get("steps", 0)


def vanish_during_a_long_step(endpoint: str, routing_id: bytes | None = None) -> tuple[int, str]:
    """A DEALER opens a session, sends `step n=800` and closes at once (linger 0); the
    session's id and token."""
    peer = Peer(endpoint, routing_id=routing_id)
    try:
        peer.request(op="open", id="open", tokens=PROMPT, max_tokens=240)
        opened = peer.until("open")[-1]
        session, token = opened["session"], opened["token"]
        peer.request(op="step", id="step", session=session, token=token, n=800)
        time.sleep(0.2)  # a few decode steps in
    finally:
        peer.close()
    return session, token


def test_the_peer_watch_names_exactly_the_peers_whose_connection_closed() -> None:
    from rocforge_rt.server.peers import PeerWatch, generated_routing_id, source_fd

    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    watch = PeerWatch(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = [context.socket(zmq.DEALER) for _ in range(2)]
    try:
        seen = {}
        for dealer in dealers:
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(b"hello")
            assert router.poll(2000)
            frame = router.recv(copy=False)
            router.recv()
            assert watch.events() == []
            assert watch.arrived(frame.bytes, source_fd(frame)) is True
            seen[dealer] = (frame.bytes, source_fd(frame))
        assert all(generated_routing_id(peer) for peer, _ in seen.values())
        leaving, staying = dealers
        leaving.close(linger=0)
        assert watch.socket.poll(2000)
        gone = []
        limit = time.monotonic() + 2
        while not gone and time.monotonic() < limit:
            gone = watch.events()
        assert gone == [seen[leaving][0]]
        assert watch.arrived(*seen[leaving]) is False  # a message it sent before it left
        assert watch.arrived(*seen[staying]) is True
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        watch.close()
        router.close(linger=0)


FLOOD_THEN_VANISH = """
import time, zmq
from rocforge_rt.server.router_socket import tune_router
from rocforge_rt.server.peers import PeerWatch

context = zmq.Context()
router = context.socket(zmq.ROUTER)
tune_router(router, max_request_bytes=1 << 16)
watch = PeerWatch(router)
port = router.bind_to_random_port("tcp://127.0.0.1")
flood = context.socket(zmq.DEALER)
flood.sndhwm = 0
flood.connect(f"tcp://127.0.0.1:{port}")
for _ in range(20_000):  # far past the ROUTER's inbound queue: its reads of the peer stop
    flood.send(b"x" * 100)
flood.close(linger=10_000)  # gone once all of it is on the connection (however long that takes)
time.sleep(4.5)  # unread meanwhile, as while the daemon shuts down (two 2 s ZMTP heartbeats)
read, deadline = 0, time.monotonic() + 30
while read < 20_000 and time.monotonic() < deadline:  # a busy machine may pause the reads
    if router.poll(200):
        router.recv_multipart()
        read += 1
assert watch.socket.poll(2000), "the monitor never said the peer left"
print(read)
watch.close()
router.close(linger=0)
context.term()
"""


def test_a_peer_that_fills_its_queue_and_vanishes_while_unread_cannot_abort_the_process() -> None:
    """The daemon's ROUTER, tuned as the daemon tunes it, in a process of its own: libzmq
    aborts a process whose peer left with its queue full if a ZMTP heartbeat comes due."""
    done = subprocess.run(
        [sys.executable, "-c", FLOOD_THEN_VANISH], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "20000"  # every message it sent is still read


def test_a_client_that_vanishes_mid_step_has_its_work_stopped_and_its_slot_freed(
    tiny_model: Path,
) -> None:
    with serving(tiny_model, slow(0.002), **LONG_TURN) as daemon:  # 240 steps: seconds of work
        vanish_during_a_long_step(daemon.endpoint)
        gone = time.monotonic()
        with connect(daemon.endpoint, timeout=5) as client:
            wait_for(lambda: client.health()["in_flight"] == 0, timeout=2.0)
            wait_for(lambda: client.health()["slots_free"] == N_SLOTS, timeout=2.0)
            assert time.monotonic() - gone < 2.0
            assert client.health()["sessions"] == 0  # closed: nobody can ever reach it again
        steps = decode_steps(daemon.endpoint)
        time.sleep(0.3)
        assert decode_steps(daemon.endpoint) == steps < 200  # the engine stopped


def test_a_vanished_client_with_its_own_routing_id_keeps_its_sessions_until_it_comes_back(
    tiny_model: Path,
) -> None:
    with serving(tiny_model, slow(0.002), **LONG_TURN) as daemon:
        session, token = vanish_during_a_long_step(daemon.endpoint, routing_id=b"client-7")
        with connect(daemon.endpoint, timeout=5) as client:
            wait_for(lambda: client.health()["in_flight"] == 0, timeout=2.0)
            assert client.health()["sessions"] == 1  # it may come back under its name
        back = Peer(daemon.endpoint, routing_id=b"client-7")
        try:
            back.request(op="step", id="again", session=session, token=token)
            assert back.until("again")[-1]["error"]["code"] == "turn_finished"  # was cut
            back.request(op="close", id="close", session=session, token=token)
            assert back.until("close")[-1]["closed"] is True
        finally:
            back.close()
        assert_every_slot_is_free(daemon.endpoint)


def generate_on_a_session(peer: Peer) -> tuple[int, str]:
    """Open a session of a 40-token turn and have a `generate` on it under way (its first
    reply read); the session and its token."""
    peer.request(op="open", id="open", tokens=PROMPT, max_tokens=40)
    opened = peer.until("open")[-1]
    session, token = opened["session"], opened["token"]
    peer.request(op="generate", id="gen", session=session, token=token)
    peer.recv()
    return session, token


# --- 4b. a client's own bounds: refused at the socket, in flight ---------------------------------
def test_a_request_on_a_session_it_cannot_open_is_refused_at_the_socket_at_once(
    tiny_model: Path,
) -> None:
    """While the engine thread is in a step that takes a second, a `step` on a session the
    request's token does not open is answered by the I/O thread, not after that step."""
    with serving(tiny_model, slow(0.05)) as daemon, connect(daemon.endpoint, timeout=20) as client:
        stream = client.generate(tokens=PROMPT, max_tokens=40)
        next(stream)
        for session, token in ((999, "x" * 32), (1, "not its token")):
            started = time.monotonic()
            with pytest.raises(UnknownSession):
                client.step(session, token=token, timeout=5)
            assert time.monotonic() - started < 0.3
        stream.close()


def test_a_client_has_at_most_two_requests_a_slot_and_the_queue_in_flight(
    tiny_model: Path,
) -> None:
    """Past them its requests could only be refused: the next is `busy` at once, and the
    engine thread's inbox holds no more of its requests than that."""
    with serving(tiny_model, slow(0.05), max_queue=0) as daemon:
        peer = Peer(daemon.endpoint)
        try:
            session, token = generate_on_a_session(peer)  # one request in flight
            for i in range(2 * N_SLOTS):  # three more to the bound of four, then one past it
                peer.request(op="step", id=i, session=session, token=token)
            (past,) = peer.until(2 * N_SLOTS - 1, timeout=0.5)  # before the step ends
            assert past["error"]["code"] == "busy" and "in flight" in past["error"]["message"]
        finally:
            peer.close()


# --- 5. stopping while the model loads or warms up ---------------------------------------------
SLOW_UPLOAD = """
import sys, time
from rocforge_rt.backends.cpu import CpuBackend
from rocforge_rt.cli import main

linear = CpuBackend.linear

def slow_linear(self, *tensors):  # a big model's upload: 30 layers take seconds
    time.sleep(0.05)
    return linear(self, *tensors)

CpuBackend.linear = slow_linear
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def thirty_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model of SmolLM2-135M's shape (30 layers, no vocabulary)."""
    from rocforge_rt.model.synthetic import write_synthetic_model

    out = tmp_path_factory.mktemp("models") / "smollm2-shape.gguf"
    return write_synthetic_model("smollm2-135m", out, seed=1, progress=False)


def assert_sigterm_exits_0_within_2_s(process: Any, log_line: str) -> None:
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert process.wait(10) == 0
    assert time.monotonic() - sent < 2.0
    assert log_line in process.stderr.read()


def assert_sigterm_while_loading_exits_0_within_2_s(launcher: str, model: Path) -> None:
    """`serve` run by `launcher` (a script slowing a part of the load) answers `health` as
    loading, and SIGTERM then stops it."""
    process, addr = spawn_serve(["-c", launcher], model, ctx_size=64)
    try:
        with connect(addr, timeout=10) as client:
            assert client.health()["state"] == "loading"
        assert_sigterm_exits_0_within_2_s(process, "stopped while loading")
    finally:
        process.kill()
        process.wait()


def test_sigterm_while_the_model_loads_exits_0_within_2_s(thirty_layers: Path) -> None:
    assert_sigterm_while_loading_exits_0_within_2_s(SLOW_UPLOAD, thirty_layers)


SLOW_READ = """
import sys, time
import rocforge_rt.model.gguf_file as gguf_file
from rocforge_rt.cli import main

read = gguf_file._BoundedReader._get

def slow_read(self, *args, **kwargs):  # a model file on a slow disk: its header takes seconds
    time.sleep(0.02)
    return read(self, *args, **kwargs)

gguf_file._BoundedReader._get = slow_read
sys.exit(main(sys.argv[1:]))
"""


def test_the_socket_answers_health_while_the_model_file_is_read_and_sigterm_stops_it(
    tiny_model: Path,
) -> None:
    assert_sigterm_while_loading_exits_0_within_2_s(SLOW_READ, tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.3, 1.0, 2.0, 3.0])
def test_sigterm_at_any_moment_of_the_start_exits_0_within_2_s(
    default_model: Path, after_s: float
) -> None:
    """`python -m rocforge_rt serve` (the console script's entry) of the default model, sent
    SIGTERM `after_s` after it started: imports, reading the model file, loading, warm-up.
    Earlier, the interpreter of an editable install is still starting (site and setuptools'
    import hook take 50-80 ms here, before any code of ours); scripts/hardening_bars.py
    times 0.05 s on the installed wheel."""
    process, addr = spawn_serve(["-m", "rocforge_rt"], default_model, ctx_size=256)
    try:
        time.sleep(after_s)
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert process.wait(10) == 0, process.stderr.read()
        assert time.monotonic() - sent < 2.0
    finally:
        process.kill()
        process.wait()


def test_health_answers_within_a_second_of_the_start(default_model: Path) -> None:
    """The socket is bound before the model file is read (seconds for SmolLM2's vocabulary)."""
    started = time.monotonic()
    process, addr = spawn_serve(["-m", "rocforge_rt"], default_model, ctx_size=256)
    try:
        with connect(addr, timeout=10) as client:
            assert client.health()["live"] is True
        assert time.monotonic() - started < 1.0
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0


def test_stopping_during_the_warm_up_does_not_wait_for_it(tiny_model: Path) -> None:
    loaded = threading.Event()
    slowed = slow(0.05)  # a warm-up step takes about 0.6 s: 8 of them for 4 slots

    def hook(engine: Engine) -> None:
        slowed(engine)
        loaded.set()

    daemon = Daemon(
        DaemonConfig(model=tiny_model, backend="cpu", bind="tcp://127.0.0.1:*", ctx_size=64,
                     max_sessions=4, prefill_chunk=4),
        engine_hook=hook,
    )  # fmt: skip
    daemon.start()
    try:
        assert loaded.wait(10)
        time.sleep(0.2)  # into the warm-up
        daemon.stop()
        stopped = time.monotonic()
        daemon.join(5)
        assert time.monotonic() - stopped < 2.0
        assert daemon.error is None
    finally:
        daemon.stop()
        daemon.join()
