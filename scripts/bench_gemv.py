#!/usr/bin/env python3
"""Decode GEMV micro-benchmark: µs per launch and TB/s of weight bytes, per layer shape.

Times the quantized GEMV kernels (kernels/gemv.hip) on the GEMV shapes of the
synthetic models (8B: QKV, O + residual, gate|up + SwiGLU, down + residual, LM
head; likewise for the 1B and SmolLM2-135M shapes) by graph replay of many
launches that rotate over enough weight copies to overflow the L2 cache, as a
decode step streams a new matrix at every launch, each launch overlapping its
predecessor's tail as in a decode step (programmatic dependent launch). Each shape runs:
  - `auto`: the backend's own choice (GpuBackend.matmul.gemv), as decode uses it, on the
    row as decode hands it over: the O projection's (and the down projection's, where the
    gate|up GEMV writes it so) already quantized by its writer, "(q8 row)"; where that is
    a _bulk kernel (weights through rings in shared memory), again with each budget of
    --bulk-shared (KiB a block; 0: the register kernel);
  - unless --auto-only, every kernel variant (output rows per warp) x grid cap (blocks per
    SM);
  - with --baseline SRC, the kernel `auto` chose from an older gemv.hip of the same
    kernel interface, with the same launch (an A/B of kernel sources).
One-row shapes run each variant twice: with its blocks quantizing the activation
themselves, and ("pre") with rf_quantize_q8_gemv quantizing it once, timed with it.
Every variant's output is checked against a numpy reference on sampled rows
(the CPU backend's q8 arithmetic) before it is timed.

    python3 scripts/bench_gemv.py --shapes 8b --out bench-results/gemv.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from bench_harness import lever_label, lever_settings, tuned
from gguf import GGMLQuantizationType as Q

from rocforge_rt.backends.cpu_arithmetic import quantize_q8, rms_normalize
from rocforge_rt.backends.gpu.backend import GpuBackend
from rocforge_rt.backends.gpu.cuda import CudaDriver, NvrtcCompiler
from rocforge_rt.backends.gpu.graph import replay_us_per_launch
from rocforge_rt.backends.gpu.kernel_constants import (
    EPILOGUE_RESIDUAL,
    EPILOGUE_STORE,
    EPILOGUE_SWIGLU,
    GEMV_MAX_ROWS,
    GEMV_THREADS,
)
from rocforge_rt.backends.gpu.kernel_library import KernelLibrary, kernels_dir
from rocforge_rt.backends.gpu.kernel_variants import GEMV_KERNELS, GemvKernel, gemv_rows_per_warp
from rocforge_rt.backends.gpu.launch import LaunchHandle
from rocforge_rt.backends.gpu.launcher import IssueSettings
from rocforge_rt.backends.gpu.matmul import DeviceMatrix, Matmul, repack_rows
from rocforge_rt.backends.gpu.matmul_plan import (
    MatmulTuning,
    gemv_shared_bytes,
    swiglu_blocks_spread,
)
from rocforge_rt.backends.gpu.workspace import Activation
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams
from rocforge_rt.model.synthetic import random_blocks

L2_BYTES = 60 << 20  # H200; the rotation covers 3x this
EPS = 1e-5


@dataclass(frozen=True)
class Shape:
    name: str
    k: int
    n: int  # output rows (gate|up: n_ff, with 2 * n_ff weight rows)
    fmt: str
    epilogue: int
    gain: bool
    # The kernel whose decode output is this GEMV's row: "attention" (O), "swiglu" (down),
    # "" (the residual stream, normalized by the GEMV).
    row_from: str = ""

    @property
    def weight_rows(self) -> int:
        return 2 * self.n if self.epilogue == EPILOGUE_SWIGLU else self.n

    @property
    def qtype(self) -> Q:
        return Q.Q4_0 if self.fmt == "q4_0" else Q.Q8_0

    @property
    def weight_bytes(self) -> int:
        quant = self.k // 2 if self.fmt == "q4_0" else self.k
        return self.weight_rows * (quant + self.k // 32 * 2)


def model_shapes(name: str, n_embd: int, n_ff: int, q_dim: int, kv_dim: int, vocab: int,
                 head_fmt: str) -> list[Shape]:  # fmt: skip
    return [
        Shape(f"{name} qkv", n_embd, q_dim + 2 * kv_dim, "q4_0", EPILOGUE_STORE, True),
        Shape(f"{name} o+res", q_dim, n_embd, "q4_0", EPILOGUE_RESIDUAL, False, "attention"),
        Shape(f"{name} gate|up", n_embd, n_ff, "q4_0", EPILOGUE_SWIGLU, True),
        Shape(f"{name} down+res", n_ff, n_embd, "q4_0", EPILOGUE_RESIDUAL, False, "swiglu"),
        Shape(f"{name} lm_head", n_embd, vocab, head_fmt, EPILOGUE_STORE, True),
    ]


SHAPES = {
    "8b": model_shapes("8b", 4096, 14336, 4096, 1024, 128256, "q4_0"),
    "1b": model_shapes("1b", 2048, 8192, 2048, 512, 128256, "q8_0"),
    "135m": model_shapes("135m", 576, 1536, 576, 192, 49152, "q8_0"),
}


def dequantize_rows(fmt: str, quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Float32 rows from the repacked layout (the kernel's view of the weights)."""
    d = scales.view(np.float16).astype(np.float32)[:, :, None]
    if fmt == "q4_0":
        blocks = quants.reshape(quants.shape[0], -1, 16)
        q = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1).astype(np.float32) - 8
    else:
        q = quants.view(np.int8).reshape(quants.shape[0], -1, 32).astype(np.float32)
    return (q * d).reshape(quants.shape[0], -1)


def row_quantized_by_writer(shape: Shape, backend: GpuBackend) -> bool:
    """Whether a decode step hands this one-row GEMV its row already quantized by the kernel
    that wrote it (so no rf_quantize_q8_gemv launch precedes it): the O projection's by the
    attention kernel, the down projection's by the gate|up GEMV where that one's 32-blocks
    of outputs spread evenly over the multiprocessors (matmul_plan.plan_gemv)."""
    if shape.row_from == "attention":
        return backend.attention.tuning.quantize_out
    if shape.row_from == "swiglu":
        matmul = backend.matmul
        return matmul.tuning.quantize_swiglu and swiglu_blocks_spread(
            shape.k, matmul.caps, matmul.tuning
        )
    return False


class Bench:
    def __init__(self, driver: CudaDriver, backend: GpuBackend, baseline: Path | None) -> None:
        self.driver = driver
        self.backend = backend
        self.stream = backend.stream
        self.functions = dict(backend.launcher.functions)
        self.signatures = dict(backend.launcher.signatures)
        self.baseline = None
        self.baseline_signatures: dict[str, tuple[str, ...]] = {}
        if baseline is not None:
            self.baseline = self._compile_baseline(baseline, backend)

    def _compile_baseline(self, source: Path, backend: GpuBackend) -> dict[str, object]:
        with tempfile.TemporaryDirectory() as tmp:
            src_dir = Path(tmp) / "kernels"
            src_dir.mkdir()
            shutil.copy(source, src_dir / "gemv.hip")
            for header in kernels_dir().glob("*.h"):
                shutil.copy(header, src_dir)
            library = KernelLibrary(self.compiler, src_dir, Path(tmp) / "cache")
            code = library.load("gemv.hip")
        module = self.driver.load_module(code.code)
        self.baseline_signatures = code.signatures
        return {name: module.function(name) for name in code.kernels}

    compiler: NvrtcCompiler
    bulk_budgets: list[int]
    sweep: bool  # every kernel variant x grid cap besides `auto`

    def handle(self, function: object, name: str, grid: int, shared: int, args: tuple,
               arg_types: tuple[str, ...], cluster: int = 1) -> LaunchHandle:  # fmt: skip
        handle = LaunchHandle(
            self.driver,
            function,
            name=name,
            grid=(grid, 1, 1),
            block=(GEMV_THREADS, 1, 1),
            shared_bytes=shared,
            stream=self.stream,
            arg_types=arg_types,
            overlap=self.driver.supports_overlap,
            cluster=cluster,
        )
        handle.set_args(*args)
        return handle


def run_shape(bench: Bench, shape: Shape, rows: int, reps: int, rng: np.random.Generator) -> list:
    driver, backend = bench.driver, bench.backend
    info = driver.info
    sms = info.multiprocessors
    tensor = WeightTensor(
        "w", shape.qtype, (shape.weight_rows, shape.k),
        random_blocks(rng, shape.weight_rows, shape.k, shape.qtype, 1 / np.sqrt(shape.k)),
    )  # fmt: skip
    fmt, quants, scales = repack_rows([tensor])
    copies = max(2, math.ceil(3 * L2_BYTES / shape.weight_bytes))
    matrices = []
    for _ in range(copies):
        qs, d = driver.alloc(quants.nbytes), driver.alloc(scales.nbytes)
        driver.copy_htod(qs, quants)
        driver.copy_htod(d, scales)
        matrices.append(DeviceMatrix(fmt, shape.weight_rows, shape.k, qs, d))
    x = rng.standard_normal((rows, shape.k)).astype(np.float32)
    gain_host = rng.uniform(0.5, 1.5, shape.k).astype(np.float32)
    residual = rng.standard_normal((rows, shape.n)).astype(np.float32)
    x_buf, gain_buf = driver.alloc(x.nbytes), driver.alloc(gain_host.nbytes)
    out_buf = driver.alloc(residual.nbytes)
    driver.copy_htod(x_buf, x)
    driver.copy_htod(gain_buf, gain_host)
    gain_ptr = gain_buf.ptr if shape.gain else 0
    res_ptr = out_buf.ptr if shape.epilogue == EPILOGUE_RESIDUAL else 0

    # Reference on sampled output rows (the CPU q8 mode's arithmetic).
    sample = np.unique(np.linspace(0, shape.n - 1, min(shape.n, 384)).astype(np.int64))
    xs = rms_normalize(x, gain_host, EPS) if shape.gain else x
    xq = quantize_q8(xs)

    def dense(rows_idx: np.ndarray) -> np.ndarray:
        return xq @ dequantize_rows(fmt, quants[rows_idx], scales[rows_idx]).T

    ref = dense(sample)
    if shape.epilogue == EPILOGUE_SWIGLU:
        up = dense(sample + shape.n)
        ref = ref / (1.0 + np.exp(-ref)) * up
    elif shape.epilogue == EPILOGUE_RESIDUAL:
        ref = ref + residual[:, sample]

    def check(run: Callable[[], None]) -> float:
        driver.copy_htod(out_buf, residual)  # the residual epilogue adds in place
        run()
        driver.synchronize()
        got = np.empty_like(residual)
        driver.copy_dtoh(got, out_buf)
        if not np.all(np.isfinite(got)):
            return float("inf")
        return float(np.max(np.abs(got[:, sample] - ref)) / np.max(np.abs(ref)))

    results = []

    def record(label: str, issue: Callable[[int], None], grid: int) -> None:
        err = check(lambda: issue(0))
        us = replay_us_per_launch(bench.driver, bench.stream, issue, copies, reps)
        tbs = shape.weight_bytes / (us * 1e-6) / 1e12
        results.append({"shape": shape.name, "rows": rows, "variant": label, "grid": grid,
                        "us": us, "tb_s": tbs, "rel_err": err})  # fmt: skip
        print(f"{shape.name:>14} r{rows} {label:>22} grid {grid:6d}: {us:8.2f} us "
              f"{tbs:5.2f} TB/s  err {err:.1e}", flush=True)  # fmt: skip

    xq_buf = backend.workspace.gemv_xq
    args_of = lambda m, xq: (  # noqa: E731
        m.qs.ptr, m.d.ptr, shape.n, shape.k, x_buf.ptr, rows, xq, gain_ptr, EPS, 0,
        shape.epilogue, res_ptr, out_buf.ptr,
    )  # fmt: skip
    quantize = bench.handle(
        bench.functions["rf_quantize_q8_gemv"], "rf_quantize_q8_gemv",
        math.ceil(shape.k // 4 / GEMV_THREADS), 0,
        (x_buf.ptr, shape.k, gain_ptr, EPS, xq_buf.ptr),
        bench.signatures["rf_quantize_q8_gemv"],
    )  # fmt: skip

    # The backend's own choice, through GpuBackend.matmul.gemv (launch handles and all), on
    # the row as decode hands it over: quantized by its writer (here once, untimed) or not.
    written_q8 = rows == 1 and row_quantized_by_writer(shape, backend)
    if written_q8:
        quantize.launch()
    x_act = Activation(x_buf, rows, shape.k, q8=xq_buf.ptr if written_q8 else 0)

    def record_auto(matmul: Matmul) -> LaunchHandle:
        """Time `auto` on `matmul` (the backend's, or one of another ring budget)."""

        def auto(i: int) -> None:
            matmul.gemv(
                matrices[i], x_act, shape.n, out_buf.ptr, gain=gain_buf if shape.gain else None,
                epilogue=shape.epilogue, residual_ptr=res_ptr,
            )  # fmt: skip

        launch = backend.launcher.record(lambda: auto(0))[-1]  # after any quantize launch
        label = f"auto {launch.name.removeprefix('rf_gemv_')}"
        if launch.name.endswith("_bulk"):
            label += f" ring {matmul.tuning.gemv_bulk_shared >> 10}K"
        record(label + (" (q8 row)" if written_q8 else ""), auto, launch.grid[0])
        return launch

    chosen = record_auto(backend.matmul)
    if chosen.name.endswith("_bulk"):  # and with each budget of --bulk-shared
        for budget in bench.bulk_budgets:
            if budget != backend.matmul.tuning.gemv_bulk_shared:
                retuned = dataclasses.replace(backend.matmul.tuning, gemv_bulk_shared=budget)
                record_auto(backend.matmul.retuned(retuned))
    # One activation row may be quantized once (by rf_quantize_q8_gemv, timed with the
    # GEMV) and copied by the GEMV's blocks ("pre"), or by each block itself.
    prologues = [("", 0)] + ([("pre ", xq_buf.ptr)] if rows == 1 else [])
    epilogue = "swiglu" if shape.epilogue == EPILOGUE_SWIGLU else ""
    row_cap = 1 if rows == 1 else GEMV_MAX_ROWS
    variants = [GemvKernel(fmt, row_cap, no, epilogue)
                for no in gemv_rows_per_warp(fmt, epilogue, row_cap)]  # fmt: skip
    assert set(variants) <= set(GEMV_KERNELS)
    for variant in variants if bench.sweep else ():
        no, kernel = variant.no, variant.name
        shared = gemv_shared_bytes(shape.k, rows, info.warp_size, variant.sums)
        blocks = variant.blocks(shape.n, info.warp_size)
        grids = sorted({min(blocks, c * sms) for c in (1, 2, 4, 8)} | {blocks})
        for grid in grids:
            for label, xq in prologues:
                handles = [
                    bench.handle(
                        bench.functions[kernel],
                        kernel,
                        grid,
                        shared,
                        args_of(m, xq),
                        bench.signatures[kernel],
                    )  # fmt: skip
                    for m in matrices
                ]

                def issue(i: int, h: list = handles, pre: bool = xq != 0) -> None:
                    if pre:
                        quantize.launch()
                    h[i].launch()

                record(f"{label}n{no} cap{grid / sms:.1f}", issue, grid)

    if bench.baseline is not None and chosen.name in bench.baseline:
        # the older source's kernel of the same name and launch
        prequant = (
            rows == 1
            and shape.k >= backend.matmul.tuning.gemv_prequant_min_k
            and chosen.cluster == 1
        )
        auto_xq = xq_buf.ptr if written_q8 or prequant else 0
        # the chosen launch's arguments past the plain GEMV's (a _bulk kernel's ring)
        chosen_args = struct.Struct(chosen.layout.format).unpack(chosen.packed_bytes)
        extra = chosen_args[len(args_of(matrices[0], auto_xq)) :]
        handles = [
            bench.handle(
                bench.baseline[chosen.name],
                chosen.name,
                chosen.grid[0],
                chosen.shared_bytes,
                args_of(m, auto_xq) + extra,
                bench.baseline_signatures[chosen.name],
                chosen.cluster,
            )  # fmt: skip
            for m in matrices
        ]

        def baseline(i: int) -> None:
            if prequant and not written_q8:
                quantize.launch()
            handles[i].launch()

        record("baseline (same launch)", baseline, chosen.grid[0])

    for m in matrices:
        driver.free(m.qs)
        driver.free(m.d)
    for buf in (x_buf, gain_buf, out_buf):
        driver.free(buf)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8b,1b,135m", help="comma list of: 8b, 1b, 135m")
    parser.add_argument("--only", default="", help="substring filter on shape names")
    parser.add_argument("--rows", default="1", help="activation rows, comma list (<= 8)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--baseline", type=Path, help="an older gemv.hip to time beside")
    parser.add_argument(
        "--bulk-shared", default="0",
        help="comma list of shared-memory budgets (KiB) a block's weight rings are also timed "
        "with, beside the backend's own (0: the weights through registers)",
    )  # fmt: skip
    parser.add_argument("--auto-only", action="store_true", help="time `auto` alone, no sweep")
    parser.add_argument(
        "--matmul-lever", type=lever_settings, default=(), metavar="ATTR=VALUE[,ATTR=VALUE...]",
        help="build the backend with these fields of its MatmulTuning (its launch heuristics "
        "and levers, e.g. gemv_max_blocks_per_sm=1) for timing `auto`",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-results/gemv.json"))
    args = parser.parse_args()

    driver = CudaDriver()
    compiler = NvrtcCompiler(arch=driver.info.arch)
    hp = HParams(
        arch="llama", n_layer=1, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
        head_dim_k=128, head_dim_v=128, n_vocab=1024, n_ctx_train=64, rope_base=1e4,
        rope_dims=128, rms_eps=EPS, tied_embeddings=False,
    )  # fmt: skip
    try:
        tuning = tuned(MatmulTuning(), args.matmul_lever)
    except ValueError as exc:
        parser.error(str(exc))
    levers = lever_label(args.matmul_lever)
    backend = GpuBackend(driver, compiler, hp, n_slots=1, n_ctx=64, max_tokens=8,
                         mode="deferred", matmul_tuning=tuning)  # fmt: skip
    # Launches overlap their predecessors' tails, as in a decode step (where supported).
    as_in_decode = backend.launcher.issuing(IssueSettings(overlap=driver.supports_overlap))
    Bench.compiler = compiler
    bench = Bench(driver, backend, args.baseline)
    bench.bulk_budgets = [int(kib) << 10 for kib in args.bulk_shared.split(",")]
    bench.sweep = not args.auto_only
    print(f"device: {driver.info.name}, {driver.info.multiprocessors} SMs{levers}", flush=True)
    rng = np.random.default_rng(0)
    results = []
    with as_in_decode:
        for group in args.shapes.split(","):
            for shape in SHAPES[group]:
                if args.only and args.only not in shape.name:
                    continue
                for rows in (int(r) for r in args.rows.split(",")):
                    results.extend(run_shape(bench, shape, rows, args.reps, rng))

    print("\nbest per shape (µs, TB/s of weights) vs auto and baseline:")
    by_shape: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        by_shape.setdefault((r["shape"], r["rows"]), []).append(r)
    for (name, rows), rs in by_shape.items():
        ok = [r for r in rs if r["rel_err"] <= 1e-3]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        auto = next(r for r in rs if r["variant"].startswith("auto"))
        base = next((r for r in rs if r["variant"].startswith("baseline")), None)
        line = f"{name:>14} r{rows}: auto {auto['us']:7.2f} us {auto['tb_s']:4.2f} TB/s"
        if best:
            line += f" | best {best['variant']} g{best['grid']} {best['us']:7.2f} us"
        if base:
            line += f" | baseline {base['us']:8.2f} us {base['tb_s']:4.2f} TB/s"
        bad = [r["variant"] for r in rs if not r["rel_err"] <= 1e-3]
        if bad:
            line += f" | ERR>1e-3: {bad}"
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": driver.info.name, "matmul_levers": dict(args.matmul_lever),
              "results": results}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
