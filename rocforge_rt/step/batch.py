"""The per-step values of one forward pass (the step state)."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rocforge_rt.step.sampling import RowSampling


@dataclass(frozen=True)
class SequencePart:
    """Consecutive tokens of one sequence from position `start`, for a ragged step."""

    tokens: Sequence[int]
    start: int
    slot: int
    wants_logits: bool  # its last token's logits (to sample the sequence's next token)


@dataclass(frozen=True)
class StepBatch:
    """Tokens processed in one forward pass, possibly from several sequences.

    A prefill chunk is N tokens of one sequence at consecutive positions; a
    batched decode step is one token from each of N sequences. Each token
    attends to the cache of its own KV slot, up to and including its position.
    """

    tokens: np.ndarray  # int32 [N]
    positions: np.ndarray  # int32 [N]
    slots: np.ndarray  # int32 [N]: KV slot of each token's sequence
    logit_rows: np.ndarray  # int32 [B]: rows whose logits are wanted (a sequence's last token)
    sampling: RowSampling  # how each logits row picks its token

    def __post_init__(self) -> None:
        if self.sampling.rows != len(self.logit_rows):
            raise ValueError(
                f"{self.sampling.rows} sampling rows for {len(self.logit_rows)} logits rows"
            )

    @classmethod
    def prefill(
        cls,
        tokens: list[int],
        start: int,
        slot: int,
        logits: Literal["last", "all", "none"] = "last",
        sampling: RowSampling | None = None,
    ) -> "StepBatch":
        """Consecutive tokens of one sequence starting at position `start`.

        `logits` says which rows' logits are computed: the last (to sample the next
        token), all (teacher forcing), or none (a chunk before the prompt's end);
        `sampling` how each of those rows picks its token (default: greedy).
        """
        n = len(tokens)
        rows = {"last": [n - 1], "all": list(range(n)), "none": []}[logits]
        return cls(
            tokens=np.asarray(tokens, dtype=np.int32),
            positions=np.arange(start, start + n, dtype=np.int32),
            slots=np.full(n, slot, dtype=np.int32),
            logit_rows=np.array(rows, dtype=np.int32),
            sampling=sampling or RowSampling.greedy(len(rows)),
        )

    @classmethod
    def decode(
        cls,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        sampling: RowSampling | None = None,
    ) -> "StepBatch":
        """One token from each of several sequences; logits (and a sampled token) for every row."""
        n = len(tokens)
        return cls(
            tokens=np.asarray(tokens, dtype=np.int32),
            positions=np.asarray(positions, dtype=np.int32),
            slots=np.asarray(slots, dtype=np.int32),
            logit_rows=np.arange(n, dtype=np.int32),
            sampling=sampling or RowSampling.greedy(n),
        )

    @classmethod
    def ragged(
        cls, parts: Sequence[SequencePart], sampling: RowSampling | None = None
    ) -> "StepBatch":
        """Several sequences' tokens in one forward pass (unified scheduling): decode rows
        and prompt chunks side by side.

        Rows are laid out so that the logits rows come last and together: each part's
        tokens in order, except that the last token of a part that wants logits moves to
        the tail, parts in the given order there. A moved token still sees its part's
        others, whose K/V every layer appends before its attention runs. `sampling` has
        one row per part that wants logits, in order (default: greedy).
        """
        body: list[tuple[int, int, int]] = []  # (token, position, slot)
        tail: list[tuple[int, int, int]] = []
        for part in parts:
            rows = [(t, part.start + i, part.slot) for i, t in enumerate(part.tokens)]
            if part.wants_logits:
                body += rows[:-1]
                tail.append(rows[-1])
            else:
                body += rows
        rows = np.array(body + tail, dtype=np.int32).reshape(-1, 3)
        n, n_tail = len(rows), len(tail)
        return cls(
            tokens=np.ascontiguousarray(rows[:, 0]),
            positions=np.ascontiguousarray(rows[:, 1]),
            slots=np.ascontiguousarray(rows[:, 2]),
            logit_rows=np.arange(n - n_tail, n, dtype=np.int32),
            sampling=sampling or RowSampling.greedy(n_tail),
        )

    def next_decode(self, tokens: np.ndarray) -> "StepBatch":
        """The decode step after this one (a decode step): the same rows, each feeding the
        token it sampled (`tokens`) one position on."""
        positions = self.positions + 1
        sampling = self.sampling.advanced(tokens, positions)
        return StepBatch(tokens, positions, self.slots, self.logit_rows, sampling)

    def next_decode_fits(self, n_ctx: int) -> bool:
        """Whether the decode step after this one stays inside slots of `n_ctx` positions."""
        return int(self.positions.max()) + 1 < n_ctx

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def decode_shaped(self) -> bool:
        """Whether every token is its own sequence's only row and asks for logits."""
        rows = len(self.logit_rows)
        return rows == self.n_tokens and len(set(self.slots.tolist())) == rows

    @property
    def draw_positions(self) -> np.ndarray:
        """int32 [B]: the context position of the token each logits row draws."""
        return self.positions[self.logit_rows] + 1
