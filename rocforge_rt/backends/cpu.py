"""CPU backend: the numerical reference, in numpy.

Weights are dequantized to float32 once at load; the KV pool is float16, as on
the GPU and in llama.cpp. Matmul inputs are, by default, quantized to int8 per
32-element block first (`activations="q8"`): the arithmetic of the GPU's dp4a
GEMVs and of llama.cpp's Q4_0 x Q8_0 dot products, so results compare tightly
with both. `activations="f32"` keeps them float32.
"""

import os
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType, quants

from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import StepOutput
from rocforge_rt.step.rope import rope_tables
from rocforge_rt.step.sampling import sample_row

Q8_BLOCK = 32


def dequantize(tensor: WeightTensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order."""
    if tensor.ggml_type == GGMLQuantizationType.F32:
        return np.asarray(tensor.data, dtype=np.float32).reshape(tensor.shape)
    values = quants.dequantize(np.asarray(tensor.data), tensor.ggml_type)
    return values.astype(np.float32, copy=False).reshape(tensor.shape)


def rms_normalize(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * gain over the last axis."""
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(mean_square + eps)) * gain


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def quantize_q8(x: np.ndarray) -> np.ndarray:
    """x rounded through int8 per 32-element block: d = amax / 127, q = round(x / d).

    Rounds half away from zero (C's roundf), as the GPU kernels and llama.cpp do.
    """
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK).astype(np.float32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    scaled = blocks / safe
    q = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))
    return (q * scale).reshape(x.shape).astype(np.float32)


class CpuBackend:
    """Weight uploader and forward ops over numpy arrays; owns the KV pool storage."""

    name = "cpu"

    def __init__(self, hparams: HParams, n_slots: int, n_ctx: int, activations: str = "q8") -> None:
        if activations not in ("q8", "f32"):
            raise ValueError(f"activations must be 'q8' or 'f32', got {activations!r}")
        self.hparams = hparams
        self.activations = activations
        self.n_ctx = n_ctx
        shape_k = (n_slots, n_ctx, hparams.n_head_kv, hparams.head_dim_k)
        shape_v = (n_slots, n_ctx, hparams.n_head_kv, hparams.head_dim_v)
        self.k_cache = [np.zeros(shape_k, dtype=np.float16) for _ in range(hparams.n_layer)]
        self.v_cache = [np.zeros(shape_v, dtype=np.float16) for _ in range(hparams.n_layer)]
        self.rope_cos, self.rope_sin = rope_tables(hparams, n_ctx)

    def device_info(self) -> dict[str, object]:
        return {"backend": self.name, "device": "cpu", "threads": os.cpu_count()}

    def to_host(self, values: np.ndarray) -> np.ndarray:
        return values

    def run_step(
        self, batch: StepBatch, run_forward: Callable[[], np.ndarray], want_logits: bool
    ) -> StepOutput:
        logits = run_forward()
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
    def linear(self, *tensors: WeightTensor) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate([dequantize(t) for t in tensors], axis=0))

    def vector(self, tensor: WeightTensor) -> np.ndarray:
        return dequantize(tensor)

    def embedding(self, tensor: WeightTensor) -> np.ndarray:
        return dequantize(tensor)

    # --- forward ops -----------------------------------------------------------------
    def embed(self, table: np.ndarray, batch: StepBatch) -> np.ndarray:
        return table[batch.tokens].astype(np.float32)

    def _matmul(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return (quantize_q8(x) if self.activations == "q8" else x) @ weight.T

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
        """Causal grouped-query attention of each token over its own slot's cache."""
        hp = self.hparams
        out = np.empty((q.shape[0], hp.n_head, hp.head_dim_v), dtype=np.float32)
        scale = np.float32(1.0 / np.sqrt(hp.head_dim_k))
        for slot in np.unique(batch.slots):
            rows = np.flatnonzero(batch.slots == slot)
            positions = batch.positions[rows]
            length = int(positions.max()) + 1
            keys = self.k_cache[layer][slot, :length].astype(np.float32)  # [L, Hkv, D]
            values = self.v_cache[layer][slot, :length].astype(np.float32)
            grouped = q[rows].reshape(len(rows), hp.n_head_kv, hp.gqa_group, hp.head_dim_k)
            scores = np.einsum("thgd,lhd->thgl", grouped, keys) * scale
            future = np.arange(length)[None, :] > positions[:, None]  # [T, L]
            scores = np.where(future[:, None, None, :], -np.inf, scores)
            scores -= scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            mixed = np.einsum("thgl,lhd->thgd", weights, values)
            out[rows] = mixed.reshape(len(rows), hp.n_head, hp.head_dim_v)
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
