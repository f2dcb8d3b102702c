"""Random-weight Q4_0 llama GGUFs of real model shapes, for benchmarks and tests.

Speed depends on shapes, not values, so benchmarks run on these files. Quantized
blocks are drawn directly (random payload bytes + f16 scales of random sign, as
a real Q4_0 scale takes the sign of the block's largest element), tensor by
tensor, so even the 8B shape streams to disk without quantizing anything. Scales
give every weight matrix a standard deviation of 1/sqrt(n_in) and the embeddings
one of 1/sqrt(n_embd): activations keep unit scale through the layers and the
logits stay O(1). The files carry no vocabulary (tokenizer.ggml.model = "none"),
which llama.cpp accepts for benchmarks, unless one is given (the tests' SentencePiece
model, scripts/make_spm_test_data.py).
"""

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValue, GGUFValueType, LlamaFileType

from rocforge_rt.model.gguf_file import TensorOut, write_gguf

Q = GGMLQuantizationType


@dataclass(frozen=True)
class SyntheticShape:
    """The numbers that make a llama model's shape."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx: int
    rope_base: float
    embd_type: GGMLQuantizationType
    output_type: GGMLQuantizationType | None  # None: tied to token_embd
    head_dim: int = 0  # 0: n_embd // n_head
    rms_eps: float = 1e-5

    @property
    def head_dim_k(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SHAPES: dict[str, SyntheticShape] = {
    "tiny": SyntheticShape(64, 2, 4, 2, 128, 256, 256, 10000.0, Q.Q8_0, Q.Q4_0, head_dim=16),
    "smollm2-135m": SyntheticShape(576, 30, 9, 3, 1536, 49152, 8192, 100000.0, Q.Q8_0, None),
    "llama-1b": SyntheticShape(2048, 16, 32, 8, 8192, 128256, 131072, 500000.0, Q.Q8_0, None),
    "llama-8b": SyntheticShape(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0, Q.Q4_0, Q.Q4_0),
}

# root mean square of the integer q a block stores for a random payload byte
_Q_RMS = {
    Q.Q4_0: np.sqrt(np.mean((np.arange(16) - 8.0) ** 2)),  # value = d * (nibble - 8)
    Q.Q8_0: np.sqrt(np.mean(np.arange(-128, 128.0) ** 2)),  # value = d * int8
}


def random_blocks(
    rng: np.random.Generator, n_out: int, n_in: int, qtype: GGMLQuantizationType, std: float
) -> np.ndarray:
    """Random Q4_0 or Q8_0 rows, uint8 (n_out, row_bytes), whose values have standard
    deviation `std` and mean zero."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_out * n_in // block_size
    payload = type_size - 2
    blocks = np.empty((n_blocks, type_size), dtype=np.uint8)
    raw = rng.bit_generator.random_raw((n_blocks * payload + 7) // 8)
    blocks[:, 2:] = raw.view(np.uint8)[: n_blocks * payload].reshape(n_blocks, payload)
    # magnitudes uniform in [0.5, 1.5] * base (mean square 13/12 * base^2), random signs
    base = std / _Q_RMS[qtype] / np.sqrt(13 / 12)
    scale = (rng.random(n_blocks, dtype=np.float32) + 0.5) * base
    scale *= rng.choice(np.array([-1.0, 1.0], dtype=np.float32), n_blocks)
    blocks[:, :2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(n_out, n_in // block_size * type_size)


def _metadata(name: str, s: SyntheticShape) -> dict[str, GGUFValue]:
    u32, f32, string = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    values = {
        "general.architecture": ("llama", string),
        "general.name": (f"rocforge synthetic {name}", string),
        "general.file_type": (int(LlamaFileType.MOSTLY_Q4_0), u32),
        "general.quantization_version": (2, u32),
        "llama.vocab_size": (s.n_vocab, u32),
        "llama.context_length": (s.n_ctx, u32),
        "llama.embedding_length": (s.n_embd, u32),
        "llama.block_count": (s.n_layer, u32),
        "llama.feed_forward_length": (s.n_ff, u32),
        "llama.attention.head_count": (s.n_head, u32),
        "llama.attention.head_count_kv": (s.n_head_kv, u32),
        "llama.attention.key_length": (s.head_dim_k, u32),
        "llama.attention.value_length": (s.head_dim_k, u32),
        "llama.attention.layer_norm_rms_epsilon": (s.rms_eps, f32),
        "llama.rope.freq_base": (s.rope_base, f32),
        "llama.rope.dimension_count": (s.head_dim_k, u32),
        "tokenizer.ggml.model": ("none", string),
    }
    return {key: GGUFValue(value, vtype) for key, (value, vtype) in values.items()}


LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip


def _draw(seed: int, index: int, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `index` of the file: a norm gain near 1, or random blocks with std 1/sqrt(n_in)."""
    rng = np.random.default_rng([seed, index])  # one stream per tensor: same file in any order
    if qtype == Q.F32:
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    return random_blocks(rng, shape[0], shape[1], qtype, std=shape[1] ** -0.5)


def _tensors(s: SyntheticShape, seed: int) -> list[TensorOut]:
    q_dim, kv_dim = s.n_head * s.head_dim_k, s.n_head_kv * s.head_dim_k
    linear = {
        "attn_q": (q_dim, s.n_embd),
        "attn_k": (kv_dim, s.n_embd),
        "attn_v": (kv_dim, s.n_embd),
        "attn_output": (s.n_embd, q_dim),
        "ffn_gate": (s.n_ff, s.n_embd),
        "ffn_up": (s.n_ff, s.n_embd),
        "ffn_down": (s.n_embd, s.n_ff),
    }
    plan = [("token_embd.weight", s.embd_type, (s.n_vocab, s.n_embd))]
    for i in range(s.n_layer):
        for part in LAYER_TENSORS:
            qtype, shape = (Q.Q4_0, linear[part]) if part in linear else (Q.F32, (s.n_embd,))
            plan.append((f"blk.{i}.{part}.weight", qtype, shape))
    plan.append(("output_norm.weight", Q.F32, (s.n_embd,)))
    if s.output_type is not None:
        plan.append(("output.weight", s.output_type, (s.n_vocab, s.n_embd)))
    return [
        TensorOut(name, qtype, shape, partial(_draw, seed, index, qtype, shape))
        for index, (name, qtype, shape) in enumerate(plan)
    ]


def write_synthetic_model(
    shape: str,
    out: Path,
    *,
    seed: int = 0,
    progress: bool = True,
    vocabulary: Mapping[str, GGUFValue] | None = None,
) -> Path:
    """Write a random-weight Q4_0 GGUF of a named shape (see SHAPES) atomically to `out`.

    `vocabulary`: `tokenizer.*` keys to carry instead of "none"; the shape's vocabulary
    size becomes the number of its `tokenizer.ggml.tokens`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; known: {', '.join(SHAPES)}")
    spec = SHAPES[shape]
    metadata = _metadata(shape, spec)
    if vocabulary is not None:
        spec = replace(spec, n_vocab=len(vocabulary["tokenizer.ggml.tokens"].value))
        metadata = _metadata(shape, spec)
        del metadata["tokenizer.ggml.model"]
        metadata.update(vocabulary)
    return write_gguf(
        Path(out),
        metadata,
        _tensors(spec, seed),
        progress=progress,
        desc=f"synthetic {shape}",
    )
