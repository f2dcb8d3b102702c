"""scripts/bench_phase_boundary.py on a CUDA device: each way of separating dependent phases
(kernels chained by programmatic dependent launch, persistent kernels with either grid
barrier) hands every phase the row the one before it wrote."""

import pytest
from script_modules import load_script

pytestmark = pytest.mark.gpu


def load_bench():
    return load_script("bench_phase_boundary")


def test_every_variant_computes_the_chains_bits_on_one_and_two_blocks_a_multiprocessor(
    gpu_driver,
):
    bench = load_bench()
    phases = 2 * bench.LAYER + 2  # persistent kernels of a layer's phases, and a short one
    result = bench.run(gpu_driver, phases=phases, rounds=1, blocks_per_sm=[1, 2])
    sms = gpu_driver.info.multiprocessors
    chains = {f"chain_release_{when}" for when in ("at_end", "early")}
    barriers = ("fence", "acquire")
    persistent = {f"persistent_{b}_{span}" for b in barriers for span in ("layer", "all")}
    variants = chains | persistent
    assert {(row["grid"], row["variant"]) for row in result["rows"]} == {
        (grid, name) for grid in (sms, 2 * sms) for name in variants
    }
    for row in result["rows"]:
        assert row["same_as_chain"], row
        assert row["us_per_phase"] > 0
