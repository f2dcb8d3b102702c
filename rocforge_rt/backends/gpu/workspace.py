"""Every device and pinned buffer the GPU backend's steps use, allocated once at start-up.

Sized from the model's hyper-parameters, the KV pool (n_slots x n_ctx), the most
tokens a step takes (max_tokens) and the most of them that ask for logits
(max_logit_rows); nothing is allocated per step. The launch code
of each op family reads the buffers it needs from here; weights are uploaded
through `upload` and kept alive here as well.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.kernel_constants import (
    ARGMAX_PART_BYTES,
    ATTN_SPAN,
    ATTN_TILE,
    GEMV_MAX_ROWS,
    MMV_MAX_ROWS,
    Q8_STAGE,
    QK,
    ROW_STATS_BYTES,
    SAMPLE_CANDIDATES,
    SAMPLE_MAX_SLICES,
    SAMPLE_MAX_TOP,
    SAMPLE_SLICE,
)
from rocforge_rt.backends.gpu.vendor_blas import WORKSPACE_BYTES as VENDOR_WORKSPACE_BYTES
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.kv_format import kv_element_bytes
from rocforge_rt.step.rope import rope_tables
from rocforge_rt.step.sampling import PENALTY_WINDOW, ROW_PARAMS_DTYPE

ARGMAX_SLICE = 2048  # vocabulary entries per argmax block (the kernel takes any slice count)


@dataclass(frozen=True)
class Activation:
    """Rows of fp32 activations in a device buffer, starting `offset` bytes in; `q8`, when
    not 0, is the device address of the (one) row quantized in the GEMV's layout by the
    kernel that wrote it (kernels/rf_q8.h), for a GEMV to copy instead of quantizing it."""

    buf: Any
    rows: int
    width: int
    offset: int = 0
    q8: int = 0

    @property
    def ptr(self) -> int:
        return self.buf.ptr + self.offset


class Readback:
    """Where one step's sampling results go: page-locked host memory mapped into the device,
    which the sampling kernels write (each row's token and its log-probability, and the
    alternatives asked for), and the event recorded after the step. Writing there instead
    of copying after the step saves the copies' wait between two decode graphs
    (docs/performance.md)."""

    def __init__(self, driver: Driver, rows: int, index: int) -> None:
        self.index = index  # which of the workspace's sets: part of the sampler's launch keys
        self.tokens = driver.alloc_pinned(rows * 4, mapped=True)
        self.logprobs = driver.alloc_pinned(rows * 4, mapped=True)
        self.top_tokens = driver.alloc_pinned(rows * SAMPLE_MAX_TOP * 4, mapped=True)
        self.top_logprobs = driver.alloc_pinned(rows * SAMPLE_MAX_TOP * 4, mapped=True)
        self.done = driver.create_event(timing=False)


class Workspace:
    """The KV pool, RoPE tables, step state, activations and scratch of one backend.

    Device buffers start zeroed (the kernels' counters rely on it); pinned buffers
    are the host side of the step-state copies and of the readback.
    """

    def __init__(
        self,
        driver: Driver,
        hparams: HParams,
        *,
        n_slots: int,
        n_ctx: int,
        max_tokens: int,
        max_logit_rows: int,
        vendor_gemm: bool,
        kv_dtype: str = "f16",
    ) -> None:
        self.driver = driver
        self._allocated: list[Any] = []
        self._uploaded = 0  # bytes of `upload`ed arrays
        hp = hparams
        f32 = 4
        self.gate = driver.alloc_pinned(4, mapped=True)  # the flag rf_hold waits on
        # KV pool: per layer [n_slots, n_ctx, n_kv, head_dim] of `kv_dtype` elements
        # (step/kv_format.py), zeroed. The kernels that read or write it take `kv_fp8`
        # (kernel_variants.py rows).
        self.kv_dtype = kv_dtype
        self.kv_fp8 = kv_dtype == "fp8"
        element = kv_element_bytes(kv_dtype)
        self.k_cache = [self.zeros(n_slots * n_ctx * hp.kv_dim_k * element)
                        for _ in range(hp.n_layer)]  # fmt: skip
        self.v_cache = [self.zeros(n_slots * n_ctx * hp.kv_dim_v * element)
                        for _ in range(hp.n_layer)]  # fmt: skip
        cos, sin = rope_tables(hp, n_ctx)
        self.rope_cos, self.rope_sin = self.upload(cos), self.upload(sin)
        # Step state (read by kernels through pointers) and its pinned staging areas:
        # tokens, positions, KV slots, each logits row's sampling parameters and, when a
        # row is penalized, every row's recent tokens (step/sampling.py recent_window).
        self.step_tokens = self.zeros(max_tokens * 4)
        self.step_positions = self.zeros(max_tokens * 4)
        self.step_slots = self.zeros(max_tokens * 4)
        self.step_sampling = self.zeros(max_tokens * ROW_PARAMS_DTYPE.itemsize)
        self.step_recent = self.zeros(max_tokens * PENALTY_WINDOW * 4)
        self.step_state = (self.step_tokens, self.step_positions, self.step_slots,
                           self.step_sampling, self.step_recent)  # fmt: skip
        self.staging = [driver.alloc_pinned(buf.nbytes) for buf in self.step_state]
        # Logits rows a step may ask for (one per session; a teacher-forced chunk's):
        self.max_logit_rows = rows = max_logit_rows
        # The argmax's row statistics for the sampler.
        self.row_stats = self.zeros(rows * ROW_STATS_BYTES)
        # The sampler's per-slice candidates and totals (none past SAMPLE_MAX_SLICES slices:
        # the sampler then takes its general path alone).
        slices = math.ceil(hp.n_vocab / SAMPLE_SLICE)
        self.sample_slices = slices if slices <= SAMPLE_MAX_SLICES else 0
        self.sample_candidates = self.zeros(rows * slices * SAMPLE_CANDIDATES * 8)
        self.sample_slice_sums = self.zeros(rows * slices * 8)
        # Two sets of the sampling results: a decode step issued ahead samples into the set
        # the step before it does not use (executor.py, pipelined decode).
        self.readbacks = (Readback(driver, rows, 0), Readback(driver, rows, 1))
        self.logits_host = driver.alloc_pinned(rows * hp.n_vocab * 4)
        # Activations.
        self.x = self.zeros(max_tokens * hp.n_embd * f32)
        self.qkv = self.zeros(max_tokens * (hp.q_dim + hp.kv_dim_k + hp.kv_dim_v) * f32)
        self.q = self.zeros(max_tokens * hp.q_dim * f32)
        self.attn = self.zeros(max_tokens * hp.n_head * hp.head_dim_v * f32)
        self.h = self.zeros(max_tokens * hp.n_ff * f32)
        self.logits = self.zeros(rows * hp.n_vocab * f32)
        # Prefill GEMM input: activation rows quantized to int8 per block, and their scales.
        self.gemm_max_k = max(hp.n_embd, hp.n_ff, hp.n_head * hp.head_dim_v)
        self.xq = self.zeros(max_tokens * self.gemm_max_k)
        self.xq_d = self.zeros(max_tokens * (self.gemm_max_k // QK) * f32)
        # The MMV's input, the same in its tiles layout (whole canonical-sum stages).
        stage_blocks = math.ceil(self.gemm_max_k // QK / Q8_STAGE) * Q8_STAGE
        self.mmv_xq = self.zeros(MMV_MAX_ROWS * stage_blocks * QK)
        self.mmv_xq_d = self.zeros(MMV_MAX_ROWS * stage_blocks * f32)
        # One decode row quantized once for the GEMVs that copy it (kernels/rf_q8.h's
        # layout: int8 quants, then an f32 scale and an i32 sum per block), written by
        # rf_quantize_q8_gemv or the decode attention kernel.
        self.gemv_xq = self.zeros(stage_blocks * (QK + 8))
        # The down projection's row, the same, written by the gate|up GEMV's SwiGLU epilogue
        # (its own input may be in gemv_xq).
        self.ffn_xq = self.zeros(math.ceil(hp.n_ff // QK / Q8_STAGE) * Q8_STAGE * (QK + 8))
        # The vendor GEMM's operands (when it is on): rows in fp16, one layer matrix in
        # fp16 (bigger ones, the LM head, go in slabs of rows), gate|up outputs in fp16,
        # and the library's own scratch.
        if vendor_gemm:
            f16 = 2
            qkv = hp.q_dim + hp.kv_dim_k + hp.kv_dim_v
            layer_matrices = (qkv * hp.n_embd, hp.n_embd * hp.n_head * hp.head_dim_v,
                              2 * hp.n_ff * hp.n_embd, hp.n_embd * hp.n_ff)  # fmt: skip
            self.x16 = self.zeros(max_tokens * self.gemm_max_k * f16)
            self.w16 = self.zeros(max(layer_matrices) * f16)
            self.gate_up16 = self.zeros(max_tokens * 2 * hp.n_ff * f16)
            self.blas_scratch = self.zeros(VENDOR_WORKSPACE_BYTES)
        # Decode attention's records (acc[d], m, l, 2 unused) per head: each tile's part,
        # then each span's state; for the rows of one decode-kernel launch (a decode step's,
        # one per session; a step with more such rows launches it in pieces of this many).
        # Counters per (row, KV head): the spans done, then each span's tiles done; they
        # start at zero and the kernel resets them.
        self.attn_tiles = math.ceil(n_ctx / ATTN_TILE)
        attn_spans = math.ceil(self.attn_tiles / ATTN_SPAN)
        self.attn_decode_rows = min(max_tokens, max(n_slots, GEMV_MAX_ROWS))
        self.attn_partial = self.zeros(
            self.attn_decode_rows * hp.n_head * (self.attn_tiles + attn_spans)
            * (hp.head_dim_v + 4) * f32
        )  # fmt: skip
        self.attn_counters = self.zeros(self.attn_decode_rows * hp.n_head_kv * (1 + attn_spans) * 4)
        # Argmax slices per row, their partial results and counters (zero; the kernel resets).
        self.argmax_slices = math.ceil(hp.n_vocab / ARGMAX_SLICE)
        self.argmax_partial = self.zeros(rows * self.argmax_slices * ARGMAX_PART_BYTES)
        self.argmax_counters = self.zeros(rows * 4)
        driver.synchronize()

    def device_bytes(self) -> dict[str, int]:
        """Device memory held, by use: weights (and tables), KV pool, the other buffers."""
        total = sum(buf.nbytes for buf in self._allocated)
        kv = sum(buf.nbytes for buf in (*self.k_cache, *self.v_cache))
        return {"weights": self._uploaded, "kv_cache": kv, "buffers": total - kv - self._uploaded}

    def zeros(self, nbytes: int) -> Any:
        """A zeroed device buffer of `nbytes` (at least 4), kept for the workspace's life."""
        buf = self.driver.alloc(max(nbytes, 4))
        self.driver.memset(buf, 0)
        self._allocated.append(buf)
        return buf

    def upload(self, array: np.ndarray) -> Any:
        """A device copy of `array` (weights, tables), kept for the workspace's life."""
        array = np.ascontiguousarray(array)
        buf = self.driver.alloc(array.nbytes)
        self.driver.copy_htod(buf, array)
        self._allocated.append(buf)
        self._uploaded += buf.nbytes
        return buf
