#!/usr/bin/env python3
"""What a dependent phase boundary costs: kernels chained by programmatic dependent launch
(how decode runs now) against persistent kernels with a software grid barrier.

Issue 14 asks whether one persistent kernel a layer would beat SmolLM2's 153 launches a
step. Inside such a kernel every dependent step (Q|K|V, attention, O, gate|up, down) still
waits for all blocks of the step before it, through a grid barrier instead of a kernel
boundary. This measures both ways on the same phases (scripts/phase_boundary.cu: a
GEMV-shaped step a phase, weights loaded before the wait, the row's sum of squares, one
value a warp written for the next phase), graph-replayed, µs a phase:
  - chain_release_at_end / chain_release_early: one kernel a phase, the next one released
    at the end or right after the wait;
  - persistent_fence / persistent_acquire x LAYER (phases a kernel, 5 as a layer's steps)
    and ALL (one kernel): the fenced barrier of cooperative groups' grid sync, or a
    monotonic count with release/acquire order.
Each variant's final row is compared with the chain's (it must be bit-identical).
CUDA sm_90 or newer only (griddepcontrol, PTX memory orders).

    python3 scripts/bench_phase_boundary.py --out bench-results/phase-boundary.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rocforge_rt.backends.gpu.cuda import CudaDriver, NvrtcCompiler

SOURCE = Path(__file__).with_name("phase_boundary.cu")
ROW = 576  # SmolLM2's hidden size
ROW_PAD = 1024  # floats between the two halves of the ping-pong row buffer
THREADS = 256  # the GEMV's block
LAYER = 5  # dependent steps a decode layer launches (step/forward.py LAYER_OPS)
REPLAYS = 20  # graph replays a timed run


class KernelArgs:
    """A kernel's ``void*[]`` parameters over ctypes values kept alive with it."""

    def __init__(self, *values: ctypes._SimpleCData) -> None:
        self.values = values
        self.array = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self.array)


def first_row() -> np.ndarray:
    """Phase 0's input row and the (zero) other half of the ping-pong buffer."""
    row = np.zeros(2 * ROW_PAD, np.float32)
    row[:ROW] = np.linspace(0.5, 1.5, ROW, dtype=np.float32)
    return row


class Bench:
    """The variants on one grid size, each a graph over its own row buffer and barrier."""

    def __init__(self, driver: CudaDriver, module, grid: int, phases: int) -> None:
        self.driver, self.module, self.grid, self.phases = driver, module, grid, phases
        self.stream = driver.create_stream()
        self.wstride = grid * THREADS  # 16-byte weight pieces a phase
        rng = np.random.default_rng(0)
        weights = rng.random(phases * self.wstride * 4, dtype=np.float32) * np.float32(0.01)
        self.weights = driver.alloc(weights.nbytes)  # phases x grid blocks, past the L2
        driver.copy_htod(self.weights, weights)
        self.args: list[KernelArgs] = []

    def launcher(self, kernel: str, *values: ctypes._SimpleCData) -> Callable[[], None]:
        """A prepared launch of `kernel` over the grid: arguments (weights, wstride, *values)."""
        args = KernelArgs(ctypes.c_uint64(self.weights.ptr), ctypes.c_int(self.wstride), *values)
        self.args.append(args)
        function = self.module.function(kernel)
        return self.driver.prepare_launch(
            function, (self.grid, 1, 1), (THREADS, 1, 1), 0, self.stream, args.ptr, overlap=True
        )

    def chain(self, kernel: str, buf: int) -> list[Callable[[], None]]:
        """A launch a phase: phase p reads half p % 2 of the row buffer, writes the other."""

        def half(p: int) -> ctypes.c_uint64:
            return ctypes.c_uint64(buf + (p % 2) * ROW_PAD * 4)

        return [self.launcher(kernel, ctypes.c_int(p), half(p), half(p + 1))
                for p in range(self.phases)]  # fmt: skip

    def persistent(self, kernel: str, per_kernel: int, buf: int, bar: int) -> list:
        """A launch a `per_kernel` phases, each kernel with its grid barrier's words at `bar`."""
        return [self.launcher(kernel, ctypes.c_int(first),
                              ctypes.c_int(min(per_kernel, self.phases - first)),
                              ctypes.c_uint64(buf), ctypes.c_uint64(bar))
                for first in range(0, self.phases, per_kernel)]  # fmt: skip

    def variants(self) -> dict[str, tuple[object, object]]:
        """name -> (row buffer, instantiated graph)."""
        out = {}
        plans = [(f"chain_release_{when}", f"pb_chain_release_{when}", 0)
                 for when in ("at_end", "early")]  # fmt: skip
        plans += [(f"persistent_{barrier}_{span}", f"pb_persistent_{barrier}", per_kernel)
                  for barrier in ("fence", "acquire")
                  for span, per_kernel in (("layer", LAYER), ("all", self.phases))]  # fmt: skip
        for name, kernel, per_kernel in plans:
            buf = self.driver.alloc(2 * ROW_PAD * 4)
            bar = self.driver.alloc(64 * 4)
            self.driver.memset(bar, 0)
            if per_kernel:
                launches = self.persistent(kernel, per_kernel, buf.ptr, bar.ptr)
            else:
                launches = self.chain(kernel, buf.ptr)
            self.driver.begin_capture(self.stream)
            for launch in launches:
                launch()
            graph = self.driver.graph_instantiate(self.driver.end_capture(self.stream))
            out[name] = (buf, graph)
        return out

    def final_row(self, buf, graph) -> np.ndarray:
        self.driver.copy_htod(buf, first_row())
        self.driver.graph_launch(graph, self.stream)
        self.stream.synchronize()
        host = np.zeros(2 * ROW_PAD, np.float32)
        self.driver.copy_dtoh(host, buf)
        start = (self.phases % 2) * ROW_PAD
        return host[start : start + ROW]

    def us_per_phase(self, buf, graph) -> float:
        self.driver.copy_htod(buf, first_row())
        self.driver.graph_launch(graph, self.stream)  # warm
        start, end = self.driver.create_event(), self.driver.create_event()
        self.driver.event_record(start, self.stream)
        for _ in range(REPLAYS):
            self.driver.graph_launch(graph, self.stream)
        self.driver.event_record(end, self.stream)
        self.driver.event_synchronize(end)
        return self.driver.event_elapsed_ms(start, end) * 1000 / REPLAYS / self.phases


def run(driver: CudaDriver, phases: int, rounds: int, blocks_per_sm: list[int]) -> dict:
    """Every variant on each grid size; the JSON-ready result."""
    if not driver.supports_overlap:
        raise SystemExit(f"{driver.info.name} ({driver.info.arch}): needs sm_90 or newer")
    defines = {"PB_K": ROW, "PB_K_PAD": ROW_PAD, "PB_THREADS": THREADS}
    code = NvrtcCompiler(driver.info.arch).compile(SOURCE.read_text(), SOURCE.name, {}, defines)
    module = driver.load_module(code)
    result = {"device": driver.info.name, "phases": phases, "rounds": rounds, "rows": []}
    for per_sm in blocks_per_sm:
        bench = Bench(driver, module, per_sm * driver.info.multiprocessors, phases)
        variants = bench.variants()
        rows = {name: bench.final_row(*v) for name, v in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):  # interleaved
            for name, v in variants.items():
                times[name].append(bench.us_per_phase(*v))
        chain = rows["chain_release_at_end"]
        for name in variants:
            median = statistics.median(times[name])
            same = bool(np.array_equal(rows[name], chain))
            result["rows"].append({"grid": bench.grid, "variant": name, "us_per_phase": median,
                                   "runs": times[name], "same_as_chain": same})  # fmt: skip
            print(f"grid {bench.grid:4d}  {name:28s} {median:6.3f} us a phase  same bits: {same}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", type=int, default=150, help="phases a step (SmolLM2: 150)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed runs a variant")
    parser.add_argument(
        "--blocks-per-sm", type=int, nargs="+", default=[1, 2], help="grid sizes to run"
    )
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    with CudaDriver() as driver:
        result = run(driver, args.phases, args.rounds, args.blocks_per_sm)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if all(row["same_as_chain"] for row in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
