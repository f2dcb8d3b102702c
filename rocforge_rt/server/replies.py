"""The maps the engine thread replies with, and the outbox they wait in until sent.

Replies to a job: token replies (a streamed token, or a final reply with its
finish reason, usage and timings) and error replies. A streaming request
(`generate`) has `done` in every reply, True in its last. `usage_map` is the
`stats` reply's picture of sessions and KV use.

The replies of one flush reach the I/O thread as one inproc message, a batch
(`pack_batch`, `unpack_batch`): a msgpack array of each reply's ROUTER frames
(envelope, then the packed reply). One message a step instead of one a reply: a
ZeroMQ send releases the GIL and wakes the I/O thread, and the engine thread then
waits to take it back, so one send a step halves what a step spends sending under many
streams (docs/performance.md).
"""

import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import zmq

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.kv_cache import kv_bytes_per_token, kv_pool_bytes
from rocforge_rt.engine.session import Session, TokenEvent
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.server.jobs import CancelCause, Job
from rocforge_rt.server.protocol import ErrorCode, error_reply, ok_reply, pack


class Outbox:
    """Replies made on the engine thread, sent together after the step that made them."""

    def __init__(self) -> None:
        self.pending: list[tuple[tuple[bytes, ...], dict[str, Any]]] = []

    def add(self, job: Job, reply: dict[str, Any]) -> None:
        self.pending.append((job.envelope, reply))

    def send(self, socket: zmq.Socket) -> None:
        """Send every pending reply, in order, as one batch."""
        socket.send(pack_batch(self.pending))
        self.pending.clear()


def pack_batch(replies: Sequence[tuple[tuple[bytes, ...], dict[str, Any]]]) -> bytes:
    """(envelope, reply) pairs as one message (never empty: END_OF_REPLIES is b"")."""
    return msgpack.packb([[*envelope, pack(reply)] for envelope, reply in replies])


def unpack_batch(message: bytes) -> list[list[bytes]]:
    """A batch's replies, in order, each as the frames of its ROUTER message."""
    return msgpack.unpackb(message)


def _token_map(event: TokenEvent, logprobs: bool, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """A token of a token reply; with logprobs asked for, its alternatives and (a model with a
    vocabulary) the bytes it and each alternative stand for: the HTTP front's token strings."""
    token: dict[str, Any] = {"token": event.token, "text": event.text, "logprob": event.logprob}
    if logprobs:
        token["top_logprobs"] = [list(pair) for pair in event.top_logprobs]
        if tokenizer is not None:
            token["bytes"] = tokenizer.token_bytes(event.token)
            token["top_bytes"] = [tokenizer.token_bytes(t) for t, _ in event.top_logprobs]
    return token


def _token_reply(
    job: Job,
    session: Session,
    n_ctx: int,
    events: Iterable[TokenEvent],
    text: str,
    finish_reason: FinishReason | None,
    timings: dict[str, float],
    **extra: Any,
) -> dict[str, Any]:
    logprobs = session.sampler is not None and session.sampler.params.logprobs > 0
    tokenizer = session.stream.tokenizer if session.stream is not None else None
    if job.token is not None:  # the first reply of the job that opened the session
        extra["token"], job.token = job.token, None
    return ok_reply(
        job.request.id,
        session=job.session_id,
        tokens=[_token_map(e, logprobs, tokenizer) for e in events],
        text=text,
        finish_reason=None if finish_reason is None else str(finish_reason),
        usage={
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "context_tokens": session.n_context,
            "context_size": n_ctx,
        },
        timings=timings,
        **extra,
    )


def stream_reply(job: Job, session: Session, n_ctx: int, event: TokenEvent) -> dict[str, Any]:
    """A streamed token that does not end the job (`done` False); TTFT with the first."""
    job.timer.token_sent(time.perf_counter(), streamed=True)
    ttft_ms = job.timer.ttft_ms if job.completion_tokens == 1 else None
    timings = {} if ttft_ms is None else {"ttft_ms": ttft_ms}
    return _token_reply(job, session, n_ctx, [event], event.text, None, timings, done=False)


def final_reply(
    job: Job,
    session: Session,
    n_ctx: int,
    events: Iterable[TokenEvent],
    finish_reason: FinishReason | None,
    *,
    tail: str = "",
    abort_reason: CancelCause | None = None,
) -> dict[str, Any]:
    """A job's last token reply: its last tokens (and `tail`, text held back until the end),
    its usage and timings; the request's latency record is taken here."""
    events = list(events)
    now = time.perf_counter()
    if events:
        job.timer.token_sent(now, streamed=job.streams)
    record = job.timer.finish(
        now,
        prompt_tokens=job.prompt_tokens,
        completion_tokens=job.completion_tokens,
        finish_reason=finish_reason,
    )
    timings = {"e2e_ms": record.e2e_ms}
    if record.ttft_ms is not None:
        timings["ttft_ms"] = record.ttft_ms
    if record.itl_ms_mean is not None:
        timings["itl_ms_mean"] = record.itl_ms_mean
    if job.prefill_started is not None:
        timings["queue_ms"] = (job.prefill_started - job.received) * 1000.0
    if record.wait_ms is not None:
        timings["wait_ms"] = record.wait_ms
    extra: dict[str, Any] = {}
    if abort_reason is not None:
        extra["abort_reason"] = str(abort_reason)
    if job.streams:
        extra["done"] = True
    text = "".join(e.text for e in events) + tail
    return _token_reply(job, session, n_ctx, events, text, finish_reason, timings, **extra)


def job_error_reply(
    job: Job, code: ErrorCode, message: str, finish_reason: FinishReason | None = None
) -> dict[str, Any]:
    """An error that ends a job (`done` for a streaming request)."""
    extra: dict[str, Any] = {}
    if finish_reason is not None:
        extra["finish_reason"] = str(finish_reason)
    if job.streams:
        extra["done"] = True
    return error_reply(job.request.id, code, message, **extra)


def usage_map(
    engine: Engine, sessions: list[Session], prefilling: int, generating: int
) -> dict[str, Any]:
    """Sessions open and running, and the KV pool's use (part of the `stats` reply)."""
    cached = sum(session.n_past for session in sessions)
    per_token = kv_bytes_per_token(engine.hparams, engine.kv_dtype)
    pool = kv_pool_bytes(engine.hparams, engine.slots.n_slots, engine.n_ctx, engine.kv_dtype)
    return {
        "sessions": {
            "open": len(sessions),
            "max": engine.slots.n_slots,
            "prefilling": prefilling,
            "generating": generating,
        },
        "kv": {
            "slots_in_use": engine.slots.in_use,
            "slots": engine.slots.n_slots,
            "tokens_cached": cached,
            "dtype": engine.kv_dtype,
            "bytes_used": cached * per_token,
            "pool_bytes": pool,
            "use": cached * per_token / pool,
        },
    }
