"""The attention planner (attention_plan.py), without a GPU: on an H100's multiprocessors and
the default tuning, the SmolLM2, 1B and 8B shapes' steps take the kernels, grids, folds and
quantized outputs the backend chose before the planner existed (pinned below, from the
launches of those shapes over a 1,024-position pool with 8-row decode launches)."""

from dataclasses import replace

import pytest

from rocforge_rt.backends.gpu.attention_plan import (
    AttentionShape,
    AttentionTuning,
    decode_wave,
    folds_apart,
    plan_attention,
)
from rocforge_rt.step.batch import SequencePart, StepBatch

TUNING = AttentionTuning()
H100_MULTIPROCESSORS = 132
# (head dim, query heads, KV heads) of each model shape.
MODELS = {"smollm2": (64, 9, 3), "1b": (64, 32, 8), "8b": (128, 32, 8)}
BATCHES = {
    "one@5": StepBatch.decode([1], [5], [0]),
    "one@511": StepBatch.decode([1], [511], [0]),  # 8 key tiles: folded in the kernel
    "one@575": StepBatch.decode([1], [575], [0]),  # 9 key tiles: folded apart
    "one@1000": StepBatch.decode([1], [1000], [0]),
    "three": StepBatch.decode([1, 2, 3], [10, 700, 3], [0, 1, 2]),
    "chunk8": StepBatch.prefill(list(range(8)), 0, 2, "none"),  # GEMV_MAX_ROWS: decode rows
    "chunk24": StepBatch.prefill(list(range(24)), 100, 1, "none"),
    # Rows: slot 1's 19 chunk rows, slot 2's 8, slot 0's 12, then the 3 logits rows.
    "ragged": StepBatch.ragged(
        [
            SequencePart([1], 5, 0, True),
            SequencePart([2], 9, 3, True),
            SequencePart(list(range(20)), 200, 1, True),
            SequencePart(list(range(8)), 3, 2, False),
            SequencePart(list(range(12)), 600, 0, False),
        ]
    ),
}
# Per batch: (kernel suffix, first row, rows, grid, fold grid or None) a launch; whether the
# step folds apart; whether its output row is also quantized.
P, D = "prefill", "decode"


def pinned(model: str) -> dict[str, tuple[list[tuple], bool, bool]]:
    _, n_head, n_kv = MODELS[model]
    chunk_blocks = {"smollm2": (2, 1, 1), "1b": (2, 2, 1), "8b": (2, 2, 1)}[model]
    return {
        "one@5": ([(D, 0, 1, (n_kv, 1, 16), None)], False, True),
        "one@511": ([(D, 0, 1, (n_kv, 1, 16), None)], False, True),
        "one@575": ([(D, 0, 1, (n_kv, 1, 16), (n_head, 1, 1))], True, True),
        "one@1000": ([(D, 0, 1, (n_kv, 1, 16), (n_head, 1, 1))], True, True),
        "three": ([(D, 0, 3, (n_kv, 3, 16), (n_head, 3, 1))], True, False),
        "chunk8": ([(D, 0, 8, (n_kv, 8, 16), None)], False, False),
        "chunk24": ([(P, 0, 24, (n_kv, chunk_blocks[0], 1), None)], False, False),
        "ragged": (
            [
                (P, 0, 19, (n_kv, chunk_blocks[1], 1), None),
                (D, 19, 8, (n_kv, 8, 16), (n_head, 8, 1)),
                (P, 27, 12, (n_kv, chunk_blocks[2], 1), None),
                (D, 39, 3, (n_kv, 3, 16), (n_head, 3, 1)),
            ],
            True,
            False,
        ),
    }


def shape(model: str, kv_fp8: bool = False) -> AttentionShape:
    head_dim, n_head, n_kv = MODELS[model]
    return AttentionShape(head_dim, n_head, n_kv, kv_fp8, key_tiles=16, decode_rows=8)


def plan_rows(model: str, batch: StepBatch, tuning: AttentionTuning, kv_fp8: bool = False):
    """The plan as pinned: each launch's kernel suffix, rows, grid and fold grid."""
    plan = plan_attention(batch.slots, batch.positions, shape(model, kv_fp8), tuning)
    head_dim = MODELS[model][0]
    fp8 = "_fp8" if kv_fp8 else ""
    rows = []
    for launch in plan.launches:
        kind, _, rest = launch.kernel.removeprefix("rf_attention_").partition("_")
        assert rest == f"d{head_dim}{fp8}"
        fold_grid = None
        if launch.fold is not None:
            assert launch.fold[0] == f"rf_attention_fold_d{head_dim}"
            fold_grid = launch.fold[1]
        rows.append((kind, launch.first, launch.rows, launch.grid, fold_grid))
    return rows, plan.fold_apart, plan.quantize_out


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_steps_plan_as_before(model: str, kv_fp8: bool) -> None:
    for name, batch in BATCHES.items():
        assert plan_rows(model, batch, TUNING, kv_fp8) == pinned(model)[name], name


@pytest.mark.parametrize("model", MODELS)
def test_a_tuning_moves_the_fold_threshold_and_stops_quantizing_the_output(model: str) -> None:
    tuning = replace(TUNING, fold_kernel_min_tiles=2, quantize_out=False)
    for name, batch in BATCHES.items():
        launches, fold_apart, quantize_out = plan_rows(model, batch, tuning)
        assert not quantize_out
        longest = int(batch.positions.max()) + 1
        assert fold_apart == (longest > 64), name  # from 2 key tiles on
        assert all((fold is not None) == fold_apart for kind, *_, fold in launches if kind == D)


def test_the_decode_wave_is_the_devices_unless_the_tuning_gives_one() -> None:
    assert decode_wave(H100_MULTIPROCESSORS, 16, TUNING) == 2112
    assert decode_wave(H100_MULTIPROCESSORS, 16, replace(TUNING, decode_wave=0)) == 0
    assert decode_wave(H100_MULTIPROCESSORS, 16, replace(TUNING, decode_wave=1)) == 1


def test_a_step_folds_apart_from_nine_key_tiles_on() -> None:
    assert TUNING.fold_kernel_min_tiles == 9
    assert not folds_apart(8 * 64, TUNING)
    assert folds_apart(8 * 64 + 1, TUNING)
    assert not folds_apart(0, TUNING)
