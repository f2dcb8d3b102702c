"""RoPE tables, computed once at load in float64 and stored as float32."""

import numpy as np

from rocforge_rt.model.hparams import HParams


def rope_tables(hparams: HParams, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape [n_ctx, rope_dims // 2] for the adjacent-pair (GGML "norm") form.

    Pair i of a head, elements (2i, 2i+1), turns by pos * base^(-2i / rope_dims);
    elements past rope_dims are not rotated.
    """
    half = hparams.rope_dims // 2
    inv_freq = hparams.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / hparams.rope_dims)
    angles = np.arange(n_ctx, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
