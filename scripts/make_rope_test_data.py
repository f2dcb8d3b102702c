"""Make the RoPE scaling test data: llama.cpp's last-position logits on Llama 3.2-like models.

    python3 -m venv /tmp/spmref
    /tmp/spmref/bin/pip install llama-cpp-python gguf numpy tqdm tokenizers
    PYTHONPATH=. /tmp/spmref/bin/python scripts/make_rope_test_data.py

1. Writes two random-weight models of the `tiny-llama3` synthetic shape (seed 0, the byte
   vocabulary) to a scratch folder: `factors`, with the rope_freqs.weight of Meta's Llama 3.1
   rule (factor 32, low/high frequency factors 1 and 4, original context 8192), and
   `linear4`, the same weights without that tensor but with rope.scaling.type 'linear',
   factor 4. Beside each, an F32 copy (every tensor dequantized exactly), on which llama.cpp
   computes in float32 what rocforge's CPU backend computes with `activations="f32"`; on the
   Q4_0 file itself llama.cpp quantizes activations to int8 blocks with fp16 scales.
2. For fixed random prompts of byte tokens (ids 0-255) of 1, 64, 2,000 and 4,000 tokens (the
   `linear4` model: 2,000), asks llama.cpp (llama-cpp-python, CPU, 2 threads) for the logits
   after the last token, on the Q4_0 file and on its F32 copy; and on the Q4_0 file once more
   with flash attention (its other CPU attention: how far llama.cpp's own roundings part its
   logits).
3. Writes tests/data/tiny-llama3-rope.llamacpp.npz (the prompts, `ids_<length>`, and the
   logits, `logits_<case>_<q4_0|f32|q4_0_fa>`, float32, compressed) and
   tests/data/tiny-llama3-rope.llamacpp.json (the cases, how each model was written, the
   content digest of each file, the versions used).

tests/test_rope_scaling.py rewrites the models, checks their digests against the JSON, and
compares rocforge's logits with these; llama.cpp is not needed to run the tests.
"""

import json
import sys
import tempfile
from functools import partial
from importlib.metadata import version
from pathlib import Path

import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType, quants

from rocforge_rt.model.gguf_file import open_gguf
from rocforge_rt.model.gguf_writer import TensorOut, copy_metadata, write_gguf
from rocforge_rt.model.synthetic import content_digest, write_synthetic_model

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
STEM = "tiny-llama3-rope.llamacpp"
SHAPE, SEED = "tiny-llama3", 0
VARIANTS = {
    "factors": {"rope_factors": True, "linear_rope": None},
    "linear4": {"rope_factors": False, "linear_rope": 4.0},
}
CASES = [("factors", 1), ("factors", 64), ("factors", 2000), ("factors", 4000), ("linear4", 2000)]
PROMPT_SEED = 2024
N_CTX = 4096 + 256  # llama.cpp's context: room for the longest prompt
THREADS = 2


def f32_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor dequantized to F32 (exactly: a Q4_0/Q8_0 value is f16 * int)."""
    reader = open_gguf(src)

    def values(t) -> np.ndarray:
        raw = np.asarray(t.data)
        return quants.dequantize(raw, GGMLQuantizationType(t.tensor_type)).astype(np.float32)

    tensors = [
        TensorOut(
            t.name, GGMLQuantizationType.F32, tuple(reversed(t.shape.tolist())), partial(values, t)
        )
        for t in reader.tensors
    ]
    return write_gguf(dst, copy_metadata(reader), tensors, progress=False)


def last_logits(
    path: Path, prompts: dict[int, list[int]], lengths: list[int], flash_attn: bool = False
) -> dict[int, list]:
    """llama.cpp's logits after the last token of each prompt, each from an empty cache."""
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=N_CTX, logits_all=False, n_threads=THREADS, verbose=False,
        flash_attn=flash_attn,
    )  # fmt: skip
    out = {}
    for n in lengths:
        llm.reset()  # eval starts over at position 0 (the cache past n_tokens is dropped)
        llm.eval(prompts[n])
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        out[n] = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float32)
        print(f"{path.name}: {n} tokens", file=sys.stderr)
    llm.close()
    return out


def main() -> int:
    rng = np.random.default_rng(PROMPT_SEED)
    lengths = sorted({n for _, n in CASES})
    prompts = {n: rng.integers(0, 256, n).tolist() for n in lengths}
    arrays = {f"ids_{n}": np.array(prompts[n], dtype=np.int32) for n in lengths}
    variants = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in VARIANTS.items():
            model = write_synthetic_model(
                SHAPE, Path(tmp) / f"{name}.gguf", seed=SEED, progress=False, vocab=True, **options
            )
            copy = f32_copy(model, Path(tmp) / f"{name}-f32.gguf")
            variants[name] = {
                **options,
                "digest": content_digest(model),
                "f32_digest": content_digest(copy),
            }
            wanted = [n for variant, n in CASES if variant == name]
            runs = (("q4_0", model, False), ("f32", copy, False), ("q4_0_fa", model, True))
            for kind, path, flash_attn in runs:
                for n, logits in last_logits(path, prompts, wanted, flash_attn).items():
                    arrays[f"logits_{name}-{n}_{kind}"] = logits
    np.savez_compressed(DATA / f"{STEM}.npz", **arrays)
    provenance = {
        "model": {"shape": SHAPE, "seed": SEED, "vocab": True},
        "variants": variants,
        "cases": [{"name": f"{v}-{n}", "variant": v, "length": n} for v, n in CASES],
        "prompt_seed": PROMPT_SEED,
        "llama_cpp": {
            "n_ctx": N_CTX,
            "n_threads": THREADS,
            "n_batch": 512,
            "flash_attn": "off, and on for the q4_0_fa logits",
        },
        "versions": {p: version(p) for p in ("llama_cpp_python", "gguf", "numpy")},
    }
    (DATA / f"{STEM}.json").write_text(json.dumps(provenance, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
