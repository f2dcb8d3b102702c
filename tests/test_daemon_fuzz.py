"""Property: no sequence of frames breaks the daemon or another client's session.

Hypothesis sends random messages (mostly of one frame, some of several) from
throw-away sockets: raw bytes (oversize ones included), random msgpack values,
opens and generates of random token prompts, valid-ish requests (a real op
with a random subset of its fields, each of a valid type: opens, generates,
steps, aborts and closes on random session ids really run) and those requests
with one field replaced by a random value. After each, the daemon must still
answer `health`; after all of them, a session opened before the fuzzing must
decode the same greedy tokens as a reference run made before it, and nothing
may be left held: no request in flight, no session but that one, every other
slot free.
"""

import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from clients.rocforge_client import connect
from rocforge_rt.server.config import DaemonConfig
from rocforge_rt.server.daemon import Daemon
from rocforge_rt.server.protocol import OPS

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]
N_TOKENS = 12
MAX_REQUEST_BYTES = 2048
CONFIG = {
    "backend": "cpu",
    "bind": "tcp://127.0.0.1:*",
    "ctx_size": 48,
    "max_sessions": 16,  # fuzz sessions stay open until their socket closes: busy comes too
    "max_prompt_tokens": 32,
    "max_new_tokens": N_TOKENS,
    "max_request_bytes": MAX_REQUEST_BYTES,
    "prefill_chunk": 4,
    "idle_timeout_s": 600.0,
}
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


def token_ids(*replies: Any) -> list[int]:
    return [t.token for r in replies for t in r.tokens]


def test_random_frames_leave_the_daemon_serving_and_other_sessions_intact(tiny_model: Path) -> None:
    with (
        Daemon(DaemonConfig(model=tiny_model, **CONFIG)) as daemon,
        connect(daemon.endpoint, timeout=10) as owner,
    ):
        first = owner.open(tokens=PROMPT, max_tokens=N_TOKENS)
        reference = token_ids(first, owner.step(first.session, N_TOKENS - 1))
        owner.close(first.session)
        victim = owner.open(tokens=PROMPT, max_tokens=N_TOKENS)
        context = zmq.Context.instance()

        @settings(
            max_examples=200,
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
            attacker.poll(20)  # let the daemon start on it before the socket vanishes
            attacker.close()
            assert owner.health(timeout=5)["live"]

        fuzz()
        assert owner.health()["ready"]
        assert token_ids(victim, owner.step(victim.session, N_TOKENS - 1)) == reference
        # nothing leaked: the attackers' sessions closed with their sockets, every slot but
        # the victim's is free
        deadline = time.monotonic() + 5
        while (owner.health()["in_flight"], owner.health()["sessions"]) != (0, 1):
            assert time.monotonic() < deadline, owner.health()
            time.sleep(0.02)
        assert owner.health()["slots_free"] == CONFIG["max_sessions"] - 1
