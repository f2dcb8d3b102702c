"""Random-weight llama GGUFs of real model shapes (Q4_0 or a K-quant mix) for benchmarks and tests.

Speed depends on shapes, not values, so benchmarks run on these files. Quantized
blocks are drawn directly (random payload bytes + f16 scales of random sign, as
a real Q4_0 scale takes the sign of the block's largest element), tensor by
tensor, so even the 8B shape streams to disk without quantizing anything. Scales
give every weight matrix a standard deviation of 1/sqrt(n_in) and the embeddings
one of 1/sqrt(n_embd): activations keep unit scale through the layers and the
logits stay O(1). The files carry no vocabulary (tokenizer.ggml.model = "none"),
which llama.cpp accepts for benchmarks, unless `vocab=True` gives them a small byte-level
BPE vocabulary (`byte_vocabulary`: every byte, a few merges, a BOS token), enough for
`rocforge generate` and text prompts, or `vocabulary` gives the `tokenizer.*` keys of
another (the tests' SentencePiece model, scripts/make_spm_test_data.py). The file's
vocabulary size is its vocabulary's (`synthetic_shape`): a byte vocabulary raises a shape
of fewer tokens (`tiny`) to VOCAB_SIZE and pads a larger one with unused tokens. A file with
a vocabulary may carry a Jinja chat template (`chat_template`, e.g. CHATML_TEMPLATE) in
`tokenizer.chat_template`, for `--chat` and chat requests.

A quantization mix (`MIXES`) sets each tensor's type: `q4_0`, the runtime's own layout
(the shape's embedding types), or `q4_k_m`, the K-quant mix most downloaded GGUFs use
(attn_v and ffn_down Q6_K, the other linear weights Q4_K, token_embd and output.weight
Q6_K): the file `rocforge convert` is for. Types other than Q4_0/Q8_0 are made by
quantizing Gaussian values of the same standard deviations, a slice of rows at a time
(gguf.quants where it can quantize the type, `kquants` for the K types it cannot).

A shape with a `Llama3Rope` rule (`tiny-llama3`) also carries `rope_freqs.weight`, the
per-pair RoPE frequency factors llama.cpp's converter writes for Llama 3.1-3.3, computed by
Meta's rule (`llama3_rope_factors`); `linear_rope` adds linear RoPE scaling keys instead of
or beside them.
"""

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValue, GGUFValueType, LlamaFileType

from rocforge_rt.model import kquants
from rocforge_rt.model.gguf_file import LINEAR_SUFFIXES, ROPE_FREQS, open_gguf
from rocforge_rt.model.gguf_metadata import field_value
from rocforge_rt.model.gguf_writer import TensorOut, write_gguf
from rocforge_rt.model.spm import CONTROL, NORMAL, UNUSED
from rocforge_rt.model.tokenizer import BYTE_LEVEL_CHARS

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Llama3Rope:
    """Meta's Llama 3.1 RoPE scaling rule (config.json's rope_scaling, rope_type "llama3")."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192  # original_max_position_embeddings


def llama3_rope_factors(base: float, rope_dims: int, rule: Llama3Rope) -> np.ndarray:
    """The per-pair factors of `rope_freqs.weight`, float32 [rope_dims // 2].

    The frequency of pair i is base^(-2i / rope_dims), of wavelength 2 pi / frequency.
    Wavelengths shorter than original_context / high_freq_factor keep their frequency
    (factor 1); longer than original_context / low_freq_factor divide it by `factor`;
    in between, the scaled frequency is the mix (1 - s) * freq / factor + s * freq with
    s = (original_context / wavelength - low_freq_factor) / (high - low), so the factor
    is 1 / ((1 - s) / factor + s). Computed in float64, stored as float32.
    """
    freqs = float(base) ** (-np.arange(rope_dims // 2, dtype=np.float64) * 2.0 / rope_dims)
    wavelengths = 2.0 * math.pi / freqs
    short = rule.original_context / rule.high_freq_factor
    long = rule.original_context / rule.low_freq_factor
    smooth = (rule.original_context / wavelengths - rule.low_freq_factor) / (
        rule.high_freq_factor - rule.low_freq_factor
    )
    between = 1.0 / ((1.0 - smooth) / rule.factor + smooth)
    factors = np.where(wavelengths < short, 1.0, np.where(wavelengths > long, rule.factor, between))
    return factors.astype(np.float32)


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
    llama3_rope: Llama3Rope | None = None  # write rope_freqs.weight by this rule

    @property
    def head_dim_k(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SHAPES: dict[str, SyntheticShape] = {
    "tiny": SyntheticShape(64, 2, 4, 2, 128, 256, 256, 10000.0, Q.Q8_0, Q.Q4_0, head_dim=16),
    # the smallest shape whose rows hold 256-value K-quant blocks; its vocabulary size is
    # byte_vocabulary's
    "tiny-k": SyntheticShape(256, 2, 4, 2, 512, 264, 256, 10000.0, Q.Q8_0, Q.Q4_0, head_dim=64),
    "smollm2-135m": SyntheticShape(576, 30, 9, 3, 1536, 49152, 8192, 100000.0, Q.Q8_0, None),
    "llama-1b": SyntheticShape(2048, 16, 32, 8, 8192, 128256, 131072, 500000.0, Q.Q8_0, None),
    "llama-8b": SyntheticShape(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0, Q.Q4_0, Q.Q4_0),
    # Llama 3.2 1B's RoPE (base 500000, head dim 64, rope_freqs by the 3.1 rule at factor 32,
    # original context 8192: 15 pairs keep their frequency, 14 divide it by 32, 3 in between)
    # and tied embeddings, in 4 layers of 256; the vocabulary size is byte_vocabulary's
    "tiny-llama3": SyntheticShape(
        n_embd=256,
        n_layer=4,
        n_head=4,
        n_head_kv=2,
        n_ff=512,
        n_vocab=264,
        n_ctx=8192,
        rope_base=500000.0,
        embd_type=Q.Q8_0,
        output_type=None,
        head_dim=64,
        llama3_rope=Llama3Rope(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192
        ),
    ),
}


@dataclass(frozen=True)
class QuantMix:
    """The tensor types of a file: per linear weight, and for the embeddings (None: the
    shape's own)."""

    linear: dict[str, GGMLQuantizationType]  # LINEAR_SUFFIXES -> type
    embd_type: GGMLQuantizationType | None
    output_type: GGMLQuantizationType | None  # a tied shape stays tied
    file_type: LlamaFileType


MIXES: dict[str, QuantMix] = {
    "q4_0": QuantMix(dict.fromkeys(LINEAR_SUFFIXES, Q.Q4_0), None, None, LlamaFileType.MOSTLY_Q4_0),
    # llama.cpp's Q4_K_M gives attn_v and ffn_down Q6_K in some layers; here in all
    "q4_k_m": QuantMix(
        {s: Q.Q6_K if s in ("attn_v", "ffn_down") else Q.Q4_K for s in LINEAR_SUFFIXES},
        Q.Q6_K,
        Q.Q6_K,
        LlamaFileType.MOSTLY_Q4_K_M,
    ),
}

# byte_vocabulary's merges: the pair, in the byte-level alphabet
VOCAB_MERGES = ("Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "o n")
VOCAB_BOS = "<s>"
VOCAB_SIZE = len(BYTE_LEVEL_CHARS) + len(VOCAB_MERGES) + 1  # 264
# the ChatML format (SmolLM2's and Qwen's, without a default system prompt); to
# byte_vocabulary its <|im_start|> and <|im_end|> are plain text
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_vocabulary(n_vocab: int) -> dict[str, GGUFValue]:
    """A byte-level BPE vocabulary of `n_vocab` tokens as GGUF metadata: ids 0-255 the bytes,
    then VOCAB_MERGES' tokens, the BOS token (added to every prompt; no EOS, so generation
    runs to its token limit), and unused tokens up to `n_vocab`."""
    if n_vocab < VOCAB_SIZE:
        raise ValueError(f"a byte vocabulary needs {VOCAB_SIZE} tokens, the shape has {n_vocab}")
    merged = [m.replace(" ", "") for m in VOCAB_MERGES]
    unused = [f"<|unused_{i}|>" for i in range(n_vocab - VOCAB_SIZE)]
    tokens = [*BYTE_LEVEL_CHARS, *merged, VOCAB_BOS, *unused]
    types = [NORMAL] * (len(BYTE_LEVEL_CHARS) + len(merged)) + [CONTROL] + [UNUSED] * len(unused)
    array, string = GGUFValueType.ARRAY, GGUFValueType.STRING
    return {
        "tokenizer.ggml.model": GGUFValue("gpt2", string),
        "tokenizer.ggml.pre": GGUFValue("gpt-2", string),
        "tokenizer.ggml.tokens": GGUFValue(tokens, array, string),
        "tokenizer.ggml.token_type": GGUFValue(types, array, GGUFValueType.INT32),
        "tokenizer.ggml.merges": GGUFValue(list(VOCAB_MERGES), array, string),
        "tokenizer.ggml.bos_token_id": GGUFValue(tokens.index(VOCAB_BOS), GGUFValueType.UINT32),
        "tokenizer.ggml.add_bos_token": GGUFValue(True, GGUFValueType.BOOL),
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


def _metadata(
    name: str, s: SyntheticShape, mix: str, vocab: bool, linear_rope: float | None
) -> dict[str, GGUFValue]:
    u32, f32, string = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    label = name if mix == "q4_0" else f"{name} {mix}"
    values = {
        "general.architecture": ("llama", string),
        "general.name": (f"rocforge synthetic {label}", string),
        "general.file_type": (int(MIXES[mix].file_type), u32),
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
    }
    if linear_rope is not None:
        values["llama.rope.scaling.type"] = ("linear", string)
        values["llama.rope.scaling.factor"] = (linear_rope, f32)
    metadata = {key: GGUFValue(value, vtype) for key, (value, vtype) in values.items()}
    return metadata | (
        byte_vocabulary(s.n_vocab) if vocab else {"tokenizer.ggml.model": GGUFValue("none", string)}
    )


LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip


CHUNK_VALUES = 1 << 22  # Gaussian values drawn and quantized at a time


def _draw(seed: int, index: int, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `index` of the file: a norm gain near 1, or weights with std 1/sqrt(n_in)
    (random Q4_0/Q8_0 blocks, or Gaussian values quantized to any other type)."""
    rng = np.random.default_rng([seed, index])  # one stream per tensor: same file in any order
    if qtype == Q.F32:
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    n_out, n_in = shape
    std = n_in**-0.5
    if qtype in _Q_RMS:
        return random_blocks(rng, n_out, n_in, qtype, std=std)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    out = np.empty((n_out, n_in // block_size * type_size), dtype=np.uint8)
    step = max(1, CHUNK_VALUES // n_in)
    for start in range(0, n_out, step):
        rows = min(step, n_out - start)
        values = rng.standard_normal((rows, n_in), dtype=np.float32) * np.float32(std)
        out[start : start + rows] = kquants.quantize(values, qtype).view(np.uint8)
    return out


def _tensors(s: SyntheticShape, seed: int, mix: QuantMix, rope_factors: bool) -> list[TensorOut]:
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
    embd_type = s.embd_type if mix.embd_type is None else mix.embd_type
    plan = [("token_embd.weight", embd_type, (s.n_vocab, s.n_embd))]
    for i in range(s.n_layer):
        for part in LAYER_TENSORS:
            qtype, shape = (
                (mix.linear[part], linear[part]) if part in linear else (Q.F32, (s.n_embd,))
            )
            plan.append((f"blk.{i}.{part}.weight", qtype, shape))
    plan.append(("output_norm.weight", Q.F32, (s.n_embd,)))
    if s.output_type is not None:
        output_type = s.output_type if mix.output_type is None else mix.output_type
        plan.append(("output.weight", output_type, (s.n_vocab, s.n_embd)))
    for name, qtype, shape in plan:
        block_size = GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block_size:
            raise ValueError(
                f"{name}: rows of {shape[-1]} values cannot hold {qtype.name} blocks of "
                f"{block_size}; pick a shape whose widths are multiples of {block_size} (tiny-k)"
            )
    weights = [
        TensorOut(name, qtype, shape, partial(_draw, seed, index, qtype, shape))
        for index, (name, qtype, shape) in enumerate(plan)
    ]
    if not (rope_factors and s.llama3_rope):
        return weights
    # first, where llama.cpp's converter puts it; the weights' draws do not depend on it
    factors = llama3_rope_factors(s.rope_base, s.head_dim_k, s.llama3_rope)
    return [TensorOut(ROPE_FREQS, Q.F32, factors.shape, lambda: factors), *weights]


def synthetic_shape(
    shape: str, *, vocab: bool = False, vocabulary: Mapping[str, GGUFValue] | None = None
) -> SyntheticShape:
    """SHAPES[shape] as a file of it is written: `vocabulary`'s number of tokens is its
    vocabulary size; a byte vocabulary (`vocab`) raises it to VOCAB_SIZE at least."""
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; known: {', '.join(SHAPES)}")
    spec = SHAPES[shape]
    if vocabulary is not None:
        return replace(spec, n_vocab=len(vocabulary["tokenizer.ggml.tokens"].value))
    if vocab and spec.n_vocab < VOCAB_SIZE:
        return replace(spec, n_vocab=VOCAB_SIZE)
    return spec


def write_synthetic_model(
    shape: str,
    out: Path,
    *,
    seed: int = 0,
    progress: bool = True,
    mix: str = "q4_0",
    vocab: bool = False,
    vocabulary: Mapping[str, GGUFValue] | None = None,
    chat_template: str | None = None,
    rope_factors: bool = True,
    linear_rope: float | None = None,
) -> Path:
    """Write a random-weight GGUF of a named shape (see SHAPES) in a quantization mix (see
    MIXES) atomically to `out`: with a byte vocabulary if `vocab`, or with `vocabulary`'s
    `tokenizer.*` keys (the vocabulary size is `synthetic_shape`'s), and with
    `chat_template` as tokenizer.chat_template (it needs one of them; written as given).

    A shape with a Llama 3.1 RoPE rule carries rope_freqs.weight unless `rope_factors` is
    False; `linear_rope` adds rope.scaling.type 'linear' with that factor. Neither changes
    the weights: the same seed draws the same ones."""
    if vocab and vocabulary is not None:
        raise ValueError("give a synthetic model `vocab` or a `vocabulary`, not both")
    if chat_template is not None and not vocab and vocabulary is None:
        raise ValueError("a chat template needs a vocabulary: give `vocab` or a `vocabulary`")
    spec = synthetic_shape(shape, vocab=vocab, vocabulary=vocabulary)
    if mix not in MIXES:
        raise ValueError(f"unknown quantization mix {mix!r}; known: {', '.join(MIXES)}")
    metadata = _metadata(shape, spec, mix, vocab, linear_rope)
    if vocabulary is not None:
        del metadata["tokenizer.ggml.model"]
        metadata.update(vocabulary)
    if chat_template is not None:
        metadata["tokenizer.chat_template"] = GGUFValue(chat_template, GGUFValueType.STRING)
    return write_gguf(
        Path(out),
        metadata,
        _tensors(spec, seed, MIXES[mix], rope_factors),
        progress=progress,
        desc=f"synthetic {shape} {mix}",
    )


def content_digest(path: Path) -> str:
    """sha256 of a GGUF's metadata values and tensors (names, types, shapes, bytes), in file
    order: what a forward pass reads, whatever the writer's padding or alignment."""
    reader = open_gguf(path)
    digest = hashlib.sha256()
    for name, field in reader.fields.items():
        if not name.startswith("GGUF."):
            digest.update(repr((name, field_value(field))).encode())
    for t in reader.tensors:
        digest.update(repr((t.name, int(t.tensor_type), t.shape.tolist())).encode())
        digest.update(np.ascontiguousarray(t.data).view(np.uint8).tobytes())
    return digest.hexdigest()
