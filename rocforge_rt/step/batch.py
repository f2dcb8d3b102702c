"""The per-step values of one forward pass (the step state)."""

from dataclasses import dataclass
from typing import Literal

import numpy as np

from rocforge_rt.step.sampling import RowSampling


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

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chunk(self) -> bool:
        """Whether these are consecutive tokens of one sequence (a prompt chunk)."""
        slots, positions = self.slots, self.positions
        if not len(slots):
            return False
        consecutive = np.array_equal(positions, positions[0] + np.arange(len(positions)))
        return bool(consecutive and np.all(slots == slots[0]))

    @property
    def draw_positions(self) -> np.ndarray:
        """int32 [B]: the context position of the token each logits row draws."""
        return self.positions[self.logit_rows] + 1
