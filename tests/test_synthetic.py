"""Synthetic models: each shape's table states the real model's numbers; written files
load as the shape they name and hold weights sane for a forward pass; any shape takes a
byte vocabulary, and a file with one a chat template."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from script_modules import load_script

from rocforge_rt.engine.engine import Engine
from rocforge_rt.engine.generate import Generation
from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model.gguf_file import (
    LINEAR_SUFFIXES,
    load_model_file,
    model_from_reader,
    open_gguf,
)
from rocforge_rt.model.spm import UNUSED
from rocforge_rt.model.synthetic import (
    CHATML_TEMPLATE,
    MIXES,
    SHAPES,
    VOCAB_SIZE,
    SyntheticShape,
    byte_vocabulary,
    random_blocks,
    synthetic_shape,
    write_synthetic_model,
)
from rocforge_rt.model.tokenizer import Tokenizer

Q = GGMLQuantizationType
make_synthetic_model = load_script("make_synthetic_model")


# name, width, layers, (heads, kv heads), head dim, ffn, vocab, token_embd, output, rope base, ctx
TABLE = [
    ("smollm2-135m", 576, 30, (9, 3), 64, 1536, 49152, Q.Q8_0, "tied", 100000.0, 8192),
    ("llama-1b", 2048, 16, (32, 8), 64, 8192, 128256, Q.Q8_0, "tied", 500000.0, 131072),
    ("llama-8b", 4096, 32, (32, 8), 128, 14336, 128256, Q.Q4_0, Q.Q4_0, 500000.0, 8192),
    ("tiny", 64, 2, (4, 2), 16, 128, 256, Q.Q8_0, Q.Q4_0, 10000.0, 256),
    ("tiny-k", 256, 2, (4, 2), 64, 512, 264, Q.Q8_0, Q.Q4_0, 10000.0, 256),
    ("tiny-llama3", 256, 4, (4, 2), 64, 512, 264, Q.Q8_0, "tied", 500000.0, 8192),
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


@pytest.mark.parametrize("name", ["tiny", "tiny-k", "smollm2-135m", "tiny-llama3"])
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
    assert (hp.rope_freq_factors is None) == (s.llama3_rope is None)  # rope_freqs.weight
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


def test_the_q4_k_m_mix_has_its_types_and_unit_gain_weights(q4_k_m_model: Path) -> None:
    with pytest.raises(ModelFormatError, match="expected Q4_0 .* found Q6_K"):
        load_model_file(q4_k_m_model)  # the runtime's own check: convert it first
    model = model_from_reader(q4_k_m_model, open_gguf(q4_k_m_model), check_types=False)
    assert model.metadata["general.file_type"] == 15  # MOSTLY_Q4_K_M
    assert model.metadata["general.name"] == "rocforge synthetic tiny-k q4_k_m"
    assert model.hparams.n_embd == 256 and not model.hparams.tied_embeddings
    for i in range(2):
        for suffix in LINEAR_SUFFIXES:
            expected = Q.Q6_K if suffix in ("attn_v", "ffn_down") else Q.Q4_K
            assert model.layer(i, suffix).ggml_type == expected, suffix
    assert model.tensor("token_embd.weight").ggml_type == Q.Q6_K
    assert model.tensor("output.weight").ggml_type == Q.Q6_K
    for t in (model.layer(0, "attn_q"), model.layer(1, "ffn_down"), model.lm_head):
        values = quants.dequantize(t.data, t.ggml_type)
        n_in = t.shape[1]
        assert abs(values.mean()) < 0.02 * n_in**-0.5, t.name
        assert values.std() == pytest.approx(n_in**-0.5, rel=0.05), t.name


def test_the_byte_vocabulary_encodes_and_decodes_text(q4_k_m_model: Path) -> None:
    model = model_from_reader(q4_k_m_model, open_gguf(q4_k_m_model), check_types=False)
    tokenizer = Tokenizer.from_metadata(model.metadata)
    assert tokenizer.n_vocab == model.hparams.n_vocab == VOCAB_SIZE
    ids = tokenizer.encode(" the cat, ünïcode")
    assert ids[0] == tokenizer.bos_id and tokenizer.token_text(ids[1]) == "Ġthe"
    assert tokenizer.decode(ids[1:]) == " the cat, ünïcode"
    assert tokenizer.eog_ids == frozenset()  # no EOS: generation runs to its limit


def test_a_byte_vocabulary_pads_with_unused_tokens_and_needs_room() -> None:
    vocab = byte_vocabulary(VOCAB_SIZE + 3)
    assert len(vocab["tokenizer.ggml.tokens"].value) == VOCAB_SIZE + 3
    assert vocab["tokenizer.ggml.token_type"].value[-3:] == [UNUSED] * 3
    with pytest.raises(ValueError, match=f"needs {VOCAB_SIZE} tokens, the shape has 256"):
        byte_vocabulary(256)


def test_a_mix_the_shape_cannot_hold_and_an_unknown_mix_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rows of 64 values cannot hold Q6_K blocks of 256"):
        write_synthetic_model("tiny", tmp_path / "x.gguf", mix="q4_k_m")
    with pytest.raises(ValueError, match="unknown quantization mix 'q3_k_s'"):
        write_synthetic_model("tiny-k", tmp_path / "x.gguf", mix="q3_k_s")
    assert sorted(MIXES) == ["q4_0", "q4_k_m"]
    assert not list(tmp_path.iterdir())


def test_script_writes_a_k_quant_model_with_a_vocabulary(tmp_path: Path) -> None:
    out = tmp_path / "k.gguf"
    assert make_synthetic_model.main(["tiny-k", str(out), "--mix", "q4_k_m", "--vocab"]) == 0
    model = model_from_reader(out, open_gguf(out), check_types=False)
    assert model.layer(0, "attn_q").ggml_type == Q.Q4_K
    assert model.metadata["tokenizer.ggml.model"] == "gpt2"


def test_unknown_shape_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown synthetic shape 'llama-70b'"):
        write_synthetic_model("llama-70b", tmp_path / "x.gguf")


@pytest.mark.parametrize("name", SHAPES)
def test_every_shape_takes_a_byte_vocabulary_of_at_least_its_own_size(name: str) -> None:
    """Planned, not written: llama-8b's file is 4 GB. A shape of fewer tokens than the byte
    vocabulary grows to it; one of more keeps its size (its files do not change)."""
    s = synthetic_shape(name, vocab=True)
    assert s.n_vocab == max(SHAPES[name].n_vocab, VOCAB_SIZE)
    assert replace(s, n_vocab=SHAPES[name].n_vocab) == SHAPES[name]  # nothing else changes
    assert len(byte_vocabulary(s.n_vocab)["tokenizer.ggml.tokens"].value) == s.n_vocab
    assert synthetic_shape(name) == SHAPES[name]  # without a vocabulary, the shape's own


@pytest.mark.parametrize("name", [name for name in SHAPES if name.startswith("tiny")])
def test_a_small_shape_with_a_byte_vocabulary_loads_and_tokenizes(
    name: str, tmp_path: Path
) -> None:
    path = write_synthetic_model(name, tmp_path / "v.gguf", seed=1, progress=False, vocab=True)
    model = load_model_file(path)
    tokenizer = Tokenizer.from_metadata(model.metadata)
    n_vocab = max(SHAPES[name].n_vocab, VOCAB_SIZE)
    assert tokenizer.n_vocab == model.hparams.n_vocab == model.metadata["llama.vocab_size"]
    assert model.tensor("token_embd.weight").shape[0] == model.lm_head.shape[0] == n_vocab
    assert tokenizer.decode(tokenizer.encode(" the cat")[1:]) == " the cat"


def test_a_chat_template_renders_a_chat_prompt_that_generates_on_the_cpu(tmp_path: Path) -> None:
    path = write_synthetic_model(
        "tiny", tmp_path / "c.gguf", progress=False, vocab=True, chat_template=CHATML_TEMPLATE
    )
    model = load_model_file(path)
    assert model.metadata["tokenizer.chat_template"] == CHATML_TEMPLATE
    tokenizer = Tokenizer.from_metadata(model.metadata)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.encode_chat(messages) == tokenizer.encode(prompt)  # BOS, then the text
    engine = Engine.load(model, backend="cpu", n_ctx=128, threads=1)
    generation = Generation(engine, tokenizer.encode_chat(messages), max_tokens=4)
    list(generation)
    assert generation.stats.generated_tokens == 4


def test_a_chat_template_needs_a_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="a chat template needs a vocabulary"):
        write_synthetic_model("tiny", tmp_path / "x.gguf", chat_template=CHATML_TEMPLATE)
    with pytest.raises(SystemExit) as exit_info:
        make_synthetic_model.main(["tiny", str(tmp_path / "x.gguf"), "--chat-template", "chatml"])
    assert exit_info.value.code == 2
    assert "--chat-template needs --vocab" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_script_takes_a_chat_template_by_preset_file_or_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    literal = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(literal, encoding="utf-8")
    for given, expected in [
        ("chatml", CHATML_TEMPLATE),
        (literal, literal),
        (f"@{tmp_path}/t.jinja", literal),
    ]:
        out = tmp_path / "m.gguf"
        assert (
            make_synthetic_model.main(["tiny", str(out), "--vocab", "--chat-template", given]) == 0
        )
        assert load_model_file(out).metadata["tokenizer.chat_template"] == expected, given
    with pytest.raises(SystemExit) as exit_info:
        make_synthetic_model.main(
            ["tiny", str(out), "--vocab", "--chat-template", "@missing.jinja"]
        )
    assert exit_info.value.code == 2
    assert "cannot read missing.jinja" in capsys.readouterr().err
