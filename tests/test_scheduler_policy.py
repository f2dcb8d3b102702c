"""The step policy (server/policy.py), alone: which work each engine step runs, and what a
token means for its job. No engine, no sockets: jobs and token events are made by hand."""

import pytest

from rocforge_rt.engine.session import TokenEvent
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.server.jobs import CancelCause, Finished, Job, JobState
from rocforge_rt.server.policy import Emit, StepPolicy
from rocforge_rt.server.protocol import Prompt, Request, Turn

TURN = Turn(Prompt(tokens=(1, 2, 3)))


def new_turn(op: str) -> Job:
    """An open, append or one-shot generate: it prefills a prompt first."""
    session = 1 if op == "append" else None
    return Job(Request(op=op, id=op, session=session, turn=TURN), (b"peer",), 0.0)


def on_session(op: str, *, n: int = 1, deadline_ms: float | None = None) -> Job:
    """A step (n tokens) or a generate on an open session: it decodes from the start."""
    request = Request(op=op, id=op, session=1, n=n, deadline_ms=deadline_ms)
    return Job(request, (b"peer",), 0.0)


def token(t: int = 7, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(t, f"<{t}>", -1.0, (), finish)


@pytest.fixture()
def policy() -> StepPolicy:
    return StepPolicy()


# --- what a step runs ---------------------------------------------------------------------------
def test_an_idle_policy_runs_nothing(policy: StepPolicy) -> None:
    assert not policy.busy
    assert policy.next_prefill() is None and policy.decode_batch() == ()


def test_each_step_runs_one_prefill_chunk_of_the_oldest_prompt_still_prefilling(policy) -> None:
    first, second = new_turn("open"), new_turn("generate")
    policy.queue_prefill(first)
    policy.queue_prefill(second)
    assert first.state is second.state is JobState.PREFILLING
    assert policy.next_prefill() is first
    assert policy.next_prefill() is first  # a chunk that did not finish the prompt: again
    policy.after_prefill(first, token())
    policy.remove(first)  # its end
    assert policy.next_prefill() is second


def test_each_step_decodes_one_token_for_every_decoding_job_in_order_of_arrival(policy) -> None:
    jobs = [on_session("step", n=3), on_session("generate"), on_session("step", n=1)]
    for j in jobs:
        policy.join_decode(j)
    assert all(j.state is JobState.DECODING for j in jobs)
    assert policy.decode_batch() == tuple(jobs)


def test_a_generate_whose_prefill_ends_joins_the_decode_batch_of_the_same_step(policy) -> None:
    running, new = on_session("generate"), new_turn("generate")
    policy.join_decode(running)
    policy.queue_prefill(new)
    assert policy.next_prefill() is new
    assert policy.after_prefill(new, token()) is Emit.STREAM
    assert new.state is JobState.DECODING and new.remaining == float("inf")
    assert policy.next_prefill() is None
    assert policy.decode_batch() == (running, new)  # asked after the prefill chunk ran


def test_a_prefill_and_a_decode_run_in_one_step(policy) -> None:
    prefilling, decoding = new_turn("open"), on_session("step", n=4)
    policy.queue_prefill(prefilling)
    policy.join_decode(decoding)
    assert policy.next_prefill() is prefilling and policy.decode_batch() == (decoding,)


# --- cancellation -------------------------------------------------------------------------------
def test_flagged_and_overdue_jobs_are_due_to_cancel_before_the_step(policy) -> None:
    flagged, overdue, fine = (
        new_turn("open"),
        on_session("step", deadline_ms=10.0),
        on_session("step"),
    )
    policy.queue_prefill(flagged)
    policy.join_decode(overdue)
    policy.join_decode(fine)
    flagged.cancel = CancelCause.CLIENT
    assert policy.due_to_cancel(now=0.005) == [(flagged, CancelCause.CLIENT)]
    assert policy.due_to_cancel(now=0.010) == [
        (flagged, CancelCause.CLIENT),
        (overdue, CancelCause.DEADLINE),
    ]


def test_a_flag_wins_over_a_passed_deadline(policy) -> None:
    j = on_session("generate", deadline_ms=1.0)
    policy.join_decode(j)
    j.cancel = CancelCause.SHUTDOWN
    assert policy.due_to_cancel(now=5.0) == [(j, CancelCause.SHUTDOWN)]


def test_an_ended_job_leaves_the_queues_and_is_never_scheduled_again(policy) -> None:
    prefilling, decoding = new_turn("open"), on_session("generate")
    policy.queue_prefill(prefilling)
    policy.join_decode(decoding)
    for j in (prefilling, decoding):
        j.cancel = CancelCause.DISCONNECT
        policy.remove(j)
    policy.remove(decoding)  # again: nothing happens
    assert not policy.busy and policy.due_to_cancel(now=0.0) == []
    assert policy.next_prefill() is None and policy.decode_batch() == ()


# --- what a token means -------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["open", "append"])
def test_open_and_append_end_with_their_first_token(policy, op: str) -> None:
    j = new_turn(op)
    policy.queue_prefill(j)
    first = token()
    assert policy.after_prefill(j, first) == Finished(None, (first,))
    assert j.completion_tokens == 1
    assert policy.next_prefill() is j  # still queued until its end takes it out


def test_a_first_token_that_ends_the_turn_ends_a_generate(policy) -> None:
    j = new_turn("generate")
    policy.queue_prefill(j)
    last = token(finish=FinishReason.STOP_TOKEN)
    assert policy.after_prefill(j, last) == Finished(FinishReason.STOP_TOKEN, (last,))
    assert policy.decode_batch() == ()


def test_a_generate_streams_each_token_and_ends_with_the_one_that_ends_its_turn(policy) -> None:
    j = on_session("generate")
    policy.join_decode(j)
    assert [policy.after_decode(j, token(t)) for t in (1, 2)] == [Emit.STREAM, Emit.STREAM]
    last = token(3, FinishReason.LENGTH)
    assert policy.after_decode(j, last) == Finished(FinishReason.LENGTH, (last,))
    assert j.completion_tokens == 3


def test_a_step_holds_its_tokens_and_replies_once_with_all_n(policy) -> None:
    j = on_session("step", n=3)
    policy.join_decode(j)
    events = [token(t) for t in (1, 2, 3)]
    assert policy.after_decode(j, events[0]) is Emit.HOLD
    assert policy.after_decode(j, events[1]) is Emit.HOLD
    assert policy.after_decode(j, events[2]) == Finished(None, tuple(events))
    assert j.events == [] and j.completion_tokens == 3


def test_a_step_ends_early_when_its_turn_ends(policy) -> None:
    j = on_session("step", n=10)
    policy.join_decode(j)
    first, last = token(1), token(2, FinishReason.STOP_STRING)
    policy.after_decode(j, first)
    assert policy.after_decode(j, last) == Finished(FinishReason.STOP_STRING, (first, last))
