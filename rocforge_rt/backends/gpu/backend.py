"""The forward ops on a GPU: weights repacked at load, each op one or a few kernel launches.

Works over any driver with the interface of backends/gpu/cuda.py (CUDA) and
backends/gpu/hip.py (HIP). `GpuBackend` composes the parts, each with one job:
workspace.py (every buffer), launcher.py (launch handles), one module per op family
beside its kernels (matmul.py, attention.py, embedding.py, rope.py, sampling.py) and
executor.py (step state, step modes, graphs, readback, runtime statistics).
"""

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import numpy as np

from rocforge_rt.backends.gpu.attention import Attention, check_attention_shapes
from rocforge_rt.backends.gpu.attention_plan import DEFAULT_ATTENTION_TUNING, AttentionTuning
from rocforge_rt.backends.gpu.driver import Driver
from rocforge_rt.backends.gpu.embedding import Embedding
from rocforge_rt.backends.gpu.executor import StepExecutor, check_mode
from rocforge_rt.backends.gpu.kernel_constants import EPILOGUE_RESIDUAL, EPILOGUE_SWIGLU
from rocforge_rt.backends.gpu.kernel_library import Compiler, KernelLibrary
from rocforge_rt.backends.gpu.launcher import Launcher
from rocforge_rt.backends.gpu.matmul import DeviceMatrix, Matmul, repack_rows
from rocforge_rt.backends.gpu.matmul_plan import DEFAULT_MATMUL_TUNING, MatmulTuning
from rocforge_rt.backends.gpu.rope import RopeKvAppend
from rocforge_rt.backends.gpu.sampling import Sampling
from rocforge_rt.backends.gpu.vendor_blas import open_vendor_gemm
from rocforge_rt.backends.gpu.workspace import Activation, Workspace
from rocforge_rt.errors import BackendError
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams
from rocforge_rt.profiling.kernel_timer import KernelTimer
from rocforge_rt.profiling.launch_tracker import LaunchOverheadTracker
from rocforge_rt.profiling.load_progress import COMPILING_KERNELS, LoadProgress
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.caps import BackendCaps
from rocforge_rt.step.forward import StepOutput
from rocforge_rt.step.kv_format import check_kv_dtype

# Logits rows a step may ask for, at least (more where there are more sessions): a
# prompt chunk asks for one, a teacher-forced one (Engine.logits) for up to this many.
MIN_LOGIT_ROWS = 256


class GpuBackend:
    """Weight uploader and forward ops over a device driver and the kernel library (a
    `Backend`: backends/contract.py).

    The ops of one launch each are their op family's objects themselves, with no call
    in between: `embed`, `attention` and `sample`.
    """

    embed: Embedding  # (table, batch) -> Activation
    attention: Attention  # (q, layer, batch) -> Activation
    sample: Sampling  # (logits, sampling, first_row, readback): each row's token into both

    def __init__(
        self,
        driver: Driver,
        compiler: Compiler,
        hparams: HParams,
        *,
        n_slots: int,
        n_ctx: int,
        max_tokens: int = 512,
        mode: str = "graph",
        overlap: bool = True,
        batch_invariant: bool = False,
        lookahead: bool = True,
        kv_dtype: str = "f16",
        matmul_tuning: MatmulTuning = DEFAULT_MATMUL_TUNING,
        attention_tuning: AttentionTuning = DEFAULT_ATTENTION_TUNING,
        progress: LoadProgress | None = None,
    ) -> None:
        """`progress` hears of the kernel sources compiled (those in neither the kernel cache
        nor the wheel, compiled in parallel first)."""
        check_mode(mode)
        check_attention_shapes(hparams)
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.driver = driver
        self.name = driver.info.vendor
        self.hparams = hparams
        self.n_ctx = n_ctx
        self.stream = driver.create_stream()
        # Profiling, both off until enabled: host launch times, and GPU times of sampled steps.
        self.launch_tracker = LaunchOverheadTracker()
        library = KernelLibrary(compiler)
        library.build(progress=None if progress is None else partial(progress, COMPILING_KERNELS))
        self.launcher = Launcher(driver, self.stream, library, self.launch_tracker)
        self.kernel_timer = KernelTimer(driver, self.stream)
        # A step may mix sequences' decode rows and prompt chunks (Engine.step): every op but
        # attention is row by row, and attention splits the step into launches by run of one
        # slot's consecutive positions (attention.py).
        self.caps = BackendCaps(
            ragged_steps=True,
            lookahead=lookahead,
            batch_invariant=batch_invariant,
            max_tokens=max_tokens,
            max_logit_rows=min(max_tokens, max(n_slots, MIN_LOGIT_ROWS)),
            kv_dtype=self.kv_dtype,
        )
        self.workspace = ws = Workspace(
            driver,
            hparams,
            n_slots=n_slots,
            n_ctx=n_ctx,
            max_tokens=max_tokens,
            max_logit_rows=self.caps.max_logit_rows,
            vendor_gemm=not batch_invariant,
            kv_dtype=kv_dtype,
        )
        vendor_gemm = None
        if not batch_invariant:
            scratch = ws.blas_scratch
            vendor_gemm = open_vendor_gemm(
                driver.info.vendor, self.stream.handle, scratch.ptr, scratch.nbytes
            )
        launcher = self.launcher
        self.matmul = Matmul(
            driver,
            launcher,
            ws,
            hparams,
            n_ctx=n_ctx,
            max_tokens=max_tokens,
            vendor_gemm=vendor_gemm,
            tuning=matmul_tuning,
        )
        self.embed = Embedding(launcher, ws, hparams)
        self.rope = RopeKvAppend(launcher, ws, hparams, n_ctx=n_ctx)
        self.attention = Attention(
            driver, launcher, ws, hparams, n_ctx=n_ctx, tuning=attention_tuning
        )
        self.sample = Sampling(launcher, ws)
        self.executor = StepExecutor(
            driver,
            self.stream,
            launcher,
            ws,
            self.sample,
            n_vocab=hparams.n_vocab,
            max_tokens=max_tokens,
            n_ctx=n_ctx,
            mode=mode,
            # Programmatic dependent launch (where the driver supports it): each kernel may
            # start while the previous one finishes, waiting inside for its results. Decode
            # steps only: a prompt chunk's big grids, launched early into a busy device,
            # crowd a few multiprocessors and slow prefill (docs/performance.md).
            overlap=overlap and driver.supports_overlap,
            lookahead=lookahead,
            launch_tracker=self.launch_tracker,
            kernel_timer=self.kernel_timer,
            launch_variant=self.attention.folds_apart,
        )

    @property
    def mode(self) -> str:
        """The step mode: per-kernel-sync, deferred or graph (may be switched between steps)."""
        return self.executor.mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self.executor.mode = mode

    @property
    def overlap(self) -> bool:
        """Whether decode steps launch with programmatic dependent launch."""
        return self.executor.overlap

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's outputs are the same alone, batched or in a prompt chunk (the
        int8 GEMM for every chunk); False: prompt chunks take the vendor GEMM."""
        return self.caps.batch_invariant

    def device_info(self) -> dict[str, object]:
        info = self.driver.info
        return {
            "backend": self.name,
            "device": info.name,
            "arch": info.arch,
            "batch_invariant": self.batch_invariant,
            "prompt_gemm": "int8" if self.batch_invariant else self.matmul.vendor_gemm.library,
            "max_tokens": self.caps.max_tokens,
            "max_logit_rows": self.caps.max_logit_rows,
            "kv_dtype": self.kv_dtype,
            "device_bytes": self.workspace.device_bytes(),
        }

    def warm_up(self) -> None:
        """Nothing more: the kernels were loaded when the backend was built, and the first
        steps (the daemon's warm-up) capture the step graphs."""

    # --- weights -------------------------------------------------------------------------
    def weights_uploaded(self, tensors: Iterable[WeightTensor]) -> None:
        """Nothing to release: the weights were copied to the device, the file stays mapped
        for the model's other readers."""

    def linear(self, *tensors: WeightTensor) -> DeviceMatrix:
        fmt, quants, scales = repack_rows(tensors)
        n, k = quants.shape[0], tensors[0].shape[1]
        upload = self.workspace.upload
        return DeviceMatrix(fmt, n, k, upload(quants), upload(scales))

    def vector(self, tensor: WeightTensor) -> Any:
        return self.workspace.upload(np.asarray(tensor.data, dtype=np.float32))

    def embedding(self, tensor: WeightTensor) -> DeviceMatrix:
        return self.linear(tensor)

    def load_activation(self, values: np.ndarray) -> Activation:
        """Put fp32 rows into the layer-input buffer (for op-level tests and benchmarks)."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        self.driver.copy_htod(self.workspace.x, values)
        return Activation(self.workspace.x, values.shape[0], values.shape[1])

    # --- forward ops (step/forward.py ForwardOps; embed and attention are attributes) -----
    def norm_matmul(self, x: Activation, norm: Any, weight: DeviceMatrix) -> Activation:
        qkv = self.workspace.qkv
        self.matmul(weight, x, weight.n, qkv.ptr, gain=norm)
        return Activation(qkv, x.rows, weight.n)

    def norm_qkv_rope(
        self, x: Activation, norm: Any, weight: DeviceMatrix, layer: int, batch: StepBatch
    ) -> Activation:
        """q of the normalized QKV projection, rotated; k and v rotated into the KV pool.

        Decode rows: one GEMV or MMV whose epilogue does RoPE + KV-append; a prompt chunk:
        the GEMM, then the rope kernel (all store through kernels/rf_rope.h).
        """
        if x.rows >= self.matmul.gemm_min_rows:
            return self.rope_kv_append(self.norm_matmul(x, norm, weight), layer, batch)
        self.matmul(weight, x, weight.n, 0, gain=norm, rope_layer=layer)
        return Activation(self.workspace.q, x.rows, self.hparams.q_dim)

    def rope_kv_append(self, qkv: Activation, layer: int, batch: StepBatch) -> Activation:
        return self.rope(qkv, layer)

    def matmul_add(self, x: Activation, weight: DeviceMatrix, residual: Activation) -> Activation:
        self.matmul(
            weight, x, weight.n, residual.ptr, epilogue=EPILOGUE_RESIDUAL, residual_ptr=residual.ptr
        )
        return residual

    def norm_gate_up_swiglu(self, x: Activation, norm: Any, weight: DeviceMatrix) -> Activation:
        n_ff = weight.n // 2
        h = self.workspace.h
        q8 = self.matmul(weight, x, n_ff, h.ptr, gain=norm, epilogue=EPILOGUE_SWIGLU)
        return Activation(h, x.rows, n_ff, q8=q8)

    def lm_head(
        self, x: Activation, norm: Any, weight: DeviceMatrix, batch: StepBatch
    ) -> Activation:
        rows = batch.logit_rows
        logits = self.workspace.logits
        if len(rows) == 0:
            return Activation(logits, 0, weight.n)
        first = int(rows[0])
        if not np.array_equal(rows, np.arange(first, first + len(rows))):
            raise BackendError("the GPU LM head takes a contiguous range of rows")
        picked = Activation(x.buf, len(rows), x.width, x.offset + first * x.width * 4)
        self.matmul(weight, picked, weight.n, logits.ptr, gain=norm)
        return Activation(logits, len(rows), weight.n)

    # --- steps (step/forward.py StepRunner) ------------------------------------------------
    def write_step_state(self, batch: StepBatch) -> None:
        """Make the device step state hold this batch (copied only when it does not already)."""
        self.executor.write_step_state(batch)

    def run_step(
        self,
        batch: StepBatch,
        forward: Callable[[StepBatch], Activation],
        want_logits: bool,
        ahead: bool = False,
    ) -> StepOutput:
        """One step in this backend's mode; the only synchronization is the wait for its
        readback. `ahead`: pipelined decode (executor.py)."""
        return self.executor.run_step(batch, forward, want_logits, ahead)

    def take_ahead(self, again: bool) -> StepOutput:
        """Read back the decode step issued ahead (`again`: issue the next one first)."""
        return self.executor.take_ahead(again)

    def discard_ahead(self) -> None:
        self.executor.discard_ahead()

    def runtime_stats(self) -> dict[str, object]:
        """Launches, syncs and graph replays per step, and the argument cache's counters."""
        return self.executor.runtime_stats()

    def profile(self) -> dict[str, object]:
        """The launch tracker's and kernel timer's figures, and one row per kernel name."""
        return self.executor.profile()

    def reset_runtime_stats(self) -> None:
        self.executor.reset_runtime_stats()

    def to_host(self, values: Activation) -> np.ndarray:
        """Copy activations to the host and synchronize (op-level tests)."""
        out = np.empty((values.rows, values.width), dtype=np.float32)
        if values.rows:
            self.driver.copy_dtoh(
                out, values.buf, self.stream, src_offset=values.offset, nbytes=out.nbytes
            )
        self.stream.synchronize()
        return out
