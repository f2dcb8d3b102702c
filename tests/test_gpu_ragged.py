"""Ragged steps on the GPU: one forward pass over several sequences' prompt chunks and decode
rows gives each sequence the bits of a pass of its own.

Every op but attention is row by row; attention splits a step's rows into launches
(backends/gpu/attention_plan.py): a run of one slot's consecutive positions past GEMV_MAX_ROWS
takes the prefill kernel, the rows between such runs the decode kernel, in pieces of at
most `attn_decode_rows`. The split is checked without a GPU; the bits on one, batch
invariant (the int8 GEMM shares the GEMV's summation order).
"""

import numpy as np
import pytest

from rocforge_rt.backends.gpu import cuda
from rocforge_rt.backends.gpu.attention_plan import AttentionRange, attention_ranges
from rocforge_rt.backends.gpu.kernel_constants import GEMV_MAX_ROWS
from rocforge_rt.engine.engine import Engine
from rocforge_rt.step.batch import SequencePart, StepBatch
from rocforge_rt.step.sampling import RowSampling, Sampler, SamplingParams

DECODE_ROWS = 8  # the decode kernel's rows a launch on the engines below (6 slots)

_rng = np.random.default_rng(17)


def _tokens(n: int) -> list[int]:
    return _rng.integers(0, 1000, n).tolist()


# What the slots hold before the step: a prompt's first chunk (slot 3) and the contexts of
# two sessions that decode (slots 4, 5; 70 positions: two key tiles).
HISTORY = [SequencePart(_tokens(n), 0, slot, False) for slot, n in ((3, 60), (4, 20), (5, 70))]
PARTS = [
    SequencePart(_tokens(70), 0, 0, True),  # a whole prompt past GEMV_MAX_ROWS
    SequencePart(_tokens(8), 0, 1, True),  # whole short prompts ...
    SequencePart(_tokens(5), 0, 2, True),
    SequencePart(_tokens(15), 60, 3, False),  # a prompt's middle chunk, across a key tile
    SequencePart(_tokens(1), 20, 4, True),  # decode rows of the other sessions
    SequencePart(_tokens(1), 70, 5, True),
]
SAMPLER = Sampler(SamplingParams(temperature=0.8, top_k=40, seed=11, logprobs=2))


def launches(batch: StepBatch, decode_rows: int = DECODE_ROWS) -> list[tuple[bool, int, int]]:
    """The batch's attention launches as (prefill kernel, first row, rows)."""
    return [tuple(r) for r in attention_ranges(batch.slots, batch.positions, decode_rows)]


def test_a_decode_step_is_one_decode_launch():
    batch = StepBatch.decode([1, 2, 3, 4, 5], [9, 0, 130, 4, 5], [4, 0, 2, 1, 3])
    assert launches(batch) == [(False, 0, 5)]
    assert attention_ranges(batch.slots, batch.positions, 5) == [AttentionRange(False, 0, 5)]


def test_a_prompt_chunk_takes_the_prefill_kernel_only_past_the_gemv_rows():
    short = StepBatch.prefill(list(range(GEMV_MAX_ROWS)), 30, 2)
    long = StepBatch.prefill(list(range(GEMV_MAX_ROWS + 1)), 30, 2)
    assert launches(short) == [(False, 0, GEMV_MAX_ROWS)]
    assert launches(long) == [(True, 0, GEMV_MAX_ROWS + 1)]


def test_a_ragged_step_launches_each_long_run_on_the_prefill_kernel_and_the_rest_in_pieces():
    """The whole prompt's rows but its last (moved to the tail) and the middle chunk take the
    prefill kernel; the short prompts' rows between them are 11 decode rows (pieces of 8
    and 3), the tail's 5 (the prompts' last rows, the decode rows) one more launch."""
    assert launches(StepBatch.ragged(PARTS)) == [
        (True, 0, 69),
        (False, 69, 8),
        (False, 77, 3),
        (True, 80, 15),
        (False, 95, 5),
    ]


def run(engine: Engine, parts: list[SequencePart]) -> tuple[list, np.ndarray]:
    """One pass over `parts`: each logits row's sampled token (SAMPLER's), and its logits."""
    rows = sum(part.wants_logits for part in parts)
    out = engine._run(StepBatch.ragged(parts, RowSampling.of([SAMPLER] * rows)), True)
    return [out.sampled(r) for r in range(rows)], out.logits


def prepared_engine(synthetic_model) -> Engine:
    engine = Engine.load(
        synthetic_model, backend="cuda", n_slots=6, n_ctx=128, batch_invariant=True
    )
    assert engine.backend.workspace.attn_decode_rows == DECODE_ROWS
    for part in HISTORY:
        run(engine, [part])
    return engine


@pytest.mark.gpu
@pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device")
def test_a_ragged_step_gives_every_part_the_bits_of_its_own_pass(synthetic_model):
    """Sampled tokens, log-probabilities, alternatives and logits of the ragged step equal
    those of each part run alone; then every sequence's next token gets the same logits,
    so each slot's cache holds the same K/V (the middle chunk's included)."""
    alone, together = prepared_engine(synthetic_model), prepared_engine(synthetic_model)
    expected = [run(alone, [part]) for part in PARTS]
    tokens, logits = run(together, PARTS)
    assert tokens == [t for sampled, _ in expected for t in sampled]
    assert np.array_equal(logits, np.concatenate([rows for _, rows in expected]))
    for part in PARTS:
        following = [SequencePart([7], part.start + len(part.tokens), part.slot, True)]
        assert np.array_equal(run(together, following)[1], run(alone, following)[1])
