"""load_model_file: a valid Q4_0 llama GGUF maps zero-copy; every malformed file is rejected
with a message naming the file, the key or tensor, what was expected, what was found and a fix."""

import mmap
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValue, GGUFValueType, quants

from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model.gguf_file import load_model_file, open_gguf
from rocforge_rt.model.gguf_writer import TensorOut, copy_metadata, write_gguf
from rocforge_rt.model.hparams import HParams

Q = GGMLQuantizationType


def rewrite(
    src: Path,
    dst: Path,
    *,
    metadata: Callable[[dict[str, GGUFValue]], None] = lambda m: None,
    tensors: Callable[[dict[str, TensorOut]], None] = lambda t: None,
) -> Path:
    """Copy a GGUF to `dst` after editing its metadata and tensor dicts in place."""
    reader = open_gguf(src)
    meta = copy_metadata(reader)
    outs = {
        t.name: TensorOut(
            t.name, Q(t.tensor_type), tuple(reversed(t.shape.tolist())), partial(np.asarray, t.data)
        )
        for t in reader.tensors
    }
    metadata(meta)
    tensors(outs)
    return write_gguf(dst, meta, list(outs.values()), progress=False)


def q4_0_tensor(name: str, shape: tuple[int, int]) -> TensorOut:
    values = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    return TensorOut(name, Q.Q4_0, shape, lambda: quants.quantize(values, Q.Q4_0))


def load_error(path: Path) -> str:
    with pytest.raises(ModelFormatError) as info:
        load_model_file(path)
    return str(info.value)


def assert_mentions(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# --- the happy path -------------------------------------------------------------------


def test_tiny_model_hparams(tiny_model: Path) -> None:
    assert load_model_file(tiny_model).hparams == HParams(
        arch="llama",
        n_layer=2,
        n_embd=64,
        n_ff=128,
        n_head=4,
        n_head_kv=2,
        head_dim_k=16,
        head_dim_v=16,
        n_vocab=256,
        n_ctx_train=256,
        rope_base=10000.0,
        rope_dims=16,
        rms_eps=pytest.approx(1e-5),
        tied_embeddings=False,
    )


def test_tensor_shapes_and_types(tiny_model: Path) -> None:
    model = load_model_file(tiny_model)
    expected = {
        "attn_norm": ((64,), Q.F32),
        "attn_q": ((64, 64), Q.Q4_0),
        "attn_k": ((32, 64), Q.Q4_0),
        "attn_v": ((32, 64), Q.Q4_0),
        "attn_output": ((64, 64), Q.Q4_0),
        "ffn_norm": ((64,), Q.F32),
        "ffn_gate": ((128, 64), Q.Q4_0),
        "ffn_up": ((128, 64), Q.Q4_0),
        "ffn_down": ((64, 128), Q.Q4_0),
    }
    for i in range(2):
        for suffix, (shape, qtype) in expected.items():
            t = model.layer(i, suffix)
            assert (t.name, t.shape, t.ggml_type) == (f"blk.{i}.{suffix}.weight", shape, qtype)
    embd = model.tensor("token_embd.weight")
    assert (embd.shape, embd.ggml_type) == ((256, 64), Q.Q8_0)
    assert model.lm_head.name == "output.weight"
    assert (model.lm_head.shape, model.lm_head.ggml_type) == ((256, 64), Q.Q4_0)


def test_quantized_data_is_raw_blocks(tiny_model: Path) -> None:
    t = load_model_file(tiny_model).layer(0, "ffn_down")
    assert (t.data.dtype, t.data.shape) == (np.uint8, (64, 128 // 32 * 18))
    assert t.nbytes == 64 * 4 * 18


def test_tensor_data_is_a_read_only_view_of_the_mapped_file(tiny_model: Path) -> None:
    for t in load_model_file(tiny_model).tensors.values():
        assert not t.data.flags.owndata and not t.data.flags.writeable
        assert isinstance(t.mapping, mmap.mmap)
        mapped = np.frombuffer(t.mapping, np.uint8).ctypes.data
        assert mapped <= t.data.ctypes.data, t.name
        assert t.data.ctypes.data + t.data.nbytes <= mapped + len(t.mapping), t.name


def test_missing_output_weight_means_tied_embeddings(tiny_model: Path, tmp_path: Path) -> None:
    path = rewrite(tiny_model, tmp_path / "tied.gguf", tensors=lambda t: t.pop("output.weight"))
    model = load_model_file(path)
    assert model.hparams.tied_embeddings
    assert model.lm_head.name == "token_embd.weight"


def test_optional_keys_take_llama_cpp_defaults(tiny_model: Path, tmp_path: Path) -> None:
    optional = ("head_count_kv", "key_length", "value_length")
    optional_keys = [f"llama.attention.{k}" for k in optional] + [
        "llama.rope.dimension_count",
        "llama.rope.freq_base",
        "llama.vocab_size",
    ]

    def drop_optional(meta: dict[str, GGUFValue]) -> None:
        for key in optional_keys:
            del meta[key]

    def as_mha(tensors: dict[str, TensorOut]) -> None:  # head_count_kv defaults to head_count
        for i in range(2):
            for part in ("attn_k", "attn_v"):
                name = f"blk.{i}.{part}.weight"
                tensors[name] = q4_0_tensor(name, (64, 64))

    path = rewrite(tiny_model, tmp_path / "defaults.gguf", metadata=drop_optional, tensors=as_mha)
    hp = load_model_file(path).hparams
    assert (hp.n_head_kv, hp.head_dim_k, hp.head_dim_v, hp.rope_dims) == (4, 16, 16, 16)
    assert hp.rope_base == 10000.0
    assert hp.n_vocab == 256  # from token_embd's rows


# --- unreadable files -------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    assert_mentions(load_error(path), str(path), "expected a GGUF file", "nothing at this path")


def test_directory(tmp_path: Path) -> None:
    message = load_error(tmp_path)
    assert_mentions(message, str(tmp_path), "a GGUF file", "found a directory", "pass the .gguf")


def test_zero_length_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.touch()
    assert_mentions(load_error(path), str(path), "empty file (0 bytes)", "re-download")


def test_wrong_magic(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGML" + tiny_model.read_bytes()[4:])
    message = load_error(path)
    assert_mentions(message, str(path), "magic", "expected b'GGUF'", "found b'GGML'", "convert")


def test_unsupported_version(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "v4.gguf"
    data = bytearray(tiny_model.read_bytes())
    data[4:8] = (4).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    message = load_error(path)
    assert_mentions(message, str(path), "GGUF version", "expected 2 or 3", "found 4", "re-export")


def test_truncated_tensor_data(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_model.read_bytes()[:-1000])
    size = path.stat().st_size
    message = load_error(path)
    assert_mentions(message, str(path), "tensor data", f"found {size} bytes", "truncated")
    assert_mentions(message, "re-download")


def test_truncated_header(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_model.read_bytes()[:200])
    message = load_error(path)
    assert_mentions(message, str(path), "header", "found 200 bytes", "truncated", "re-download")


# --- files that are not a runnable llama model -------------------------------------------


def test_non_llama_architecture(tiny_model: Path, tmp_path: Path) -> None:
    def qwen(meta: dict[str, GGUFValue]) -> None:
        meta["general.architecture"] = GGUFValue("qwen2", GGUFValueType.STRING)

    path = rewrite(tiny_model, tmp_path / "qwen.gguf", metadata=qwen)
    message = load_error(path)
    assert_mentions(message, str(path), "general.architecture", "expected 'llama'", "'qwen2'")
    assert_mentions(message, "only llama-family models")


def test_missing_metadata_key(tiny_model: Path, tmp_path: Path) -> None:
    path = rewrite(
        tiny_model, tmp_path / "nokey.gguf", metadata=lambda m: m.pop("llama.block_count")
    )
    message = load_error(path)
    assert_mentions(message, str(path), "'llama.block_count'", "an integer", "key missing")
    assert_mentions(message, "re-convert")


# --- RoPE scaling: linear factors and rope_freqs.weight are read, other scaling refused ----


def f32(value: float) -> GGUFValue:
    return GGUFValue(value, GGUFValueType.FLOAT32)


def with_metadata(tiny_model: Path, dst: Path, **values: GGUFValue) -> Path:
    """tiny_model with `llama.<key>` metadata set (dots in keys written as `__`)."""
    update = {f"llama.{key.replace('__', '.')}": value for key, value in values.items()}
    return rewrite(tiny_model, dst, metadata=lambda m: m.update(update))


LINEAR = GGUFValue("linear", GGUFValueType.STRING)


@pytest.mark.parametrize(
    ("values", "freq_scale"),
    [
        ({"rope__scaling__type": LINEAR, "rope__scaling__factor": f32(4.0)}, 0.25),
        ({"rope__scaling__factor": f32(2.0)}, 0.5),  # no type: llama.cpp's default, linear
        ({"rope__scale_linear": f32(8.0)}, 0.125),  # the older key
        # both keys: rope.scaling.factor wins, as in llama.cpp
        ({"rope__scaling__factor": f32(2.0), "rope__scale_linear": f32(8.0)}, 0.5),
        ({"rope__scaling__type": LINEAR, "rope__scaling__factor": f32(0.0)}, 1.0),  # 0: unset
        ({"rope__scaling__type": GGUFValue("none", GGUFValueType.STRING)}, 1.0),
        ({"rope__scaling__factor": f32(1.0), "rope__scaling__attn_factor": f32(1.0)}, 1.0),
    ],
    ids=["linear", "untyped", "scale_linear", "both-keys", "zero", "none", "ones"],
)
def test_linear_rope_scaling_is_read_as_llama_cpp_reads_it(
    tiny_model: Path, tmp_path: Path, values: dict, freq_scale: float
) -> None:
    hp = load_model_file(with_metadata(tiny_model, tmp_path / "linear.gguf", **values)).hparams
    assert hp.rope_freq_scale == freq_scale
    assert hp.rope_freq_factors is None


@pytest.mark.parametrize("kind", ["yarn", "longrope", "dynamic"])
def test_other_rope_scaling_types_are_refused_by_name(
    tiny_model: Path, tmp_path: Path, kind: str
) -> None:
    kind_value = GGUFValue(kind, GGUFValueType.STRING)
    path = with_metadata(
        tiny_model, tmp_path / "scaled.gguf", rope__scaling__type=kind_value,
        rope__scaling__factor=f32(8.0),
    )  # fmt: skip
    message = load_error(path)
    assert_mentions(message, str(path), "'llama.rope.scaling.type'", f"found {kind!r}")
    assert_mentions(message, "expected 'none' or 'linear'", f"{kind} RoPE scaling is not supported")
    assert_mentions(message, "rope_freqs.weight", "Llama 3.1")


@pytest.mark.parametrize(
    ("values", "key", "found"),
    [
        ({"rope__scaling__factor": f32(-2.0)}, "rope.scaling.factor", "found -2.0"),
        ({"rope__scale_linear": f32(float("nan"))}, "rope.scale_linear", "found nan"),
        ({"rope__scaling__factor": GGUFValue("4", GGUFValueType.STRING)}, "rope.scaling.factor",
         "found '4'"),
    ],
    ids=["negative", "nan", "string"],
)  # fmt: skip
def test_a_bad_linear_factor_is_refused(
    tiny_model: Path, tmp_path: Path, values: dict, key: str, found: str
) -> None:
    path = with_metadata(tiny_model, tmp_path / "bad.gguf", **values)
    message = load_error(path)
    assert_mentions(message, str(path), f"'llama.{key}'", "a finite number > 0", found)


def test_a_factor_with_scaling_type_none_contradicts_itself(
    tiny_model: Path, tmp_path: Path
) -> None:
    none = GGUFValue("none", GGUFValueType.STRING)
    path = with_metadata(
        tiny_model, tmp_path / "none.gguf", rope__scaling__type=none, rope__scaling__factor=f32(8.0)
    )
    message = load_error(path)
    assert_mentions(message, "'llama.rope.scaling.factor'", "expected 1.0, as")
    assert_mentions(message, "'llama.rope.scaling.type' is 'none'", "found 8.0", "contradicts")


def test_a_rope_attention_factor_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    path = with_metadata(tiny_model, tmp_path / "attn.gguf", rope__scaling__attn_factor=f32(0.5))
    message = load_error(path)
    assert_mentions(message, "'llama.rope.scaling.attn_factor'", "expected 1.0", "found 0.5")
    assert_mentions(message, "RoPE scaling is not supported")


def with_freqs(tiny_model: Path, dst: Path, freqs: TensorOut) -> Path:
    return rewrite(tiny_model, dst, tensors=lambda t: t.update({freqs.name: freqs}))


def freqs_tensor(values: np.ndarray, qtype: Q = Q.F32) -> TensorOut:
    return TensorOut("rope_freqs.weight", qtype, values.shape, lambda: values)


def test_rope_freqs_factors_are_read_into_the_hparams(tiny_model: Path, tmp_path: Path) -> None:
    factors = np.array([1, 1, 1, 1.5, 4, 32, 32, 32], dtype=np.float32)  # tiny: 8 pairs
    model = load_model_file(with_freqs(tiny_model, tmp_path / "f.gguf", freqs_tensor(factors)))
    assert model.hparams.rope_freq_factors == tuple(factors.tolist())
    assert model.hparams.rope_freq_scale == 1.0
    assert model.tensor("rope_freqs.weight").ggml_type == Q.F32  # kept, validated


@pytest.mark.parametrize(
    ("values", "qtype", "parts"),
    [
        (np.ones(16, np.float32), Q.F32,
         ("expected shape (8,)", "rope.dimension_count 16 / 2", "found shape (16,)")),
        (np.ones((2, 4), np.float32), Q.F32, ("expected shape (8,)", "found shape (2, 4)")),
        (np.ones(8, np.float16), Q.F16, ("expected F32", "found F16")),
        (np.array([1, 1, 1, 0, 2, 2, 2, 2], np.float32), Q.F32,
         ("finite factors > 0", "found 0.0 at pair 3 (1 of 8 pairs bad)")),
        (np.array([1, 1, 1, 1, 1, np.nan, 2, np.nan], np.float32), Q.F32,
         ("found nan at pair 5 (2 of 8 pairs bad)",)),
        (np.array([1, -1, 1, 1, 1, 1, 1, 1], np.float32), Q.F32, ("found -1.0 at pair 1",)),
        (np.array([1, 1, 1, 1, 1, 1, 1, np.inf], np.float32), Q.F32, ("found inf at pair 7",)),
    ],
    ids=["length", "2-d", "f16", "zero", "nan", "negative", "inf"],
)  # fmt: skip
def test_bad_rope_freqs_are_refused(
    tiny_model: Path, tmp_path: Path, values: np.ndarray, qtype: Q, parts: tuple[str, ...]
) -> None:
    path = with_freqs(tiny_model, tmp_path / "bad.gguf", freqs_tensor(values, qtype))
    message = load_error(path)
    assert_mentions(message, str(path), "tensor 'rope_freqs.weight'", *parts)
    assert_mentions(message, "re-convert")


def test_missing_tensor(tiny_model: Path, tmp_path: Path) -> None:
    name = "blk.1.ffn_up.weight"
    path = rewrite(tiny_model, tmp_path / "incomplete.gguf", tensors=lambda t: t.pop(name))
    message = load_error(path)
    assert_mentions(message, str(path), repr(name), "present with shape (128, 64)", "nothing")
    assert_mentions(message, "re-download")


def test_wrong_shape(tiny_model: Path, tmp_path: Path) -> None:
    name = "blk.0.attn_q.weight"
    path = rewrite(
        tiny_model,
        tmp_path / "shape.gguf",
        tensors=lambda t: t.update({name: q4_0_tensor(name, (32, 64))}),
    )
    message = load_error(path)
    assert_mentions(
        message, str(path), repr(name), "expected shape (64, 64)", "found shape (32, 64)"
    )
    assert_mentions(message, "convert_hf_to_gguf.py", "rocforge convert")


def test_linear_weight_not_q4_0(tiny_model: Path, tmp_path: Path) -> None:
    name = "blk.1.ffn_gate.weight"
    values = np.random.default_rng(0).standard_normal((128, 64), dtype=np.float32)
    q4_1 = TensorOut(name, Q.Q4_1, (128, 64), lambda: quants.quantize(values, Q.Q4_1))
    path = rewrite(tiny_model, tmp_path / "q4_1.gguf", tensors=lambda t: t.update({name: q4_1}))
    message = load_error(path)
    assert_mentions(message, str(path), repr(name), "expected Q4_0, found Q4_1", "rocforge convert")


def test_norm_not_f32(tiny_model: Path, tmp_path: Path) -> None:
    name = "output_norm.weight"
    f16 = TensorOut(name, Q.F16, (64,), lambda: np.ones(64, dtype=np.float16))
    path = rewrite(tiny_model, tmp_path / "f16.gguf", tensors=lambda t: t.update({name: f16}))
    message = load_error(path)
    assert_mentions(message, str(path), repr(name), "expected F32, found F16", "rocforge convert")


def test_extra_tensor(tiny_model: Path, tmp_path: Path) -> None:
    bias = TensorOut("blk.0.attn_q.bias", Q.F32, (64,), lambda: np.zeros(64, dtype=np.float32))
    path = rewrite(
        tiny_model, tmp_path / "bias.gguf", tensors=lambda t: t.update({bias.name: bias})
    )
    message = load_error(path)
    assert_mentions(message, str(path), "'blk.0.attn_q.bias'", "extra F32 tensor", "wrong outputs")
