"""What the GPU op tests share: one-layer shapes, random Q4_0/Q8_0 weights, relative error."""

import numpy as np
from gguf import GGMLQuantizationType as Q

from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams
from rocforge_rt.model.synthetic import random_blocks


def hparams(n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, head_dim=64, n_vocab=1024) -> HParams:
    """A one-layer model shape (SmolLM2-135M's widths by default)."""
    return HParams(
        arch="llama", n_layer=1, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        head_dim_k=head_dim, head_dim_v=head_dim, n_vocab=n_vocab, n_ctx_train=8192,
        rope_base=10000.0, rope_dims=head_dim, rms_eps=1e-5, tied_embeddings=False,
    )  # fmt: skip


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|; a non-finite GPU output fails outright."""
    assert np.all(np.isfinite(got)), "non-finite GPU output"
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def weight(rng: np.random.Generator, n: int, k: int, qtype=Q.Q4_0, name: str = "w") -> WeightTensor:
    """A random n x k quantized matrix, scaled so that outputs stay near unit size."""
    return WeightTensor(name, qtype, (n, k), random_blocks(rng, n, k, qtype, 1 / np.sqrt(k)))
