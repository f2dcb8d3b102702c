"""The forward ops on a GPU: weights repacked at load, each op one or a few kernel launches.

Works over any driver with the interface of backends/gpu/cuda.py (CUDA) and
backends/gpu/hip.py (HIP). Per-step values (tokens, positions, KV slots) live in a
device step-state buffer that the kernels read through pointers, so a launch
handle's arguments are the same bytes from one decode step to the next.
"""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from rocforge_rt.backends.gpu.graph import StepGraph
from rocforge_rt.backends.gpu.kernel_library import KernelLibrary
from rocforge_rt.backends.gpu.launch import ARG_CACHE_STATS, LaunchHandle
from rocforge_rt.errors import BackendError
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams
from rocforge_rt.profiling.kernel_timer import KernelTimer
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import StepOutput
from rocforge_rt.step.rope import rope_tables
from rocforge_rt.step.sampling import MAX_LOGPROBS, ROW_PARAMS_DTYPE, RowSampling

QK = 32  # elements per quant block
Q8_STAGE = 2  # blocks per stage of the canonical matmul sum (kernels/rf_q8.h RF_Q8_STAGE)
GEMV_THREADS = 256
GEMV_MAX_ROWS = 8  # activation rows one GEMV launch takes (kernels/gemv.hip)
GEMV_SHARED_LIMIT = 48 * 1024  # portable without opt-in (AMD LDS is 64 KiB)
# Output rows one warp computes together, per (format, variant), for one activation row:
# the rf_gemv_<fmt>_b1_n<NO><variant> kernels; more activation rows take the
# rf_gemv_<fmt>_b8_n<NO><variant> ones, NO from GEMV_MULTI_ROW_NO. The variants: plain
# (store or add the residual), _swiglu, and _rope (the QKV projection: RoPE + KV-append).
GEMV_ROWS_PER_WARP = {
    ("q4_0", ""): (1, 2, 4),
    ("q4_0", "_swiglu"): (1, 2),
    ("q4_0", "_rope"): (2, 4),
    ("q8_0", ""): (1, 2),
    ("q8_0", "_swiglu"): (1,),
}
GEMV_MULTI_ROW_NO = {"": 1, "_swiglu": 1, "_rope": 2}
GEMV_MIN_BLOCKS_PER_SM = 1  # widest row groups that still give every multiprocessor a block
GEMV_MAX_BLOCKS_PER_SM = 4  # grid cap: warps stride over the rest (fewer re-quantizations of x)
EPILOGUE_STORE, EPILOGUE_RESIDUAL, EPILOGUE_SWIGLU = 0, 1, 2
EMBED_THREADS = 256
ROPE_THREADS = 256
ATTN_SEGMENT = 64  # context positions a decode block takes (kernels/attention.hip)
ATTN_SEGMENT_PIECES = 2  # RF_ATTN_SEGMENT: its pieces of 32 positions, a warp each per head
ATTN_PREFILL_LANES = 128  # warp size x RF_ATTN_PREFILL_TOKENS (tokens a prefill block takes)
ATTN_MAX_GROUP, ATTN_MAX_HEAD_DIM = 8, 128
ARGMAX_THREADS = 256
ARGMAX_SLICE = 2048  # vocabulary entries per argmax block (kernels/sampling.hip)
ARGMAX_PART_BYTES = 12  # (max, index, sum) per slice
ROW_STATS_BYTES = 8  # (max, log of the sum of exp) per logits row
SAMPLE_THREADS = 1024
SAMPLE_SLICE = 4096  # vocabulary entries per candidates block (kernels/sampling.hip)
SAMPLE_CANDIDATES = 64  # best rank keys a slice keeps
SAMPLE_MAX_SLICES = SAMPLE_SLICE // SAMPLE_CANDIDATES

GEMV_ARGS = ("ptr", "ptr", "i32", "i32", "ptr", "i32", "ptr", "f32", "i32", "ptr", "ptr")
GEMV_ROPE_ARGS = GEMV_ARGS[:8] + ("ptr",) * 7 + ("i32",) * 5
EMBED_ARGS = ("ptr", "ptr", "i32", "i32", "ptr", "i32", "ptr")
ROPE_ARGS = ("ptr",) * 8 + ("i32",) * 6
ATTN_DECODE_ARGS = ("ptr",) * 5 + ("i32",) * 4 + ("f32", "i32", "ptr", "ptr", "ptr")
ATTN_PREFILL_ARGS = ("ptr",) * 5 + ("i32",) * 5 + ("f32", "ptr")
ARGMAX_ARGS = ("ptr", "i32") + ("ptr",) * 7 + ("i32",)
CANDIDATE_ARGS = ("ptr", "i32") + ("ptr",) * 4
SAMPLE_ARGS = ("ptr", "i32", "ptr", "ptr", "i32", "i32") + ("ptr",) * 8
STEP_MODES = ("per-kernel-sync", "deferred", "graph")
GATE_ARGS = ("ptr", "u32", "u32")
GATE_MAX_NAPS = 250_000  # rf_hold gives up after ~0.5 s of polling (a gate never opened)
# Prefill GEMM (kernels/gemm.hip): more than GEMV_MAX_ROWS activation rows take it.
GEMM_THREADS, GEMM_TILE_N, GEMM_TILE_M = 128, 128, 64  # SwiGLU tiles hold TILE_N / 2 outputs
Q8_ROWS_THREADS = 256
GEMM_ARGS = ("ptr", "ptr", "i32", "i32", "ptr", "ptr", "i32", "i32", "ptr", "ptr")
Q8_ROWS_ARGS = ("ptr", "i32", "ptr", "f32", "ptr", "ptr")

_BLOCK_LAYOUT = {
    # type: (bytes per GGUF block, bytes of quants per block, format name)
    GGMLQuantizationType.Q4_0: (18, 16, "q4_0"),
    GGMLQuantizationType.Q8_0: (34, 32, "q8_0"),
}


@dataclass(frozen=True)
class DeviceMatrix:
    """A quantized weight matrix on the device, quants and f16 scales stored apart."""

    fmt: str  # "q4_0" | "q8_0"
    n: int  # output rows
    k: int  # input columns
    qs: Any
    d: Any


@dataclass(frozen=True)
class Activation:
    """Rows of fp32 activations in a device buffer, starting `offset` bytes in."""

    buf: Any
    rows: int
    width: int
    offset: int = 0

    @property
    def ptr(self) -> int:
        return self.buf.ptr + self.offset


def gemv_shared_bytes(k: int, rows: int, warp_size: int) -> int:
    """Dynamic shared memory of a GEMV launch over `rows` activation rows of width k.

    Per row: block slots (k / 32 rounded up to whole sum stages) of int8 quants and a
    (f32 scale, i32 sum) each; then the per-warp sums of squares (kernels/gemv.hip).
    """
    padded_blocks = math.ceil(k // QK / Q8_STAGE) * Q8_STAGE
    return rows * padded_blocks * (QK + 8) + GEMV_MAX_ROWS * (GEMV_THREADS // warp_size) * 4


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


class GpuBackend:
    """Weight uploader and forward ops over a device driver and the kernel library."""

    def __init__(
        self,
        driver: Any,
        compiler: Any,
        hparams: HParams,
        *,
        n_slots: int,
        n_ctx: int,
        max_tokens: int = 512,
        mode: str = "graph",
        overlap: bool = True,
    ) -> None:
        if mode not in STEP_MODES:
            raise BackendError(f"unknown step mode {mode!r}; choose one of {', '.join(STEP_MODES)}")
        self._check_shapes(hparams)
        self.driver = driver
        self.name = driver.info.vendor
        self.hparams = hparams
        self.n_ctx = n_ctx
        self.max_tokens = max_tokens
        self.mode = mode
        # Programmatic dependent launch (where the driver supports it): each kernel may
        # start while the previous one finishes, waiting inside for its results.
        self.overlap = overlap and driver.supports_overlap
        self.stream = driver.create_stream()
        self._functions = self._load_kernels(KernelLibrary(compiler))
        self._handles: dict[tuple, LaunchHandle] = {}
        # Profiling, both off until enabled: host launch times, and GPU times of sampled steps.
        self.launch_tracker = LaunchOverheadTracker()
        self.kernel_timer = KernelTimer(driver, self.stream)
        self._timing: KernelTimer | None = None  # the timer while a timed step is issued
        self._gate = driver.alloc_pinned(4)  # the flag rf_hold waits on (device-readable)
        self._recording: list[LaunchHandle] | None = None  # handles launched under capture
        # Whether this step's launches overlap their predecessors: decode steps only. A prompt
        # chunk's big grids, launched early into a busy device, would crowd a few
        # multiprocessors (measured: SmolLM2 prefill 30% slower with it).
        self._overlap_step = False
        # Decode graphs by (batch size, whether a row samples beyond the argmax).
        self._graphs: dict[tuple[int, bool], StepGraph] = {}
        self._device_state: tuple[bytes, ...] | None = None  # what the step state holds
        self._allocated: list[Any] = []
        hp = hparams
        f32 = 4
        # KV pool: per layer [n_slots, n_ctx, n_kv, head_dim] fp16, zeroed.
        self.k_cache = [self._zeros(n_slots * n_ctx * hp.kv_dim_k * 2) for _ in range(hp.n_layer)]
        self.v_cache = [self._zeros(n_slots * n_ctx * hp.kv_dim_v * 2) for _ in range(hp.n_layer)]
        cos, sin = rope_tables(hp, n_ctx)
        self.rope_cos, self.rope_sin = self._upload(cos), self._upload(sin)
        # Step state (read by kernels through pointers) and its pinned staging areas:
        # tokens, positions, KV slots, and each logits row's sampling parameters.
        self.step_tokens = self._zeros(max_tokens * 4)
        self.step_positions = self._zeros(max_tokens * 4)
        self.step_slots = self._zeros(max_tokens * 4)
        self.step_sampling = self._zeros(max_tokens * ROW_PARAMS_DTYPE.itemsize)
        self._step_state = (self.step_tokens, self.step_positions, self.step_slots,
                            self.step_sampling)  # fmt: skip
        self._staging = [driver.alloc_pinned(buf.nbytes) for buf in self._step_state]
        # Sampling results (token, its log-probability, the alternatives asked for), read
        # back through pinned memory; the argmax's row statistics for the sampler.
        self.sampled = self._zeros(max_tokens * 4)
        self.sampled_logprob = self._zeros(max_tokens * 4)
        self.row_stats = self._zeros(max_tokens * ROW_STATS_BYTES)
        # The sampler's per-slice candidates and totals (none past SAMPLE_MAX_SLICES slices:
        # the sampler then takes its general path alone).
        slices = math.ceil(hparams.n_vocab / SAMPLE_SLICE)
        self.sample_slices = slices if slices <= SAMPLE_MAX_SLICES else 0
        self.sample_candidates = self._zeros(max_tokens * slices * SAMPLE_CANDIDATES * 8)
        self.sample_slice_sums = self._zeros(max_tokens * slices * 8)
        self.top_tokens = self._zeros(max_tokens * MAX_LOGPROBS * 4)
        self.top_logprobs = self._zeros(max_tokens * MAX_LOGPROBS * 4)
        self._sampled_host = driver.alloc_pinned(max_tokens * 4)
        self._logprob_host = driver.alloc_pinned(max_tokens * 4)
        self._top_tokens_host = driver.alloc_pinned(max_tokens * MAX_LOGPROBS * 4)
        self._top_logprobs_host = driver.alloc_pinned(max_tokens * MAX_LOGPROBS * 4)
        self._logits_host = driver.alloc_pinned(max_tokens * hparams.n_vocab * 4)
        self.steps = 0
        self.host_ns = 0  # host time issuing steps, up to the final synchronization
        # Activations.
        self.x = self._zeros(max_tokens * hp.n_embd * f32)
        self.qkv = self._zeros(max_tokens * (hp.q_dim + hp.kv_dim_k + hp.kv_dim_v) * f32)
        self.q = self._zeros(max_tokens * hp.q_dim * f32)
        self.attn = self._zeros(max_tokens * hp.n_head * hp.head_dim_v * f32)
        self.h = self._zeros(max_tokens * hp.n_ff * f32)
        self.logits = self._zeros(max_tokens * hp.n_vocab * f32)
        # Prefill GEMM input: activation rows quantized to int8 per block, and their scales.
        self.gemm_max_k = max(hp.n_embd, hp.n_ff, hp.n_head * hp.head_dim_v)
        self.xq = self._zeros(max_tokens * self.gemm_max_k)
        self.xq_d = self._zeros(max_tokens * (self.gemm_max_k // QK) * f32)
        self.use_prefill_gemm = True  # False: every row count takes the GEMV (A/B runs)
        # Decode attention's per-segment states, for the tokens of a decode step (one per
        # session, or a short prompt chunk); counters start at zero and the kernel resets them.
        self.attn_segments = math.ceil(n_ctx / ATTN_SEGMENT)
        self.attn_decode_rows = min(max_tokens, max(n_slots, GEMV_MAX_ROWS))
        self.attn_partial = self._zeros(
            self.attn_decode_rows * hp.n_head * self.attn_segments * (hp.head_dim_v + 2) * f32
        )
        self.attn_counters = self._zeros(self.attn_decode_rows * hp.n_head_kv * 4)
        # Argmax slices per row, their partial results and counters (zero; the kernel resets).
        self.argmax_slices = math.ceil(hp.n_vocab / ARGMAX_SLICE)
        self.argmax_partial = self._zeros(max_tokens * self.argmax_slices * ARGMAX_PART_BYTES)
        self.argmax_counters = self._zeros(max_tokens * 4)
        driver.synchronize()

    # --- set-up ------------------------------------------------------------------------
    @staticmethod
    def _check_shapes(hp: HParams) -> None:
        problems = []
        if hp.head_dim_k != hp.head_dim_v:
            problems.append(f"key length {hp.head_dim_k} != value length {hp.head_dim_v}")
        if hp.head_dim_k % QK or hp.head_dim_k > ATTN_MAX_HEAD_DIM:
            problems.append(f"head dim {hp.head_dim_k} is not a multiple of 32 up to 128")
        if hp.gqa_group > ATTN_MAX_GROUP:
            problems.append(f"{hp.gqa_group} query heads per KV head (at most 8)")
        if problems:
            raise BackendError(
                "the GPU attention kernel cannot run this model: " + "; ".join(problems)
            )

    def _load_kernels(self, library: KernelLibrary) -> dict[str, Any]:
        functions = {}
        for source in library.sources():
            code = library.load(source)
            module = self.driver.load_module(code.code)
            for name in code.kernels:
                functions[name] = module.function(name)
        return functions

    def _zeros(self, nbytes: int) -> Any:
        buf = self.driver.alloc(max(nbytes, 4))
        self.driver.memset(buf, 0)
        self._allocated.append(buf)
        return buf

    def _upload(self, array: np.ndarray) -> Any:
        array = np.ascontiguousarray(array)
        buf = self.driver.alloc(array.nbytes)
        self.driver.copy_htod(buf, array)
        self._allocated.append(buf)
        return buf

    def device_info(self) -> dict[str, object]:
        info = self.driver.info
        return {"backend": self.name, "device": info.name, "arch": info.arch}

    # --- weights -------------------------------------------------------------------------
    def linear(self, *tensors: WeightTensor) -> DeviceMatrix:
        fmt, quants, scales = repack_rows(tensors)
        n, k = quants.shape[0], tensors[0].shape[1]
        return DeviceMatrix(fmt, n, k, self._upload(quants), self._upload(scales))

    def vector(self, tensor: WeightTensor) -> Any:
        return self._upload(np.asarray(tensor.data, dtype=np.float32))

    def embedding(self, tensor: WeightTensor) -> DeviceMatrix:
        return self.linear(tensor)

    # --- launching -------------------------------------------------------------------------
    def _launch(
        self,
        key: tuple,
        kernel: str,
        arg_types: Sequence[str],
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[int | float],
        shared_bytes: int = 0,
    ) -> None:
        """Launch through the handle that owns this call site; its args repack only on change.

        A handle's geometry is fixed, so it is part of the key: a call site whose grid
        or shared memory changes gets another handle, never a stale launch shape.
        """
        overlap = self._overlap_step
        key = (*key, kernel, grid, block, shared_bytes, overlap)
        handle = self._handles.get(key)
        if handle is None:
            handle = LaunchHandle(
                self.driver,
                self._functions[kernel],
                name=kernel,
                grid=grid,
                block=block,
                shared_bytes=shared_bytes,
                stream=self.stream,
                arg_types=arg_types,
                tracker=self.launch_tracker,
                overlap=overlap,
            )
            self._handles[key] = handle
        handle.set_args(*args)
        timer = self._timing
        if timer is None:
            handle.launch()
        else:
            timer.before(kernel)
            handle.launch()
            timer.after()
        if self._recording is not None:
            self._recording.append(handle)
        if self.mode == "per-kernel-sync":
            self.stream.synchronize()

    def _gemv(
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
        """out = W x for every activation row, GEMV_MAX_ROWS (or fewer, to fit) per launch.

        One activation row (decode) takes the widest row group per warp that still gives
        each multiprocessor a block, and at most GEMV_MAX_BLOCKS_PER_SM blocks per
        multiprocessor (the warps stride over the rest); several rows take the b8 kernels.
        With `rope_layer`, the outputs are the Q|K|V rows of that layer: the kernel rotates
        q into `self.q` and k, v into the layer's KV pool instead of storing to `out_ptr`.
        """
        k = matrix.k
        info = self.driver.info
        warps = GEMV_THREADS // info.warp_size
        scratch = gemv_shared_bytes(k, 0, info.warp_size)
        per_row_shared = gemv_shared_bytes(k, 1, info.warp_size) - scratch
        max_rows = max(1, min(GEMV_MAX_ROWS, (GEMV_SHARED_LIMIT - scratch) // per_row_shared))
        variant = "_rope" if rope_layer is not None else ""
        variant = "_swiglu" if epilogue == EPILOGUE_SWIGLU else variant
        gain_ptr = gain.ptr if gain is not None else 0
        for first in range(0, x.rows, max_rows):
            rows = min(max_rows, x.rows - first)
            if rows == 1:
                choices = GEMV_ROWS_PER_WARP[(matrix.fmt, variant)]
                min_blocks = GEMV_MIN_BLOCKS_PER_SM * info.multiprocessors
                wide = [no for no in choices if math.ceil(n_out / no / warps) >= min_blocks]
                no = max(wide, default=choices[0])
                kernel = f"rf_gemv_{matrix.fmt}_b1_n{no}{variant}"
            else:
                no = GEMV_MULTI_ROW_NO[variant]
                kernel = f"rf_gemv_{matrix.fmt}_b{GEMV_MAX_ROWS}_n{no}{variant}"
            blocks = math.ceil(math.ceil(n_out / no) / warps)
            grid = (max(1, min(blocks, GEMV_MAX_BLOCKS_PER_SM * info.multiprocessors)), 1, 1)
            out_offset = first * n_out * 4
            head = (matrix.qs.ptr, matrix.d.ptr, n_out, k, x.ptr + first * k * 4, rows, gain_ptr,
                    self.hparams.rms_eps)  # fmt: skip
            if rope_layer is None:
                residual = residual_ptr + out_offset if residual_ptr else 0
                arg_types, tail = GEMV_ARGS, (epilogue, residual, out_ptr + out_offset)
            else:
                arg_types, tail = GEMV_ROPE_ARGS, self._rope_args(rope_layer, first)
            self._launch(
                ("gemv", matrix.qs.ptr, epilogue, rope_layer, first, rows, x.ptr),
                kernel,
                arg_types,
                grid,
                (GEMV_THREADS, 1, 1),
                head + tail,
                gemv_shared_bytes(k, rows, info.warp_size),
            )

    def _rope_args(self, layer: int, first: int) -> tuple[int, ...]:
        """Where RoPE + KV-append (kernels/rf_rope.h) writes, from activation row `first` on."""
        hp = self.hparams
        return (
            self.step_positions.ptr + first * 4,
            self.step_slots.ptr + first * 4,
            self.rope_cos.ptr,
            self.rope_sin.ptr,
            self.q.ptr + first * hp.q_dim * 4,
            self.k_cache[layer].ptr,
            self.v_cache[layer].ptr,
            hp.q_dim,
            hp.kv_dim_k,
            hp.head_dim_k,
            hp.rope_dims,
            self.n_ctx,
        )

    def _gemm(
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

        The rows are normalized (with a gain) and quantized to q8 once, into `xq`/`xq_d`;
        then one int8 GEMM reads every weight once per 64 rows and applies the epilogue.
        """
        k = matrix.k
        if x.rows > self.max_tokens or k > self.gemm_max_k:
            raise BackendError(
                f"GEMM of {x.rows} rows x {k} columns exceeds the prefill buffers "
                f"({self.max_tokens} x {self.gemm_max_k})"
            )
        gain_ptr = gain.ptr if gain is not None else 0
        self._launch(
            ("q8rows", x.ptr, x.rows, k, gain_ptr),
            "rf_quantize_q8_rows",
            Q8_ROWS_ARGS,
            (x.rows, 1, 1),
            (Q8_ROWS_THREADS, 1, 1),
            (x.ptr, k, gain_ptr, self.hparams.rms_eps, self.xq.ptr, self.xq_d.ptr),
        )
        tile_n = GEMM_TILE_N // 2 if epilogue == EPILOGUE_SWIGLU else GEMM_TILE_N
        self._launch(
            ("gemm", matrix.qs.ptr, epilogue, x.rows, out_ptr),
            f"rf_gemm_{matrix.fmt}",
            GEMM_ARGS,
            (math.ceil(x.rows / GEMM_TILE_M), math.ceil(n_out / tile_n), 1),
            (GEMM_THREADS, 1, 1),
            (
                matrix.qs.ptr,
                matrix.d.ptr,
                n_out,
                k,
                self.xq.ptr,
                self.xq_d.ptr,
                x.rows,
                epilogue,
                residual_ptr,
                out_ptr,
            ),
        )

    def load_activation(self, values: np.ndarray) -> Activation:
        """Put fp32 rows into the layer-input buffer (for op-level tests and benchmarks)."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        self.driver.copy_htod(self.x, values)
        return Activation(self.x, values.shape[0], values.shape[1])

    # --- forward ops -------------------------------------------------------------------------
    def embed(self, table: DeviceMatrix, batch: StepBatch) -> Activation:
        n = batch.n_tokens
        hp = self.hparams
        self._launch(
            ("embed", n),
            f"rf_embed_{table.fmt}_split",
            EMBED_ARGS,
            (math.ceil(hp.n_embd / EMBED_THREADS), min(n, 65535), 1),
            (EMBED_THREADS, 1, 1),
            (table.qs.ptr, table.d.ptr, table.n, hp.n_embd, self.step_tokens.ptr, n, self.x.ptr),
        )
        return Activation(self.x, n, hp.n_embd)

    def _matmul(
        self,
        matrix: DeviceMatrix,
        x: Activation,
        n_out: int,
        out_ptr: int,
        *,
        gain: Any = None,
        epilogue: int = EPILOGUE_STORE,
        residual_ptr: int = 0,
    ) -> None:
        """out = W x: the GEMV for up to GEMV_MAX_ROWS rows, the GEMM for prompt chunks."""
        if self.use_prefill_gemm and x.rows > GEMV_MAX_ROWS:
            self._gemm(matrix, x, n_out, out_ptr, gain, epilogue, residual_ptr)
        else:
            self._gemv(matrix, x, n_out, out_ptr, gain=gain, epilogue=epilogue,
                       residual_ptr=residual_ptr)  # fmt: skip

    def norm_matmul(self, x: Activation, norm: Any, weight: DeviceMatrix) -> Activation:
        self._matmul(weight, x, weight.n, self.qkv.ptr, gain=norm)
        return Activation(self.qkv, x.rows, weight.n)

    def norm_qkv_rope(
        self, x: Activation, norm: Any, weight: DeviceMatrix, layer: int, batch: StepBatch
    ) -> Activation:
        """q of the normalized QKV projection, rotated; k and v rotated into the KV pool.

        Decode rows: one GEMV whose epilogue does RoPE + KV-append; a prompt chunk: the
        GEMM, then the rope kernel (both store through kernels/rf_rope.h).
        """
        if self.use_prefill_gemm and x.rows > GEMV_MAX_ROWS:
            return self.rope_kv_append(self.norm_matmul(x, norm, weight), layer, batch)
        self._gemv(weight, x, weight.n, gain=norm, rope_layer=layer)
        return Activation(self.q, x.rows, self.hparams.q_dim)

    def rope_kv_append(self, qkv: Activation, layer: int, batch: StepBatch) -> Activation:
        hp = self.hparams
        self._launch(
            ("rope", layer, qkv.rows),
            "rf_rope_kv_append",
            ROPE_ARGS,
            (qkv.rows, 1, 1),
            (ROPE_THREADS, 1, 1),
            (
                qkv.ptr,
                self.q.ptr,
                self.k_cache[layer].ptr,
                self.v_cache[layer].ptr,
                self.step_positions.ptr,
                self.step_slots.ptr,
                self.rope_cos.ptr,
                self.rope_sin.ptr,
                hp.n_head,
                hp.n_head_kv,
                hp.head_dim_k,
                hp.head_dim_v,
                hp.rope_dims,
                self.n_ctx,
            ),
        )
        return Activation(self.q, qkv.rows, hp.q_dim)

    def attention(self, q: Activation, layer: int, batch: StepBatch) -> Activation:
        """Each token over its slot's cache: a prompt chunk past GEMV_MAX_ROWS takes the
        prefill kernel (K/V rows shared by its tokens), anything else the decode kernel
        (segments across blocks); both read each K/V row once for a KV head's group and
        give a token the same bits (kernels/attention.hip)."""
        hp = self.hparams
        warp = self.driver.info.warp_size
        scale = float(np.float32(1.0 / math.sqrt(hp.head_dim_k)))
        if q.rows > GEMV_MAX_ROWS and batch.is_chunk:
            tokens = ATTN_PREFILL_LANES // warp  # a warp per (token, head of the group)
            self._launch(
                ("attention-prefill", layer, q.rows),
                "rf_attention_prefill",
                ATTN_PREFILL_ARGS,
                (hp.n_head_kv, math.ceil(q.rows / tokens), 1),
                (tokens * hp.gqa_group * warp, 1, 1),
                (q.ptr, self.k_cache[layer].ptr, self.v_cache[layer].ptr, self.step_positions.ptr,
                 self.step_slots.ptr, q.rows, self.n_ctx, hp.n_head, hp.n_head_kv, hp.head_dim_k,
                 scale, self.attn.ptr),
            )  # fmt: skip
            return Activation(self.attn, q.rows, hp.n_head * hp.head_dim_v)
        if q.rows > self.attn_decode_rows:
            raise BackendError(
                f"{q.rows} tokens of several sequences in one step; decode attention takes "
                f"{self.attn_decode_rows}"
            )
        self._launch(
            ("attention", layer, q.rows),
            "rf_attention_decode",
            ATTN_DECODE_ARGS,
            (hp.n_head_kv, q.rows, self.attn_segments),
            (ATTN_SEGMENT_PIECES * hp.gqa_group * warp, 1, 1),
            (
                q.ptr,
                self.k_cache[layer].ptr,
                self.v_cache[layer].ptr,
                self.step_positions.ptr,
                self.step_slots.ptr,
                self.n_ctx,
                hp.n_head,
                hp.n_head_kv,
                hp.head_dim_k,
                scale,
                self.attn_segments,
                self.attn_partial.ptr,
                self.attn_counters.ptr,
                self.attn.ptr,
            ),
        )
        return Activation(self.attn, q.rows, hp.n_head * hp.head_dim_v)

    def matmul_add(self, x: Activation, weight: DeviceMatrix, residual: Activation) -> Activation:
        self._matmul(
            weight, x, weight.n, residual.ptr, epilogue=EPILOGUE_RESIDUAL, residual_ptr=residual.ptr
        )
        return residual

    def norm_gate_up_swiglu(self, x: Activation, norm: Any, weight: DeviceMatrix) -> Activation:
        n_ff = weight.n // 2
        self._matmul(weight, x, n_ff, self.h.ptr, gain=norm, epilogue=EPILOGUE_SWIGLU)
        return Activation(self.h, x.rows, n_ff)

    def lm_head(
        self, x: Activation, norm: Any, weight: DeviceMatrix, batch: StepBatch
    ) -> Activation:
        rows = batch.logit_rows
        if len(rows) == 0:
            return Activation(self.logits, 0, weight.n)
        first = int(rows[0])
        if not np.array_equal(rows, np.arange(first, first + len(rows))):
            raise BackendError("the GPU LM head takes a contiguous range of rows")
        picked = Activation(x.buf, len(rows), x.width, x.offset + first * x.width * 4)
        self._matmul(weight, picked, weight.n, self.logits.ptr, gain=norm)
        return Activation(self.logits, len(rows), weight.n)

    def sample(self, logits: Activation, sampling: RowSampling, first_row: int) -> None:
        """Each logits row's token into `sampled` and the step state (token, position + 1).

        The argmax kernel serves greedy batches alone; when a row draws at random or
        reports alternatives, the sampler's two kernels follow it (kernels/sampling.hip:
        per-slice candidates, then the draw). `first_row` is the batch row of logits row
        0 (whose position keys the draw).
        """
        if logits.rows == 0:
            return
        drawn = sampling.needs_sampler
        self._launch(
            ("argmax", logits.rows),
            "rf_argmax_advance",
            ARGMAX_ARGS,
            (self.argmax_slices, logits.rows, 1),
            (ARGMAX_THREADS, 1, 1),
            (
                logits.ptr,
                logits.width,
                self.step_tokens.ptr,
                self.step_positions.ptr,
                self.sampled.ptr,
                self.sampled_logprob.ptr,
                self.row_stats.ptr,
                self.argmax_partial.ptr,
                self.argmax_counters.ptr,
                int(not drawn),
            ),
        )
        if not drawn:
            return
        common = (logits.ptr, logits.width, self.step_sampling.ptr, self.row_stats.ptr)
        candidates = (self.sample_candidates.ptr, self.sample_slice_sums.ptr)
        if self.sample_slices:
            self._launch(
                ("sample-candidates", logits.rows),
                "rf_sample_candidates",
                CANDIDATE_ARGS,
                (self.sample_slices, logits.rows, 1),
                (SAMPLE_THREADS, 1, 1),
                common + candidates,
            )
        self._launch(
            ("sample", logits.rows),
            "rf_sample_advance",
            SAMPLE_ARGS,
            (logits.rows, 1, 1),
            (SAMPLE_THREADS, 1, 1),
            (
                *common,
                first_row,
                self.sample_slices,
                *candidates,
                self.step_tokens.ptr,
                self.step_positions.ptr,
                self.sampled.ptr,
                self.sampled_logprob.ptr,
                self.top_tokens.ptr,
                self.top_logprobs.ptr,
            ),
        )

    # --- steps -------------------------------------------------------------------------------
    def write_step_state(self, batch: StepBatch) -> None:
        """Make the device step state hold this batch, copying only when it does not already.

        Steady greedy decode needs no copy: the previous step's argmax kernel already
        wrote each row's next token and advanced its position. The copy is issued on
        the step's stream, so it lands before the launches (or graph) that read it.
        """
        n = batch.n_tokens
        if n > self.max_tokens:
            raise BackendError(f"{n} tokens in one step; this backend takes {self.max_tokens}")
        wanted = self._state_bytes(batch)
        if wanted == self._device_state:
            return
        # Every step ends with a synchronization, so the staging areas are free to reuse.
        for staging, buf, value in zip(self._staging, self._step_state, wanted, strict=True):
            if not value:
                continue
            staging.view(np.uint8, (buf.nbytes,))[: len(value)] = np.frombuffer(value, np.uint8)
            self.driver.copy_htod(buf, staging, self.stream, nbytes=len(value))
        self._device_state = wanted

    @staticmethod
    def _state_bytes(
        batch: StepBatch, tokens: np.ndarray | None = None, advance: int = 0
    ) -> tuple[bytes, ...]:
        """The step-state bytes of `batch` (tokens, positions, slots, sampling rows);
        with `tokens` and `advance`, those the next decode step of the same rows needs."""
        values = (
            batch.tokens if tokens is None else tokens,
            batch.positions + advance,
            batch.slots,
        )
        return (*(np.asarray(v, dtype=np.int32).tobytes() for v in values),
                batch.sampling.params.tobytes())  # fmt: skip

    def run_step(
        self, batch: StepBatch, run_forward: Callable[[], Activation], want_logits: bool
    ) -> StepOutput:
        """One step in this backend's mode; the only synchronization is the final readback.

        A step the kernel timer samples is issued eagerly behind a closed gate
        (kernels/gate.hip, except in per-kernel-sync mode) and the gate opened once all
        of it is queued, so its kernels run back to back and their events time them.
        """
        issue_start = time.perf_counter_ns()
        tracker = self.launch_tracker if self.launch_tracker.enabled else None
        if tracker is not None:
            tracker.begin_step(issue_start)
        syncs_before = self.driver.counters.syncs
        timed = self.kernel_timer.start_step(self.steps, issue_start)
        gated = timed and self.mode != "per-kernel-sync"
        rows = len(batch.logit_rows)
        decode_shape = rows == batch.n_tokens and len(set(batch.slots.tolist())) == rows
        top = int(batch.sampling.params["logprobs"].max(initial=0))
        replay_timed = False
        self._overlap_step = self.overlap and decode_shape
        if gated:
            self._close_gate()
        try:
            self.write_step_state(batch)
            if self.mode == "graph" and decode_shape and not timed:
                replay_timed = self._replay(batch, run_forward, tracker)
            else:
                self._timing = self.kernel_timer if timed else None
                try:
                    self._issue(batch, run_forward)
                finally:
                    self._timing = None
            self._queue_readback(rows, top > 0, want_logits)
        finally:
            self._overlap_step = False
            if gated:
                self._gate.view(np.uint32, 1)[0] = 1  # open: the queued step runs
                self.kernel_timer.released(time.perf_counter_ns())
        self.host_ns += time.perf_counter_ns() - issue_start
        self.stream.synchronize()
        if timed:
            self.kernel_timer.finish_step()
        if replay_timed:
            self.kernel_timer.finish_replay()
        if tracker is not None:
            tracker.end_step(time.perf_counter_ns(), self.driver.counters.syncs - syncs_before)
        self.steps += 1
        tokens = self._sampled_host.view(np.int32, (self.max_tokens,))[:rows].copy()
        logprobs = self._logprob_host.view(np.float32, (self.max_tokens,))[:rows].copy()
        host_logits = None
        if want_logits:
            shape = (self.max_tokens, self.hparams.n_vocab)
            host_logits = self._logits_host.view(np.float32, shape)[:rows].copy()
        # The sampler advanced the step state to the next decode step of these rows.
        self._device_state = self._state_bytes(batch, tokens, 1) if decode_shape else None
        return StepOutput(tokens, logprobs, self._top_alternatives(batch, top), host_logits)

    def _top_alternatives(
        self, batch: StepBatch, top: int
    ) -> tuple[tuple[tuple[int, float], ...], ...]:
        """Each row's best alternatives, as many as it asked for (read back after the sync)."""
        counts = batch.sampling.params["logprobs"]
        if not top:
            return ((),) * len(counts)
        shape = (self.max_tokens, MAX_LOGPROBS)
        ids = self._top_tokens_host.view(np.int32, shape)
        values = self._top_logprobs_host.view(np.float32, shape)
        return tuple(
            tuple(zip(ids[r, :n].tolist(), values[r, :n].tolist(), strict=True))
            for r, n in enumerate(counts.tolist())
        )

    def _replay(
        self,
        batch: StepBatch,
        run_forward: Callable[[], Activation],
        tracker: LaunchOverheadTracker | None,
    ) -> bool:
        """Replay the decode graph of this batch size and sampler, capturing it on first use.

        Returns whether the kernel timer timed this replay (read it after the sync).
        """
        key = (batch.n_tokens, batch.sampling.needs_sampler)
        graph = self._graphs.get(key)
        if graph is None:
            graph = StepGraph(self.driver, self.stream)
            graph.capture(lambda: self._record(batch, run_forward))
            self._graphs[key] = graph
        timed = self.kernel_timer.begin_replay(self.steps)
        replay_start = time.perf_counter_ns()
        graph.replay()
        if tracker is not None:
            tracker.launched("graph_replay", replay_start, time.perf_counter_ns())
        if timed:
            self.kernel_timer.end_replay()
        return timed

    def _queue_readback(self, rows: int, top: bool, want_logits: bool) -> None:
        """Queue the copies of the sampled tokens (alternatives, logits) into pinned memory."""
        if not rows:
            return
        copy, stream = self.driver.copy_dtoh, self.stream
        copy(self._sampled_host, self.sampled, stream, nbytes=rows * 4)
        copy(self._logprob_host, self.sampled_logprob, stream, nbytes=rows * 4)
        if top:
            nbytes = rows * MAX_LOGPROBS * 4
            copy(self._top_tokens_host, self.top_tokens, stream, nbytes=nbytes)
            copy(self._top_logprobs_host, self.top_logprobs, stream, nbytes=nbytes)
        if want_logits:
            nbytes = rows * self.hparams.n_vocab * 4
            copy(self._logits_host, self.logits, stream, nbytes=nbytes)

    def _close_gate(self) -> None:
        """Queue a kernel that holds the stream until the gate flag is set (kernels/gate.hip)."""
        self._gate.view(np.uint32, 1)[0] = 0
        self._launch(
            ("gate",),
            "rf_hold",
            GATE_ARGS,
            (1, 1, 1),
            (1, 1, 1),
            (self._gate.ptr, 1, GATE_MAX_NAPS),
        )

    def runtime_stats(self) -> dict[str, object]:
        """Launches, syncs and graph replays per step, and the argument cache's counters."""
        counters = self.driver.counters.snapshot()
        steps = max(self.steps, 1)
        cache = ARG_CACHE_STATS.snapshot()
        return {
            "mode": self.mode,
            "overlap": self.overlap,
            "steps": self.steps,
            "launches_per_step": counters["launches"] / steps,
            "host_us_per_step": self.host_ns / steps / 1000,
            "syncs_per_step": counters["syncs"] / steps,
            "graph_replay": self.mode == "graph",
            "graph_replays": counters["graph_replays"],
            "graph_captures": counters["captures"],
            "launch_handles": len(self._handles),
            "arg_cache_hits": cache["hits"],
            "arg_cache_misses": cache["misses"],
            "arg_bytes_repacked": cache["bytes_repacked"],
            "launch_tracking": self.launch_tracker.enabled,
            "kernel_timing": self.kernel_timer.enabled,
            **self.profile(),
        }

    def profile(self) -> dict[str, object]:
        """The launch tracker's step figures, the kernel timer's, and one row per kernel name.

        A kernel row merges its host launch statistics (while tracking is on), its
        handles' argument-cache counters (always) and its GPU time (timed steps).
        """
        launches = self.launch_tracker.snapshot()
        gpu = self.kernel_timer.snapshot()
        kernels: dict[str, dict[str, Any]] = launches.pop("kernels")
        for handle in self._handles.values():
            row = kernels.setdefault(handle.name, {})
            row["arg_cache_hits"] = row.get("arg_cache_hits", 0) + handle.hits
            row["arg_cache_misses"] = row.get("arg_cache_misses", 0) + handle.misses
            row["arg_bytes_repacked"] = row.get("arg_bytes_repacked", 0) + handle.bytes_repacked
        for name, row in gpu.pop("kernels").items():
            kernels.setdefault(name, {}).update(row)
        return {"launch_overhead": launches, "gpu_time": gpu, "kernels": kernels}

    def reset_runtime_stats(self) -> None:
        self.driver.counters.reset()
        ARG_CACHE_STATS.reset()
        self.launch_tracker.reset()
        self.kernel_timer.reset()
        for handle in self._handles.values():
            handle.reset_stats()
        self.steps = 0
        self.host_ns = 0

    def _issue(self, batch: StepBatch, run_forward: Callable[[], Activation]) -> None:
        """Issue the forward and the sampler."""
        self.sample(
            run_forward(), batch.sampling, int(batch.logit_rows[0]) if len(batch.logit_rows) else 0
        )

    def _record(
        self, batch: StepBatch, run_forward: Callable[[], Activation]
    ) -> list[LaunchHandle]:
        """Issue the step, returning every handle launched (for capture)."""
        self._recording = []
        try:
            self._issue(batch, run_forward)
            return self._recording
        finally:
            self._recording = None

    def to_host(self, values: Activation) -> np.ndarray:
        """Copy activations to the host and synchronize (op-level tests)."""
        out = np.empty((values.rows, values.width), dtype=np.float32)
        if values.rows:
            self.driver.copy_dtoh(
                out, values.buf, self.stream, src_offset=values.offset, nbytes=out.nbytes
            )
        self.stream.synchronize()
        return out
