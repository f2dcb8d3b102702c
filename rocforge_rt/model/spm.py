"""SentencePiece vocabularies (`tokenizer.ggml.model` = "llama"), tokenized as llama.cpp does.

Llama 2, TinyLlama and Mistral GGUFs carry a SentencePiece vocabulary: token texts with
scores and types, byte-fallback tokens `<0x00>`..`<0xFF>`, and no merge list. llama.cpp
(llama-vocab.cpp, its "SPM" tokenizer) encodes a text fragment so:

1. Spaces become U+2581 ("▁"); a fragment that starts the text or follows a special token
   gets one in front when `tokenizer.ggml.add_space_prefix` is set (the default).
2. The fragment is split into code points. Every adjacent pair whose concatenation is a
   token of the vocabulary, of any type, is a candidate merge scored by that token's
   score. The best candidate is merged (highest score; on equal scores the leftmost),
   the candidates around the new symbol are added, and so on until none is left.
3. Each final symbol is its token; a symbol that is no token (a single code point missing
   from the vocabulary) becomes the byte tokens of its UTF-8 bytes.

Special tokens are cut out of the text before that, longest first (control and unknown
tokens only when parsing specials; user-defined tokens always).

This module runs that algorithm itself. The HF `tokenizers` library has no model that
does: its BPE model ranks merge *pairs* in one fixed order, while here pairs of equal
score (two splits of one token, or any two in a vocabulary without scores) are taken
leftmost first. With "ab" and "ba" of equal score, "aba" gives ab+a and "bab" gives ba+b;
no fixed pair order gives both. Its Unigram model is another algorithm (the best-scoring
segmentation). So encoding runs in Python, holding the GIL. To keep that cheap the
escaped text is cut wherever no token could span the cut (two adjacent characters that
appear together in no token), which changes nothing since no merge crosses such a cut,
and the ids of each piece are cached.
"""

from __future__ import annotations

import heapq
import math
import operator
import re
from collections.abc import Sequence
from itertools import chain, compress

from rocforge_rt.errors import ModelFormatError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # SentencePiece's visible space, "▁"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
RECONVERT = "re-convert the model with llama.cpp's convert_hf_to_gguf.py"


def byte_token_text(byte: int) -> str:
    """The text of the byte-fallback token for `byte`, e.g. '<0x0A>'."""
    return f"<0x{byte:02X}>"


def spm_piece(text: str, kind: int) -> bytes:
    """The bytes a token prints as (llama.cpp's token_to_piece with specials shown)."""
    if kind == NORMAL:
        return text.replace(SPACE, " ").encode("utf-8")
    if kind in (CONTROL, UNKNOWN, USER_DEFINED):
        return text.encode("utf-8")
    if kind == BYTE:
        return bytes([int(text[3:5], 16)])
    return b""  # unused


class SpmEncoder:
    """Token ids of text for one SentencePiece vocabulary, identical to llama.cpp's."""

    _CACHE_ENTRIES = 1 << 16  # pieces remembered before the cache starts afresh
    _CACHE_MAX_CHARS = 64  # longer pieces are rare: not cached

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        scores: Sequence[float],
        *,
        add_space_prefix: bool,
    ) -> None:
        ids: dict[str, int] = {}
        for i, text in enumerate(tokens):
            first = ids.setdefault(text, i)
            if first != i:
                raise ModelFormatError(
                    f"GGUF key 'tokenizer.ggml.tokens': expected distinct token texts, found "
                    f"{text!r} at ids {first} and {i} (llama.cpp refuses it too); {RECONVERT}"
                )
        for i, (text, kind) in enumerate(zip(tokens, token_types, strict=True)):
            if kind == BYTE and not _BYTE_TOKEN.fullmatch(text):
                raise ModelFormatError(
                    f"GGUF key 'tokenizer.ggml.token_type': expected byte tokens (type 6) to "
                    f"read '<0xXX>', found token {i} {text!r} of type 6; {RECONVERT}"
                )
        self._ids = ids
        self._scores = {text: float(s) for text, s in zip(tokens, scores, strict=True)}
        self._byte_ids = [self._byte_id(b) for b in range(256)]
        self.add_space_prefix = add_space_prefix
        # Special tokens are cut out longest first (llama.cpp sorts by byte length; among
        # equal lengths its order is unspecified, here it is by id).
        specials = [
            (text, i, token_types[i] == USER_DEFINED)
            for i, text in enumerate(tokens)
            if token_types[i] in (CONTROL, UNKNOWN, USER_DEFINED)
        ]
        specials.sort(key=lambda s: -len(s[0].encode("utf-8")))
        self._specials = specials
        # Two adjacent characters no token holds side by side: no merge ever joins them.
        joinable: set[str] = set()
        for text in tokens:
            joinable.update(text[k : k + 2] for k in range(len(text) - 1))
        self._joins = frozenset(joinable).__contains__
        self._cache: dict[str, list[int]] = {}

    def _byte_id(self, byte: int) -> int:
        # llama.cpp's byte_to_token: '<0xXX>', else a token that is the byte itself.
        text = byte_token_text(byte)
        found = self._ids.get(text)
        if found is None and byte < 0x80:
            found = self._ids.get(chr(byte))
        if found is None:
            raise ModelFormatError(
                f"GGUF key 'tokenizer.ggml.tokens': expected the 256 byte-fallback tokens "
                f"'<0x00>'..'<0xFF>' of a SentencePiece vocabulary, found no {text!r}; "
                f"{RECONVERT} from a tokenizer with byte_fallback"
            )
        return found

    def encode(self, text: str, *, parse_special: bool) -> list[int]:
        """Ids of `text` (no BOS): special tokens cut out, each text fragment merged."""
        out: list[int] = []
        prev_special = True  # the first fragment gets the space prefix too
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                fragment = " " + fragment
            self._encode_fragment(fragment.replace(" ", SPACE), out)
            prev_special = False
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """`text` as raw fragments (str) and special token ids (int), in order."""
        fragments: list[str | int] = [text] if text else []
        for special, token_id, always in self._specials:
            if not (always or parse_special):
                continue  # control and unknown tokens are text unless parsing specials
            if not any(isinstance(f, str) and special in f for f in fragments):
                continue
            cut: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    cut.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(special)):
                    if k:
                        cut.append(token_id)
                    if part:
                        cut.append(part)
            fragments = cut
        return fragments

    def _pieces(self, text: str) -> list[str]:
        """`text` cut between every two characters that no token holds side by side."""
        pairs = map(operator.add, text, text[1:])  # character pairs, in C: no Python loop
        cuts = list(compress(range(1, len(text)), map(operator.not_, map(self._joins, pairs))))
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    def _encode_fragment(self, text: str, out: list[int]) -> None:
        cache = self._cache
        pieces = self._pieces(text)
        found: list[list[int] | None] = list(map(cache.get, pieces))
        for k in compress(range(len(found)), map(operator.not_, found)):  # cache misses
            piece = pieces[k]
            ids = cache.get(piece)  # an earlier miss of this text may have filled it
            if ids is None:
                ids = self._merge(piece)
                if len(piece) <= self._CACHE_MAX_CHARS:
                    if len(cache) >= self._CACHE_ENTRIES:
                        cache.clear()
                    cache[piece] = ids
            found[k] = ids
        out.extend(chain.from_iterable(found))  # type: ignore[arg-type]

    def _merge(self, text: str) -> list[int]:
        """The ids of one piece: the greedy best-score merge, then tokens or bytes."""
        symbols = list(text)  # code points; a merged-away symbol becomes ""
        n = len(symbols)
        following = list(range(1, n + 1))
        following[-1] = -1
        if n > 1:
            scores = self._scores
            preceding = list(range(-1, n - 1))
            # (-score, left, right, length): the best score first, then the leftmost.
            heap: list[tuple[float, int, int, int]] = []
            for k in range(n - 1):
                score = scores.get(symbols[k] + symbols[k + 1])
                if score is not None:
                    heap.append((-score, k, k + 1, 2))
            heapq.heapify(heap)
            while heap:
                _, left, right, length = heapq.heappop(heap)
                a, b = symbols[left], symbols[right]
                if not a or not b or len(a) + len(b) != length:
                    continue  # outdated: one side has merged since
                merged = a + b
                symbols[left], symbols[right] = merged, ""
                after = following[right]
                following[left] = after
                if after >= 0:
                    preceding[after] = left
                    score = scores.get(merged + symbols[after])
                    if score is not None:
                        heapq.heappush(
                            heap, (-score, left, after, len(merged) + len(symbols[after]))
                        )
                before = preceding[left]
                if before >= 0:
                    score = scores.get(symbols[before] + merged)
                    if score is not None:
                        heapq.heappush(
                            heap, (-score, before, left, len(symbols[before]) + len(merged))
                        )
        ids: list[int] = []
        k = 0
        while k >= 0:
            symbol = symbols[k]
            token_id = self._ids.get(symbol)
            if token_id is None:  # one code point missing from the vocabulary
                ids.extend(self._byte_ids[b] for b in symbol.encode("utf-8"))
            else:
                ids.append(token_id)
            k = following[k]
        return ids


def check_scores(scores: object, n_vocab: int) -> list[float]:
    """`tokenizer.ggml.scores` as floats, one per token (missing: all 0, as llama.cpp)."""
    key = "tokenizer.ggml.scores"
    if scores is None:
        return [0.0] * n_vocab
    if not isinstance(scores, list) or len(scores) != n_vocab:
        found = f"{len(scores)} entries" if isinstance(scores, list) else type(scores).__name__
        raise ModelFormatError(
            f"GGUF key {key!r}: expected {n_vocab} scores (one per token), found {found}; "
            f"{RECONVERT}"
        )
    bad = next(
        (
            (i, s)
            for i, s in enumerate(scores)
            if isinstance(s, bool) or not isinstance(s, int | float) or math.isnan(s)
        ),
        None,
    )
    if bad is not None:
        raise ModelFormatError(
            f"GGUF key {key!r}: expected numbers, found {bad[1]!r} for token {bad[0]}; {RECONVERT}"
        )
    return [float(s) for s in scores]
