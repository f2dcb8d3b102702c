"""Llama 3 RoPE scaling on the GPU (run on a GPU machine): the tiny-llama3 models' last
logits, through a prompt (the rope kernel after the prefill GEMM) and through a decode step
(the QKV GEMV's RoPE epilogue), against llama.cpp's (tests/data/tiny-llama3-rope.llamacpp.*)
to the bars the CPU engine meets (tests/test_rope_scaling.py). The GPU kernels only read the
RoPE tables (step/rope.py), so the factors reach them through the tables alone."""

from pathlib import Path

import numpy as np
import pytest
from rope_reference import (
    ONE_TOKEN_CASE,
    QUANT_CORR,
    QUANT_MAX_DIFF,
    agreement,
    llamacpp_attention_spread,
    nearer_agreement,
)

from rocforge_rt.backends.gpu import cuda
from rocforge_rt.engine.engine import Engine
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.rope import rope_tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda.device_count() == 0, reason="no CUDA device"),
]

N_CTX = 4096
CASES = ["factors-1", "factors-64", "factors-2000", "factors-4000", "linear4-2000"]


@pytest.fixture(scope="module", params=["int8", "vendor"])
def engines(request, llama3_models: dict[str, Path]) -> dict[str, Engine]:
    """variant -> a CUDA engine; the prompt GEMM the int8 one (batch invariant, the CPU's q8
    arithmetic) or the vendor one (fp16 operands)."""
    invariant = request.param == "int8"
    return {
        variant: Engine.load(path, backend="cuda", n_ctx=N_CTX, batch_invariant=invariant)
        for variant, path in llama3_models.items()
    }


def test_the_device_tables_are_the_scaled_ones(engines) -> None:
    for engine in engines.values():
        ws = engine.backend.workspace
        tables = rope_tables(engine.hparams, N_CTX)
        for table, buf in zip(tables, (ws.rope_cos, ws.rope_sin), strict=True):
            got = np.empty_like(table)
            ws.driver.copy_dtoh(got, buf)
            assert np.array_equal(got, table)


@pytest.mark.parametrize("case", CASES)
def test_a_prompt_s_last_logits_follow_llamacpp(engines, rope_reference, case) -> None:
    c = rope_reference.cases[case]
    logits = engines[c.variant].logits(c.ids)[-1]
    for reference in (c.q4_0, c.f32):
        max_diff, corr = agreement(logits, reference)
        assert max_diff <= QUANT_MAX_DIFF and corr >= QUANT_CORR, (max_diff, corr)


def test_past_one_token_logits_part_from_llamacpp_no_more_than_its_two_attentions_do(
    engines, rope_reference
) -> None:
    """As on the CPU (tests/test_rope_scaling.py): from the nearer of llama.cpp's two CPU
    attentions' logits on the Q4_0 file, no farther than those two from each other (measured
    on an H200, both prompt GEMMs: up to 0.066, correlation down to 0.99970)."""
    spread_diff, spread_corr = llamacpp_attention_spread(rope_reference)
    for case in rope_reference.cases.values():
        if len(case.ids) > 1:
            max_diff, corr = nearer_agreement(engines[case.variant].logits(case.ids)[-1], case)
            assert max_diff <= spread_diff and corr >= spread_corr, (case.name, max_diff, corr)


def test_a_one_token_prompt_s_logits_are_llamacpps_on_the_q4_0_file(engines, rope_reference):
    """The device's q8 arithmetic is llama.cpp's Q4_0 x Q8_0 too (fp16 activation scales,
    exact block dots): where attention only copies V, the logits differ by rounding order
    alone."""
    c = rope_reference.cases[ONE_TOKEN_CASE]
    max_diff, corr = agreement(engines[c.variant].logits(c.ids)[-1], c.q4_0)
    assert max_diff <= 1e-3 and corr >= 1 - 1e-7, (max_diff, corr)


@pytest.mark.parametrize("case", [c for c in CASES if not c.endswith("-1")])
def test_a_decode_step_s_logits_follow_llamacpp(engines, rope_reference, case) -> None:
    """The prompt but its last token prefilled, the last token through a decode step."""
    c = rope_reference.cases[case]
    engine = engines[c.variant]
    engine.logits(c.ids[:-1])
    last = len(c.ids) - 1
    logits = engine._run(StepBatch.decode([c.ids[-1]], [last], [0]), True).logits[0]
    for reference in (c.q4_0, c.f32):
        max_diff, corr = agreement(logits, reference)
        assert max_diff <= QUANT_MAX_DIFF and corr >= QUANT_CORR, (max_diff, corr)
