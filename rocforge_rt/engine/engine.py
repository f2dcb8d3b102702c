"""The engine: a model's weights on a backend, a KV pool of slots, and the sessions using them.

Contract: one thread drives an Engine (its executor). The daemon hands work to
that thread; nothing else calls in.
"""

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rocforge_rt.backends import Backend, create_backend
from rocforge_rt.engine.kv_cache import SlotAllocator
from rocforge_rt.engine.session import Session, TokenEvent
from rocforge_rt.errors import EngineError, EngineErrorCode
from rocforge_rt.model.gguf_file import ModelFile, load_model_file
from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import ForwardOps, StepOutput, forward, upload_weights
from rocforge_rt.step.sampling import RowSampling, Sampler, SamplingParams

DEFAULT_PREFILL_CHUNK = 512


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
    ) -> None:
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
        self.weights = upload_weights(model, backend)
        self.slots = SlotAllocator(n_slots, n_ctx)
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self._session_ids = itertools.count(1)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        backend: str = "auto",
        n_slots: int = 1,
        n_ctx: int = 2048,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        **backend_options: Any,
    ) -> "Engine":
        """Load a GGUF onto a backend; `backend_options` go to create_backend."""
        model = load_model_file(path)
        n_ctx = min(n_ctx, model.hparams.n_ctx_train)
        device = create_backend(
            backend, model.hparams, n_slots=n_slots, n_ctx=n_ctx, **backend_options
        )
        prefill_chunk = min(prefill_chunk, getattr(device, "max_tokens", prefill_chunk))
        return cls(model, device, n_slots=n_slots, n_ctx=n_ctx, prefill_chunk=prefill_chunk)

    # --- sessions ----------------------------------------------------------------------
    def open_session(
        self,
        prompt: Sequence[int],
        *,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        max_tokens: int = 256,
    ) -> Session:
        """Take a KV slot and queue the prompt.

        EngineError: BUSY when every slot is in use; CONTEXT_FULL or INVALID_ARGUMENT for a
        prompt it cannot take.
        """
        self._check_turn(prompt, 0, max_tokens)
        session = Session(
            next(self._session_ids),
            self.slots.acquire(),
            self.n_ctx,
            self.tokenizer.eog_ids if self.tokenizer else frozenset(),
            self.tokenizer.stream() if self.tokenizer else None,
        )
        session.start_turn(list(prompt), Sampler(sampling), tuple(stop), max_tokens)
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
        session.start_turn(list(tokens), Sampler(sampling), tuple(stop), max_tokens)

    def close_session(self, session: Session) -> None:
        self.slots.release(session.slot)

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
    def _run(self, batch: StepBatch, want_logits: bool) -> StepOutput:
        return self.backend.run_step(
            batch, lambda: forward(self.ops, self.weights, batch), want_logits
        )

    def _sample(self, sessions: Sequence[Session], batch: StepBatch) -> list[TokenEvent]:
        """Run the step (the backend samples each row) and let each session take its token."""
        out = self._run(batch, False)
        return [session.accept(out.sampled(row)) for row, session in enumerate(sessions)]

    @staticmethod
    def _sampling(sessions: Sequence[Session]) -> RowSampling:
        return RowSampling.of([s.sampler for s in sessions])

    def prefill(
        self, session: Session, *, should_stop: Callable[[], bool] | None = None
    ) -> TokenEvent | None:
        """Process the session's pending tokens chunk by chunk and sample its next token.

        `should_stop` is asked between chunks; when it says yes, the prefill stops
        (the tokens processed so far stay cached) and None is returned.
        """
        while len(session.pending) > self.prefill_chunk:
            start = session.n_past
            chunk = session.take_pending(self.prefill_chunk)
            self._run(StepBatch.prefill(chunk, start, session.slot, "none"), False)
            if should_stop is not None and should_stop():
                return None
        start = session.n_past
        chunk = session.take_pending(len(session.pending))
        batch = StepBatch.prefill(chunk, start, session.slot, sampling=self._sampling([session]))
        (event,) = self._sample([session], batch)
        return event

    def decode(self, sessions: Sequence[Session]) -> list[TokenEvent]:
        """One batched decode step: each session feeds its one pending token."""
        for s in sessions:
            if s.finished or len(s.pending) != 1:
                raise EngineError(
                    EngineErrorCode.NOT_DECODABLE, f"session {s.session_id} is not ready to decode"
                )
        positions = [s.n_past for s in sessions]
        tokens = [s.take_pending(1)[0] for s in sessions]
        slots = [s.slot for s in sessions]
        return self._sample(
            sessions, StepBatch.decode(tokens, positions, slots, self._sampling(sessions))
        )

    def logits(self, tokens: Sequence[int], slot: int = 0) -> np.ndarray:
        """Logits after every position of `tokens` (teacher forcing), from an empty context.

        Runs chunk by chunk, as a prefill does; the slot's cache is overwritten.
        """
        rows = []
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = list(tokens[start : start + self.prefill_chunk])
            rows.append(self._run(StepBatch.prefill(chunk, start, slot, "all"), True).logits)
        return np.concatenate(rows, axis=0)
