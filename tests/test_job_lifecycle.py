"""How a job ends (server/lifecycle.py), without sockets: each outcome's reply, and what the
end releases (queue place, board entry, reserved slot, the session it opened), on the
tiny model's CPU engine. The engine thread's loop is played by hand."""

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.session import TokenEvent
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.profiling.latency import LatencyRecorder
from rocforge_rt.server.jobs import (
    CancelCause,
    Cancelled,
    Failed,
    Finished,
    Job,
    JobBoard,
    JobState,
    Limits,
    PeerGone,
)
from rocforge_rt.server.lifecycle import Lifecycle
from rocforge_rt.server.policy import StepPolicy
from rocforge_rt.server.prompts import tokenize_turn
from rocforge_rt.server.protocol import ErrorCode, ProtocolError, parse_request
from rocforge_rt.server.refusals import Refusals
from rocforge_rt.server.replies import Outbox

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]
PEER = b"peer"
LIMITS = Limits(n_ctx=64, max_sessions=2, max_prompt_tokens=56, max_new_tokens=40,
                idle_timeout_s=300.0)  # fmt: skip


class Rig:
    """A Lifecycle with its engine, board, policy and outbox, as the engine thread holds them."""

    def __init__(self, engine: Engine, limits: Limits = LIMITS) -> None:
        self.engine = engine
        # the engine's allocator: the one count of slots
        self.board = JobBoard(engine.slots, max_queue=limits.max_queue)
        self.policy = StepPolicy()
        self.outbox = Outbox()
        self.refusals = Refusals(max_per_client_s=0)
        self.lifecycle = Lifecycle(
            engine,
            limits,
            self.board,
            self.policy,
            LatencyRecorder(),
            self.outbox,
            self.refusals,
        )
        self._ids = iter(range(1, 1000))
        self.accepted: list[Job] = []

    def accept(self, op: str, peer: bytes = PEER, **fields: Any) -> Job:
        """A request as the engine thread gets it: parsed and admitted to the board (with the
        session's token, as its client holds it, unless `token` is given) by the I/O
        thread, its prompt tokenized by the prompt thread."""
        live = self.lifecycle.sessions.get(fields.get("session"))
        if live is not None and "token" not in fields:
            fields["token"] = live.owner.token
        request = parse_request({"op": op, "id": next(self._ids), **fields})
        job = Job(request, (peer,), time.perf_counter())
        self.board.admit(job)
        tokenize_turn(job, self.engine.tokenizer)
        self.accepted.append(job)
        return job

    def start(self, op: str, peer: bytes = PEER, **fields: Any) -> Job:
        job = self.accept(op, peer, **fields)
        self.lifecycle.start(job)
        return job

    def first_token(self, job: Job) -> TokenEvent:
        """Run the job's prefill to its first token and hand it to the policy."""
        session = self.lifecycle.session_of(job)
        while (event := self.engine.prefill(session, should_stop=lambda: True)) is None:
            pass
        self.lifecycle.deliver(job, event, self.policy.after_prefill(job, event))
        return event

    def decode(self, job: Job) -> TokenEvent:
        (event,) = self.engine.decode([self.lifecycle.session_of(job)])
        self.lifecycle.deliver(job, event, self.policy.after_decode(job, event))
        return event

    def replies(self) -> list[dict[str, Any]]:
        """The replies made since the last call."""
        replies = [reply for _envelope, reply in self.outbox.pending]
        self.outbox.pending.clear()
        return replies

    def open_session(self, **fields: Any) -> int:
        """An open whose first token has been replied: the client's idle session."""
        job = self.start("open", tokens=PROMPT, **fields)
        self.first_token(job)
        (reply,) = self.replies()
        return reply["session"]

    def free_slots(self) -> int:
        """Session slots the board would still reserve (up to a probe it queues, or refuses)."""
        probes = []
        try:
            while not probes or probes[-1].slot is not None:
                probes.append(self.accept("open", tokens=[1]))
        except ProtocolError as exc:
            assert exc.code is ErrorCode.BUSY
        reserved = sum(probe.slot is not None for probe in probes)
        for probe in probes:
            self.board.retire(probe)
        return reserved

    def holds_nothing(self) -> bool:
        """No session, no slot, no job in flight, nothing queued."""
        return (
            not self.lifecycle.sessions
            and self.engine.slots.in_use == 0
            and self.board.counts()
            == {"in_flight": 0, "sessions": 0, "slots_free": 2, "waiting": 0}
            and not self.policy.busy
            and not self.policy.waiting
            and self.free_slots() == LIMITS.max_sessions
        )


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    return Engine.load(tiny_model, backend="cpu", n_slots=2, n_ctx=64, prefill_chunk=4)


@pytest.fixture()
def rig(engine: Engine) -> Iterator[Rig]:
    rig = Rig(engine)
    yield rig
    for live in list(rig.lifecycle.sessions.values()):  # the engine is shared by the module
        rig.lifecycle.close_session(live)
    for job in rig.accepted:  # a test that failed midway may leave a slot reserved
        rig.board.retire(job)


# --- the session a job opened -------------------------------------------------------------------
def test_an_open_that_ends_before_its_first_token_closes_the_session_it_opened(rig: Rig) -> None:
    job = rig.start("open", tokens=PROMPT)
    assert job.state is JobState.PREFILLING and rig.engine.slots.in_use == 1
    assert rig.board.counts() == {"in_flight": 1, "sessions": 1, "slots_free": 1, "waiting": 0}
    assert rig.lifecycle.end(job, Cancelled(CancelCause.CLIENT)) is True
    assert job.state is JobState.ENDED
    (reply,) = rig.replies()
    assert reply["error"] == {
        "code": "aborted", "message": "request cut before its first token (client)",
    }  # fmt: skip
    assert rig.holds_nothing()


def test_an_open_that_gave_its_token_leaves_its_session_open_and_idle(rig: Rig) -> None:
    job = rig.start("open", tokens=PROMPT, max_tokens=8)
    rig.first_token(job)
    (reply,) = rig.replies()
    assert reply["ok"] and reply["finish_reason"] is None and len(reply["tokens"]) == 1
    live = rig.lifecycle.sessions[reply["session"]]
    assert live.job is None and not live.session.finished
    assert rig.board.counts() == {"in_flight": 0, "sessions": 1, "slots_free": 1, "waiting": 0}
    assert rig.engine.slots.in_use == 1 and rig.free_slots() == 1


@pytest.mark.parametrize(
    "outcome",
    [
        Finished(FinishReason.LENGTH),
        Failed(ErrorCode.INTERNAL, "engine error: injected", FinishReason.ERROR),
        Cancelled(CancelCause.DISCONNECT),
    ],
    ids=["finished", "failed", "cancelled"],
)
def test_a_one_shot_generate_closes_its_session_however_it_ends(rig: Rig, outcome) -> None:
    job = rig.start("generate", tokens=PROMPT, max_tokens=8)
    rig.first_token(job)
    (streamed,) = rig.replies()
    assert streamed["done"] is False
    rig.lifecycle.end(job, outcome)
    (final,) = rig.replies()
    assert final["done"] is True
    assert rig.holds_nothing()


# --- refused and queued jobs --------------------------------------------------------------------
def test_a_refused_open_gives_back_the_slot_it_reserved(rig: Rig) -> None:
    job = rig.start("open", tokens=PROMPT, max_tokens=41)
    (reply,) = rig.replies()
    assert reply["error"]["code"] == "limit_exceeded" and job.state is JobState.ENDED
    assert rig.holds_nothing()


def test_a_job_cancelled_while_queued_ends_at_its_start(rig: Rig) -> None:
    job = rig.accept("generate", tokens=PROMPT)
    job.cancel = CancelCause.SHUTDOWN
    rig.lifecycle.start(job)
    (reply,) = rig.replies()
    assert reply == {
        "id": job.request.id, "ok": False, "done": True,
        "error": {"code": "aborted", "message": "aborted (shutdown) before it started"},
    }  # fmt: skip
    assert rig.holds_nothing()


# --- jobs waiting for a session slot -------------------------------------------------------------
QUEUEING = dataclasses.replace(LIMITS, max_queue=4, max_queue_time_s=60.0)


@pytest.fixture()
def full(engine: Engine) -> Iterator[Rig]:
    """A rig whose board queues (--max-queue 4) with both slots held by idle sessions."""
    rig = Rig(engine, QUEUEING)
    rig.open_session()
    rig.open_session()
    yield rig
    for live in list(rig.lifecycle.sessions.values()):
        rig.lifecycle.close_session(live)
    for job in rig.accepted:
        rig.board.retire(job)


def test_a_job_waiting_for_a_slot_starts_as_if_admitted_when_a_session_closes(full: Rig) -> None:
    first = full.start("generate", tokens=PROMPT, max_tokens=4)
    second = full.start("open", tokens=PROMPT, max_tokens=4)
    assert first.state is second.state is JobState.WAITING
    assert list(full.policy.waiting) == [first, second] and not full.policy.busy
    assert full.board.counts()["waiting"] == 2 and first.slot is None
    full.lifecycle.start_waiting()  # no slot free: nothing moves
    assert first.state is JobState.WAITING and full.replies() == []
    full.lifecycle.close_session(next(iter(full.lifecycle.sessions.values())))
    full.lifecycle.start_waiting()
    assert first.state is JobState.PREFILLING and second.state is JobState.WAITING  # oldest first
    assert first.session_id in full.lifecycle.sessions and first.slot is None  # the session's
    assert full.board.counts() == {"in_flight": 2, "sessions": 2, "slots_free": 0, "waiting": 1}
    assert first.waited > 0 and first.timer.wait_s == first.waited
    full.lifecycle.end(first, Cancelled(CancelCause.CLIENT))  # its one-shot session closes
    full.lifecycle.start_waiting()
    assert second.state is JobState.PREFILLING


@pytest.mark.parametrize(
    ("ending", "code", "message"),
    [
        (Cancelled(CancelCause.CLIENT), "aborted", "aborted (client) before it started"),
        (Cancelled(CancelCause.DISCONNECT), "aborted", "aborted (disconnect) before it started"),
        (Cancelled(CancelCause.SHUTDOWN), "aborted", "aborted (shutdown) before it started"),
        (Cancelled(CancelCause.DEADLINE), "deadline_exceeded",
         "aborted (deadline) before it started"),
        ("overdue", "busy", "waited 60.0 s for a session slot, the limit (--max-queue-time 60): all"
                            " 2 session slots (--max-sessions 2) are in use; retry later"),
    ],
    ids=["abort", "disconnect", "shutdown", "deadline", "max-queue-time"],
)  # fmt: skip
def test_a_waiting_job_ends_as_a_queued_one_and_leaves_the_queue(
    full: Rig, ending: Any, code: str, message: str
) -> None:
    job = full.start("generate", tokens=PROMPT)
    if ending == "overdue":
        full.lifecycle.end_overdue(job.received + 59.9)  # not yet
        assert job.state is JobState.WAITING
        full.lifecycle.end_overdue(job.received + 60.0)
    else:
        full.lifecycle.end(job, ending)
    (reply,) = full.replies()
    assert reply == {"id": job.request.id, "ok": False, "done": True,
                     "error": {"code": code, "message": message}}  # fmt: skip
    assert job.state is JobState.ENDED and not full.policy.waiting
    assert full.board.counts() == {"in_flight": 0, "sessions": 2, "slots_free": 0, "waiting": 0}
    for live in list(full.lifecycle.sessions.values()):
        full.lifecycle.close_session(live)
    assert full.holds_nothing()


def test_a_turn_the_daemon_refuses_is_refused_at_once_not_after_waiting(full: Rig) -> None:
    job = full.start("open", tokens=PROMPT, max_tokens=41)
    (reply,) = full.replies()
    assert reply["error"]["code"] == "limit_exceeded" and job.state is JobState.ENDED
    assert full.board.counts()["waiting"] == 0 and not full.policy.waiting


# --- jobs on the client's session ---------------------------------------------------------------
def test_a_step_cut_before_its_first_token_ends_the_turn_but_not_the_session(rig: Rig) -> None:
    session = rig.open_session(max_tokens=8)
    job = rig.start("step", session=session, n=3)
    assert job.state is JobState.DECODING
    rig.lifecycle.end(job, Cancelled(CancelCause.DEADLINE))
    (reply,) = rig.replies()
    assert reply["error"]["code"] == "deadline_exceeded"
    live = rig.lifecycle.sessions[session]
    assert live.job is None and live.session.finish_reason is FinishReason.ABORT
    assert rig.board.counts() == {"in_flight": 0, "sessions": 1, "slots_free": 1, "waiting": 0}
    rig.start("step", session=session)
    assert rig.replies()[0]["error"]["code"] == "turn_finished"


def test_a_step_cut_after_tokens_replies_them_with_finish_abort(rig: Rig) -> None:
    session = rig.open_session(max_tokens=8)
    job = rig.start("step", session=session, n=5)
    tokens = [rig.decode(job).token for _ in range(2)]
    assert rig.replies() == []  # a step holds its tokens
    rig.lifecycle.end(job, Cancelled(CancelCause.CLIENT))
    (reply,) = rig.replies()
    assert [t["token"] for t in reply["tokens"]] == tokens
    assert (reply["finish_reason"], reply["abort_reason"]) == ("abort", "client")
    assert session in rig.lifecycle.sessions


def test_an_engine_failure_ends_the_turn_with_finish_reason_error(rig: Rig) -> None:
    session = rig.open_session(max_tokens=8)
    job = rig.start("step", session=session, n=2)
    rig.lifecycle.end(job, Failed(ErrorCode.INTERNAL, "engine error: x", FinishReason.ERROR))
    (reply,) = rig.replies()
    assert reply["error"]["code"] == "internal" and reply["finish_reason"] == "error"
    assert rig.lifecycle.sessions[session].session.finish_reason is FinishReason.ERROR


# --- ending twice -------------------------------------------------------------------------------
def test_ending_a_job_twice_is_harmless_no_second_reply_nothing_released_twice(rig: Rig) -> None:
    job = rig.start("generate", tokens=PROMPT, max_tokens=8)
    assert rig.lifecycle.end(job, Cancelled(CancelCause.CLIENT)) is True
    assert rig.lifecycle.end(job, Failed(ErrorCode.INTERNAL, "again")) is False
    assert len(rig.replies()) == 1
    assert rig.holds_nothing()


# --- closing a session: a separate operation ----------------------------------------------------
def test_close_ends_the_job_running_on_the_session_then_closes_it(rig: Rig) -> None:
    session = rig.open_session(max_tokens=8)
    step = rig.start("step", session=session, n=5)
    rig.decode(step)
    close = rig.start("close", session=session)
    step_reply, close_reply = rig.replies()
    assert step_reply["id"] == step.request.id and step_reply["abort_reason"] == "close"
    assert close_reply == {
        "id": close.request.id, "ok": True, "session": session, "closed": True,
        "usage": {"context_tokens": len(PROMPT) + 2},
    }  # fmt: skip
    assert step.state is close.state is JobState.ENDED
    assert rig.holds_nothing()


def test_closing_an_idle_session_gives_its_slot_back_and_makes_no_reply(rig: Rig) -> None:
    session = rig.open_session()
    rig.lifecycle.close_session(rig.lifecycle.sessions[session])
    assert rig.replies() == []
    assert rig.holds_nothing()


def test_idle_sessions_are_closed_and_remembered_as_expired(engine: Engine) -> None:
    rig = Rig(engine, dataclasses.replace(LIMITS, idle_timeout_s=0.01))
    session = rig.open_session()
    token = rig.lifecycle.sessions[session].owner.token
    rig.lifecycle.reap_idle(time.perf_counter() + 1.0)
    assert rig.holds_nothing()
    rig.start("step", session=session, token=token)
    (reply,) = rig.replies()
    assert reply["error"]["code"] == "unknown_session" and "expired" in reply["error"]["message"]
    rig.start("step", session=session)  # without its token: told nothing about it
    (reply,) = rig.replies()
    assert reply["error"]["code"] == "unknown_session" and "expired" not in str(reply)


# --- engine refusals and the one count of slots ---------------------------------------------------
def test_the_board_reserves_the_engines_own_slots_and_the_session_takes_its_slot_over(
    rig: Rig,
) -> None:
    held = [rig.engine.open_session([1]) for _ in range(2)]  # taken outside the daemon
    try:
        with pytest.raises(ProtocolError) as busy:
            rig.accept("open", tokens=PROMPT)
        assert busy.value.code is ErrorCode.BUSY  # one count: the board sees them taken
    finally:
        for session in held:
            rig.engine.close_session(session)
    job = rig.accept("open", tokens=PROMPT)
    reserved = job.slot
    assert reserved is not None and rig.engine.slots.in_use == 1  # a real slot, at admission
    rig.lifecycle.start(job)
    assert job.slot is None and rig.lifecycle.session_of(job).slot == reserved
    assert rig.engine.slots.in_use == 1  # the same slot, not a second one
    rig.lifecycle.end(job, Cancelled(CancelCause.CLIENT))
    rig.replies()
    assert rig.holds_nothing()


def test_an_engine_refusal_is_replied_with_its_mapped_code_and_gives_back_the_slot(
    rig: Rig,
) -> None:
    rig.start("open", tokens=[1, 256])  # checked by the engine: the vocabulary
    (reply,) = rig.replies()
    assert reply["error"] == {
        "code": "bad_request", "message": "token id 256 is outside the vocabulary [0, 256)",
    }  # fmt: skip
    assert rig.holds_nothing()


# --- abort from acceptance, close of a running request, a client gone -----------------------------
def test_an_abort_by_session_reaches_a_request_accepted_but_not_yet_started(rig: Rig) -> None:
    session = rig.open_session(max_tokens=8)
    job = rig.accept("step", session=session, n=5)  # still in the engine thread's inbox
    assert rig.board.cancel(PEER, CancelCause.CLIENT, session=session) is True
    rig.lifecycle.start(job)
    (reply,) = rig.replies()
    assert reply["error"] == {"code": "aborted", "message": "aborted (client) before it started"}
    assert rig.board.cancel(PEER, CancelCause.CLIENT, session=session) is False  # it has ended


@pytest.mark.parametrize("op", ["generate", "open"])
def test_closing_a_session_whose_job_opened_it_ends_the_job_and_closes_it_once(
    rig: Rig, op: str
) -> None:
    job = rig.start(op, tokens=PROMPT, max_tokens=8)
    if op == "generate":  # a one-shot generate, streaming
        rig.first_token(job)
        assert rig.replies()[0]["done"] is False
    close = rig.start("close", session=job.session_id)  # an open: still in its prefill
    ended, closed = rig.replies()
    if op == "generate":
        assert (ended["finish_reason"], ended["abort_reason"]) == ("abort", "close")
    else:
        assert ended["error"]["code"] == "aborted"
    assert closed["id"] == close.request.id and closed["closed"] is True
    assert rig.holds_nothing()


@pytest.mark.parametrize("keep_sessions", [False, True], ids=["generated-id", "own-id"])
def test_a_client_gone_has_its_running_jobs_ended_and_its_sessions_closed(
    rig: Rig, keep_sessions: bool
) -> None:
    idle = rig.open_session(max_tokens=8)
    busy = rig.open_session(max_tokens=8)
    step = rig.start("step", session=busy, n=5)
    rig.lifecycle.peer_gone(PeerGone(PEER, keep_sessions))
    (reply,) = rig.replies()
    assert reply["id"] == step.request.id and reply["error"]["code"] == "aborted"
    assert step.state is JobState.ENDED
    if keep_sessions:  # it may come back under its own routing id: the idle timeout decides
        assert set(rig.lifecycle.sessions) == {idle, busy}
    else:
        assert rig.holds_nothing()
