"""convert_to_q4_0: linear weights of any supported type become the Q4_0 that
gguf.quants makes of their f32 values; everything else is kept; the write is atomic."""

from functools import partial
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValue, GGUFValueType, quants

from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model import convert, default_model
from rocforge_rt.model.convert import convert_to_q4_0
from rocforge_rt.model.gguf_file import (
    LINEAR_SUFFIXES,
    ModelFile,
    TensorOut,
    WeightTensor,
    copy_metadata,
    load_model_file,
    model_from_reader,
    open_gguf,
    write_gguf,
)

Q = GGMLQuantizationType
EXTRA_METADATA = {
    "general.description": GGUFValue("tiny — test model", GGUFValueType.STRING),
    "general.tags": GGUFValue(["a", "b c", "ü"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    "tokenizer.ggml.token_type": GGUFValue([1, 3, 6], GGUFValueType.ARRAY, GGUFValueType.INT32),
    "tokenizer.ggml.scores": GGUFValue([0.5, -1.25], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    "tokenizer.ggml.add_bos_token": GGUFValue(True, GGUFValueType.BOOL),
    "tokenizer.ggml.bos_token_id": GGUFValue(1, GGUFValueType.UINT32),
}
N_LINEAR = 2 * len(LINEAR_SUFFIXES) + 1  # tiny: 2 layers and an untied output.weight


def as_f32(t: WeightTensor) -> np.ndarray:
    return quants.dequantize(t.data.view(np.uint8), t.ggml_type).reshape(t.shape)


def is_linear(name: str) -> bool:
    return name == "output.weight" or name.split(".")[-2] in LINEAR_SUFFIXES


def unchecked(path: Path) -> ModelFile:
    """A model whose tensor types need not be the runtime's (a conversion source)."""
    return model_from_reader(path, open_gguf(path), check_types=False)


def retyped(
    tiny: Path, dst: Path, linear: Q, embd: Q = Q.Q8_0, *, arch: str = "llama", norm: Q = Q.F32
) -> Path:
    """The tiny model with its linear weights, token_embd and norms stored as other types,
    plus string, array and bool metadata for a conversion to carry over."""
    model = load_model_file(tiny)
    metadata = copy_metadata(open_gguf(tiny)) | EXTRA_METADATA
    metadata["general.architecture"] = GGUFValue(arch, GGUFValueType.STRING)

    def stored_as(t: WeightTensor) -> TensorOut:
        qtype = linear if is_linear(t.name) else embd if t.name == "token_embd.weight" else norm
        if qtype == t.ggml_type:
            return TensorOut(t.name, qtype, t.shape, partial(np.asarray, t.data))
        return TensorOut(t.name, qtype, t.shape, partial(quants.quantize, as_f32(t), qtype))

    tensors = [stored_as(t) for t in model.tensors.values()]
    return write_gguf(dst, metadata, tensors, progress=False)


@pytest.mark.parametrize("linear_type", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_1])
def test_linear_weights_become_the_q4_0_of_their_f32_values(
    tiny_model: Path, tmp_path: Path, linear_type: Q
) -> None:
    src = unchecked(retyped(tiny_model, tmp_path / "src.gguf", linear_type))
    out = load_model_file(convert_to_q4_0(src.path, tmp_path / "out.gguf", progress=False))
    linear = [name for name in out.tensors if is_linear(name)]
    assert len(linear) == N_LINEAR
    for name in linear:
        assert src.tensors[name].ggml_type == linear_type
        assert out.tensors[name].ggml_type == Q.Q4_0
        expected = quants.quantize(as_f32(src.tensors[name]), Q.Q4_0)
        np.testing.assert_array_equal(out.tensors[name].data, expected, err_msg=name)


def test_q4_0_weights_embeddings_and_norms_are_copied_unchanged(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = load_model_file(convert_to_q4_0(tiny_model, tmp_path / "out.gguf", progress=False))
    src = load_model_file(tiny_model)
    assert list(out.tensors) == list(src.tensors)  # order kept
    for name, t in src.tensors.items():
        assert out.tensors[name].ggml_type == t.ggml_type
        np.testing.assert_array_equal(out.tensors[name].data, t.data, err_msg=name)


@pytest.mark.parametrize(
    ("embd_type", "out_type"),
    [(Q.Q8_0, Q.Q8_0), (Q.F16, Q.F16), (Q.F32, Q.F32), (Q.Q4_1, Q.Q8_0), (Q.BF16, Q.Q8_0)],
)
def test_token_embd_is_kept_unless_q4_1_or_bf16(
    tiny_model: Path, tmp_path: Path, embd_type: Q, out_type: Q
) -> None:
    src = unchecked(retyped(tiny_model, tmp_path / "src.gguf", Q.F16, embd_type))
    out = load_model_file(convert_to_q4_0(src.path, tmp_path / "out.gguf", progress=False))
    embd = out.tensor("token_embd.weight")
    assert embd.ggml_type == out_type
    src_embd = src.tensor("token_embd.weight")
    expected = (
        src_embd.data if out_type == embd_type else quants.quantize(as_f32(src_embd), out_type)
    )
    np.testing.assert_array_equal(embd.data, expected)


def test_f16_norms_become_f32(tiny_model: Path, tmp_path: Path) -> None:
    src = unchecked(retyped(tiny_model, tmp_path / "src.gguf", Q.Q4_0, norm=Q.F16))
    out = load_model_file(convert_to_q4_0(src.path, tmp_path / "out.gguf", progress=False))
    norm = out.tensor("output_norm.weight")
    assert norm.ggml_type == Q.F32
    np.testing.assert_array_equal(norm.data, src.tensor("output_norm.weight").data)


def test_metadata_is_copied_with_its_types_and_file_type_becomes_q4_0(
    tiny_model: Path, tmp_path: Path
) -> None:
    src_path = retyped(tiny_model, tmp_path / "src.gguf", Q.Q4_1)
    out_path = convert_to_q4_0(src_path, tmp_path / "out.gguf", progress=False)
    src, out = GGUFReader(src_path), GGUFReader(out_path)
    assert list(out.fields) == list(src.fields)
    for key, field in src.fields.items():
        if key != "general.file_type":
            assert out.fields[key].types == field.types, key
            assert out.fields[key].contents() == field.contents(), key
    assert out.fields["general.file_type"].contents() == 2
    metadata = load_model_file(out_path).metadata
    assert metadata["general.tags"] == ["a", "b c", "ü"]
    assert metadata["general.description"] == "tiny — test model"


def test_unsupported_tensor_type_is_rejected_before_writing(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = retyped(tiny_model, tmp_path / "src.gguf", Q.Q5_0)
    dst = tmp_path / "out.gguf"
    with pytest.raises(ModelFormatError) as info:
        convert_to_q4_0(src, dst, progress=False)
    message = str(info.value)
    for part in (str(src), "'blk.0.attn_q.weight'", "found Q5_0", "Q4_1"):
        assert part in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


def test_invalid_source_is_rejected_before_writing(tiny_model: Path, tmp_path: Path) -> None:
    src = retyped(tiny_model, tmp_path / "src.gguf", Q.Q4_1, arch="gpt2")
    with pytest.raises(ModelFormatError, match="expected 'llama', found 'gpt2'"):
        convert_to_q4_0(src, tmp_path / "out.gguf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


class InterruptedQuantizer:
    """gguf.quants.quantize that raises KeyboardInterrupt on its `at`-th call."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.real = at, 0, quants.quantize

    def __call__(self, data: np.ndarray, qtype: Q) -> np.ndarray:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.real(data, qtype)


def test_interrupted_conversion_leaves_no_output_and_no_temp_file(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = retyped(tiny_model, tmp_path / "src.gguf", Q.F32)
    quantizer = InterruptedQuantizer(at=N_LINEAR // 2)
    monkeypatch.setattr(convert.quants, "quantize", quantizer)
    with pytest.raises(KeyboardInterrupt):
        convert_to_q4_0(src, tmp_path / "out.gguf", progress=False)
    assert quantizer.calls == N_LINEAR // 2  # midway through the tensors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


def test_interrupted_conversion_keeps_the_previous_output(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = retyped(tiny_model, tmp_path / "src.gguf", Q.F32)
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"previous")
    monkeypatch.setattr(convert.quants, "quantize", InterruptedQuantizer(at=1))
    with pytest.raises(KeyboardInterrupt):
        convert_to_q4_0(src, dst, progress=False)
    assert dst.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf", "src.gguf"]


def test_ensure_default_model_converts_once_and_rebuilds_a_broken_file(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_model, "source_gguf_path", lambda models_dir: tiny_model)
    path = default_model.ensure_default_model(tmp_path, progress=False)
    assert path == default_model.default_model_path(tmp_path)
    load_model_file(path)
    stamp = path.stat().st_mtime_ns
    assert default_model.ensure_default_model(tmp_path, progress=False) == path
    assert path.stat().st_mtime_ns == stamp  # a valid model is not converted again
    path.write_bytes(b"broken")
    default_model.ensure_default_model(tmp_path, progress=False)
    load_model_file(path)


@pytest.mark.slow
def test_real_smollm2_converts_to_a_loadable_q4_0_model(source_gguf: Path, tmp_path: Path) -> None:
    out = load_model_file(convert_to_q4_0(source_gguf, tmp_path / "smollm2.gguf", progress=False))
    src = unchecked(source_gguf)
    assert out.hparams == src.hparams
    assert out.hparams.tied_embeddings
    linear = [t for t in out.tensors.values() if is_linear(t.name)]
    assert len(linear) == 30 * len(LINEAR_SUFFIXES)
    assert {t.ggml_type for t in linear} == {Q.Q4_0}
    assert out.tensor("token_embd.weight").ggml_type == Q.Q8_0
    assert out.metadata["general.file_type"] == 2
    assert out.metadata["tokenizer.ggml.tokens"] == src.metadata["tokenizer.ggml.tokens"]
    assert out.metadata["tokenizer.ggml.merges"] == src.metadata["tokenizer.ggml.merges"]
