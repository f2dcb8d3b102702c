"""The tokenizer of a GGUF file, built from its own metadata, matching llama.cpp's ids.

Two vocabulary kinds (`tokenizer.ggml.model`) are supported; any other (e.g. "bert",
"t5", "rwkv", "plamo2") is refused by name:

- "gpt2", byte-level BPE (SmolLM2, Llama 3), with the pre-tokenizers below. Each
  reproduces the regex split llama.cpp uses for the `tokenizer.ggml.pre` names listed
  with it (llama-vocab.cpp), expressed with the HF `tokenizers` library, which then does
  the BPE merges exactly as llama.cpp does, with the GIL released.
- "llama", SentencePiece (Llama 2, TinyLlama, Mistral): tokens, scores and types with
  byte fallback, encoded by `spm.SpmEncoder`, which runs llama.cpp's merge order itself
  (spm.py says why no HF `tokenizers` model reproduces it).

One class, `Tokenizer`, serves both: encode, decode, streaming decode, token texts,
special tokens and the chat template.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from tokenizers import AddedToken, Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model.chat import render_chat
from rocforge_rt.model.spm import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    SpmEncoder,
    check_scores,
    spm_piece,
)

# Tokens that end a generation by name; llama.cpp also forces them to be control tokens.
EOG_TOKEN_NAMES = frozenset(
    {
        "<|im_end|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
    }
)

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(*, use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _isolate(*patterns: str) -> list[pre_tokenizers.PreTokenizer]:
    return [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]


@dataclass(frozen=True)
class _PreTokenizerFamily:
    """One llama.cpp pre-tokenizer type: its regex split and the flags it implies."""

    names: frozenset[str]
    build: Callable[[], pre_tokenizers.PreTokenizer]
    ignore_merges: bool = False
    default_add_bos: bool = False


_FAMILIES = (
    # \p{N} one by one, then the GPT-2 pattern.
    _PreTokenizerFamily(
        frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}),
        lambda: pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _byte_level(use_regex=True)]
        ),
    ),
    # The GPT-2 pattern alone.
    _PreTokenizerFamily(
        frozenset({"gpt-2", "phi-2", "mpt", "olmo", "jais"}),
        lambda: _byte_level(use_regex=True),
    ),
    # Llama 3: digits in groups of up to three; whole words found in the vocabulary win.
    _PreTokenizerFamily(
        frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"}),
        lambda: pre_tokenizers.Sequence([*_isolate(_LLAMA3_PATTERN), _byte_level(use_regex=False)]),
        ignore_merges=True,
        default_add_bos=True,
    ),
    # llama.cpp's fallback: punctuation runs, GPT-2, number runs, then 3-digit groups.
    _PreTokenizerFamily(
        frozenset({"default"}),
        lambda: pre_tokenizers.Sequence(
            [
                *_isolate(r"[\p{P}\$\+<=>\^~\|]+", _GPT2_PATTERN, r"\p{N}+", "[0-9][0-9][0-9]"),
                _byte_level(use_regex=False),
            ]
        ),
    ),
)
_FAMILY_BY_NAME = {name: family for family in _FAMILIES for name in family.names}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(0x100 + extra)
    return {c: b for b, c in chars.items()}


_ALPHABET = _byte_level_alphabet()
# the vocabulary entry of each byte 0..255 in a byte-level BPE vocabulary ('Ġ' for b' ')
BYTE_LEVEL_CHARS = tuple(sorted(_ALPHABET, key=_ALPHABET.__getitem__))
_ALPHABET_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _ALPHABET.items()})


def _byte_level_decode(text: str) -> bytes:
    """The bytes a byte-level BPE token stands for (a foreign character stays as its UTF-8)."""
    try:
        return text.translate(_ALPHABET_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(
            bytes([_ALPHABET[c]]) if c in _ALPHABET else c.encode("utf-8") for c in text
        )


def _require(metadata: Mapping[str, Any], key: str, kind: type, expected: str) -> Any:
    value = metadata.get(key)
    if not isinstance(value, kind):
        found = "missing" if value is None else f"{type(value).__name__} {value!r:.80}"
        raise ModelFormatError(f"GGUF key {key!r}: expected {expected}, found {found}")
    return value


def _optional_id(metadata: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_vocab:
        raise ModelFormatError(
            f"GGUF key {key!r}: expected a token id in [0, {n_vocab}), found {value!r}"
        )
    return value


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after the first character.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ModelFormatError(
            f"GGUF key 'tokenizer.ggml.merges': expected 'left right' pairs, found {merge!r}"
        )
    return merge[:cut], merge[cut + 1 :]


class _ByteLevelBpe:
    """Byte-level BPE encoding through the HF `tokenizers` library."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        family: _PreTokenizerFamily,
    ) -> None:
        self._tokens = list(tokens)
        self._types = list(token_types)
        self._family = family
        vocab = {text: i for i, text in enumerate(tokens)}
        # A character missing from the vocabulary must stay a symbol that merges with
        # nothing and is then dropped, as in llama.cpp; HF would drop it before merging.
        # It becomes an "unknown" placeholder one past the vocabulary, removed in encode().
        self._missing_id = len(tokens)
        placeholder = "\x00missing"
        while placeholder in vocab:
            placeholder += "\x00"
        vocab[placeholder] = self._missing_id
        pairs = [_split_merge(m) for m in merges]
        try:
            model = models.BPE(
                vocab, pairs, unk_token=placeholder, ignore_merges=family.ignore_merges
            )
        except Exception as exc:
            raise ModelFormatError(
                f"GGUF key 'tokenizer.ggml.merges': expected merges of tokens in the "
                f"vocabulary, found an inconsistency ({exc})"
            ) from exc
        self._hf = self._build_hf(model)

    @staticmethod
    def piece(text: str, kind: int) -> bytes:
        # llama.cpp's token_to_piece for BPE: normal tokens are byte-level text, special
        # and user-defined tokens print their text, anything else prints nothing.
        if kind == NORMAL:
            return _byte_level_decode(text)
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            return text.encode("utf-8")
        return b""

    def _build_hf(self, model: models.BPE, *, parse_special: bool = True) -> HFTokenizer:
        hf = HFTokenizer(model)
        hf.pre_tokenizer = self._family.build()
        # Control and unknown tokens are matched in text only when parsing specials;
        # user-defined tokens always are (llama.cpp's tokenizer_st_partition).
        hf.add_tokens(
            [
                AddedToken(text, special=kind != USER_DEFINED, normalized=False)
                for text, kind in zip(self._tokens, self._types, strict=True)
                if kind in (CONTROL, UNKNOWN, USER_DEFINED)
            ]
        )
        hf.encode_special_tokens = not parse_special
        return hf

    @cached_property
    def _hf_plain(self) -> HFTokenizer:
        """A twin that treats control tokens in text as plain text (built on first use)."""
        return self._build_hf(self._hf.model, parse_special=False)

    def encode(self, text: str, *, parse_special: bool) -> list[int]:
        # The library's batch call releases the GIL (its single-text call holds it).
        hf = self._hf if parse_special else self._hf_plain
        (encoding,) = hf.encode_batch([text], add_special_tokens=False)
        return [i for i in encoding.ids if i != self._missing_id]


class _Encoder(Protocol):
    def encode(self, text: str, *, parse_special: bool) -> list[int]: ...


def _token_list(metadata: Mapping[str, Any]) -> list[str]:
    tokens = _require(metadata, "tokenizer.ggml.tokens", list, "a list of strings")
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelFormatError(
            "GGUF key 'tokenizer.ggml.tokens': expected a non-empty list of strings"
        )
    # llama.cpp gives an empty token a unique placeholder text.
    return [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def _token_types(metadata: Mapping[str, Any], n_vocab: int) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type", [NORMAL] * n_vocab)
    if not isinstance(types, list) or len(types) != n_vocab:
        found = len(types) if isinstance(types, list) else type(types).__name__
        raise ModelFormatError(
            f"GGUF key 'tokenizer.ggml.token_type': expected {n_vocab} entries "
            f"(one per token), found {found}"
        )
    bad = [t for t in types if not isinstance(t, int) or not NORMAL <= t <= BYTE]
    if bad:
        raise ModelFormatError(
            f"GGUF key 'tokenizer.ggml.token_type': expected types 1..6, found {bad[0]!r}"
        )
    return types


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise ModelFormatError(f"GGUF key {key!r}: expected a bool, found {value!r}")
    return value


# llama.cpp's SentencePiece defaults where the GGUF names no id (BPE has none).
_SPM_DEFAULT_IDS = {"unknown": 0, "bos": 1, "eos": 2}


class Tokenizer:
    """A GGUF's tokenizer (byte-level BPE or SentencePiece), reproducing llama.cpp's."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        pieces: Sequence[bytes],
        encoder: _Encoder,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        eog_ids: frozenset[int],
        chat_template: str | None,
        add_space_prefix: bool = False,
    ) -> None:
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.eog_ids = eog_ids
        self.chat_template = chat_template
        self.add_space_prefix = add_space_prefix
        self._tokens = list(tokens)
        self._pieces = list(pieces)
        self._encoder = encoder
        self._hidden_when_skipping = frozenset(
            i for i, kind in enumerate(token_types) if kind in (CONTROL, UNKNOWN)
        )

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from `read_metadata()` output; ModelFormatError if unsupported or malformed."""
        model = _require(metadata, "tokenizer.ggml.model", str, "a string")
        if model not in ("gpt2", "llama"):
            raise ModelFormatError(
                f"GGUF key 'tokenizer.ggml.model': expected 'gpt2' (byte-level BPE) or "
                f"'llama' (SentencePiece), found {model!r}; this tokenizer model is not "
                f"supported"
            )
        family = None
        if model == "gpt2":
            pre = metadata.get("tokenizer.ggml.pre") or "default"  # llama.cpp's fallback
            family = _FAMILY_BY_NAME.get(pre) if isinstance(pre, str) else None
            if family is None:
                raise ModelFormatError(
                    f"GGUF key 'tokenizer.ggml.pre': expected one of {sorted(_FAMILY_BY_NAME)}, "
                    f"found {pre!r}; this pre-tokenizer is not supported"
                )
        tokens = _token_list(metadata)
        n_vocab = len(tokens)
        types = _token_types(metadata, n_vocab)
        if family is not None:
            merges = _require(metadata, "tokenizer.ggml.merges", list, "a list of strings")
            if not all(isinstance(m, str) for m in merges):
                raise ModelFormatError(
                    "GGUF key 'tokenizer.ggml.merges': expected a list of strings"
                )
            scores, defaults = [], {}
        else:
            scores = check_scores(metadata.get("tokenizer.ggml.scores"), n_vocab)
            defaults = _SPM_DEFAULT_IDS

        def token_id(name: str) -> int | None:
            key = f"tokenizer.ggml.{name}_token_id"
            if key in metadata:
                return _optional_id(metadata, key, n_vocab)
            default = defaults.get(name)
            return default if default is not None and default < n_vocab else None

        bos_id = token_id("bos")
        eos_id = token_id("eos")
        add_bos = _flag(
            metadata,
            "tokenizer.ggml.add_bos_token",
            True if family is None else family.default_add_bos,
        )
        if add_bos and bos_id is None:
            raise ModelFormatError(
                "GGUF key 'tokenizer.ggml.bos_token_id': expected a BOS id because "
                "'tokenizer.ggml.add_bos_token' is true, found none"
            )

        eog = {eos_id, token_id("eot"), token_id("eom")}
        named_eog = {i for i, text in enumerate(tokens) if text in EOG_TOKEN_NAMES}
        types = [CONTROL if i in named_eog else t for i, t in enumerate(types)]
        template = metadata.get("tokenizer.chat_template")
        specials = {
            "bos_id": bos_id,
            "eos_id": eos_id,
            "add_bos": add_bos,
            "eog_ids": frozenset((eog | named_eog) - {None}),
            "chat_template": template if isinstance(template, str) and template else None,
        }
        if family is not None:
            pieces = [_ByteLevelBpe.piece(t, k) for t, k in zip(tokens, types, strict=True)]
            bpe = _ByteLevelBpe(tokens, types, merges, family)
            return cls(tokens, types, pieces, bpe, **specials)
        for name in ("unknown", "padding"):  # unused for encoding; checked all the same
            token_id(name)
        add_space_prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", True)
        spm = SpmEncoder(tokens, types, scores, add_space_prefix=add_space_prefix)
        pieces = [spm_piece(t, k) for t, k in zip(tokens, types, strict=True)]
        return cls(tokens, types, pieces, spm, add_space_prefix=add_space_prefix, **specials)

    def encode(
        self, text: str, *, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`; `add_bos` None follows the GGUF's add_bos_token flag.

        A byte-level BPE vocabulary is tokenized with the GIL released (the library's
        batch call), so other threads run meanwhile; a SentencePiece one in Python
        (spm.py), in short steps over cached pieces."""
        ids = self._encoder.encode(text, parse_special=parse_special)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ValueError("a BOS token was requested but this GGUF defines none")
            ids.insert(0, self.bos_id)
        return ids

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.n_vocab})")
        return token_id

    def token_bytes(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """The raw bytes a token stands for; control tokens give their text, or nothing
        with `skip_special` (llama.cpp's token_to_piece)."""
        token_id = self._check(token_id)
        if skip_special and token_id in self._hidden_when_skipping:
            return b""
        return self._pieces[token_id]

    def token_text(self, token_id: int) -> str:
        """The token's entry in the GGUF vocabulary ('Ġthe' byte-level, '▁the' SentencePiece)."""
        return self._tokens[self._check(token_id)]

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 replaced); `skip_special` drops control tokens.

        As llama.cpp's detokenizer, a vocabulary with add_space_prefix (SentencePiece)
        drops one leading space of the first token: the one encode put before the text.
        """
        data = [self.token_bytes(i, skip_special=skip_special) for i in ids]
        if data and self.add_space_prefix and data[0][:1] == b" ":
            data[0] = data[0][1:]
        return b"".join(data).decode("utf-8", errors="replace")

    def stream(self, *, skip_special: bool = False, sequence_start: bool = False) -> TextStream:
        """A UTF-8-safe incremental detokenizer over this vocabulary.

        `sequence_start`: the ids begin a sequence (as encode returns them), so the first
        one drops the space add_space_prefix put there, as `decode` does. Generated text
        continues a prompt: its first token keeps its space, as llama.cpp streams it."""
        return TextStream(self, skip_special=skip_special, sequence_start=sequence_start)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` with the GGUF's chat template (ValueError if it has none)."""
        if self.chat_template is None:
            raise ValueError("this GGUF has no 'tokenizer.chat_template' to render messages with")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token="" if self.bos_id is None else self._tokens[self.bos_id],
            eos_token="" if self.eos_id is None else self._tokens[self.eos_id],
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of `messages` rendered by the chat template. BOS is added as the GGUF says,
        unless the template put it first already (Llama 2, Mistral and Llama 3 templates begin
        with `{{ bos_token }}`): one BOS, as HF's and vLLM's chat prompts have, where
        llama.cpp gives two and warns."""
        text = self.apply_chat_template(messages)
        bos = None if self.bos_id is None else self._tokens[self.bos_id]
        return self.encode(text, add_bos=False if bos and text.startswith(bos) else None)


class TextStream:
    """Incremental detokenizer: emits only complete characters, holding back split ones."""

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special: bool = False, sequence_start: bool = False
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._strip_space = sequence_start and tokenizer.add_space_prefix
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def push(self, token_id: int) -> str:
        """Add one token; return the characters it completes (possibly '')."""
        data = self._tokenizer.token_bytes(token_id, skip_special=self._skip_special)
        if self._strip_space:
            self._strip_space = False
            if data[:1] == b" ":
                data = data[1:]
        return self._decoder.decode(data)

    def flush(self) -> str:
        """End the stream (its turn is over) and start afresh; returns the text held back.

        Only an incomplete character can be held back (`push` releases every complete
        one), and a turn that ends inside a character (cut by max_tokens, say) will never
        complete it: those bytes are dropped, not sent as U+FFFD. So this returns ''.
        """
        self._decoder.reset()
        return ""
