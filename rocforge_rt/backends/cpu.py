"""CPU backend: the numerical reference, in numpy.

Q4_0 and Q8_0 weights are kept as their blocks' integers (in float32) and scales;
F16/F32 ones are dequantized to float32 at load. The KV pool is float16, as on the
GPU and in llama.cpp. Matmul inputs are, by default, quantized to int8 per
32-element block first (`activations="q8"`): the arithmetic of the GPU's dp4a
GEMVs and of llama.cpp's Q4_0 x Q8_0 dot products, so results compare tightly
with both. `activations="f32"` keeps them float32.

Every matmul is row-independent: an output row is bit-identical whatever other rows
share the call, so a session's tokens do not depend on who else is generating.
BLAS cannot promise that (one row takes its GEMV, several its GEMM, each summing in
its own order), so BLAS (or einsum) only computes what is exact in any order: the
integer dot product of each 32-element block (|dot| <= 32 * 127 * 128 < 2^24, exact in
float32). The blocks are then weighed and summed elementwise in the GPU's canonical
order (`kernels/rf_q8.h`): stages of two blocks, each added by a fused multiply-add
(emulated in float64), the stage sums folded left to right. Without an integer form
(F16/F32 weights, or `activations="f32"`) each row takes a BLAS call of its own.
"""

import os
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property

import numpy as np
from gguf import GGMLQuantizationType, quants

from rocforge_rt.errors import BackendError
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import StepOutput
from rocforge_rt.step.rope import rope_tables
from rocforge_rt.step.sampling import sample_row

Q8_BLOCK = 32  # elements per quant block; the canonical sum takes them in stages of two
# Sizes (in float32 elements) that pick how q8_matmul walks a call; they bound memory and
# time, not results: every way applies the same operations to each element.
_EINSUM_ROWS, _EINSUM_OUTPUTS = 2, 16384  # dots by einsum for calls this small
_STACKED_ELEMENTS = 1 << 19  # else all blocks' terms at once up to this many
_CHUNK_ELEMENTS = 1 << 19  # else block by block over chunks of rows of this many outputs

# GGUF block layouts: bytes per block (an f16 scale, then the quants).
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q8_0: 34}


def dequantize(tensor: WeightTensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order."""
    if tensor.ggml_type == GGMLQuantizationType.F32:
        return np.asarray(tensor.data, dtype=np.float32).reshape(tensor.shape)
    values = quants.dequantize(np.asarray(tensor.data), tensor.ggml_type)
    return values.astype(np.float32, copy=False).reshape(tensor.shape)


class BlockMatrix:
    """A Q4_0/Q8_0 matrix [n_out, n_in] as its blocks' integers and f16 scales.

    `ints` is [n_blocks, 32, n_out] float32 holding integers (Q4_0: nibble - 8, Q8_0: the
    int8s), `scales` [n_blocks, n_out] float32; value = scale * int, exactly.
    `dense` (and `.T`, so that `x @ m.T` works as for an array) is the float32 matrix.
    """

    def __init__(self, ints: np.ndarray, scales: np.ndarray) -> None:
        self.ints = ints
        self.scales = scales
        self.shape = (ints.shape[2], ints.shape[0] * Q8_BLOCK)

    @classmethod
    def from_tensors(cls, *tensors: WeightTensor) -> "BlockMatrix":
        """The tensors' rows stacked (as Q|K|V or gate|up are)."""
        parts = [_block_ints(t) for t in tensors]
        ints = np.concatenate([p[0] for p in parts], axis=2)
        scales = np.concatenate([p[1] for p in parts], axis=1)
        return cls(ints, scales)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of the matrix as float32 [len(ids), n_in] (an embedding lookup)."""
        values = self.ints[:, :, ids] * self.scales[:, None, ids]  # [n_blocks, 32, len(ids)]
        return np.ascontiguousarray(values.transpose(2, 0, 1)).reshape(len(ids), self.shape[1])

    @cached_property
    def dense(self) -> np.ndarray:
        return self.rows(np.arange(self.shape[0]))

    @property
    def T(self) -> np.ndarray:  # noqa: N802 - numpy's name
        return self.dense.T


def is_block_quantized(tensor: WeightTensor) -> bool:
    return tensor.ggml_type in _BLOCK_BYTES


def _block_ints(tensor: WeightTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0/Q8_0 tensor's integers [n_blocks, 32, n_out] (float32) and scales."""
    n_out = tensor.shape[0]
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(
        n_out, -1, _BLOCK_BYTES[tensor.ggml_type]
    )
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    if tensor.ggml_type == GGMLQuantizationType.Q4_0:
        nibbles = blocks[..., 2:]  # element j in the low nibble of byte j, j + 16 in the high
        ints = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32) - 8
    else:
        ints = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32)
    return np.ascontiguousarray(ints.transpose(1, 2, 0)), np.ascontiguousarray(scales.T)


def rms_normalize(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * gain over the last axis."""
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(mean_square + eps)) * gain


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x as int8 per 32-element block: the integers [rows, n_blocks, 32] (float32)
    and the scales d [rows, n_blocks]; d = amax / 127, q = round(x / d).

    Rounds half away from zero (C's roundf), as the GPU kernels and llama.cpp do.
    """
    blocks = x.reshape(x.shape[0], x.shape[1] // Q8_BLOCK, Q8_BLOCK).astype(np.float32, copy=False)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    q = blocks / np.where(scale > 0, scale, np.float32(1))[..., None]
    q += np.copysign(np.float32(0.5), q)
    return np.trunc(q, out=q), scale


def quantize_q8(x: np.ndarray) -> np.ndarray:
    """x rounded through int8 per 32-element block (see `q8_blocks`), as float32."""
    q, scale = q8_blocks(x.reshape(-1, x.shape[-1]))
    return (q * scale[..., None]).reshape(x.shape)


def q8_matmul(x: np.ndarray, weight: BlockMatrix) -> np.ndarray:
    """quantize_q8(x) @ weight.T, each output summed in the canonical order (module docstring).

    Row-independent: the integer block dots are exact however they are computed, and the
    rest is elementwise: the same float32 operations on each output whatever the rows
    around it. The shape of the call only picks the fastest way to get the dots.
    """
    n_blocks, _, n_out = weight.ints.shape
    q, scale_x = q8_blocks(x)
    if x.shape[0] <= _EINSUM_ROWS and n_out <= _EINSUM_OUTPUTS:
        # Decode of a session or two: one pass over the weights, faster than a BLAS call
        # per block for a layer's matrices (not for the LM head's 49152 outputs).
        return _q8_fold(np.einsum("rbi,bio->bro", q, weight.ints), scale_x, weight)
    if n_blocks * n_out * x.shape[0] <= _STACKED_ELEMENTS:
        dots = np.matmul(np.ascontiguousarray(q.transpose(1, 0, 2)), weight.ints)
        return _q8_fold(dots, scale_x, weight)
    out = np.empty((x.shape[0], n_out), dtype=np.float32)
    chunk = max(1, _CHUNK_ELEMENTS // n_out)
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        out[rows] = _q8_block_by_block(q[rows], scale_x[rows], weight)
    return out


def _q8_fold(dots: np.ndarray, scale_x: np.ndarray, weight: BlockMatrix) -> np.ndarray:
    """[rows, n_out] from every block's dots [n_blocks, rows, n_out] (overwritten)."""
    n_blocks = weight.ints.shape[0]
    scales = scale_x.T[:, :, None] * weight.scales[:, None, :]  # d_x * d_w, [b, r, o]
    stages = np.multiply(dots[0::2], scales[0::2], out=dots[0::2])  # fmaf(d, dot, 0)
    pairs = n_blocks // 2
    _fma(scales[1::2], dots[1::2], stages[:pairs], out=stages[:pairs])  # fmaf(d, dot, stage)
    total = stages[0]
    for stage in stages[1:]:
        total += stage
    return total


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray, out: np.ndarray) -> np.ndarray:
    """fmaf(a, b, c) elementwise into float32 `out`, through float64, where a * b is exact
    (b holds integers below 2^20) and so is the sum, unless c is over ~2^9 times a * b or
    a * b over ~2^29 times c; only then can rounding twice (to float64, then to float32)
    differ from fmaf's single rounding, and only on a float32 tie."""
    return np.add(np.multiply(a, b, dtype=np.float64), c, out=out, dtype=np.float64)


def _q8_block_by_block(q: np.ndarray, scale_x: np.ndarray, weight: BlockMatrix) -> np.ndarray:
    """As `_q8_fold` computes it, holding one block's terms at a time (prompt chunks)."""
    n_blocks, _, n_out = weight.ints.shape
    total, stage, dot, scale = (np.empty((q.shape[0], n_out), np.float32) for _ in range(4))
    for b in range(0, n_blocks, 2):
        np.matmul(q[:, b], weight.ints[b], out=stage)
        np.multiply.outer(scale_x[:, b], weight.scales[b], out=scale)
        stage *= scale  # fmaf(d, dot, 0)
        if b + 1 < n_blocks:  # the stage's second block: fmaf(d, dot, stage)
            np.matmul(q[:, b + 1], weight.ints[b + 1], out=dot)
            np.multiply.outer(scale_x[:, b + 1], weight.scales[b + 1], out=scale)
            _fma(scale, dot, stage, out=stage)
        if b == 0:
            total, stage = stage, total
        else:
            total += stage
    return total


def rowwise_matmul(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x @ weight.T, one BLAS call per row: each row's call is the same alone or batched."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    for r in range(x.shape[0]):
        np.matmul(np.ascontiguousarray(x[r]), weight.T, out=out[r])
    return out


class CpuBackend:
    """Weight uploader and forward ops over numpy arrays; owns the KV pool storage."""

    ragged_steps = True  # a step may mix sequences' decode rows and prompt chunks

    name = "cpu"

    def __init__(
        self,
        hparams: HParams,
        n_slots: int,
        n_ctx: int,
        activations: str = "q8",
        lookahead: bool = False,
    ) -> None:
        """`lookahead`: take part in pipelined decode (StepRunner) the lazy way: a step
        issued ahead runs when it is taken, and not at all when it is dropped. The host has
        nothing to overlap it with, so it is off by default; the engine's tests turn it on."""
        if activations not in ("q8", "f32"):
            raise ValueError(f"activations must be 'q8' or 'f32', got {activations!r}")
        self.hparams = hparams
        self.activations = activations
        self.lookahead = lookahead
        # The step issued ahead: the step before it, its output, and the forward to run.
        self._ahead: tuple[StepBatch, StepOutput, Callable[[StepBatch], np.ndarray]] | None = None
        self.n_ctx = n_ctx
        shape_k = (n_slots, n_ctx, hparams.n_head_kv, hparams.head_dim_k)
        shape_v = (n_slots, n_ctx, hparams.n_head_kv, hparams.head_dim_v)
        self.k_cache = [np.zeros(shape_k, dtype=np.float16) for _ in range(hparams.n_layer)]
        self.v_cache = [np.zeros(shape_v, dtype=np.float16) for _ in range(hparams.n_layer)]
        self.rope_cos, self.rope_sin = rope_tables(hparams, n_ctx)

    def device_info(self) -> dict[str, object]:
        # Row-independent matmuls: a token's logits do not depend on the rows beside it.
        return {"backend": self.name, "device": "cpu", "threads": os.cpu_count(),
                "batch_invariant": True}  # fmt: skip

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
        picked = [
            sample_row(row, *batch.sampling.row(r), int(position))
            for r, (row, position) in enumerate(zip(logits, batch.draw_positions, strict=True))
        ]
        return StepOutput(
            np.array([p.token for p in picked], dtype=np.int32),
            np.array([p.logprob for p in picked], dtype=np.float32),
            tuple(p.top for p in picked),
            logits if want_logits else None,
        )

    # --- weights -------------------------------------------------------------------
    def linear(self, *tensors: WeightTensor) -> BlockMatrix | np.ndarray:
        """A BlockMatrix where every tensor is Q4_0/Q8_0, else float32 [n_out, n_in]."""
        if all(is_block_quantized(t) for t in tensors):
            return BlockMatrix.from_tensors(*tensors)
        return np.ascontiguousarray(np.concatenate([dequantize(t) for t in tensors], axis=0))

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
            return q8_matmul(x, weight)
        return rowwise_matmul(quantize_q8(x), weight)

    def norm_matmul(self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return self._matmul(rms_normalize(x, norm, self.hparams.rms_eps), weight)

    def norm_qkv_rope(
        self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray, layer: int, batch: StepBatch
    ) -> np.ndarray:
        """q of the normalized QKV projection, rotated; k and v rotated into the KV pool."""
        return self.rope_kv_append(self.norm_matmul(x, norm, weight), layer, batch)

    def rope_kv_append(self, qkv: np.ndarray, layer: int, batch: StepBatch) -> np.ndarray:
        hp = self.hparams
        n = qkv.shape[0]
        q = qkv[:, : hp.q_dim].reshape(n, hp.n_head, hp.head_dim_k)
        k = qkv[:, hp.q_dim : hp.q_dim + hp.kv_dim_k].reshape(n, hp.n_head_kv, hp.head_dim_k)
        v = qkv[:, hp.q_dim + hp.kv_dim_k :].reshape(n, hp.n_head_kv, hp.head_dim_v)
        q = self._rotate(q, batch.positions)
        k = self._rotate(k, batch.positions)
        self.k_cache[layer][batch.slots, batch.positions] = k
        self.v_cache[layer][batch.slots, batch.positions] = v
        return q

    def _rotate(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Adjacent-pair RoPE on [n, heads, head_dim] at the given positions."""
        dims = self.hparams.rope_dims
        cos = self.rope_cos[positions][:, None, :]
        sin = self.rope_sin[positions][:, None, :]
        even, odd = x[..., 0:dims:2], x[..., 1:dims:2]
        out = x.copy()
        out[..., 0:dims:2] = even * cos - odd * sin
        out[..., 1:dims:2] = even * sin + odd * cos
        return out

    def attention(self, q: np.ndarray, layer: int, batch: StepBatch) -> np.ndarray:
        """Causal grouped-query attention of each token over its own slot's cache.

        A slot's rows are computed together (as BLAS products per KV head), apart from the
        other slots': a session's attention does not depend on who else is in the batch.
        """
        hp = self.hparams
        n_kv, group = hp.n_head_kv, hp.gqa_group
        out = np.empty((q.shape[0], hp.n_head, hp.head_dim_v), dtype=np.float32)
        scale = np.float32(1.0 / np.sqrt(hp.head_dim_k))
        for slot in np.unique(batch.slots):
            rows = np.flatnonzero(batch.slots == slot)
            positions = batch.positions[rows]
            length = int(positions.max()) + 1
            keys = self.k_cache[layer][slot, :length].astype(np.float32).transpose(1, 2, 0)
            values = self.v_cache[layer][slot, :length].astype(np.float32).transpose(1, 0, 2)
            # [Hkv, T * G, D]: each KV head's query heads, token-major
            grouped = q[rows].reshape(len(rows), n_kv, group, hp.head_dim_k).transpose(1, 0, 2, 3)
            scores = np.matmul(grouped.reshape(n_kv, len(rows) * group, -1), keys) * scale
            future = np.arange(length)[None, :] > positions[:, None]  # [T, L]
            scores[:, np.repeat(future, group, axis=0)] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores, out=scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            mixed = np.matmul(weights, values).reshape(n_kv, len(rows), group, hp.head_dim_v)
            out[rows] = mixed.transpose(1, 0, 2, 3).reshape(len(rows), hp.n_head, hp.head_dim_v)
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
