"""Synthetic models: each shape's table states the real model's numbers; written files
load as the shape they name and hold weights sane for a forward pass."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from rocforge_rt.model.gguf_file import load_model_file
from rocforge_rt.model.synthetic import SHAPES, SyntheticShape, random_blocks, write_synthetic_model

Q = GGMLQuantizationType
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_synthetic_model.py"
_spec = importlib.util.spec_from_file_location("make_synthetic_model", SCRIPT)
make_synthetic_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_synthetic_model)


# name, width, layers, (heads, kv heads), head dim, ffn, vocab, token_embd, output, rope base, ctx
TABLE = [
    ("smollm2-135m", 576, 30, (9, 3), 64, 1536, 49152, Q.Q8_0, "tied", 100000.0, 8192),
    ("llama-1b", 2048, 16, (32, 8), 64, 8192, 128256, Q.Q8_0, "tied", 500000.0, 131072),
    ("llama-8b", 4096, 32, (32, 8), 128, 14336, 128256, Q.Q4_0, Q.Q4_0, 500000.0, 8192),
    ("tiny", 64, 2, (4, 2), 16, 128, 256, Q.Q8_0, Q.Q4_0, 10000.0, 256),
]


def numbers(s: SyntheticShape) -> tuple:
    """A shape in TABLE's column order."""
    heads = (s.n_head, s.n_head_kv)
    output = s.output_type or "tied"
    return (s.n_embd, s.n_layer, heads, s.head_dim_k, s.n_ff, s.n_vocab, s.embd_type, output,
            s.rope_base, s.n_ctx)  # fmt: skip


@pytest.mark.parametrize("row", TABLE, ids=[row[0] for row in TABLE])
def test_shape_table(row: tuple) -> None:
    name, *expected = row
    assert numbers(SHAPES[name]) == tuple(expected)
    assert SHAPES[name].rms_eps == 1e-5


def test_table_lists_every_shape() -> None:
    assert sorted(SHAPES) == sorted(row[0] for row in TABLE)


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m"])
def test_written_model_loads_as_its_shape(name: str, tmp_path: Path) -> None:
    path = write_synthetic_model(name, tmp_path / f"{name}.gguf", progress=False)
    model = load_model_file(path)
    s: SyntheticShape = SHAPES[name]
    hp = model.hparams
    assert (hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_vocab) == (
        s.n_embd, s.n_layer, s.n_head, s.n_head_kv, s.n_ff, s.n_vocab,
    )  # fmt: skip
    assert (hp.head_dim_k, hp.head_dim_v, hp.rope_dims) == (s.head_dim_k,) * 3
    assert (hp.n_ctx_train, hp.rope_base, hp.rms_eps) == (s.n_ctx, s.rope_base, pytest.approx(1e-5))
    assert hp.tied_embeddings == (s.output_type is None)
    assert model.tensor("token_embd.weight").ggml_type == s.embd_type
    assert model.lm_head.ggml_type == (s.output_type or s.embd_type)
    assert model.metadata["general.file_type"] == 2
    assert model.metadata["tokenizer.ggml.model"] == "none"
    assert model.metadata["llama.vocab_size"] == s.n_vocab
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.gguf"]  # no temp file left


def test_same_seed_same_file_other_seed_other_weights(tmp_path: Path) -> None:
    a = write_synthetic_model("tiny", tmp_path / "a.gguf", seed=7, progress=False)
    b = write_synthetic_model("tiny", tmp_path / "b.gguf", seed=7, progress=False)
    c = write_synthetic_model("tiny", tmp_path / "c.gguf", seed=8, progress=False)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_weights_have_unit_gain_statistics(tmp_path: Path) -> None:
    model = load_model_file(
        write_synthetic_model("smollm2-135m", tmp_path / "m.gguf", progress=False)
    )
    for t in (model.layer(0, "attn_q"), model.layer(5, "ffn_down"), model.lm_head):
        values = quants.dequantize(t.data, t.ggml_type)
        n_in = t.shape[1]
        assert abs(values.mean()) < 0.01 * n_in**-0.5, t.name
        assert values.std() == pytest.approx(n_in**-0.5, rel=0.05), t.name
    norm = model.layer(3, "ffn_norm").data
    assert norm.dtype == np.float32 and abs(norm.mean() - 1) < 0.02 and norm.min() > 0.5


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_random_blocks_are_valid_blocks_of_the_requested_std(qtype: Q) -> None:
    blocks = random_blocks(np.random.default_rng(0), 256, 512, qtype, std=0.1)
    values = quants.dequantize(blocks, qtype)
    assert values.shape == (256, 512)
    assert np.isfinite(values).all()
    assert values.std() == pytest.approx(0.1, rel=0.03)
    assert abs(values.mean()) < 0.002


def test_script_lists_shapes_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        make_synthetic_model.main(["--help"])
    help_text = capsys.readouterr().out
    for name in SHAPES:
        assert name in help_text


def test_script_writes_a_model(tmp_path: Path) -> None:
    out = tmp_path / "tiny.gguf"
    assert make_synthetic_model.main(["tiny", str(out), "--seed", "3"]) == 0
    assert load_model_file(out).hparams.n_layer == 2


def test_unknown_shape_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown synthetic shape 'llama-70b'"):
        write_synthetic_model("llama-70b", tmp_path / "x.gguf")
