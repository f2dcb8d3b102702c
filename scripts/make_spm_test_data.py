"""Make the SentencePiece test model and llama.cpp's reference ids for it (tests/data).

    python3 -m venv /tmp/spmref
    /tmp/spmref/bin/pip install sentencepiece llama-cpp-python gguf numpy tqdm tokenizers
    PYTHONPATH=. /tmp/spmref/bin/python scripts/make_spm_test_data.py

1. Trains a small SentencePiece BPE vocabulary with Llama 2's tokenizer settings (byte
   fallback, digits split, whitespace-only pieces, identity normalization) on the text
   below, with control and user-defined tokens of its own.
2. Wraps it as llama.cpp's convert_hf_to_gguf.py would (`tokenizer.ggml.model` "llama",
   tokens, scores, token types, bos/eos/unk/pad ids, add_bos/add_space_prefix, a chat
   template) in a random-weight GGUF of the `tiny` synthetic shape:
   tests/data/spm-tiny.gguf.
3. Asks llama.cpp (llama-cpp-python, vocab only) for the ids of every test string with and
   without BOS, parsing specials and not; the detokenized text of those ids
   (llama_detokenize, specials shown and not); and the piece of every token
   (llama_token_to_piece): tests/data/spm-tiny.llamacpp.json. The same for two variants
   written to scratch files only: the vocabulary with add_space_prefix false, and a
   hand-made vocabulary without scores where merges tie (kept in the JSON itself).

tests/test_tokenizer_spm.py checks rocforge's tokenizer against that file; neither
sentencepiece nor llama.cpp is needed to run the tests.
"""

import ctypes
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp
import sentencepiece as spm
from gguf import GGUFValue, GGUFValueType

from rocforge_rt.model.synthetic import write_synthetic_model

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
GGUF = DATA / "spm-tiny.gguf"
REFERENCE = DATA / "spm-tiny.llamacpp.json"
VOCAB_SIZE = 800
CONTROL_SYMBOLS = ["<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]
USER_DEFINED_SYMBOLS = ["<sep>", "[MASK]"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A quick brown dog jumps over the lazy fox.
Once upon a time there was a little town by the sea, and in the town there lived a baker.
Every morning the baker made bread, and every evening the people of the town came to buy it.
The weather was cold in the winter and warm in the summer; the children played outside.
She said: "Hello, world!" and he answered: "Hello again." Then they both laughed.
It's a test, isn't it? We'll see what they're doing; I'd say you've done well.
Numbers: 1, 2, 3, 10, 42, 100, 2024, 3.14159, 1,000,000 and 0.5 percent; call 555-0123.
In 1999 the price was $12.50, in 2010 it was $17.25 and in 2023 it rose to $21.00.
def add(a, b):
    return a + b

class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5

for i in range(10):
    if i % 2 == 0:
        print(i)
        continue
    else:
        pass
========================================
----------------------------------------
........................................
The café served crème brûlée, a jalapeño omelette and a piña colada.
Der Bär läuft über die Brücke; schöne Grüße aus München und Zürich.
El niño comió una manzana; mañana vamos a la montaña con la señora.
Le garçon a mangé une pomme à la maison près de l'école élémentaire.
東京は日本の首都です。今日は天気がいいです。私は学生です。
我们今天去公园散步。中国的首都是北京。你好，世界！
아침에 커피를 마셨어요. 안녕하세요.
aaaa bbbb aaaaaa abababab aaa bbb aa bb
  two spaces   three spaces    four spaces		tabs	here
The end of the story is near. The end.
"""
# Read a few times so frequent pairs win clearly; the BPE trainer needs no more.
TRAINING_TEXT = CORPUS * 3

TEXTS = [
    "",
    " ",
    "  ",
    "Hello world",
    "Hello, world!",
    " Hello world",
    "Hello world ",
    "  leading two spaces",
    "trailing three spaces   ",
    "multiple   spaces    between     words",
    "The quick brown fox jumps over the lazy dog.",
    "It's a test, isn't it? We'll see what they're doing.",
    "line one\nline two\n\nline four\n",
    "\n",
    "\n\nstarts with newlines",
    "tab\tseparated\tvalues\t",
    "\t\tindented with tabs",
    "mixed \t \n whitespace \n\t run",
    "    four-space indent\n        eight-space indent",
    "def add(a, b):\n    return a + b\n",
    "café crème brûlée",
    "über schöne Grüße, München",
    "El niño y la señora, mañana.",
    "École élémentaire à Paris",
    "東京は日本の首都です。",
    "你好，世界！我们今天去公园。",
    "안녕하세요",
    "漢字と ひらがな と カタカナ",
    "emoji 🚀 rocket",
    "🙂🙃😀",
    "family 👨‍👩‍👧 and flag 🇫🇷",
    "1 2 3 4 5",
    "12345678901234567890",
    "3.14159 and 2,718 and -42",
    "Call 555-0123 before 2024-12-31.",
    "$12.50 + $17.25 = $29.75",
    "aaaaaaaaaaaa",
    "aaaaa aaaaaa aaaaaaa",
    "abababababab",
    "bbbbbbbb aaaa",
    "========",
    "----------------",
    "..........",
    "=-=-=-=-",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|>",
    "text<|im_end|>more text",
    "[INST] What is 2+2? [/INST]",
    "[INST]no spaces[/INST]",
    "<s>Hello</s>",
    "<s> spaced </s>",
    "an <unk> token",
    "user-defined <sep> token",
    "<sep>at the start",
    "[MASK] [MASK][MASK]",
    "a<sep>b<sep>c",
    "<0x41> written out",
    "<|im_start",
    "▁already▁escaped▁spaces",
    "Zürich 東京 🚀 42\tend\n",
]


def _vocabulary(model_file: Path) -> dict[str, GGUFValue]:
    """The tokenizer keys llama.cpp's converter writes for a SentencePiece model."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()
    tokens, scores, types = [], [], []
    user_defined = set(USER_DEFINED_SYMBOLS)
    for i in range(n):
        piece = sp.id_to_piece(i)
        score = sp.get_score(i)
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_unused(i):
            kind = 5
        elif sp.is_byte(i):
            kind = 6
        elif piece in user_defined:
            # as convert_hf_to_gguf.py does for tokenizer_config.json's non-special tokens
            kind, score = 4, -1000.0
        else:
            kind = 1
        tokens.append(piece)
        scores.append(score)
        types.append(kind)
    string, u32 = GGUFValueType.STRING, GGUFValueType.UINT32
    array, boolean = GGUFValueType.ARRAY, GGUFValueType.BOOL
    vocabulary = {
        "tokenizer.ggml.model": GGUFValue("llama", string),
        "tokenizer.ggml.tokens": GGUFValue(tokens, array, string),
        "tokenizer.ggml.scores": GGUFValue(scores, array, GGUFValueType.FLOAT32),
        "tokenizer.ggml.token_type": GGUFValue(types, array, GGUFValueType.INT32),
        "tokenizer.ggml.bos_token_id": GGUFValue(sp.bos_id(), u32),
        "tokenizer.ggml.eos_token_id": GGUFValue(sp.eos_id(), u32),
        "tokenizer.ggml.unknown_token_id": GGUFValue(sp.unk_id(), u32),
        "tokenizer.ggml.padding_token_id": GGUFValue(sp.unk_id(), u32),
        "tokenizer.ggml.add_bos_token": GGUFValue(True, boolean),
        "tokenizer.ggml.add_eos_token": GGUFValue(False, boolean),
        "tokenizer.ggml.add_space_prefix": GGUFValue(True, boolean),
        "tokenizer.chat_template": GGUFValue(CHAT_TEMPLATE, string),
    }
    return vocabulary


def _tie_vocabulary() -> dict[str, GGUFValue]:
    """A vocabulary without scores (llama.cpp reads 0 for all): every merge ties, so the
    leftmost candidate wins. "ab" and "ba" tie in "aba" and in "bab": no fixed order of
    merge pairs (HF `tokenizers`' BPE) gives llama.cpp's ids for both."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    for text in ("\u2581", "a", "b", "c", "ab", "ba", "bc", "abc", "\u2581\u2581"):
        tokens.append(text)
        types.append(1)
    string, array = GGUFValueType.STRING, GGUFValueType.ARRAY
    return {
        "tokenizer.ggml.model": GGUFValue("llama", string),
        "tokenizer.ggml.tokens": GGUFValue(tokens, array, string),
        "tokenizer.ggml.token_type": GGUFValue(types, array, GGUFValueType.INT32),
    }


def _train(workdir: Path) -> Path:
    corpus = workdir / "corpus.txt"
    corpus.write_text(TRAINING_TEXT, encoding="utf-8")
    prefix = workdir / "spm"
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        hard_vocab_limit=False,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        max_sentence_length=100000,
        control_symbols=CONTROL_SYMBOLS,
        user_defined_symbols=USER_DEFINED_SYMBOLS,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def _detokenize(vocab: ctypes.c_void_p, ids: list[int], *, special: bool) -> str:
    array = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, array, len(ids), buf, size, False, special)
    assert 0 <= n <= size, n
    return buf.raw[:n].decode("utf-8", errors="replace")


def _piece(vocab: ctypes.c_void_p, token: int, *, special: bool) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 256, 0, special)
    assert 0 <= n <= 256, n
    return buf.raw[:n].hex()


def _cases(llm: llama_cpp.Llama, texts: list[str], *, detokenize: bool) -> list[dict]:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    cases = []
    for text in texts:
        case: dict = {"text": text}
        for bos in (False, True):
            for special in (False, True):
                ids = llm.tokenize(text.encode("utf-8"), add_bos=bos, special=special)
                name = f"ids{'_bos' if bos else ''}{'_special' if special else ''}"
                case[name] = ids
        if detokenize:
            for name in ("ids_special", "ids_bos_special"):
                ids = case[name]
                case[f"{name}_text"] = _detokenize(vocab, ids, special=True)
                case[f"{name}_text_skip"] = _detokenize(vocab, ids, special=False)
        cases.append(case)
    return cases


def _variant(workdir: Path, name: str, vocabulary: dict[str, GGUFValue], texts: list[str]) -> dict:
    """Cases for a vocabulary written to a scratch GGUF (not kept: the test rebuilds its
    metadata from the committed model or from `metadata` here)."""
    path = workdir / f"{name}.gguf"
    write_synthetic_model("tiny", path, seed=16, progress=False, vocabulary=vocabulary)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return {"cases": _cases(llm, texts, detokenize=True)}


def _reference(workdir: Path, vocabulary: dict[str, GGUFValue]) -> dict:
    llm = llama_cpp.Llama(str(GGUF), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    no_prefix = {
        **vocabulary,
        "tokenizer.ggml.add_space_prefix": GGUFValue(False, GGUFValueType.BOOL),
    }
    ties = _tie_vocabulary()
    tie_texts = ["aba", "bab", "abab", "babab", "abc", "cab", "bcab", "a b a", "ba  ab", "bbaa"]
    return {
        "generator": f"llama-cpp-python {llama_cpp.__version__} (scripts/make_spm_test_data.py)",
        "model": GGUF.name,
        "n_vocab": n_vocab,
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "eog": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "pieces_hex": [_piece(vocab, i, special=True) for i in range(n_vocab)],
        "pieces_hex_skip": [_piece(vocab, i, special=False) for i in range(n_vocab)],
        "cases": _cases(llm, TEXTS, detokenize=True),
        "no_space_prefix": _variant(workdir, "no-space-prefix", no_prefix, TEXTS),
        "ties": {
            "metadata": {key: value.value for key, value in ties.items()},
            **_variant(workdir, "ties", ties, tie_texts),
        },
    }


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        vocabulary = _vocabulary(_train(Path(tmp)))
        write_synthetic_model("tiny", GGUF, seed=16, progress=False, vocabulary=vocabulary)
        reference = _reference(Path(tmp), vocabulary)
    REFERENCE.write_text(json.dumps(reference, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {GGUF} ({GGUF.stat().st_size} bytes) and {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
