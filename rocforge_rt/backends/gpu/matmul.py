"""Quantized matmuls: weights repacked at load, the decode GEMV and MMV, the prompt GEMMs.

By activation rows:
- one row (batch-1 decode): kernels/gemv.hip, dp4a dot products; its blocks copy the
  row quantized by the kernel that wrote it (the attention's output: `Activation.q8`),
  else from `MatmulTuning.gemv_prequant_min_k` columns by rf_quantize_q8_gemv first, else
  quantize it themselves;
- 2 to MMV_MAX_ROWS rows (a decode batch, short chunks): rf_mmv (kernels/gemm.hip), the
  rows quantized once, then each weight block loaded once for all rows and multiplied on
  the int8 matrix units;
- more rows take one of two GEMMs:
  - the vendor GEMM (the default for matmuls of `MatmulTuning.vendor_min_flop` or more):
    the matrix, or a slab of its rows, expanded to fp16 and multiplied by cuBLAS / hipBLAS
    (vendor_blas.py) with fp32 accumulation (kernels/gemm_f16.hip holds the operand and
    SwiGLU kernels): faster than the int8 GEMM on the 1B and 8B shapes from 16 rows on,
    while smaller matmuls are bound by the host's launches, of which it takes more
    (docs/performance.md);
  - the int8 GEMM (kernels/gemm.hip): batch invariant (no vendor GEMM), every row count
    takes it.
The GEMV, the MMV and the int8 GEMM share one arithmetic (kernels/rf_q8.h), so a row's
outputs do not depend on the rows computed beside it. All RMS-normalize their rows with a
gain when given one and end in an epilogue (store, residual add, SwiGLU); the GEMV's and
MMV's epilogue can instead rotate q, k, v and append k, v to the KV pool (kernels/rf_rope.h).
Which kernels and launch shapes a matmul takes is planned in matmul_plan.py from a
`MatmulTuning`, fixed at construction; the kernels are kernel_variants.py's rows.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.kernel_constants import (
    DEQUANT_PART,
    EPILOGUE_RESIDUAL,
    EPILOGUE_STORE,
    EPILOGUE_SWIGLU,
    F16_THREADS,
    GEMM_THREADS,
    GEMM_TILE_M,
    GEMM_TILE_N,
    GEMV_THREADS,
    MMV_MAX_ROWS,
    Q4_0_BLOCK_BYTES,
    Q8_0_BLOCK_BYTES,
    Q8_NORM_THREADS,
    Q8_ROWS_BLOCKS,
    Q8_ROWS_THREADS,
    QK,
)
from rocforge_rt.backends.gpu.kernel_variants import (
    DequantF16Kernel,
    GemmKernel,
    MmvKernel,
    MmvShape,
    QuantizeRowsKernel,
    mmv_tiles,
)
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.matmul_plan import (
    DeviceCaps,
    GemvLaunch,
    GemvShape,
    MatmulTuning,
    epilogue_variant,
    mmv_shape,
    plan_gemv,
)
from rocforge_rt.backends.gpu.vendor_blas import VendorGemm
from rocforge_rt.backends.gpu.workspace import Activation, Workspace
from rocforge_rt.errors import BackendError
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams

MMV_TILE = 16  # weight rows of a block: the mma's M (outputs: 16, or 8 gate|up pairs)

_BLOCK_LAYOUT = {
    # type: (bytes per GGUF block, bytes of quants per block, format name)
    GGMLQuantizationType.Q4_0: (Q4_0_BLOCK_BYTES, QK // 2, "q4_0"),
    GGMLQuantizationType.Q8_0: (Q8_0_BLOCK_BYTES, QK, "q8_0"),
}
FORMATS = tuple(fmt for _, _, fmt in _BLOCK_LAYOUT.values())
# The kernel names of the one-row families, spelled once (kernel_variants.py).
QUANTIZE_ROWS_NAMES = {layout: QuantizeRowsKernel(layout).name for layout in ("rows", "tiles")}
GEMM_NAMES = {fmt: GemmKernel(fmt).name for fmt in FORMATS}
DEQUANT_F16_NAMES = {fmt: DequantF16Kernel(fmt).name for fmt in FORMATS}


@dataclass(frozen=True)
class DeviceMatrix:
    """A quantized weight matrix on the device, quants and f16 scales stored apart."""

    fmt: str  # "q4_0" | "q8_0"
    n: int  # output rows
    k: int  # input columns
    qs: Any
    d: Any

    @property
    def row_quant_bytes(self) -> int:
        return self.k // QK * (QK // 2 if self.fmt == "q4_0" else QK)


def repack_rows(tensors: Sequence[WeightTensor]) -> tuple[str, np.ndarray, np.ndarray]:
    """Row-stack GGUF Q4_0/Q8_0 tensors and split each block into quants and scale.

    Returns (format, quants uint8 [n, k * bits / 8], scales uint16 [n, k / 32]):
    the same bytes as the GGUF, scales moved apart so quants are 16-byte aligned.
    """
    types = {t.ggml_type for t in tensors}
    if len(types) != 1 or next(iter(types)) not in _BLOCK_LAYOUT:
        names = ", ".join(f"{t.name} ({t.ggml_type.name})" for t in tensors)
        raise BackendError(f"the GPU backend reads Q4_0 or Q8_0 matrices only; got {names}")
    block_bytes, quant_bytes, fmt = _BLOCK_LAYOUT[types.pop()]
    raw = np.concatenate([np.asarray(t.data, dtype=np.uint8) for t in tensors], axis=0)
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.uint16).reshape(raw.shape[0], -1)
    quants = np.ascontiguousarray(blocks[:, :, 2:]).reshape(raw.shape[0], -1)
    assert quants.shape[1] == blocks.shape[1] * quant_bytes
    return fmt, quants, scales


class Matmul:
    """out = W x over activation rows: the GEMV for one, the MMV for a few, else a GEMM."""

    def __init__(
        self,
        driver: Driver,
        launcher: Launcher,
        workspace: Workspace,
        hparams: HParams,
        *,
        n_ctx: int,
        max_tokens: int,
        vendor_gemm: VendorGemm | None,
        tuning: MatmulTuning,
    ) -> None:
        self.driver = driver
        self.launcher = launcher
        self._launch = launcher.launch
        self.ws = workspace
        self.hparams = hparams
        self.n_ctx = n_ctx
        self.max_tokens = max_tokens
        self.vendor_gemm = vendor_gemm
        self.tuning = tuning
        self.caps = DeviceCaps.of(driver)
        # Every row count takes the GEMV's arithmetic (the int8 GEMM past the MMV): a token's
        # outputs then do not depend on the rows computed beside it.
        self.batch_invariant = vendor_gemm is None
        # The fewest activation rows that take a GEMM (compared on the hot path).
        self.gemm_min_rows = MMV_MAX_ROWS + 1 if tuning.use_prefill_gemm else math.inf
        # Plans by their inputs, looked up per call (planning is pure but not free).
        self._gemv_plans: dict[tuple, tuple[GemvLaunch, ...]] = {}
        self._mmv_kernels: dict[tuple[str, int, int, str, bool], MmvKernel] = {}

    def retuned(self, tuning: MatmulTuning) -> "Matmul":
        """This matmul planned with another tuning: a new object over the same launcher and
        workspace (for A/B runs and tests; this one keeps its own)."""
        return Matmul(self.driver, self.launcher, self.ws, self.hparams, n_ctx=self.n_ctx,
                      max_tokens=self.max_tokens, vendor_gemm=self.vendor_gemm,
                      tuning=tuning)  # fmt: skip

    def __call__(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int,
        *,
        gain: Any = None,
        epilogue: int = EPILOGUE_STORE,
        residual_ptr: int = 0,
        rope_layer: int | None = None,
    ) -> int:
        """out = W x: the GEMV for one row, the MMV for up to MMV_MAX_ROWS, else a GEMM.

        `rope_layer` (fewer than `gemm_min_rows` rows): the outputs are that layer's
        Q|K|V rows, rotated into the workspace's `q` and the KV pool (see `gemv`).
        Returns where the outputs' q8 form was written as well (`Activation.q8`), else 0.
        """
        if x.rows >= self.gemm_min_rows:
            if rope_layer is not None:
                raise BackendError("the prompt GEMMs do not rotate: run the rope kernel after")
            vendor = not self.batch_invariant and (
                2 * x.rows * matrix.n * matrix.k >= self.tuning.vendor_min_flop
            )
            gemm = self.vendor if vendor else self.gemm
            gemm(matrix, x, n_out, out_ptr, gain, epilogue, residual_ptr)
            return 0
        if x.rows >= self.tuning.mmv_min_rows:
            self.mmv(matrix, x, n_out, out_ptr, gain=gain, epilogue=epilogue,
                     residual_ptr=residual_ptr, rope_layer=rope_layer)  # fmt: skip
            return 0
        return self.gemv(matrix, x, n_out, out_ptr, gain=gain, epilogue=epilogue,
                         residual_ptr=residual_ptr, rope_layer=rope_layer)  # fmt: skip

    def gemv(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int = 0,
        *,
        gain: Any = None,
        epilogue: int = EPILOGUE_STORE,
        residual_ptr: int = 0,
        rope_layer: int | None = None,
    ) -> int:
        """out = W x for every activation row, in the launches `plan_gemv` plans
        (matmul_plan.py). With `rope_layer`, the outputs are the Q|K|V rows of that layer:
        the kernel rotates q into the workspace's `q` and k, v into the layer's KV pool
        instead of storing to `out_ptr`. A one-row SwiGLU GEMV whose kernel also quantizes
        its outputs writes them to the workspace's `ffn_xq`; returns where that q8 row
        went, else 0.
        """
        k = matrix.k
        variant = epilogue_variant(epilogue, rope_layer)
        key = (matrix.fmt, n_out, k, x.rows, variant, gain is not None, x.q8 != 0,
               variant == "rope" and self.ws.kv_fp8)  # fmt: skip
        launches = self._gemv_plans.get(key)
        if launches is None:
            launches = plan_gemv(GemvShape(*key), self.caps, self.tuning)
            self._gemv_plans[key] = launches
        gain_ptr = gain.ptr if gain is not None else 0
        q8_out = 0
        for launch in launches:
            first, rows, kernel = launch.first, launch.rows, launch.kernel
            x_ptr = x.ptr + first * k * 4
            xq_ptr = x.q8 if launch.copies_writer_q8 else 0
            if launch.prequantize:
                xq_ptr = self.ws.gemv_xq.ptr
                self._launch(
                    ("rf_quantize_q8_gemv", x_ptr, k, gain_ptr),
                    "rf_quantize_q8_gemv",
                    (launch.prequantize_grid, 1, 1),
                    (GEMV_THREADS, 1, 1),
                    (x_ptr, k, gain_ptr, self.hparams.rms_eps, xq_ptr),
                )
            head = (matrix.qs.ptr, matrix.d.ptr, n_out, k, x_ptr, rows, xq_ptr, gain_ptr,
                    self.hparams.rms_eps, int(launch.release_early))  # fmt: skip
            tail = self._store_args(first, n_out, out_ptr, epilogue, residual_ptr, rope_layer)
            if kernel.q8_out:
                q8_out = self.ws.ffn_xq.ptr
                tail += (q8_out,)
            if kernel.bulk:
                tail += (launch.ring_slots,)
            self._launch(
                ("gemv", matrix.qs.ptr, epilogue, rope_layer, first, rows, x.ptr),
                kernel.name,
                (launch.grid, 1, 1),
                (launch.block, 1, 1),
                head + tail,
                launch.shared_bytes,
                launch.cluster,
            )
        return q8_out

    def _store_args(
        self,
        first: int,
        n_out: int,
        out_ptr: int,
        epilogue: int,
        residual_ptr: int,
        rope_layer: int | None,
    ) -> tuple[int, ...]:
        """A GEMV's or MMV's epilogue arguments from activation row `first` on: (epilogue,
        residual, out), or with `rope_layer` where RoPE + KV-append writes."""
        if rope_layer is not None:
            return self._rope_args(rope_layer, first)
        offset = first * n_out * 4
        return (epilogue, residual_ptr + offset if residual_ptr else 0, out_ptr + offset)

    def _rope_args(self, layer: int, first: int) -> tuple[int, ...]:
        """Where RoPE + KV-append (kernels/rf_rope.h) writes, from activation row `first` on."""
        hp, ws = self.hparams, self.ws
        return (
            ws.step_positions.ptr + first * 4,
            ws.step_slots.ptr + first * 4,
            ws.rope_cos.ptr,
            ws.rope_sin.ptr,
            ws.q.ptr + first * hp.q_dim * 4,
            ws.k_cache[layer].ptr,
            ws.v_cache[layer].ptr,
            hp.q_dim,
            hp.kv_dim_k,
            hp.head_dim_k,
            hp.rope_dims,
            self.n_ctx,
        )

    def _check_fits(self, rows: int, k: int) -> None:
        if rows > self.max_tokens or k > self.ws.gemm_max_k:
            raise BackendError(
                f"GEMM of {rows} rows x {k} columns exceeds the prefill buffers "
                f"({self.max_tokens} x {self.ws.gemm_max_k})"
            )

    def _quantize_rows(
        self, x_ptr: int, rows: int, k: int, gain: Any, layout: str, xq_ptr: int, xd_ptr: int
    ) -> None:
        """Normalize (with a gain) and quantize rows to q8 in `layout`: "rows" (the GEMM's)
        or "tiles" (the MMV's) into xq_ptr / xd_ptr (rf_quantize_q8_<layout>)."""
        kernel = QUANTIZE_ROWS_NAMES[layout]
        gain_ptr = gain.ptr if gain is not None else 0
        self._launch(
            (kernel, x_ptr, rows, k, gain_ptr),
            kernel,
            (rows, math.ceil(k // QK / Q8_ROWS_BLOCKS), 1),
            (Q8_ROWS_THREADS, 1, 1),
            (x_ptr, k, gain_ptr, self.hparams.rms_eps, xq_ptr, xd_ptr),
        )

    def mmv(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int = 0,
        *,
        gain: Any = None,
        epilogue: int = EPILOGUE_STORE,
        residual_ptr: int = 0,
        rope_layer: int | None = None,
    ) -> None:
        """out = W x for a few activation rows (rf_mmv, kernels/gemm.hip), the GEMV's
        arithmetic: MMV_MAX_ROWS rows per launch, each quantized once into the workspace's
        `mmv_xq`/`mmv_xq_d` first (the tiles layout); the shape from `mmv_shape`.
        `rope_layer` as in `gemv`."""
        k = matrix.k
        self._check_fits(min(x.rows, MMV_MAX_ROWS), k)
        variant = epilogue_variant(epilogue, rope_layer)
        kv_fp8 = variant == "rope" and self.ws.kv_fp8
        outputs_per_block = MMV_TILE // 2 if epilogue == EPILOGUE_SWIGLU else MMV_TILE
        blocks = math.ceil(n_out / outputs_per_block)
        ws = self.ws
        for first in range(0, x.rows, MMV_MAX_ROWS):
            rows = min(MMV_MAX_ROWS, x.rows - first)
            self._quantize_rows(x.ptr + first * k * 4, rows, k, gain, "tiles",
                                ws.mmv_xq.ptr, ws.mmv_xq_d.ptr)  # fmt: skip
            kernel = self._mmv_kernel(matrix.fmt, rows, blocks, variant, kv_fp8)
            head = (matrix.qs.ptr, matrix.d.ptr, n_out, k, ws.mmv_xq.ptr, ws.mmv_xq_d.ptr, rows)
            tail = self._store_args(first, n_out, out_ptr, epilogue, residual_ptr, rope_layer)
            self._launch(
                ("mmv", matrix.qs.ptr, epilogue, rope_layer, first, rows, x.ptr),
                kernel.name,
                (blocks, 1, 1),
                (kernel.threads, 1, 1),
                head + tail,
            )

    def _mmv_kernel(
        self, fmt: str, rows: int, blocks: int, variant: str, kv_fp8: bool
    ) -> MmvKernel:
        """The rf_mmv kernel of a launch of `rows` activation rows over `blocks` blocks."""
        key = (fmt, rows, blocks, variant, kv_fp8)
        kernel = self._mmv_kernels.get(key)
        if kernel is None:
            shape = self.mmv_shape(mmv_tiles(rows), blocks)
            kernel = self._mmv_kernels[key] = MmvKernel(fmt, shape, variant, kv_fp8)
        return kernel

    def mmv_shape(self, tiles: int, blocks: int) -> MmvShape:
        """The shape of an rf_mmv launch of `blocks` blocks of `tiles` 8-row tiles
        (matmul_plan.py `mmv_shape`)."""
        return mmv_shape(tiles, blocks, self.caps, self.tuning)

    def gemm(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int,
        gain: Any,
        epilogue: int,
        residual_ptr: int,
    ) -> None:
        """out = W x for many activation rows (kernels/gemm.hip), the GEMV's arithmetic.

        The rows are normalized (with a gain) and quantized to q8 once, into the
        workspace's `xq`/`xq_d`; then one int8 GEMM reads every weight once per
        GEMM_TILE_M rows and applies the epilogue.
        """
        k = matrix.k
        ws = self.ws
        self._check_fits(x.rows, k)
        self._quantize_rows(x.ptr, x.rows, k, gain, "rows", ws.xq.ptr, ws.xq_d.ptr)
        tile_n = GEMM_TILE_N // 2 if epilogue == EPILOGUE_SWIGLU else GEMM_TILE_N
        self._launch(
            ("gemm", matrix.qs.ptr, epilogue, x.rows, out_ptr),
            GEMM_NAMES[matrix.fmt],
            (math.ceil(x.rows / GEMM_TILE_M), math.ceil(n_out / tile_n), 1),
            (GEMM_THREADS, 1, 1),
            (
                matrix.qs.ptr,
                matrix.d.ptr,
                n_out,
                k,
                ws.xq.ptr,
                ws.xq_d.ptr,
                x.rows,
                epilogue,
                residual_ptr,
                out_ptr,
            ),
        )

    def vendor(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int,
        gain: Any,
        epilogue: int,
        residual_ptr: int,
    ) -> None:
        """out = W x through the vendor GEMM in fp16 (kernels/gemm_f16.hip, vendor_blas.py).

        The rows are normalized (with a gain) into fp16 once; then W is expanded to fp16
        a slab of rows at a time (the whole matrix when it fits the workspace's `w16`)
        and each slab multiplied into its band of output columns. The residual
        epilogue accumulates into out, which must be the residual; SwiGLU keeps gate|up
        in fp16 and combines them in one more kernel.
        """
        k, ws, rows = matrix.k, self.ws, x.rows
        self._check_fits(rows, k)
        if epilogue == EPILOGUE_RESIDUAL and residual_ptr != out_ptr:
            raise BackendError("the vendor GEMM adds the residual in place: out must be it")
        gain_ptr = gain.ptr if gain is not None else 0
        self._launch(
            ("rows_f16", x.ptr, rows, k, gain_ptr),
            "rf_rows_f16",
            (rows, 1, 1),
            (Q8_NORM_THREADS, 1, 1),
            (x.ptr, k, gain_ptr, self.hparams.rms_eps, ws.x16.ptr),
        )
        swiglu = epilogue == EPILOGUE_SWIGLU
        target, pitch, elem = (ws.gate_up16.ptr, matrix.n, 2) if swiglu else (out_ptr, n_out, 4)
        slab = ws.w16.nbytes // (2 * k)
        for first in range(0, matrix.n, slab):
            n = min(slab, matrix.n - first)
            self._launch(
                ("dequant_f16", matrix.qs.ptr, first),
                DEQUANT_F16_NAMES[matrix.fmt],
                (math.ceil(n * k // DEQUANT_PART / F16_THREADS), 1, 1),
                (F16_THREADS, 1, 1),
                (
                    matrix.qs.ptr + first * matrix.row_quant_bytes,
                    matrix.d.ptr + first * (k // QK) * 2,
                    n,
                    k,
                    ws.w16.ptr,
                ),
            )
            self.launcher.call_library(
                f"{self.vendor_gemm.library}_gemm",
                lambda n=n, first=first: self.vendor_gemm.gemm(
                    n=n,
                    rows=rows,
                    k=k,
                    w_ptr=ws.w16.ptr,
                    x_ptr=ws.x16.ptr,
                    out_ptr=target + first * elem,
                    out_pitch=pitch,
                    accumulate=epilogue == EPILOGUE_RESIDUAL,
                    out_f16=swiglu,
                ),
            )
        if swiglu:
            self._launch(
                ("swiglu_f16", rows, n_out, out_ptr),
                "rf_swiglu_f16",
                (math.ceil(rows * n_out / F16_THREADS), 1, 1),
                (F16_THREADS, 1, 1),
                (ws.gate_up16.ptr, rows, n_out, out_ptr),
            )
