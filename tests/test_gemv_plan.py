"""The matmul planners (matmul_plan.py), without a GPU: on an H100's capabilities and the
default tuning, the decode GEMVs and batch MMVs of the SmolLM2, 1B and 8B shapes take the
kernels and launch shapes the backend chose before the planners existed (pinned below)."""

from dataclasses import replace

import pytest

from rocforge_rt.backends.gpu.kernel_variants import MMV_KERNELS, MmvKernel, mmv_shapes, mmv_tiles
from rocforge_rt.backends.gpu.matmul_plan import (
    DeviceCaps,
    GemvShape,
    MatmulTuning,
    mmv_shape,
    plan_gemv,
)

H100 = DeviceCaps(warp_size=32, multiprocessors=132, max_shared_per_block=227 << 10,
                  clusters=True, bulk_copy=True)  # fmt: skip
TUNING = MatmulTuning()
# (n_embd, n_ff, q_dim + 2 * kv_dim, vocab, LM head format) of each model shape.
MODELS = {
    "smollm2": (576, 1536, 960, 49152, "q8_0"),
    "1b": (2048, 8192, 3072, 128256, "q8_0"),
    "8b": (4096, 14336, 6144, 128256, "q4_0"),
}


def decode_gemvs(model: str, rows: int = 1, *, down_q8: bool) -> dict[str, GemvShape]:
    """A decode step's GEMVs: Q|K|V (RoPE), O (its row quantized by the attention), gate|up
    (SwiGLU), down (its row quantized by gate|up when `down_q8`), the LM head."""
    embd, ff, qkv, vocab, head = MODELS[model]
    one = rows == 1
    return {
        "qkv": GemvShape("q4_0", qkv, embd, rows, "rope", gain=True),
        "o": GemvShape("q4_0", embd, embd, rows, row_q8=one),
        "gate_up": GemvShape("q4_0", ff, embd, rows, "swiglu", gain=True),
        "down": GemvShape("q4_0", embd, ff, rows, row_q8=one and down_q8),
        "lm_head": GemvShape(head, vocab, embd, rows, gain=True),
    }


# (kernel, grid, shared bytes, cluster, ring slots, release early, prequantize) a GEMV.
ONE_ROW = {
    "smollm2": {
        "qkv": ("rf_gemv_q4_0_b1_n2_rope", 60, 3088, 1, 0, True, False),
        "o": ("rf_gemv_q4_0_b1_n1", 72, 2032, 1, 0, True, False),
        "gate_up": ("rf_gemv_q4_0_b1_n1_swiglu", 192, 3088, 1, 0, True, False),
        "down": ("rf_gemv_q4_0_b1_n1", 72, 3232, 1, 0, True, False),
        "lm_head": ("rf_gemv_q8_0_b1_n2", 264, 3088, 1, 0, False, False),
    },
    "1b": {
        "qkv": ("rf_gemv_q4_0_b1_n2_rope", 192, 4928, 1, 0, True, True),
        "o": ("rf_gemv_q4_0_b1_n1", 256, 3872, 1, 0, True, False),
        "gate_up": ("rf_gemv_q4_0_b1_n2_swiglu_q8_cl", 256, 7040, 2, 0, True, False),
        "down": ("rf_gemv_q4_0_b1_n1", 256, 11552, 1, 0, True, False),
        "lm_head": ("rf_gemv_q8_0_b1_n2", 264, 4928, 1, 0, False, True),
    },
    "8b": {
        "qkv": ("rf_gemv_q4_0_b1_n4_rope", 192, 9600, 1, 0, True, True),
        "o": ("rf_gemv_q4_0_b1_n2", 256, 7488, 1, 0, True, False),
        "gate_up": ("rf_gemv_q4_0_b1_n2_swiglu_cl", 264, 9600, 2, 0, False, False),
        "down": ("rf_gemv_q4_0_b1_n2", 256, 20288, 1, 0, True, True),
        "lm_head": ("rf_gemv_q4_0_b1_n4_bulk", 264, 83456, 1, 2, False, True),
    },
}
# (kernel, grid, shared bytes) of each launch of an 8-row GEMV.
EIGHT_ROWS = {
    ("1b", "qkv"): [("rf_gemv_q4_0_b8_n2_rope", 192, 37632)],
    ("1b", "gate_up"): [("rf_gemv_q4_0_b8_n1_swiglu", 264, 37632)],
    ("1b", "down"): [("rf_gemv_q4_0_b8_n1", 256, 39424)] * 2 + [("rf_gemv_q4_0_b8_n1", 256, 29184)],
    ("1b", "lm_head"): [("rf_gemv_q8_0_b8_n1", 264, 29184)],
    ("8b", "qkv"): [
        ("rf_gemv_q4_0_b8_n2_rope", 264, 47872),
        ("rf_gemv_q4_0_b8_n2_rope", 264, 27392),
    ],
    ("8b", "down"): [("rf_gemv_q4_0_b8_n1", 264, 44544)] * 4,
    ("8b", "lm_head"): [
        ("rf_gemv_q4_0_b8_n1", 264, 44544),
        ("rf_gemv_q4_0_b1_n4_bulk", 264, 83456),
    ],
}
# The MMV shape (and epilogue) of each matmul at 2, 16 and 64 rows.
_LAYER = ("qkv", "o", "gate_up", "down", "lm_head")
MMV = {
    ("smollm2", 2): ("t1_k8_m1_rope", "t1_k8_m1", "t1_k8_m1_swiglu", "t1_k8_m1", "t1_k2_m1"),
    ("smollm2", 16): ("t1_k8_m2_rope", "t1_k8_m2", "t2_k8_m1_swiglu", "t1_k8_m2", "t2_k2_m1"),
    ("smollm2", 64): ("t4_k8_m2_rope", "t4_k8_m2", "t4_k8_m2_swiglu", "t4_k8_m2", "t8_k1_m1"),
    ("1b", 2): ("t1_k8_m1_rope", "t1_k8_m1", "t1_k2_m1_swiglu", "t1_k8_m1", "t1_k2_m1"),
    ("1b", 16): ("t2_k8_m1_rope", "t2_k8_m1", "t2_k2_m1_swiglu", "t2_k8_m1", "t2_k2_m1"),
    ("1b", 64): ("t4_k8_m2_rope", "t4_k8_m2", "t8_k1_m1_swiglu", "t4_k8_m2", "t8_k1_m1"),
    ("8b", 2): ("t1_k8_m1_rope", "t1_k8_m1", "t1_k2_m1_swiglu", "t1_k8_m1", "t1_k2_m1"),
    ("8b", 16): ("t2_k8_m1_rope", "t2_k8_m1", "t2_k2_m1_swiglu", "t2_k8_m1", "t2_k2_m1"),
    ("8b", 64): ("t4_k8_m2_rope", "t4_k8_m2", "t8_k1_m1_swiglu", "t4_k8_m2", "t8_k1_m1"),
}


@pytest.mark.parametrize("model", MODELS)
def test_one_row_gemvs_plan_as_before(model: str) -> None:
    down_q8 = model == "1b"  # the 1B gate|up GEMV quantizes its outputs for the down one
    for op, shape in decode_gemvs(model, down_q8=down_q8).items():
        (launch,) = plan_gemv(shape, H100, TUNING)
        got = (launch.kernel.name, launch.grid, launch.shared_bytes, launch.cluster,
               launch.ring_slots, launch.release_early, launch.prequantize)  # fmt: skip
        assert got == ONE_ROW[model][op], op
        assert launch.block == 256 and launch.copies_writer_q8 == (shape.row_q8 and not shape.gain)


@pytest.mark.parametrize(("model", "op"), EIGHT_ROWS)
def test_eight_row_gemvs_split_to_fit_shared_memory(model: str, op: str) -> None:
    shape = decode_gemvs(model, 8, down_q8=False)[op]
    plan = plan_gemv(shape, H100, TUNING)
    assert [(p.kernel.name, p.grid, p.shared_bytes) for p in plan] == EIGHT_ROWS[(model, op)]
    assert sum(p.rows for p in plan) == 8 and plan[0].first == 0


@pytest.mark.parametrize(("model", "rows"), MMV)
def test_mmv_shapes_plan_as_before(model: str, rows: int) -> None:
    embd, ff, qkv, vocab, head = MODELS[model]
    outputs = {"qkv": qkv, "o": embd, "gate_up": ff, "down": embd, "lm_head": vocab}
    for op, suffix in zip(_LAYER, MMV[(model, rows)], strict=True):
        per_block = 8 if op == "gate_up" else 16  # 16 weight rows: 8 gate|up pairs
        shape = mmv_shape(mmv_tiles(rows), -(-outputs[op] // per_block), H100, TUNING)
        epilogue = {"qkv": "rope", "gate_up": "swiglu"}.get(op, "")
        kernel = MmvKernel(head if op == "lm_head" else "q4_0", shape, epilogue)
        assert kernel in MMV_KERNELS
        assert kernel.name == f"rf_mmv_{kernel.fmt}_{suffix}", op


def test_an_mmv_shape_index_picks_that_shape_of_every_tile_count() -> None:
    """`mmv_shape_index` overrides the warps rule: shape i of each tile count's declared
    shapes, the last past them."""
    for tiles in (1, 2, 4, 8):
        shapes = mmv_shapes(tiles)
        for index in range(len(shapes) + 1):
            tuning = replace(TUNING, mmv_shape_index=index)
            assert mmv_shape(tiles, 1, H100, tuning) == shapes[min(index, len(shapes) - 1)]


def test_a_tuning_changes_the_plan_and_devices_without_clusters_or_bulk_copies() -> None:
    gate_up = decode_gemvs("8b", down_q8=False)["gate_up"]
    lm_head = decode_gemvs("8b", down_q8=False)["lm_head"]
    no_cluster = replace(TUNING, gemv_cluster_blocks=1)
    (launch,) = plan_gemv(gate_up, H100, no_cluster)
    assert (launch.kernel.name, launch.cluster, launch.prequantize) == (
        "rf_gemv_q4_0_b1_n2_swiglu",
        1,
        True,
    )
    plain = replace(H100, clusters=False, bulk_copy=False)
    assert plan_gemv(gate_up, plain, TUNING) == plan_gemv(gate_up, H100, no_cluster)
    (head,) = plan_gemv(lm_head, plain, TUNING)
    assert (head.kernel.name, head.ring_slots) == ("rf_gemv_q4_0_b1_n4", 0)
    (capped,) = plan_gemv(decode_gemvs("8b", down_q8=False)["o"], H100,
                          replace(TUNING, gemv_max_blocks_per_sm=1))  # fmt: skip
    assert capped.grid == 132
