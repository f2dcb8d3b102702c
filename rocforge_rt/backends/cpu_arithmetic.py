"""The CPU backend's arithmetic in numpy, beside its compiled kernels (`cpu_kernels`).

Matmul inputs are quantized to int8 per 32-element block (`q8_blocks`, `quantize_q8`): the
arithmetic of the GPU's dp4a GEMVs and of llama.cpp's Q4_0 x Q8_0 dot products. The quantized
matmul (`q8_matmul`, by the kernels, parallel over output rows) takes the integer dot product
of each 32-element block (exact), weighs the blocks and sums them in the GPU's canonical
order (`kernels/rf_q8.h`): stages of two blocks, each added by a fused multiply-add
(emulated in float64), the stage sums folded left to right; `q8_matmul_reference` is the
same arithmetic in numpy. Without an integer form (F16/F32 weights, or float32 activations)
each row takes a BLAS call of its own (`rowwise_matmul`). `rms_normalize` and `silu` are the
numpy references the GPU's tests compare against.
"""

import numpy as np

from rocforge_rt.backends.cpu_kernels import PARALLEL_KERNELS, q8_tiled_matmul
from rocforge_rt.backends.cpu_weights import Q8_BLOCK, BlockMatrix


def rms_normalize(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * gain over the last axis (the backend's steps take it compiled,
    `cpu_kernels.rms_norm_rows`, bit for bit)."""
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(mean_square + eps)) * gain


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x as int8 per 32-element block: the integers [rows, n_blocks, 32] (float32)
    and the kept scales [rows, n_blocks]: q = round(x / d) with d = amax / 127, the scale
    kept being `kept_scales(d)`.

    Rounds half away from zero (C's roundf), as the GPU kernels and llama.cpp do.
    """
    blocks = x.reshape(x.shape[0], x.shape[1] // Q8_BLOCK, Q8_BLOCK).astype(np.float32, copy=False)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    q = blocks / np.where(scale > 0, scale, np.float32(1))[..., None]
    q += np.copysign(np.float32(0.5), q)
    return np.trunc(q, out=q), kept_scales(scale)


def kept_scales(scale: np.ndarray) -> np.ndarray:
    """Block scales as the dot products use them: rounded to the nearest fp16 (even on a
    tie), saturating at its largest finite value, as llama.cpp keeps its q8 blocks' (and
    kernels/rf_q8.h, rf_q8_kept_scale); float32."""
    return np.minimum(scale, np.finfo(np.float16).max).astype(np.float16).astype(np.float32)


def quantize_q8(x: np.ndarray) -> np.ndarray:
    """x rounded through int8 per 32-element block (see `q8_blocks`), as float32."""
    q, scale = q8_blocks(x.reshape(-1, x.shape[-1]))
    return (q * scale[..., None]).reshape(x.shape)


def q8_matmul(x: np.ndarray, weight: BlockMatrix) -> np.ndarray:
    """quantize_q8(x) @ weight.T, each output summed in the canonical order (module docstring),
    by the compiled kernels of `cpu_kernels` (the arithmetic of `q8_matmul_reference`).

    Row-independent: each output is its own activation row's and weight row's float32
    operations, in a fixed order, whatever the rows around it and the threads.
    """
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    with PARALLEL_KERNELS:
        q8_tiled_matmul(x, weight.words, weight.scales, out)
    return out


def q8_matmul_reference(x: np.ndarray, weight: BlockMatrix) -> np.ndarray:
    """`q8_matmul` in numpy: the canonical arithmetic written out (`_q8_fold`), for tests."""
    q, scale_x = q8_blocks(x)
    ints, scale_w = weight.integers(np.arange(weight.shape[0]))  # [o, b, 32], [o, b]
    dots = np.einsum("rbi,obi->bro", q, ints.astype(np.float32))  # exact in any order
    return _q8_fold(dots, scale_x, scale_w.T)


def _q8_fold(dots: np.ndarray, scale_x: np.ndarray, scale_w: np.ndarray) -> np.ndarray:
    """[rows, n_out] from every block's dots [n_blocks, rows, n_out] (overwritten) and the
    scales scale_x [rows, n_blocks], scale_w [n_blocks, n_out]."""
    n_blocks = dots.shape[0]
    scales = scale_x.T[:, :, None] * scale_w[:, None, :]  # d_x * d_w, [b, r, o]
    stages = np.multiply(dots[0::2], scales[0::2], out=dots[0::2])  # fmaf(d, dot, 0)
    pairs = n_blocks // 2
    _fma(scales[1::2], dots[1::2], stages[:pairs], out=stages[:pairs])  # fmaf(d, dot, stage)
    total = stages[0]
    for stage in stages[1:]:
        total += stage
    return total


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray, out: np.ndarray) -> np.ndarray:
    """fmaf(a, b, c) elementwise into float32 `out`, through float64, where a * b is exact
    (b holds integers below 2^20) and so is the sum, unless c is over ~2^9 times a * b or
    a * b over ~2^29 times c; only then can rounding twice (to float64, then to float32)
    differ from fmaf's single rounding, and only on a float32 tie."""
    return np.add(np.multiply(a, b, dtype=np.float64), c, out=out, dtype=np.float64)


def rowwise_matmul(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x @ weight.T, one BLAS call per row: each row's call is the same alone or batched."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    for r in range(x.shape[0]):
        np.matmul(np.ascontiguousarray(x[r]), weight.T, out=out[r])
    return out
