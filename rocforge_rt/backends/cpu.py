"""CPU backend: the numerical reference, in numpy and compiled (numba) kernels.

`CpuBackend` uploads the weights (`cpu_weights`: Q4_0/Q8_0 kept quantized, as in the file),
runs the forward ops and the step (sampling on the host; a step issued ahead runs when it is
taken). The KV pool is float16, as on the GPU and in llama.cpp, or fp8 E4M3 bytes
(`kv_dtype="fp8"`, `step/kv_format.py`). Matmul inputs are, by default, quantized to int8 per
32-element block first (`activations="q8"`, `cpu_arithmetic`), so results compare tightly
with the GPU and llama.cpp. `activations="f32"` keeps them float32 (and the weights' float32
expansion, built on first use: a reference mode for tests).

Every matmul and the attention are row-independent: an output row is bit-identical whatever
other rows share the call, so a session's tokens do not depend on who else is generating.

Threads: `threads` (default: the physical cores) sizes numba's pool for the matmul and
limits the BLAS pools (the float32 paths) to as many, so that they do not oversubscribe
the cores.
"""

import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import NamedTuple

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from rocforge_rt.backends.cpu_arithmetic import q8_matmul, quantize_q8, rowwise_matmul, silu
from rocforge_rt.backends.cpu_attention import attend
from rocforge_rt.backends.cpu_kernels import PARALLEL_KERNELS, rms_norm_rows, rope_rows
from rocforge_rt.backends.cpu_weights import (
    Q8_BLOCK,
    BlockMatrix,
    dequantize,
    drop_mapped_pages,
    is_block_quantized,
)
from rocforge_rt.errors import BackendError
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.caps import BackendCaps
from rocforge_rt.step.forward import StepOutput
from rocforge_rt.step.kv_format import (
    KV_ELEMENT_DTYPES,
    check_kv_dtype,
    float32_to_e4m3,
    kv_element_bytes,
)
from rocforge_rt.step.rope import rope_tables
from rocforge_rt.step.sampling import sample_row


def _pool_bits(kv_dtype: str) -> np.dtype:
    """What `attend` reads a pool of `kv_dtype` as: its elements' bits (fp16: uint16)."""
    return np.dtype(f"u{kv_element_bytes(kv_dtype)}")


def physical_cores() -> int:
    """Physical cores of the host (distinct core ids per package in sysfs), else
    os.cpu_count()."""
    cores = set()
    for cpu in range(os.cpu_count() or 1):
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with (
                open(topology + "physical_package_id") as package,
                open(topology + "core_id") as core,
            ):
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            continue
    return len(cores) or os.cpu_count() or 1


def compile_kernels(kv_dtype: str = "f16") -> None:
    """Compile (or load from numba's cache) the kernels a step takes, for the argument types
    it gives them: the matmul of both weight layouts, RMSNorm (its gain read-only, as a
    model file's), RoPE (of one row, and of a chunk's rows: strided), attention over a KV
    pool of `kv_dtype`."""
    x = np.ones((1, Q8_BLOCK), dtype=np.float32)
    for packed in (np.zeros((1, 1, 16), np.uint8), np.zeros((1, 1, 32), np.int8)):
        q8_matmul(x, BlockMatrix.from_blocks(packed, np.ones((1, 1), dtype=np.float16)))
    gain = np.ones(Q8_BLOCK, dtype=np.float32)
    gain.flags.writeable = False
    rms_norm_rows(x, gain, 1e-5, np.empty_like(x))
    qkv, table = np.ones((2, 3, 2), dtype=np.float32), np.ones((1, 1), dtype=np.float32)
    for rows in (qkv[:1, :2], qkv[:, :2]):
        positions = np.zeros(len(rows), dtype=np.int32)
        rope_rows(rows, positions, table, table, np.empty(rows.shape, dtype=np.float32))
    head = np.ones((1, 1, Q8_BLOCK), dtype=np.float32)
    bits = _pool_bits(kv_dtype)
    keys_t, values = np.zeros((1, Q8_BLOCK, 1), bits), np.zeros((1, 1, Q8_BLOCK), bits)
    with PARALLEL_KERNELS:
        attend(head, keys_t, values, np.zeros(1, np.int64), np.float32(1), np.empty_like(head))


class SlotRun(NamedTuple):
    """A step's rows of one KV slot, for one attention call: the rows (a slice where they are
    consecutive) and their positions (int64)."""

    slot: int
    rows: slice | np.ndarray
    positions: np.ndarray


def slot_runs(batch: StepBatch) -> list[SlotRun]:
    """The step's rows by slot, in slot order."""
    slots, positions = batch.slots, batch.positions.astype(np.int64)
    if len(slots) and (slots == slots[0]).all():  # a decode row, or one sequence's chunk
        groups: list[tuple[int, slice | np.ndarray]] = [(int(slots[0]), slice(0, len(slots)))]
    else:
        groups = [(int(slot), np.flatnonzero(slots == slot)) for slot in np.unique(slots)]
    return [SlotRun(slot, rows, positions[rows]) for slot, rows in groups]


class CpuBackend:
    """Weight uploader and forward ops over numpy arrays; owns the KV pool storage
    (a `Backend`: backends/contract.py). No launches: no profiling hooks, no runtime stats."""

    name = "cpu"
    launch_tracker = None
    kernel_timer = None

    def __init__(
        self,
        hparams: HParams,
        n_slots: int,
        n_ctx: int,
        activations: str = "q8",
        lookahead: bool = False,
        threads: int | None = None,
        kv_dtype: str = "f16",
    ) -> None:
        """`lookahead`: take part in pipelined decode (StepRunner) the lazy way: a step
        issued ahead runs when it is taken, and not at all when it is dropped. The host has
        nothing to overlap it with, so it is off by default; the engine's tests turn it on.
        `threads`: the matmul's threads (numba's pool) and the BLAS pools' limit; None: the
        physical cores, at most numba's maximum. `kv_dtype`: the KV pool's elements, "f16"
        or "fp8" (`step/kv_format.py`)."""
        if activations not in ("q8", "f32"):
            raise ValueError(f"activations must be 'q8' or 'f32', got {activations!r}")
        self.kv_dtype = check_kv_dtype(kv_dtype)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = min(threads or physical_cores(), numba.config.NUMBA_NUM_THREADS)
        # Process-wide: BLAS runs only between the kernels, on as many threads as they use.
        self._blas_limits = threadpool_limits(limits=self.threads, user_api="blas")
        self.hparams = hparams
        self.activations = activations
        self.lookahead = lookahead
        # Row-independent matmuls and attention: a token's outputs do not depend on the rows
        # beside it; a step may mix sequences' decode rows and prompt chunks, of any size.
        self.caps = BackendCaps(
            ragged_steps=True,
            lookahead=lookahead,
            batch_invariant=True,
            max_tokens=None,
            max_logit_rows=None,
            kv_dtype=self.kv_dtype,
        )
        # The step issued ahead: the step before it, its output, and the forward to run.
        self._ahead: tuple[StepBatch, StepOutput, Callable[[StepBatch], np.ndarray]] | None = None
        self.n_ctx = n_ctx
        # The KV pool: float16, or fp8 E4M3 bytes (uint8). Keys are held positions innermost
        # ([slot, KV head, dim, position]: `attend` reads them along positions); `k_cache` is
        # each layer's view of them as [slot, position, KV head, dim], the layout of
        # `v_cache` and the GPU's.
        shape_k = (n_slots, hparams.n_head_kv, hparams.head_dim_k, n_ctx)
        shape_v = (n_slots, n_ctx, hparams.n_head_kv, hparams.head_dim_v)
        pool = KV_ELEMENT_DTYPES[self.kv_dtype]
        self.keys_t = [np.zeros(shape_k, dtype=pool) for _ in range(hparams.n_layer)]
        self.k_cache = [keys.transpose(0, 3, 1, 2) for keys in self.keys_t]
        self.v_cache = [np.zeros(shape_v, dtype=pool) for _ in range(hparams.n_layer)]
        self.rope_cos, self.rope_sin = rope_tables(hparams, n_ctx)
        self.attention_scale = np.float32(1.0 / np.sqrt(hparams.head_dim_k))
        # The step being run and its rows by slot (`slot_runs`), found once for all layers.
        self._runs: tuple[StepBatch | None, list[SlotRun]] = (None, [])

    def device_info(self) -> dict[str, object]:
        return {"backend": self.name, "device": "cpu", "threads": self.threads,
                "batch_invariant": True, "kv_dtype": self.kv_dtype}  # fmt: skip

    def runtime_stats(self) -> None:
        return None

    def reset_runtime_stats(self) -> None:
        pass

    def to_host(self, values: np.ndarray) -> np.ndarray:
        return values

    def run_step(
        self,
        batch: StepBatch,
        forward: Callable[[StepBatch], np.ndarray],
        want_logits: bool,
        ahead: bool = False,
    ) -> StepOutput:
        self._ahead = None
        out = self._step(batch, forward, want_logits)
        if ahead and self.lookahead and not want_logits and self._fits_next(batch):
            self._ahead = (batch, out, forward)
        return replace(out, ahead=self._ahead is not None)

    def take_ahead(self, again: bool) -> StepOutput:
        if self._ahead is None:
            raise BackendError("no step was issued ahead")
        before, before_out, forward = self._ahead
        batch = before.next_decode(before_out.tokens)
        out = self._step(batch, forward, False)
        self._ahead = (batch, out, forward) if again and self._fits_next(batch) else None
        return replace(out, ahead=self._ahead is not None)

    def discard_ahead(self) -> None:
        self._ahead = None

    def _fits_next(self, batch: StepBatch) -> bool:
        """Whether the decode step after `batch` (a decode step) stays inside its slots."""
        return batch.decode_shaped and batch.next_decode_fits(self.n_ctx)

    @staticmethod
    def _step(
        batch: StepBatch, forward: Callable[[StepBatch], np.ndarray], want_logits: bool
    ) -> StepOutput:
        logits = forward(batch)
        picked = []
        for r, (row, position) in enumerate(zip(logits, batch.draw_positions, strict=True)):
            params, seed, recent = batch.sampling.row(r)
            picked.append(sample_row(row, params, seed, int(position), recent))
        return StepOutput(
            np.array([p.token for p in picked], dtype=np.int32),
            np.array([p.logprob for p in picked], dtype=np.float32),
            tuple(p.top for p in picked),
            logits if want_logits else None,
        )

    def warm_up(self) -> None:
        """Compile the kernels now (the daemon's warm-up, before `ready`), not on the first
        step."""
        numba.set_num_threads(self.threads)
        compile_kernels(self.kv_dtype)

    # --- weights -------------------------------------------------------------------
    def weights_uploaded(self, tensors: Iterable[WeightTensor]) -> None:
        """After the upload: the weights are copies, so the file's pages (the header's too)
        leave the RSS."""
        drop_mapped_pages(tensors, whole_files=True)

    def linear(self, *tensors: WeightTensor) -> BlockMatrix | np.ndarray:
        """A BlockMatrix where every tensor is Q4_0/Q8_0, else float32 [n_out, n_in]; the
        tensors' file pages leave the RSS right after, so that the load's peak is about the
        weights held plus the matrix in hand."""
        if all(is_block_quantized(t) for t in tensors):
            matrix = BlockMatrix.from_tensors(*tensors)
        else:
            matrix = np.ascontiguousarray(np.concatenate([dequantize(t) for t in tensors]))
        drop_mapped_pages(tensors)
        return matrix

    def vector(self, tensor: WeightTensor) -> np.ndarray:
        return dequantize(tensor)

    def embedding(self, tensor: WeightTensor) -> BlockMatrix | np.ndarray:
        return self.linear(tensor)

    # --- forward ops -----------------------------------------------------------------
    def embed(self, table: BlockMatrix | np.ndarray, batch: StepBatch) -> np.ndarray:
        if isinstance(table, BlockMatrix):
            return table.rows(batch.tokens)
        return table[batch.tokens].astype(np.float32)

    def _matmul(self, x: np.ndarray, weight: BlockMatrix | np.ndarray) -> np.ndarray:
        if self.activations == "f32":
            dense = weight.dense if isinstance(weight, BlockMatrix) else weight
            return rowwise_matmul(x, dense)
        if isinstance(weight, BlockMatrix):
            numba.set_num_threads(self.threads)  # per calling thread: set where it runs
            return q8_matmul(x, weight)
        return rowwise_matmul(quantize_q8(x), weight)

    def norm_matmul(self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """The matmul of x normalized: `rms_normalize`'s float32 arithmetic, compiled
        (`rms_norm_rows`; x and the gain are float32 here)."""
        normed = np.empty(x.shape, dtype=np.float32)
        rms_norm_rows(x, norm, self.hparams.rms_eps, normed)
        return self._matmul(normed, weight)

    def norm_qkv_rope(
        self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray, layer: int, batch: StepBatch
    ) -> np.ndarray:
        """q of the normalized QKV projection, rotated; k and v rotated into the KV pool."""
        return self.rope_kv_append(self.norm_matmul(x, norm, weight), layer, batch)

    def rope_kv_append(self, qkv: np.ndarray, layer: int, batch: StepBatch) -> np.ndarray:
        """Adjacent-pair RoPE of q's and k's heads (one compiled pass, `rope_rows`) at the
        rows' positions; k and v into the KV pool, in its format (fp16: numpy's cast; fp8:
        `float32_to_e4m3`), from float32."""
        hp = self.hparams
        n, heads = qkv.shape[0], hp.n_head + hp.n_head_kv
        qk = qkv[:, : hp.q_dim + hp.kv_dim_k].reshape(n, heads, hp.head_dim_k)
        rotated = np.empty(qk.shape, dtype=np.float32)
        rope_rows(qk, batch.positions, self.rope_cos, self.rope_sin, rotated)
        v = qkv[:, hp.q_dim + hp.kv_dim_k :].reshape(n, hp.n_head_kv, hp.head_dim_v)
        entries = (batch.slots, batch.positions)
        self.k_cache[layer][entries] = self._pool_elements(rotated[:, hp.n_head :])
        self.v_cache[layer][entries] = self._pool_elements(v)
        return rotated[:, : hp.n_head]

    def _pool_elements(self, x: np.ndarray) -> np.ndarray:
        """float32 values as the pool takes them: as they are for fp16 (the assignment casts
        them, to nearest even), as fp8 E4M3 bytes for fp8."""
        return float32_to_e4m3(x) if self.kv_dtype == "fp8" else x

    def attention(self, q: np.ndarray, layer: int, batch: StepBatch) -> np.ndarray:
        """Causal grouped-query attention of each token over its own slot's cache.

        Each row by the compiled kernel (`cpu_attention.attend`): its own operations, in one
        order, whether it is decoded alone, batched with other sessions or in a prompt chunk.
        """
        hp = self.hparams
        queries = np.ascontiguousarray(q).reshape(q.shape[0], hp.n_head, hp.head_dim_k)
        out = np.empty((q.shape[0], hp.n_head, hp.head_dim_v), dtype=np.float32)
        planned, runs = self._runs
        if planned is not batch:
            runs = slot_runs(batch)
            self._runs = (batch, runs)
        bits = _pool_bits(self.kv_dtype)
        for run in runs:
            keys = self.keys_t[layer][run.slot].view(bits)  # [Hkv, D, n_ctx]
            values = self.v_cache[layer][run.slot].view(bits)  # [n_ctx, Hkv, D]
            mixed = out[run.rows]  # a view of the rows where they are a slice, else a copy
            with PARALLEL_KERNELS:
                attend(queries[run.rows], keys, values, run.positions, self.attention_scale, mixed)
            if not isinstance(run.rows, slice):
                out[run.rows] = mixed
        return out.reshape(q.shape[0], hp.n_head * hp.head_dim_v)

    def matmul_add(self, x: np.ndarray, weight: np.ndarray, residual: np.ndarray) -> np.ndarray:
        return residual + self._matmul(x, weight)

    def norm_gate_up_swiglu(
        self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray
    ) -> np.ndarray:
        gate_up = self.norm_matmul(x, norm, weight)
        gate, up = gate_up[:, : self.hparams.n_ff], gate_up[:, self.hparams.n_ff :]
        return silu(gate) * up

    def lm_head(
        self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray, batch: StepBatch
    ) -> np.ndarray:
        return self.norm_matmul(x[batch.logit_rows], norm, weight)
