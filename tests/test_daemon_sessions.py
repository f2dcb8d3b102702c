"""Who may use a session: the holder of its token (and, with CURVE, of its client key), never
whoever names the right ZeroMQ routing id; the per-client session quota; the operator key;
what `info` shows. Over real loopback sockets, on the tiny random-weight model."""

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import zmq.auth
from test_daemon import PROMPT, Peer, serving, slow, wait_for

from rocforge_client import Busy, Forbidden, UnknownSession, connect
from rocforge_rt.server.access import Owner, new_token, operator_allowed, same_secret
from rocforge_rt.server.protocol import ProtocolError, parse_request
from rocforge_rt.server.security import generate_keys

N_SLOTS = 2  # TINY's --max-sessions


def session_ops(session: int, **token: Any) -> list[dict[str, Any]]:
    """A request of every op that names a session."""
    return [
        {"op": "step", "id": "step", "session": session, "n": 1, **token},
        {"op": "generate", "id": "generate", "session": session, **token},
        {"op": "append", "id": "append", "session": session, "tokens": [1], **token},
        {"op": "abort", "id": "abort", "session": session, **token},
        {"op": "close", "id": "close", "session": session, **token},
    ]


def refusals(peer: Peer, session: int, **token: Any) -> list[dict[str, Any]]:
    """Each op on `session` from `peer`; their final replies."""
    out = []
    for request in session_ops(session, **token):
        peer.request(**request)
        out.append(peer.until(request["id"], timeout=5)[-1])
    return out


def open_on(peer: Peer) -> tuple[int, str]:
    peer.request(op="open", id="open", tokens=PROMPT, max_tokens=8)
    reply = peer.until("open")[-1]
    assert reply["ok"], reply
    return reply["session"], reply["token"]


# --- tokens ---------------------------------------------------------------------------------------
def test_open_replies_with_a_128_bit_token_and_later_replies_do_not_repeat_it(tiny_model) -> None:
    with serving(tiny_model) as daemon, connect(daemon.endpoint, timeout=5) as client:
        first = client.open(tokens=PROMPT, max_tokens=8)
        assert re.fullmatch(r"[0-9a-f]{32}", first.token)
        assert client.step(first.session, 2).token is None
        second = client.open(tokens=PROMPT, max_tokens=8)
        assert second.token != first.token
        for session in (first.session, second.session):
            client.close(session)


def test_a_wrong_or_missing_token_is_refused_as_a_session_that_does_not_exist(tiny_model) -> None:
    with serving(tiny_model) as daemon:
        owner = Peer(daemon.endpoint)
        try:
            session, token = open_on(owner)
            wrong = new_token()
            for given in ({}, {"token": wrong}, {"token": token[:-1]}, {"token": ""}):
                for reply in refusals(owner, session, **given):  # even from its own connection
                    assert reply["error"]["code"] == "unknown_session", (given, reply)
            missing = refusals(owner, session + 100, token=token)  # no such session
            tried = refusals(owner, session, token=wrong)
            for a, b in zip(missing, tried, strict=True):  # the same answer: nothing to probe
                assert (
                    a["error"]["message"].replace(str(session + 100), str(session))
                    == (b["error"]["message"])
                )
            owner.request(op="step", id="ok", session=session, token=token, n=2)
            assert len(owner.until("ok")[-1]["tokens"]) == 2  # the session is untouched
            owner.request(op="close", id="bye", session=session, token=token)
            assert owner.until("bye")[-1]["closed"] is True
        finally:
            owner.close()


def test_a_client_with_the_victims_routing_id_but_no_token_cannot_touch_its_session(
    tiny_model,
) -> None:
    with serving(tiny_model) as daemon:
        victim = Peer(daemon.endpoint, routing_id=b"victim")
        try:
            session, token = open_on(victim)
        finally:
            victim.close()  # its sessions wait for it: it named its own routing id
        with connect(daemon.endpoint, timeout=5) as watcher:
            wait_for(lambda: watcher.health()["sessions"] == 1)
        impostor = Peer(daemon.endpoint, routing_id=b"victim")
        try:
            for given in ({}, {"token": new_token()}):
                for reply in refusals(impostor, session, **given):
                    assert reply["error"]["code"] == "unknown_session", (given, reply)
        finally:
            impostor.close()
        with connect(daemon.endpoint, timeout=5) as back:  # the victim, reconnected
            back.adopt(session, token)
            assert len(back.step(session, 3).tokens) == 3  # nothing was taken from it
            back.close(session)
            assert back.health()["sessions"] == 0


def test_a_client_that_reconnects_under_a_new_routing_id_drives_its_session_with_the_token(
    tiny_model,
) -> None:
    with serving(tiny_model) as daemon:
        first = Peer(daemon.endpoint, routing_id=b"laptop-1")
        try:
            session, token = open_on(first)
            first.request(op="step", id="s", session=session, token=token, n=2)
            before = first.until("s")[-1]["usage"]["context_tokens"]
        finally:
            first.close()
        with connect(daemon.endpoint, timeout=5) as again:  # a new, generated routing id
            reply = again.step(session, 2, token=token)
            assert reply.usage["context_tokens"] == before + 2
            again.append(session, tokens=[7, 8], max_tokens=4)  # the token is remembered
            streamed = list(again.generate(session=session))
            assert streamed[-1].done
            assert again.abort(session=session) is False  # nothing runs on it now
            again.close(session)
            assert again.health()["sessions"] == 0


def test_a_one_shot_generate_gives_its_token_in_its_first_reply_and_can_be_aborted_with_it(
    tiny_model,
) -> None:
    with serving(tiny_model, slow(0.002)) as daemon, connect(daemon.endpoint, timeout=5) as client:
        stream = client.generate(tokens=PROMPT, max_tokens=40)
        first = next(stream)
        assert first.token is not None and not first.done
        second = next(stream)
        assert second.token is None
        with connect(daemon.endpoint, timeout=5) as stranger:
            with pytest.raises(UnknownSession):
                stranger.abort(session=first.session)
            assert stranger.abort(session=first.session, token=first.token) is True
        rest = list(stream)
        assert rest[-1].finish_reason == "abort" and rest[-1].abort_reason == "client"
        wait_for(lambda: client.health()["slots_free"] == N_SLOTS)


def test_a_token_needs_a_session() -> None:
    for request in (
        {"op": "generate", "tokens": [1], "token": "x"},
        {"op": "abort", "request": 3, "token": "x"},
    ):
        with pytest.raises(ProtocolError, match="'token' goes with 'session'"):
            parse_request(request)
    assert parse_request({"op": "step", "session": 1, "token": "ab"}).token == "ab"


def test_owners_compare_tokens_and_keys() -> None:
    token = new_token()
    plain = Owner(b"p", token)
    assert plain.admits(token, None) and plain.admits(token, "any key")
    assert not plain.admits(None, None) and not plain.admits(new_token(), None)
    assert not plain.admits("é" * 32, None)  # not ASCII: refused, not an exception
    keyed = Owner(b"p", token, user="KEY-A")
    assert keyed.admits(token, "KEY-A") and not keyed.admits(token, "KEY-B")
    assert not keyed.admits(token, None)
    assert same_secret("k", "k") and not same_secret(None, "k") and not same_secret("K", "k")


# --- the per-client quota -------------------------------------------------------------------------
def test_a_client_over_its_session_quota_is_busy_and_others_are_not(tiny_model) -> None:
    with (
        serving(tiny_model, max_sessions_per_client=1) as daemon,
        connect(daemon.endpoint, timeout=5) as greedy,
        connect(daemon.endpoint, timeout=5) as other,
    ):
        assert greedy.info()["limits"]["max_sessions_per_client"] == 1
        kept = greedy.open(tokens=PROMPT, max_tokens=4)
        with pytest.raises(Busy, match="max-sessions-per-client 1"):
            greedy.open(tokens=PROMPT, max_tokens=4)
        with pytest.raises(Busy, match="max-sessions-per-client 1"):
            next(greedy.generate(tokens=PROMPT, max_tokens=4))
        assert greedy.health()["slots_free"] == 1  # the refusals took nothing
        theirs = other.open(tokens=PROMPT, max_tokens=4)  # another client's own quota
        other.close(theirs.session)
        greedy.close(kept.session)
        again = greedy.open(tokens=PROMPT, max_tokens=4)  # under the quota again
        greedy.close(again.session)
        assert greedy.health()["slots_free"] == N_SLOTS


# --- CURVE: sessions bound to the client key; the operator key off loopback --------------------
def second_client_keys(keys: Path, folder: Path) -> Path:
    """Another authorized client key pair, in a folder a client can use."""
    folder.mkdir()
    _public, secret = zmq.auth.create_certificates(folder, "client")
    shutil.copy(folder / "client.key", keys / "authorized_clients" / "other.key")
    shutil.copy(keys / "server.key", folder / "server.key")
    assert Path(secret).name == "client.key_secret"
    return folder


def test_on_curve_sessions_belong_to_the_client_key_and_operator_ops_need_the_key(
    tiny_model, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    other_keys = second_client_keys(keys, tmp_path / "other")
    config = {"curve_keys": keys, "bind": "tcp://0.0.0.0:*", "max_sessions_per_client": 1}
    with serving(tiny_model, operator_key="op-secret", **config) as daemon:
        addr = "tcp://127.0.0.1:" + daemon.endpoint.rsplit(":", 1)[1]
        with (
            connect(addr, curve_keys=keys, timeout=5) as alice,
            connect(addr, curve_keys=other_keys, timeout=5) as bob,
        ):
            mine = alice.open(tokens=PROMPT, max_tokens=8)
            with pytest.raises(UnknownSession):  # the token, but not alice's key
                bob.step(mine.session, token=mine.token)
            with pytest.raises(UnknownSession):
                bob.close(mine.session, token=mine.token)
            bobs = bob.open(tokens=PROMPT, max_tokens=8)  # the quota counts per key
            with connect(addr, curve_keys=keys, timeout=5) as alice_again:
                with pytest.raises(Busy, match="max-sessions-per-client"):
                    alice_again.open(tokens=PROMPT, max_tokens=8)  # alice's key has its one
                assert len(alice_again.step(mine.session, 2, token=mine.token).tokens) == 2
            bob.close(bobs.session)
            alice.close(mine.session)

            # bound beyond loopback: the operator ops need the operator key
            assert alice.stats()["sessions"]["open"] == 0  # reading stats does not
            for call in (
                lambda **k: alice.stats(reset=True, **k),
                lambda **k: alice.trace(**k),
                lambda **k: alice.profile(**k),
            ):
                for key in ({}, {"operator_key": "wrong"}):
                    with pytest.raises(Forbidden, match="operator key"):
                        call(**key)
                call(operator_key="op-secret")


def test_operator_ops_need_no_key_on_loopback(tiny_model) -> None:
    with (
        serving(tiny_model, operator_key="op-secret") as daemon,
        connect(daemon.endpoint, timeout=5) as client,
    ):
        client.stats(reset=True)
        client.trace()
        assert client.profile()["available"] is False


def test_the_operator_check() -> None:
    assert operator_allowed(loopback=True, configured=None, given=None)
    assert not operator_allowed(loopback=False, configured=None, given=None)
    assert not operator_allowed(loopback=False, configured=None, given="x")  # none configured
    assert not operator_allowed(loopback=False, configured="k", given=None)
    assert not operator_allowed(loopback=False, configured="k", given="K")
    assert operator_allowed(loopback=False, configured="k", given="k")


# --- info -----------------------------------------------------------------------------------------
def test_info_names_the_model_file_without_its_path(tiny_model) -> None:
    with serving(tiny_model) as daemon, connect(daemon.endpoint, timeout=5) as client:
        info = client.info()
    assert info["model"]["path"] == tiny_model.name
    assert str(tiny_model.parent) not in repr(info)


def test_closing_frees_the_token(tiny_model) -> None:
    with serving(tiny_model) as daemon, connect(daemon.endpoint, timeout=5) as client:
        opened = client.open(tokens=PROMPT, max_tokens=8)
        token = opened.token
        client.close(opened.session)
        assert client.token(opened.session) is None
        reopened = client.open(tokens=PROMPT, max_tokens=8)  # may reuse the session's slot
        with pytest.raises(UnknownSession):
            client.step(reopened.session + 1000, token=token)
        client.close(reopened.session)
