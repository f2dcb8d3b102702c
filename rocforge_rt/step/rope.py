"""RoPE tables, computed once at load in float64 and stored as float32.

Both backends build their tables here and their kernels only read them, so RoPE scaling
(linear position scaling, Llama 3.1's per-pair frequency factors) lives in these tables alone.
"""

import numpy as np

from rocforge_rt.model.hparams import HParams


def rope_frequencies(hparams: HParams) -> np.ndarray:
    """Radians per position of each rotated pair, float64 [rope_dims // 2].

    Pair i turns by freq_scale * base^(-2i / rope_dims) / factor_i per position: llama.cpp's
    theta = pos * base^(-2i / n) / freq_factors[i], times freq_scale (1 / the linear
    scaling factor). Without scaling, freq_scale and every factor are 1.
    """
    half = hparams.rope_dims // 2
    exponents = -np.arange(half, dtype=np.float64) * 2.0 / hparams.rope_dims
    freqs = np.float64(hparams.rope_base) ** exponents * np.float64(hparams.rope_freq_scale)
    if hparams.rope_freq_factors is not None:
        factors = np.asarray(hparams.rope_freq_factors, dtype=np.float64)
        if factors.shape != (half,):
            raise ValueError(f"{factors.size} RoPE frequency factors for {half} pairs")
        freqs = freqs / factors
    return freqs


def rope_tables(hparams: HParams, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape [n_ctx, rope_dims // 2] for the adjacent-pair (GGML "norm") form.

    Pair i of a head, elements (2i, 2i+1), turns by pos * rope_frequencies(hparams)[i];
    elements past rope_dims are not rotated.
    """
    angles = np.arange(n_ctx, dtype=np.float64)[:, None] * rope_frequencies(hparams)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
