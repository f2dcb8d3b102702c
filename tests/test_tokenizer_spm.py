"""SentencePiece vocabularies (`tokenizer.ggml.model` = "llama") tokenize as llama.cpp does.

tests/data/spm-tiny.gguf is a SentencePiece BPE vocabulary trained for the tests, wrapped
as llama.cpp's converter would, with random tiny weights; spm-tiny.llamacpp.json holds
llama.cpp's ids, detokenized text and token pieces for it (scripts/make_spm_test_data.py
makes both; tests/data/README.md).
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model.gguf_metadata import read_metadata
from rocforge_rt.model.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
SPM_GGUF = DATA / "spm-tiny.gguf"
# Parametrization needs the reference at collection time.
_REFERENCE = json.loads((DATA / "spm-tiny.llamacpp.json").read_text(encoding="utf-8"))


def _params(cases: list[dict]) -> list:
    return [pytest.param(c, id=repr(c["text"])[:40]) for c in cases]


_CASES = _params(_REFERENCE["cases"])
_NO_PREFIX_CASES = _params(_REFERENCE["no_space_prefix"]["cases"])
_TIE_CASES = _params(_REFERENCE["ties"]["cases"])
# (ids key, decode's skip_special, detokenized-text key)
_DETOKENIZED = [
    ("ids_special", False, "ids_special_text"),
    ("ids_special", True, "ids_special_text_skip"),
    ("ids_bos_special", False, "ids_bos_special_text"),
    ("ids_bos_special", True, "ids_bos_special_text_skip"),
]


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    return read_metadata(SPM_GGUF)


@pytest.fixture(scope="module")
def tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(metadata)


def _check_encode(tokenizer: Tokenizer, case: dict) -> None:
    text = case["text"]
    assert tokenizer.encode(text, add_bos=False, parse_special=False) == case["ids"]
    assert tokenizer.encode(text, add_bos=False) == case["ids_special"]
    assert tokenizer.encode(text, add_bos=True, parse_special=False) == case["ids_bos"]
    assert tokenizer.encode(text) == case["ids_bos_special"]  # the GGUF adds BOS


def _check_decode(tokenizer: Tokenizer, case: dict) -> None:
    for ids_key, skip, text_key in _DETOKENIZED:
        assert tokenizer.decode(case[ids_key], skip_special=skip) == case[text_key]


@pytest.mark.parametrize("case", _CASES)
def test_encode_reproduces_llamacpp_ids_with_and_without_bos_and_specials(
    tokenizer: Tokenizer, case: dict
) -> None:
    _check_encode(tokenizer, case)


@pytest.mark.parametrize("case", _CASES)
def test_decode_of_encode_gives_llamacpp_detokenized_text(tokenizer: Tokenizer, case: dict) -> None:
    _check_decode(tokenizer, case)


@pytest.mark.parametrize("case", _CASES)
def test_stream_from_the_sequence_start_yields_the_decoded_text(
    tokenizer: Tokenizer, case: dict
) -> None:
    for ids_key, skip, text_key in _DETOKENIZED:
        stream = tokenizer.stream(skip_special=skip, sequence_start=True)
        pieces = [stream.push(i) for i in case[ids_key]]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + stream.flush() == case[text_key]


def test_plain_text_round_trips_through_encode_and_decode(tokenizer: Tokenizer) -> None:
    # Not quite every text: llama.cpp puts a space before the text after a user-defined
    # token (always parsed), and "▁" in a text comes back as a space.
    texts = [
        c["text"]
        for c in _REFERENCE["cases"]
        if not any(s in c["text"] for s in ("<sep>", "[MASK]", "\u2581"))
    ]
    assert len(texts) > 50
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False, parse_special=False)) == text


def test_token_pieces_are_llamacpp_pieces(tokenizer: Tokenizer) -> None:
    n_vocab = _REFERENCE["n_vocab"]
    assert tokenizer.n_vocab == n_vocab
    assert [tokenizer.token_bytes(i).hex() for i in range(n_vocab)] == _REFERENCE["pieces_hex"]
    skipped = [tokenizer.token_bytes(i, skip_special=True).hex() for i in range(n_vocab)]
    assert skipped == _REFERENCE["pieces_hex_skip"]


def test_special_ids_and_flags_come_from_the_gguf(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_id, tokenizer.eos_id) == (_REFERENCE["bos"], _REFERENCE["eos"])
    assert tokenizer.add_bos is _REFERENCE["add_bos"] is True
    assert tokenizer.add_space_prefix is True
    assert sorted(tokenizer.eog_ids) == _REFERENCE["eog"]  # </s> and <|im_end|>


def test_token_text_is_the_vocabulary_entry(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_bos=False)
    assert "".join(tokenizer.token_text(i) for i in ids) == "\u2581Hello\u2581world"
    assert tokenizer.token_text(tokenizer.bos_id) == "<s>"
    newline = tokenizer.encode("\n", add_bos=False)[-1]
    assert (tokenizer.token_text(newline), tokenizer.token_bytes(newline)) == ("<0x0A>", b"\n")


def test_a_character_missing_from_the_vocabulary_falls_back_to_its_bytes(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("🚀", add_bos=False)
    assert [tokenizer.token_text(i) for i in ids] == [
        "\u2581",
        "<0xF0>",
        "<0x9F>",
        "<0x9A>",
        "<0x80>",
    ]


def test_generated_text_keeps_the_space_of_its_first_token(tokenizer: Tokenizer) -> None:
    # A stream continues a prompt: "▁the" after a prompt prints its space, as llama.cpp
    # streams pieces; only a stream told it starts the sequence drops it, like decode.
    (the,) = tokenizer.encode("the", add_bos=False)
    assert tokenizer.token_text(the) == "\u2581the"
    assert tokenizer.stream().push(the) == " the"
    assert tokenizer.stream(sequence_start=True).push(the) == "the"
    assert tokenizer.decode([the]) == "the"


def test_chat_template_renders_and_tokenizes_its_control_tokens(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    case = next(c for c in _REFERENCE["cases"] if c["text"] == prompt)
    assert tokenizer.encode(prompt) == case["ids_bos_special"]


def test_a_chat_template_that_writes_bos_itself_gets_no_second_one(metadata) -> None:
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    tokenizer = Tokenizer.from_metadata({**metadata, "tokenizer.chat_template": template})
    messages = [{"role": "user", "content": "Hello"}]
    ids = tokenizer.encode_chat(messages)
    assert tokenizer.add_bos and ids[0] == tokenizer.bos_id != ids[1]
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=False)
    plain = Tokenizer.from_metadata(metadata)  # its template does not write BOS: added once
    assert plain.encode_chat(messages) == plain.encode(plain.apply_chat_template(messages))


@pytest.mark.parametrize("case", _NO_PREFIX_CASES)
def test_without_add_space_prefix_no_space_is_put_in_front(
    metadata: dict[str, Any], case: dict
) -> None:
    tokenizer = Tokenizer.from_metadata({**metadata, "tokenizer.ggml.add_space_prefix": False})
    _check_encode(tokenizer, case)
    _check_decode(tokenizer, case)


@pytest.mark.parametrize("case", _TIE_CASES)
def test_equal_scores_merge_the_leftmost_pair_first(case: dict) -> None:
    # No scores at all (llama.cpp reads 0): "aba" gives ab+a but "bab" ba+b, which no
    # fixed order of merge pairs can give both of.
    tokenizer = Tokenizer.from_metadata(_REFERENCE["ties"]["metadata"])
    _check_encode(tokenizer, case)
    _check_decode(tokenizer, case)


def _spoiled(metadata: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**metadata, **{f"tokenizer.ggml.{k}": v for k, v in changes.items()}}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scores": [0.0] * 10}, r"tokenizer\.ggml\.scores.*800 scores.*found 10 entries"),
        ({"scores": [float("nan")] * 800}, r"tokenizer\.ggml\.scores.*numbers.*nan.*token 0"),
        ({"token_type": [1] * 799}, r"tokenizer\.ggml\.token_type.*800 entries.*found 799"),
        ({"bos_token_id": 800}, r"tokenizer\.ggml\.bos_token_id.*\[0, 800\).*800"),
        ({"eos_token_id": -1}, r"tokenizer\.ggml\.eos_token_id.*\[0, 800\).*-1"),
        ({"unknown_token_id": 5000}, r"tokenizer\.ggml\.unknown_token_id.*5000"),
        ({"padding_token_id": 801}, r"tokenizer\.ggml\.padding_token_id.*801"),
        ({"add_space_prefix": 1}, r"tokenizer\.ggml\.add_space_prefix.*a bool.*found 1"),
    ],
    ids=["scores-short", "scores-nan", "types-short", "bos", "eos", "unk", "pad", "prefix-flag"],
)
def test_inconsistent_vocabulary_metadata_is_rejected_by_key(
    metadata: dict[str, Any], changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelFormatError, match=message):
        Tokenizer.from_metadata(_spoiled(metadata, **changes))


def test_a_missing_byte_token_is_rejected_naming_it(metadata: dict[str, Any]) -> None:
    tokens = list(metadata["tokenizer.ggml.tokens"])
    tokens[tokens.index("<0xF0>")] = "<0xF0-renamed>"
    types = list(metadata["tokenizer.ggml.token_type"])
    types[tokens.index("<0xF0-renamed>")] = 1
    with pytest.raises(ModelFormatError, match=r"byte-fallback tokens.*no '<0xF0>'"):
        Tokenizer.from_metadata(_spoiled(metadata, tokens=tokens, token_type=types))


def test_a_byte_token_with_a_malformed_text_is_rejected(metadata: dict[str, Any]) -> None:
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata["tokenizer.ggml.token_type"])
    types[tokens.index("\u2581the")] = 6
    with pytest.raises(ModelFormatError, match=r"byte tokens \(type 6\).*'<0xXX>'.*'▁the'"):
        Tokenizer.from_metadata(_spoiled(metadata, token_type=types))


def test_a_duplicate_token_text_is_rejected(metadata: dict[str, Any]) -> None:
    tokens = list(metadata["tokenizer.ggml.tokens"])
    tokens[-1] = tokens[-2]
    with pytest.raises(ModelFormatError, match=r"distinct token texts.*ids 798 and 799"):
        Tokenizer.from_metadata(_spoiled(metadata, tokens=tokens))


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "plamo2", "none"])
def test_other_tokenizer_models_are_rejected_by_name(metadata: dict[str, Any], model: str) -> None:
    with pytest.raises(ModelFormatError, match=f"tokenizer.ggml.model.*'llama'.*found '{model}'"):
        Tokenizer.from_metadata(_spoiled(metadata, model=model))


def test_generate_runs_end_to_end_on_the_cpu_backend() -> None:
    case = next(c for c in _REFERENCE["cases"] if c["text"] == "Hello world")
    done = subprocess.run(
        [
            sys.executable, "-m", "rocforge_rt.cli", "generate", "--model", str(SPM_GGUF),
            "--backend", "cpu", "--ctx-size", "128", "--prompt", case["text"],
            "--max-tokens", "4", "--temperature", "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"prompt_tokens={len(case['ids_bos_special'])} " in done.stderr
    assert "backend=cpu" in done.stderr and "generated_tokens=" in done.stderr
