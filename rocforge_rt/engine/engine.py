"""The engine: a model's weights on a backend, a KV pool of slots, and the sessions using them.

Contract: one thread drives an Engine (its executor). The daemon hands work to
that thread; nothing else calls in, except the slot allocator (`slots`), which is
thread-safe: the daemon reserves a slot there when it accepts a request that will
open a session, and hands it to `open_session`.

After a decode-only step the next decode step may be issued ahead (pipelined decode:
engine/pipeline.py).
"""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rocforge_rt.backends import Backend, BackendOptions, create_backend
from rocforge_rt.engine.kv_cache import SlotAllocator
from rocforge_rt.engine.pipeline import DecodePipeline, may_look_ahead
from rocforge_rt.engine.scheduling import check_step, step_token_budget
from rocforge_rt.engine.session import Session, TokenEvent, check_turn
from rocforge_rt.errors import EngineError, EngineErrorCode, LoadCancelled
from rocforge_rt.model.gguf_file import ModelFile, load_model_file
from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.profiling.load_progress import UPLOADING_WEIGHTS, LoadProgress
from rocforge_rt.step.batch import SequencePart, StepBatch
from rocforge_rt.step.forward import ForwardOps, StepOutput, forward, upload_weights
from rocforge_rt.step.sampling import (
    RowSampling,
    Sampler,
    SamplingParams,
)

# Prompt tokens per forward pass: each chunk expands every weight matrix to fp16 once for the
# vendor GEMM, and longer chunks amortize that (docs/performance.md). A daemon's decode
# streams wait for one chunk at most.
DEFAULT_PREFILL_CHUNK = 2048


def _stop_point(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise LoadCancelled("loading stopped: asked to stop")


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
        progress: LoadProgress | None = None,
    ) -> None:
        """`slots`: the allocator to use (the daemon's, shared with its socket thread), else a
        new one. `should_stop` is asked between layers of the weights' upload: when it says
        yes, LoadCancelled is raised. `progress` hears of the layers uploaded."""
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
        self.caps = backend.caps  # read once: what the steps are planned by
        self.ops: ForwardOps = backend  # what forward() calls; a profiler may wrap it
        if slots is not None and slots.n_slots != n_slots:
            raise EngineError(
                EngineErrorCode.BAD_CONFIG,
                f"a slot allocator of {slots.n_slots} slots for an engine of {n_slots}",
            )
        parts = self.hparams.n_layer + 1  # the layers, then the embeddings and the head
        uploaded = itertools.count()

        def checkpoint() -> None:  # before each part
            _stop_point(should_stop)
            if progress is not None:
                progress(UPLOADING_WEIGHTS, next(uploaded), parts)

        self.weights = upload_weights(model, backend, checkpoint)
        if progress is not None:
            progress(UPLOADING_WEIGHTS, parts, parts)
        backend.weights_uploaded(model.tensors.values())
        self.slots = slots if slots is not None else SlotAllocator(n_slots)
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self._session_ids = itertools.count(1)
        self._pipeline = DecodePipeline(backend)

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
        progress: LoadProgress | None = None,
        **backend_options: Any,
    ) -> "Engine":
        """Load a GGUF (or a model file already read) onto a backend; `backend_options` are
        BackendOptions' fields (`kv_dtype="fp8"`: an fp8 KV pool; `threads`: the CPU's
        threads), ValueError naming one that is not; `max_tokens` is the step budget unless
        given. `should_stop` is asked before each stage and between layers of the upload:
        when it says yes, LoadCancelled is raised. `progress` hears of the long stages (the
        kernels compiled, the layers uploaded)."""
        model = path if isinstance(path, ModelFile) else load_model_file(path)
        n_ctx = min(n_ctx, model.hparams.n_ctx_train)
        _stop_point(should_stop)
        backend_options.setdefault("max_tokens", step_token_budget(prefill_chunk, n_slots))
        options = BackendOptions.of(**backend_options)
        device = create_backend(
            backend, model.hparams, n_slots=n_slots, n_ctx=n_ctx, options=options,
            progress=progress,
        )  # fmt: skip
        prefill_chunk = min(prefill_chunk, device.caps.max_tokens or prefill_chunk)
        return cls(
            model,
            device,
            n_slots=n_slots,
            n_ctx=n_ctx,
            prefill_chunk=prefill_chunk,
            slots=slots,
            should_stop=should_stop,
            progress=progress,
        )

    @property
    def kv_dtype(self) -> str:
        """The KV pool's element format (`kv_format.KV_DTYPES`)."""
        return self.caps.kv_dtype

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
        check_turn(prompt, 0, max_tokens, self.hparams.n_vocab, self.n_ctx)
        sampler = Sampler(sampling)
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
        check_turn(tokens, session.n_context, max_tokens, self.hparams.n_vocab, self.n_ctx)
        session.start_turn(list(tokens), Sampler(sampling), tuple(stop), max_tokens)

    def close_session(self, session: Session) -> None:
        self.slots.release(session.slot)

    # --- steps ---------------------------------------------------------------------------
    @property
    def step_budget(self) -> int:
        """Tokens one `step` may take (decode rows and prompt chunks together)."""
        return step_token_budget(self.prefill_chunk, self.slots.n_slots)

    def _forward(self, batch: StepBatch) -> Any:
        return forward(self.ops, self.weights, batch)

    def _run(self, batch: StepBatch, want_logits: bool, ahead: bool = False) -> StepOutput:
        self._pipeline.forget()
        return self.backend.run_step(batch, self._forward, want_logits, ahead)

    def _sample(
        self, sessions: Sequence[Session], batch: StepBatch, ahead: bool
    ) -> list[TokenEvent]:
        """Run the step (the backend samples each row) and let each session take its token;
        `ahead`: the backend may issue these rows' next decode step before reading this one."""
        out = self._run(batch, False, ahead)
        self._pipeline.note(out, sessions)
        return [session.accept(out.sampled(row)) for row, session in enumerate(sessions)]

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

        On a backend with ragged steps (`caps.ragged_steps`) it is one forward pass;
        otherwise each prompt chunk takes a pass of its own, then the decode rows one.
        """
        check_step(decode, prefill)
        if not decode and not prefill:
            return StepEvents([], [])
        events = self._pipeline.take(decode, prefill) if self._pipeline.issued else {}
        to_run = () if events else decode  # not already served by the step issued ahead
        parts: list[tuple[Session, SequencePart]] = []
        for session, n in (*prefill, *((s, 1) for s in to_run)):
            start = session.n_past
            tokens = session.take_pending(n)
            parts.append((session, SequencePart(tokens, start, session.slot, not session.pending)))
        if self.caps.ragged_steps:
            passes = [parts]
        else:
            passes = [[part] for part in parts[: len(prefill)]] + [parts[len(prefill) :]]
        for group in filter(None, passes):
            sampled = [s for s, part in group if part.wants_logits]
            batch = StepBatch.ragged([part for _, part in group], self._sampling(sampled))
            ahead = not prefill and may_look_ahead(sampled)  # a decode-only step
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
        step = min(self.prefill_chunk, self.caps.max_logit_rows or self.prefill_chunk)
        for start in range(0, len(tokens), step):
            chunk = list(tokens[start : start + step])
            rows.append(self._run(StepBatch.prefill(chunk, start, slot, "all"), True).logits)
        return np.concatenate(rows, axis=0)
