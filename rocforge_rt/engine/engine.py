"""The engine: a model's weights on a backend, a KV pool of slots, and the sessions using them.

Contract: one thread drives an Engine (its executor). The daemon hands work to
that thread; nothing else calls in, except the slot allocator (`slots`), which is
thread-safe: the daemon reserves a slot there when it accepts a request that will
open a session, and hands it to `open_session`.

Pipelined decode: after a decode-only step the engine asks the backend to issue the
next decode step of the same rows before reading this one back (StepRunner, where the
backend can: the GPU's graph mode), so that the caller's work between steps (stops,
detokenization, replies) overlaps the device's. The next `step` takes that step's tokens
for each of its decode sessions that still wants exactly it (same token, position and
sampler); rows of sessions that ended are dropped, and a step that wants anything else
drops the whole step issued ahead and runs its own. A dropped row's KV entry lies past
its session's context and is overwritten before it is read.
"""

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from rocforge_rt.backends import Backend, create_backend
from rocforge_rt.engine.kv_cache import SlotAllocator
from rocforge_rt.engine.session import Session, TokenEvent
from rocforge_rt.errors import EngineError, EngineErrorCode, LoadCancelled
from rocforge_rt.model.gguf_file import ModelFile, load_model_file
from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.step.batch import SequencePart, StepBatch
from rocforge_rt.step.forward import ForwardOps, StepOutput, forward, upload_weights
from rocforge_rt.step.sampling import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    RowSampling,
    Sampler,
    SamplingParams,
)

# Prompt tokens per forward pass. Each chunk expands every weight matrix to fp16 once for
# the vendor GEMM, so longer chunks amortize that: on an H100, a 2048-token prompt took
# 68 ms (Llama-1B shape) and 201 ms (8B) in one 2048 chunk against 79 and 247 ms in 512s
# (README.md, "Measured"). A daemon's decode streams wait for one chunk at most.
DEFAULT_PREFILL_CHUNK = 2048
INT32_MAX = (1 << 31) - 1  # the device reads top_k as int32


T = TypeVar("T")  # what pack_step schedules: sessions, or the daemon's jobs


def step_token_budget(prefill_chunk: int, n_slots: int) -> int:
    """Tokens one step may take: a prompt chunk's worth, and at least a row per session."""
    return max(prefill_chunk, n_slots)


def pack_step(
    budget: int,
    decoding: Sequence[T],
    waiting: Iterable[T],
    pending: Callable[[T], int],
) -> tuple[tuple[T, ...], tuple[tuple[T, int], ...]]:
    """One scheduler step (vLLM V1's unified scheduling) of at most `budget` tokens: every
    decoding item's next token, then prompt chunks of the waiting items in their order while
    the budget lasts; `pending(item)` is how many prompt tokens an item still has. The
    arguments of `Engine.step`, for sessions or for whatever the caller schedules."""
    left = budget - len(decoding)
    chunks = []
    for item in waiting:
        if left <= 0:
            break
        n = min(pending(item), left)
        if n > 0:
            chunks.append((item, n))
            left -= n
    return tuple(decoding), tuple(chunks)


def _stop_point(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise LoadCancelled("loading stopped: asked to stop")


@dataclass(frozen=True)
class AheadRow:
    """A row of the decode step issued ahead: what it feeds the device, so that it is
    taken only for a session that still wants exactly that step."""

    session: Session
    token: int  # sampled by the step before
    position: int
    sampler: Sampler


@dataclass(frozen=True)
class StepEvents:
    """What one scheduler step (`Engine.step`) produced."""

    decoded: list[TokenEvent]  # one per decoding session, in order
    prefilled: list[TokenEvent | None]  # per prompt chunk: the first token once its prompt ends


class Engine:
    """Runs prefill and batched decode steps for sessions that share one KV pool."""

    def __init__(
        self,
        model: ModelFile,
        backend: Backend,
        *,
        n_slots: int,
        n_ctx: int,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        slots: SlotAllocator | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """`slots`: the allocator to use (the daemon's, shared with its socket thread), else a
        new one. `should_stop` is asked between layers of the weights' upload: when it says
        yes, LoadCancelled is raised."""
        if n_ctx > model.hparams.n_ctx_train:
            raise EngineError(
                EngineErrorCode.BAD_CONFIG,
                f"ctx size {n_ctx} exceeds the model's trained context {model.hparams.n_ctx_train}",
            )
        self.model = model
        self.hparams = model.hparams
        self.tokenizer = (
            None  # synthetic benchmark models carry no vocabulary
            if model.metadata.get("tokenizer.ggml.model") == "none"
            else Tokenizer.from_metadata(model.metadata)
        )
        self.backend = backend
        self.ops: ForwardOps = backend  # what forward() calls; a profiler may wrap it
        if slots is not None and slots.n_slots != n_slots:
            raise EngineError(
                EngineErrorCode.BAD_CONFIG,
                f"a slot allocator of {slots.n_slots} slots for an engine of {n_slots}",
            )
        self.weights = upload_weights(model, backend, lambda: _stop_point(should_stop))
        uploaded = getattr(backend, "weights_uploaded", None)  # the CPU's: unmaps the file
        if uploaded is not None:
            uploaded(model.tensors.values())
        self.slots = slots if slots is not None else SlotAllocator(n_slots)
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self._session_ids = itertools.count(1)
        self._ahead: tuple[AheadRow, ...] | None = None  # the decode step issued ahead

    @classmethod
    def load(
        cls,
        path: str | Path | ModelFile,
        *,
        backend: str = "auto",
        n_slots: int = 1,
        n_ctx: int = 2048,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        slots: SlotAllocator | None = None,
        should_stop: Callable[[], bool] | None = None,
        threads: int | None = None,
        **backend_options: Any,
    ) -> "Engine":
        """Load a GGUF (or a model file already read) onto a backend; `backend_options` go to
        create_backend (`kv_dtype="fp8"`: an fp8 KV pool). `threads`: the CPU backend's
        threads (None: the physical cores; the GPU backends ignore it). `should_stop` is
        asked before each stage and between layers of the upload: when it says yes,
        LoadCancelled is raised."""
        model = path if isinstance(path, ModelFile) else load_model_file(path)
        n_ctx = min(n_ctx, model.hparams.n_ctx_train)
        _stop_point(should_stop)
        backend_options.setdefault("max_tokens", step_token_budget(prefill_chunk, n_slots))
        device = create_backend(
            backend, model.hparams, n_slots=n_slots, n_ctx=n_ctx, threads=threads, **backend_options
        )
        prefill_chunk = min(prefill_chunk, getattr(device, "max_tokens", prefill_chunk))
        return cls(
            model,
            device,
            n_slots=n_slots,
            n_ctx=n_ctx,
            prefill_chunk=prefill_chunk,
            slots=slots,
            should_stop=should_stop,
        )

    @property
    def kv_dtype(self) -> str:
        """The KV pool's element format (`kv_format.KV_DTYPES`): the backend's, "f16" where
        a backend does not say."""
        return getattr(self.backend, "kv_dtype", "f16")

    # --- sessions ----------------------------------------------------------------------
    def open_session(
        self,
        prompt: Sequence[int],
        *,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        max_tokens: int = 256,
        slot: int | None = None,
    ) -> Session:
        """Queue the prompt in a KV slot: `slot`, one the caller holds (taken from `slots`),
        or else a free one taken here. The slot is the session's once this returns (closing
        the session gives it back); when this fails it is still the caller's, or, taken
        here, given back.

        EngineError: BUSY when every slot is in use; CONTEXT_FULL or INVALID_ARGUMENT for a
        prompt or sampling parameters it cannot take.
        """
        self._check_turn(prompt, 0, max_tokens)
        sampler = self._sampler(sampling)
        if slot is not None and not self.slots.in_use_slot(slot):
            raise ValueError(f"slot {slot} was not taken from this engine's allocator")
        taken = self.slots.acquire() if slot is None else slot
        try:
            session = Session(
                next(self._session_ids),
                taken,
                self.n_ctx,
                self.tokenizer.eog_ids if self.tokenizer else frozenset(),
                self.tokenizer.stream() if self.tokenizer else None,
            )
            session.start_turn(list(prompt), sampler, tuple(stop), max_tokens)
        except BaseException:
            if slot is None:
                self.slots.release(taken)
            raise
        return session

    def append(
        self,
        session: Session,
        tokens: Sequence[int],
        *,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        max_tokens: int = 256,
    ) -> None:
        """Queue another turn into a session whose previous turn has finished."""
        if not session.finished:
            raise EngineError(
                EngineErrorCode.TURN_RUNNING, f"session {session.session_id} is still generating"
            )
        self._check_turn(tokens, session.n_context, max_tokens)
        session.start_turn(list(tokens), self._sampler(sampling), tuple(stop), max_tokens)

    def close_session(self, session: Session) -> None:
        self.slots.release(session.slot)

    @staticmethod
    def _sampler(sampling: SamplingParams) -> Sampler:
        """The turn's sampler; EngineError(INVALID_ARGUMENT) for parameters a step cannot hold
        (the device reads top_k as int32, the others as float32, and divides by the
        temperature and the repetition penalty; a step reads its rows back from float32, so
        a value that rounds to 0 or a subnormal would change meaning on the way)."""
        t, k, rep = sampling.temperature, sampling.top_k, sampling.repetition_penalty
        checks = (
            (k <= INT32_MAX, f"top_k must be at most {INT32_MAX}, got {k}"),
            (
                t == 0.0 or FLOAT32_TINY <= t <= FLOAT32_MAX,
                f"temperature must be 0 or in [{FLOAT32_TINY}, {FLOAT32_MAX}] (float32), got {t}",
            ),
            (
                sampling.top_p >= FLOAT32_TINY,
                f"top_p must be at least {FLOAT32_TINY} (float32), got {sampling.top_p}",
            ),
            (
                FLOAT32_TINY <= rep <= FLOAT32_MAX,
                f"repetition_penalty must be in [{FLOAT32_TINY}, {FLOAT32_MAX}] (float32),"
                f" got {rep}",
            ),
            *(
                (
                    value == 0.0 or abs(value) >= FLOAT32_TINY,
                    f"{name} must be 0 or at least {FLOAT32_TINY} in magnitude (float32),"
                    f" got {value}",
                )
                for name, value in (
                    ("min_p", sampling.min_p),
                    ("frequency_penalty", sampling.frequency_penalty),
                    ("presence_penalty", sampling.presence_penalty),
                )
            ),
        )
        for ok, message in checks:
            if not ok:
                raise EngineError(EngineErrorCode.INVALID_ARGUMENT, message)
        try:
            return Sampler(sampling)
        except (OverflowError, ValueError) as exc:  # any other value the device's row refuses
            raise EngineError(
                EngineErrorCode.INVALID_ARGUMENT, f"sampling parameters out of range: {exc}"
            ) from None

    def _check_turn(self, tokens: Sequence[int], n_context: int, max_tokens: int) -> None:
        if not tokens:
            raise EngineError(EngineErrorCode.INVALID_ARGUMENT, "a turn needs at least one token")
        if max_tokens < 1:
            raise EngineError(
                EngineErrorCode.INVALID_ARGUMENT, f"max_tokens must be >= 1, got {max_tokens}"
            )
        bad = [t for t in tokens if not 0 <= t < self.hparams.n_vocab]
        if bad:
            raise EngineError(
                EngineErrorCode.INVALID_ARGUMENT,
                f"token id {bad[0]} is outside the vocabulary [0, {self.hparams.n_vocab})",
            )
        if n_context + len(tokens) >= self.n_ctx:
            raise EngineError(
                EngineErrorCode.CONTEXT_FULL,
                f"{n_context} tokens in context + {len(tokens)} new"
                f" leave no room in ctx size {self.n_ctx}",
            )

    # --- steps ---------------------------------------------------------------------------
    @property
    def step_budget(self) -> int:
        """Tokens one `step` may take (decode rows and prompt chunks together)."""
        return step_token_budget(self.prefill_chunk, self.slots.n_slots)

    def _forward(self, batch: StepBatch) -> Any:
        return forward(self.ops, self.weights, batch)

    def _run(self, batch: StepBatch, want_logits: bool, ahead: bool = False) -> StepOutput:
        self._ahead = None  # another step: the backend drops the one issued ahead
        return self.backend.run_step(batch, self._forward, want_logits, ahead)

    def _sample(
        self, sessions: Sequence[Session], batch: StepBatch, ahead: bool
    ) -> list[TokenEvent]:
        """Run the step (the backend samples each row) and let each session take its token;
        `ahead`: the backend may issue these rows' next decode step before reading this one."""
        out = self._run(batch, False, ahead)
        self._note_ahead(out, sessions)
        return [session.accept(out.sampled(row)) for row, session in enumerate(sessions)]

    def _note_ahead(self, out: StepOutput, sessions: Sequence[Session]) -> None:
        """Remember what the step issued ahead (if one was) feeds each row: the token `out`
        sampled, at the position after the session's last."""
        if out.ahead:
            self._ahead = tuple(
                AheadRow(s, int(out.tokens[row]), s.n_past, s.sampler)
                for row, s in enumerate(sessions)
            )

    @staticmethod
    def _may_look_ahead(sessions: Sequence[Session]) -> bool:
        """Whether the decode step after the one these sessions just took their tokens for
        is worth issuing before it is read: not when every session is sure to end with this
        step's token (its token limit). The backend also declines a step past a slot's end."""
        return any(s.n_generated + 1 < s.max_new_tokens for s in sessions)

    def _take_ahead(
        self, decode: Sequence[Session], prefill: Sequence[tuple[Session, int]]
    ) -> dict[int, TokenEvent]:
        """The decode sessions' tokens from the step issued ahead, when it is the step every
        one of them wants now (its rows may be more: those are dropped); else it is dropped
        and {} returned. Issues the step after it first when the same rows decode on."""
        rows, self._ahead = self._ahead, None
        index = {id(row.session): r for r, row in enumerate(rows)}

        def wants_it(s: Session) -> bool:
            row = rows[index[id(s)]] if id(s) in index else None
            return (
                row is not None
                and s.pending == [row.token]
                and s.n_past == row.position
                and s.sampler is row.sampler
            )

        if not decode or not all(map(wants_it, decode)):
            self.backend.discard_ahead()
            return {}
        for s in decode:
            s.take_pending(1)
        again = not prefill and len(decode) == len(rows) and self._may_look_ahead(decode)
        out = self.backend.take_ahead(again)
        self._note_ahead(out, [row.session for row in rows])
        return {id(s): s.accept(out.sampled(index[id(s)])) for s in decode}

    @staticmethod
    def _sampling(sessions: Sequence[Session]) -> RowSampling:
        return RowSampling.of([s.sampler for s in sessions], [s.history for s in sessions])

    def prefill(
        self, session: Session, *, should_stop: Callable[[], bool] | None = None
    ) -> TokenEvent | None:
        """Process the session's pending tokens chunk by chunk and sample its next token.

        `should_stop` is asked between chunks; when it says yes, the prefill stops
        (the tokens processed so far stay cached) and None is returned.
        """
        while True:
            n = min(len(session.pending), self.prefill_chunk)
            (event,) = self.step([], [(session, n)]).prefilled
            if event is not None or (should_stop is not None and should_stop()):
                return event

    def decode(self, sessions: Sequence[Session]) -> list[TokenEvent]:
        """One batched decode step: each session feeds its one pending token."""
        return self.step(sessions).decoded

    def step(
        self, decode: Sequence[Session], prefill: Sequence[tuple[Session, int]] = ()
    ) -> StepEvents:
        """One scheduler step (unified scheduling): the next token of every session in
        `decode` and a chunk of n prompt tokens of every (session, n) in `prefill`; a
        session whose prompt its chunk finishes samples its first token.

        On a backend with ragged steps (`backend.ragged_steps`) it is one forward pass;
        otherwise each prompt chunk takes a pass of its own, then the decode rows one.
        """
        for s in decode:
            if s.finished or len(s.pending) != 1:
                raise EngineError(
                    EngineErrorCode.NOT_DECODABLE, f"session {s.session_id} is not ready to decode"
                )
        if not decode and not prefill:
            return StepEvents([], [])
        seen = {s.session_id for s in decode}
        for session, n in prefill:
            if session.session_id in seen or not 1 <= n <= len(session.pending):
                raise EngineError(
                    EngineErrorCode.INVALID_ARGUMENT,
                    f"session {session.session_id}: {n} prompt tokens of"
                    f" {len(session.pending)} pending, or the session twice in one step",
                )
            seen.add(session.session_id)
        events = self._take_ahead(decode, prefill) if self._ahead is not None else {}
        to_run = () if events else decode  # not already served by the step issued ahead
        parts: list[tuple[Session, SequencePart]] = []
        for session, n in (*prefill, *((s, 1) for s in to_run)):
            start = session.n_past
            tokens = session.take_pending(n)
            parts.append((session, SequencePart(tokens, start, session.slot, not session.pending)))
        if self.backend.ragged_steps:
            passes = [parts]
        else:
            passes = [[part] for part in parts[: len(prefill)]] + [parts[len(prefill) :]]
        for group in filter(None, passes):
            sampled = [s for s, part in group if part.wants_logits]
            batch = StepBatch.ragged([part for _, part in group], self._sampling(sampled))
            ahead = not prefill and self._may_look_ahead(sampled)  # a decode-only step
            events.update(zip(map(id, sampled), self._sample(sampled, batch, ahead), strict=True))
        return StepEvents(
            decoded=[events[id(s)] for s in decode],
            prefilled=[events.get(id(s)) for s, _ in prefill],
        )

    def logits(self, tokens: Sequence[int], slot: int = 0) -> np.ndarray:
        """Logits after every position of `tokens` (teacher forcing), from an empty context.

        Runs chunk by chunk, as a prefill does (chunks no longer than the backend's logits
        rows); the slot's cache is overwritten.
        """
        rows = []
        step = min(self.prefill_chunk, getattr(self.backend, "max_logit_rows", self.prefill_chunk))
        for start in range(0, len(tokens), step):
            chunk = list(tokens[start : start + step])
            rows.append(self._run(StepBatch.prefill(chunk, start, slot, "all"), True).logits)
        return np.concatenate(rows, axis=0)
