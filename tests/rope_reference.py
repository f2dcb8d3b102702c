"""What the RoPE scaling tests share: llama.cpp's reference logits on the tiny-llama3 models
(tests/data/tiny-llama3-rope.llamacpp.*, scripts/make_rope_test_data.py), the models
rewritten from the same recipe, and the agreement measures and bars."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rocforge_rt.model.synthetic import content_digest, write_synthetic_model

DATA = Path(__file__).parent / "data"
STEM = "tiny-llama3-rope.llamacpp"
REGENERATE = "PYTHONPATH=. /tmp/spmref/bin/python scripts/make_rope_test_data.py"

# The issue's bar: rocforge's f32 activations against llama.cpp on the F32 copy of the
# same weights, where both compute in float32 (measured: max |diff| <= 0.0015).
ISSUE_MAX_DIFF, ISSUE_CORR = 0.1, 0.9999
F32_MAX_DIFF = 0.01  # tighter, for the same comparison
# Where the two sides round differently, on these random weights: one quantizes activations
# and the other not (q8 against F32, f32 against Q4_0), or both do but their attention
# rounds differently past one token (llama.cpp's CPU build takes Q and the softmax weights
# through fp16), that alone costs max |diff| up to 0.117 and correlation down to 0.99939
# (measured over every case on the CPU backend), as far as llama.cpp's own two CPU attentions
# part its logits on the Q4_0 file (`llamacpp_attention_spread`); ignoring the scaling costs
# a max |diff| past 1 and a correlation under 0.9 at 2,000 tokens. A one-token prompt, where
# attention only copies V, meets llama.cpp on the Q4_0 file to float32 rounding
# (ONE_TOKEN_MAX_DIFF): the same int8 blocks with fp16 scales, the same exact block dots.
QUANT_MAX_DIFF, QUANT_CORR = 0.15, 0.999
ONE_TOKEN_CASE = "factors-1"


@dataclass(frozen=True)
class Case:
    name: str  # "<variant>-<length>"
    variant: str  # "factors" (rope_freqs.weight) or "linear4" (linear scaling, factor 4)
    ids: list[int]
    q4_0: np.ndarray  # llama.cpp's last logits on the Q4_0 file
    f32: np.ndarray  # on its F32 copy
    q4_0_fa: np.ndarray  # on the Q4_0 file with flash attention (its other CPU attention)


@dataclass(frozen=True)
class Reference:
    provenance: dict
    cases: dict[str, Case]


def load_reference() -> Reference:
    provenance = json.loads((DATA / f"{STEM}.json").read_text())
    with np.load(DATA / f"{STEM}.npz") as arrays:
        cases = {
            c["name"]: Case(
                c["name"],
                c["variant"],
                arrays[f"ids_{c['length']}"].tolist(),
                arrays[f"logits_{c['name']}_q4_0"],
                arrays[f"logits_{c['name']}_f32"],
                arrays[f"logits_{c['name']}_q4_0_fa"],
            )
            for c in provenance["cases"]
        }
    return Reference(provenance, cases)


def write_models(reference: Reference, folder: Path) -> dict[str, Path]:
    """Each variant's model, written as the reference script wrote it; AssertionError if its
    content is not the file llama.cpp ran on."""
    recipe = reference.provenance["model"]
    paths = {}
    for name, variant in reference.provenance["variants"].items():
        path = write_synthetic_model(
            recipe["shape"], folder / f"{name}.gguf", seed=recipe["seed"], progress=False,
            vocab=recipe["vocab"], rope_factors=variant["rope_factors"],
            linear_rope=variant["linear_rope"],
        )  # fmt: skip
        assert content_digest(path) == variant["digest"], (
            f"the synthetic {name} model is not the one the reference was made on: "
            f"remake tests/data/{STEM}.* with `{REGENERATE}`"
        )
        paths[name] = path
    return paths


def agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(max |ours - theirs|, Pearson correlation) of two logits rows."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs))), float(np.corrcoef(ours, theirs)[0, 1])


def llamacpp_attention_spread(reference: Reference) -> tuple[float, float]:
    """How far llama.cpp's own two CPU attentions (flash attention off and on) part its
    logits on the Q4_0 file, at the worst case past one token: (max |diff|, correlation).
    Measured 0.080 and 0.99961: the issue's 0.9999 lies inside that floor."""
    spread = [agreement(c.q4_0_fa, c.q4_0) for c in reference.cases.values() if len(c.ids) > 1]
    return max(d for d, _ in spread), min(r for _, r in spread)


def nearer_agreement(ours: np.ndarray, case: Case) -> tuple[float, float]:
    """`agreement` of ours with the nearer (by correlation) of llama.cpp's two attentions'
    logits on the Q4_0 file."""
    both = [agreement(ours, theirs) for theirs in (case.q4_0, case.q4_0_fa)]
    return max(both, key=lambda a: a[1])
