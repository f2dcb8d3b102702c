"""The GGUF tokenizer reproduces llama.cpp's token ids and detokenizes UTF-8 safely."""

import json
from pathlib import Path
from typing import Any

import pytest

from rocforge_rt.engine.session import Session
from rocforge_rt.engine.stopping import FinishReason
from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model.gguf_metadata import read_metadata
from rocforge_rt.model.tokenizer import Tokenizer
from rocforge_rt.step.sampling import SampledToken

# Parametrization needs the reference at collection time (the `reference` fixture is the same file).
_REFERENCE = json.loads(
    (Path(__file__).parent / "data" / "smollm2-135m-q4_0.llamacpp.json").read_text()
)
_TOKENIZE = [(e["text"], e["ids"]) for e in _REFERENCE["tokenize"]]
_PROMPTS = [(c["prompt"], c["ids"]) for c in _REFERENCE["cases"]]

# llama.cpp (llama-cpp-python 0.3.36) ids for the SmolLM2 vocabulary re-labelled with other
# `tokenizer.ggml.pre` values: the same vocabulary, split by each pre-tokenizer's regexes.
_CODE = "def f(x):\n    return {'a': x}  \n\n"
_PROSE = '(hello) "world".\n\n  end;\n'
_OTHER_PRE_TOKENIZERS = [
    ("gpt-2", _CODE, [1604, 275, 24, 104, 727, 472, 1003, 7353, 81, 1539, 1792, 109, 256, 1116]),
    ("gpt-2", _PROSE, [24, 28120, 25, 476, 6693, 2227, 8866, 1112, 43, 198]),
    (
        "llama-bpe",
        _CODE,
        [1604, 275, 24, 104, 727, 198, 333, 1003, 7353, 81, 1539, 1792, 109, 256, 1116],
    ),
    ("llama-bpe", _PROSE, [24, 28120, 25, 476, 6693, 2227, 1116, 216, 1112, 43, 198]),
    (
        "default",
        _CODE,
        [1604, 275, 24, 104, 727, 472, 1003, 216, 34026, 81, 1539, 1792, 109, 256, 1116],
    ),
    ("default", _PROSE, [24, 28120, 25, 216, 18, 6693, 2227, 8866, 1112, 43, 198]),
]


@pytest.fixture(scope="module")
def metadata(source_gguf: Path) -> dict[str, Any]:
    return read_metadata(source_gguf)


@pytest.fixture(scope="module")
def tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(metadata)


@pytest.mark.parametrize(("text", "ids"), _TOKENIZE, ids=[repr(t)[:30] for t, _ in _TOKENIZE])
def test_encode_reproduces_llamacpp_ids_for_reference_strings(
    tokenizer: Tokenizer, text: str, ids: list[int]
) -> None:
    assert tokenizer.encode(text) == ids


@pytest.mark.parametrize(("prompt", "ids"), _PROMPTS, ids=[repr(p)[:30] for p, _ in _PROMPTS])
def test_encode_reproduces_llamacpp_ids_for_reference_prompts(
    tokenizer: Tokenizer, prompt: str, ids: list[int]
) -> None:
    assert tokenizer.encode(prompt) == ids


@pytest.mark.parametrize("text", [t for t, _ in _TOKENIZE + _PROMPTS])
def test_decode_inverts_encode(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_control_tokens_in_text_become_their_ids_when_parsing_specials(
    tokenizer: Tokenizer,
) -> None:
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2


def test_control_tokens_in_text_are_plain_text_when_not_parsing_specials(
    tokenizer: Tokenizer,
) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tokenizer.encode(text, parse_special=False)
    assert not {0, 1, 2} & set(ids)
    assert tokenizer.decode(ids) == text


def test_bos_follows_the_gguf_flag_unless_asked(tokenizer: Tokenizer) -> None:
    assert tokenizer.add_bos is False
    assert tokenizer.encode("Hello") == [19556]
    assert tokenizer.encode("Hello", add_bos=True) == [1, 19556]


def test_special_ids_come_from_the_gguf(tokenizer: Tokenizer) -> None:
    assert (tokenizer.n_vocab, tokenizer.bos_id, tokenizer.eos_id) == (49152, 1, 2)


def test_eog_ids_contain_im_end_and_endoftext(tokenizer: Tokenizer) -> None:
    assert {0, 2} <= tokenizer.eog_ids
    assert 1 not in tokenizer.eog_ids


def test_token_bytes_undo_the_byte_level_alphabet_and_keep_control_text(
    tokenizer: Tokenizer,
) -> None:
    assert tokenizer.token_text(216) == "Ġ"
    assert tokenizer.token_bytes(216) == b" "
    assert tokenizer.token_bytes(10813) == "🚀".encode()[:2]
    assert tokenizer.token_bytes(1) == b"<|im_start|>"


def test_decode_can_skip_control_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tokenizer.decode(ids, skip_special=True) == "assistant\nHi"


def test_out_of_range_token_id_is_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="49152"):
        tokenizer.token_bytes(49152)


def test_character_missing_from_the_vocabulary_is_dropped_without_merging_around_it(
    tokenizer: Tokenizer,
) -> None:
    # llama.cpp keeps the unknown byte as a barrier, then drops it: "*" and ")" stay apart.
    assert tokenizer.encode("*)") == [45106]
    assert tokenizer.encode("p*\x1d)") == [96, 26, 25]


def test_text_stream_never_emits_half_a_character(tokenizer: Tokenizer) -> None:
    text = "🚀 ünïcödé"
    ids = tokenizer.encode(text)
    stream = tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    assert "" in pieces  # the rocket's four bytes span three tokens
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == tokenizer.decode(ids) == text


def test_text_stream_flush_drops_a_dangling_partial_character(tokenizer: Tokenizer) -> None:
    stream = tokenizer.stream()
    assert stream.push(10813) == ""  # first two bytes of a four-byte character
    assert stream.flush() == ""  # never completed: dropped, not sent as U+FFFD
    assert stream.push(19556) == "Hello"


def test_a_turn_cut_by_max_tokens_mid_character_does_not_end_with_a_replacement(
    tokenizer: Tokenizer,
) -> None:
    rocket = tokenizer.encode("🚀")
    assert len(rocket) > 1  # four bytes over several tokens
    session = Session(0, 0, n_ctx=64, eog_ids=tokenizer.eog_ids, stream=tokenizer.stream())
    session.start_turn([19556], sampler=None, stops=(), max_new_tokens=len(rocket) - 1)
    events = [session.accept(SampledToken(t, 0.0, ())) for t in rocket[:-1]]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert "".join(e.text for e in events) == ""


@pytest.mark.parametrize(("pre", "text", "ids"), _OTHER_PRE_TOKENIZERS)
def test_other_pre_tokenizers_reproduce_llamacpp_ids(
    metadata: dict[str, Any], pre: str, text: str, ids: list[int]
) -> None:
    tokenizer = Tokenizer.from_metadata({**metadata, "tokenizer.ggml.pre": pre})
    assert tokenizer.encode(text) == ids


def test_llama3_pre_tokenizer_adds_bos_when_the_gguf_has_no_flag(
    metadata: dict[str, Any],
) -> None:
    plain = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer.from_metadata({**plain, "tokenizer.ggml.pre": "llama-bpe"}).add_bos
    assert not Tokenizer.from_metadata(plain).add_bos


def test_unknown_pre_tokenizer_is_rejected_by_name(metadata: dict[str, Any]) -> None:
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.pre.*'no-such-pre'"):
        Tokenizer.from_metadata({**metadata, "tokenizer.ggml.pre": "no-such-pre"})


def test_unsupported_tokenizer_model_is_rejected_by_name(metadata: dict[str, Any]) -> None:
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.model.*found 't5'"):
        Tokenizer.from_metadata({**metadata, "tokenizer.ggml.model": "t5"})


def test_token_types_not_matching_the_vocabulary_are_rejected(metadata: dict[str, Any]) -> None:
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.token_type.*49152.*found 3"):
        Tokenizer.from_metadata({**metadata, "tokenizer.ggml.token_type": [1, 1, 1]})
