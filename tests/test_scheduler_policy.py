"""The step policy (server/policy.py), alone: which work each engine step runs, and what a
token means for its job. No engine, no sockets: jobs and token events are made by hand."""

import pytest

from rocforge_rt.engine.session import TokenEvent
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.server.jobs import CancelCause, Finished, Job, JobState
from rocforge_rt.server.policy import Emit, StepPolicy
from rocforge_rt.server.protocol import Append, Generate, Open, Prompt, Step, Turn

TURN = Turn(Prompt(tokens=(1, 2, 3)))


def new_turn(op: str) -> Job:
    """An open, append or one-shot generate: it prefills a prompt first."""
    request = {
        "open": Open(id=op, turn=TURN),
        "append": Append(id=op, session=1, turn=TURN),
        "generate": Generate(id=op, turn=TURN),
    }[op]
    return Job(request, (b"peer",), 0.0)


def on_session(op: str, *, n: int = 1, deadline_ms: float | None = None) -> Job:
    """A step (n tokens) or a generate on an open session: it decodes from the start."""
    request = (
        Step(id=op, session=1, n=n, deadline_ms=deadline_ms)
        if op == "step"
        else Generate(id=op, session=1, deadline_ms=deadline_ms)
    )
    return Job(request, (b"peer",), 0.0)


def token(t: int = 7, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(t, f"<{t}>", -1.0, (), finish)


@pytest.fixture()
def policy() -> StepPolicy:
    return StepPolicy()


# --- what a step runs ---------------------------------------------------------------------------
def pending(tokens: dict[str, int]):
    """The prompt tokens each job still has, by request id."""
    return lambda job: tokens[job.request.id]


def test_an_idle_policy_runs_nothing(policy: StepPolicy) -> None:
    assert not policy.busy
    assert policy.plan(64, pending({})) == ((), ())


def test_prompts_arriving_together_share_a_step_oldest_first_within_the_budget(policy) -> None:
    first, second, third = (Job(Generate(id=i, turn=TURN), (b"peer",), 0.0)
                            for i in ("a", "b", "c"))  # fmt: skip
    for job in (first, second, third):
        policy.queue_prefill(job)
    assert first.state is second.state is third.state is JobState.PREFILLING
    left = {"a": 30, "b": 50, "c": 10}
    assert policy.plan(64, pending(left)) == ((), ((first, 30), (second, 34)))
    left.update(a=0, b=16)  # the step ran; a's chunk ended its prompt
    policy.after_prefill(first, token())  # a decodes from the next step on
    assert policy.plan(64, pending(left)) == ((first,), ((second, 16), (third, 10)))


def test_every_decoding_job_gets_its_token_before_prompts_get_theirs(policy) -> None:
    jobs = [on_session("step", n=3), on_session("generate"), on_session("step", n=1)]
    for j in jobs:
        policy.join_decode(j)
    waiting = new_turn("open")
    policy.queue_prefill(waiting)
    assert all(j.state is JobState.DECODING for j in jobs)
    assert policy.plan(4, pending({"open": 100})) == (tuple(jobs), ((waiting, 1),))
    assert policy.plan(3, pending({"open": 100})) == (tuple(jobs), ())


def test_a_generate_whose_prefill_ends_decodes_from_the_next_step(policy) -> None:
    running, new = on_session("generate"), new_turn("generate")
    policy.join_decode(running)
    policy.queue_prefill(new)
    assert policy.plan(16, pending({"generate": 3})) == ((running,), ((new, 3),))
    assert policy.after_prefill(new, token()) is Emit.STREAM
    assert new.state is JobState.DECODING and new.remaining == float("inf")
    assert policy.plan(16, pending({})) == ((running, new), ())


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
    assert policy.plan(64, pending({"open": 3})) == ((), ())


# --- what a token means -------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["open", "append"])
def test_open_and_append_end_with_their_first_token(policy, op: str) -> None:
    j = new_turn(op)
    policy.queue_prefill(j)
    first = token()
    assert policy.after_prefill(j, first) == Finished(None, (first,))
    assert j.completion_tokens == 1
    assert j in policy.prefilling  # still queued until its end takes it out


def test_a_first_token_that_ends_the_turn_ends_a_generate(policy) -> None:
    j = new_turn("generate")
    policy.queue_prefill(j)
    last = token(finish=FinishReason.STOP_TOKEN)
    assert policy.after_prefill(j, last) == Finished(FinishReason.STOP_TOKEN, (last,))
    assert policy.decoding == []


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
