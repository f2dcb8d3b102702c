"""CPU backend: the numerical reference, in numpy and a compiled (numba) matmul.

Q4_0 and Q8_0 weights stay quantized in memory: their blocks' packed quants and fp16 scales
(`BlockMatrix`), the file's bytes, read from it a tile at a time; F16/F32 ones are
dequantized to float32 at load.
The KV pool is float16, as on the GPU and in llama.cpp, or fp8 E4M3 bytes (`kv_dtype="fp8"`,
`step/kv_format.py`). Matmul inputs are, by default,
quantized to int8 per 32-element block first (`activations="q8"`): the arithmetic of the
GPU's dp4a GEMVs and of llama.cpp's Q4_0 x Q8_0 dot products, so results compare tightly
with both. `activations="f32"` keeps them float32 (and the weights' float32 expansion,
built on first use: a reference mode for tests).

Every matmul is row-independent: an output row is bit-identical whatever other rows
share the call, so a session's tokens do not depend on who else is generating. The
quantized matmul (`cpu_kernels`, parallel over output rows) takes the integer dot product
of each 32-element block (exact), weighs the blocks and sums them in the GPU's canonical
order (`kernels/rf_q8.h`): stages of two blocks, each added by a fused multiply-add
(emulated in float64), the stage sums folded left to right; `q8_matmul_reference` is the
same arithmetic in numpy. Without an integer form (F16/F32 weights, or
`activations="f32"`) each row takes a BLAS call of its own.

Threads: `threads` (default: the physical cores) sizes numba's pool for the matmul and
limits the BLAS pools (the float32 paths) to as many, so that they do not oversubscribe
the cores.
"""

import contextlib
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import cached_property
from typing import NamedTuple

import numba
import numpy as np
from gguf import GGMLQuantizationType, quants
from threadpoolctl import threadpool_limits

from rocforge_rt.backends.cpu_attention import attend
from rocforge_rt.backends.cpu_kernels import (
    LANES,
    PARALLEL_KERNELS,
    q8_tiled_matmul,
    rms_norm_rows,
    rope_rows,
)
from rocforge_rt.errors import BackendError
from rocforge_rt.model.gguf_file import WeightTensor
from rocforge_rt.model.hparams import HParams
from rocforge_rt.step.batch import StepBatch
from rocforge_rt.step.forward import StepOutput
from rocforge_rt.step.kv_format import (
    KV_ELEMENT_DTYPES,
    check_kv_dtype,
    float32_to_e4m3,
    kv_element_bytes,
)
from rocforge_rt.step.rope import rope_tables
from rocforge_rt.step.sampling import sample_row

Q8_BLOCK = 32  # elements per quant block; the canonical sum takes them in stages of two


def _pool_bits(kv_dtype: str) -> np.dtype:
    """What `attend` reads a pool of `kv_dtype` as: its elements' bits (fp16: uint16)."""
    return np.dtype(f"u{kv_element_bytes(kv_dtype)}")


# GGUF block layouts: bytes per block (an f16 scale, then the quants).
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q8_0: 34}


def dequantize(tensor: WeightTensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order."""
    if tensor.ggml_type == GGMLQuantizationType.F32:
        return np.asarray(tensor.data, dtype=np.float32).reshape(tensor.shape)
    values = quants.dequantize(np.asarray(tensor.data), tensor.ggml_type)
    return values.astype(np.float32, copy=False).reshape(tensor.shape)


class BlockMatrix:
    """A Q4_0/Q8_0 matrix [n_out, n_in] kept quantized: its blocks' packed quants and fp16
    scales (18 or 34 bytes a block of 32, as in the file).

    A row's blocks are the file's: a Q4_0 block's 16 quant bytes (element j in the low nibble
    of byte j, j + 16 in the high; the integer is nibble - 8) or a Q8_0 block's 32 int8, and
    its scale as fp16 bits; value = scale * integer, exactly. Rows of tensors of both types
    stacked in one matrix are all kept as int8 (`nibbles` False).

    Held tiled, the compiled kernels' layout (`cpu_kernels`): the rows in tiles of LANES (the
    last one narrower), a tile block by block, a block as the pairs of its bytes (bytes 2k
    and 2k + 1: a 16-bit word) of every row of the tile side by side. `quants` is those
    bytes, flat (the file's quant bytes, in that order), `words` the same memory as uint16
    (Q4_0) or int16 words; `scales` (fp16 bits, uint16) is flat as well, [n_blocks, width] a
    tile: the kernels take them to float32, exactly. `integers` reads rows back. `dense`
    (and `.T`, so that `x @ m.T` works as for an array) is the float32 matrix, built on
    first use: the float32 reference mode's (`activations="f32"`) and the tests'.
    """

    def __init__(self, n_out: int, n_in: int, nibbles: bool) -> None:
        """An n_out x n_in matrix of Q4_0 nibbles or int8, its rows to be put (`put_rows`)."""
        n_blocks = n_out * n_in // Q8_BLOCK
        self.nibbles = nibbles
        self.shape = (n_out, n_in)
        self.quants = np.empty(n_blocks * (16 if nibbles else 32), np.uint8 if nibbles else np.int8)
        self.scales = np.empty(n_blocks, dtype=np.uint16)
        self.words = self.quants.view(np.uint16 if nibbles else np.int16)

    @property
    def nbytes(self) -> int:
        return self.quants.nbytes + self.scales.nbytes

    @classmethod
    def from_blocks(cls, quants: np.ndarray, scales: np.ndarray) -> "BlockMatrix":
        """The matrix of quant bytes [n_out, n_blocks, 16 or 32] (Q4_0's uint8, or int8) and
        fp16 scales [n_out, n_blocks]."""
        n_out, n_blocks, _ = quants.shape
        matrix = cls(n_out, n_blocks * Q8_BLOCK, quants.dtype == np.uint8)
        words = np.ascontiguousarray(quants).view(matrix.words.dtype)
        matrix.put_rows(0, words, np.asarray(scales, dtype=np.float16).view(np.uint16))
        return matrix

    @classmethod
    def from_tensors(cls, *tensors: WeightTensor) -> "BlockMatrix":
        """The tensors' rows stacked (as Q|K|V or gate|up are), copied from the file's
        blocks a tile's rows at a time."""
        nibbles = all(t.ggml_type == GGMLQuantizationType.Q4_0 for t in tensors)
        matrix = cls(sum(t.shape[0] for t in tensors), tensors[0].shape[1], nibbles)
        start = 0
        for tensor in tensors:
            words, scales = _file_blocks(tensor)
            expand = not nibbles and tensor.ggml_type == GGMLQuantizationType.Q4_0
            for first in range(0, len(words), LANES):
                part = words[first : first + LANES]
                if expand:  # Q4_0 beside Q8_0: its nibbles as int8
                    part = _as_int8(part.view(np.uint8), axis=-1)
                part = part.view(matrix.words.dtype)
                matrix.put_rows(start + first, part, scales[first : first + LANES])
            start += len(words)
        return matrix

    def put_rows(self, start: int, words: np.ndarray, scales: np.ndarray) -> None:
        """Rows start, start + 1, ... of the matrix, from their blocks' words [rows, n_blocks,
        8 or 16] (`words`' type; any strides: a view of the file) and fp16 bits [rows,
        n_blocks], into the tiles they fall in."""
        n_out, n_blocks = self.shape[0], self.shape[1] // Q8_BLOCK
        per_block = self.words.size // (n_out * n_blocks)  # words a block: 8 or 16
        stop = start + len(words)
        for first in range(start - start % LANES, stop, LANES):
            width = min(LANES, n_out - first)
            low, high = max(start, first), min(stop, first + width)
            span = slice(first * n_blocks, (first + width) * n_blocks)
            tile = self.words[span.start * per_block : span.stop * per_block]
            lanes, rows = slice(low - first, high - first), slice(low - start, high - start)
            tile.reshape(n_blocks, per_block, width)[:, :, lanes] = words[rows].transpose(1, 2, 0)
            self.scales[span].reshape(n_blocks, width)[:, lanes] = scales[rows].T

    def integers(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows `ids` of the matrix: their integers int8 [len(ids), n_blocks, 32] and scales
        (float32) [len(ids), n_blocks]."""
        n_out, n_blocks = self.shape[0], self.shape[1] // Q8_BLOCK
        per_block = self.quants.size // (n_out * n_blocks)  # bytes a block: 16 or 32
        first = ids - ids % LANES  # each row's tile: its first row, its width; the row's lane
        width, lane = np.minimum(LANES, n_out - first)[:, None, None], (ids - first)[:, None, None]
        block, byte = np.ogrid[:n_blocks, :per_block]  # byte j is in word j // 2
        tile = first[:, None, None] * n_blocks
        quants = self.quants[
            tile * per_block + (block * per_block + byte - byte % 2) * width + 2 * lane + byte % 2
        ]
        scales = self.scales[tile[..., 0] + np.arange(n_blocks) * width[..., 0] + lane[..., 0]]
        return _as_int8(quants, axis=-1), scales.view(np.float16).astype(np.float32)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of the matrix as float32 [len(ids), n_in] (an embedding lookup); only
        those rows are dequantized."""
        ints, scales = self.integers(ids)
        values = ints.astype(np.float32) * scales[..., None]
        return values.reshape(len(ids), self.shape[1])

    @cached_property
    def dense(self) -> np.ndarray:
        # 4096 rows at a time: `integers` builds an int64 index per byte it reads
        ids = np.arange(self.shape[0])
        return np.concatenate(
            [self.rows(ids[i : i + 64 * LANES]) for i in range(0, len(ids), 64 * LANES)]
        )

    @property
    def T(self) -> np.ndarray:  # noqa: N802 - numpy's name
        return self.dense.T


def is_block_quantized(tensor: WeightTensor) -> bool:
    return tensor.ggml_type in _BLOCK_BYTES


def _file_blocks(tensor: WeightTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0/Q8_0 tensor's blocks as the file's 16-bit words (views of its mapping): the
    quants' [n_out, n_blocks, 8 or 16] and the scales' (fp16 bits) [n_out, n_blocks]."""
    per_block = _BLOCK_BYTES[tensor.ggml_type] // 2
    words = np.asarray(tensor.data).view(np.uint16).reshape(tensor.shape[0], -1, per_block)
    return words[..., 1:], words[..., 0]


def _as_int8(nibbles: np.ndarray, axis: int) -> np.ndarray:
    """Q4_0 quant bytes (16 along `axis`) as their integers (32 along it: nibble - 8), int8;
    Q8_0 ones (int8) as they are."""
    if nibbles.dtype == np.int8:
        return nibbles
    low, high = (nibbles & 0x0F).view(np.int8), (nibbles >> 4).view(np.int8)
    return np.concatenate([low, high], axis=axis) - np.int8(8)


def held_bytes(tensors: Sequence[WeightTensor]) -> int:
    """Bytes the CPU backend holds for one matrix stacked from `tensors` (`linear`), or for
    one tensor: blocks of 32 when every tensor is Q4_0/Q8_0 (18 bytes each when all are
    Q4_0, else 34: Q4_0 beside Q8_0 is held as int8, `BlockMatrix.from_tensors`), else
    float32 for all of them."""
    elements = sum(int(np.prod(t.shape)) for t in tensors)
    if not all(is_block_quantized(t) for t in tensors):
        return elements * 4
    q4_0 = GGMLQuantizationType.Q4_0
    block_type = q4_0 if all(t.ggml_type == q4_0 for t in tensors) else GGMLQuantizationType.Q8_0
    return elements // Q8_BLOCK * _BLOCK_BYTES[block_type]


def drop_mapped_pages(tensors: Iterable[WeightTensor], whole_files: bool = False) -> None:
    """Drop the file pages holding these tensors' data (rounded out to whole pages), or with
    `whole_files` every page of their files' mappings, from the process's resident set:
    MADV_DONTNEED on the GGUF's read-only mapping; they stay in the page cache, and a later
    read maps them again. The CPU backend keeps copies, so once a tensor is uploaded its
    pages are idle."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    dropped = set()  # the mappings dropped whole
    for tensor in tensors:
        mapping = getattr(tensor.data, "_mmap", None)
        if mapping is None or id(mapping) in dropped:
            continue
        with contextlib.suppress(OSError, ValueError):  # closed, or not supported
            if whole_files:
                dropped.add(id(mapping))
                mapping.madvise(mmap.MADV_DONTNEED)
                continue
            offset = tensor.data.ctypes.data - np.frombuffer(mapping, np.uint8).ctypes.data
            start = offset - offset % mmap.PAGESIZE
            mapping.madvise(mmap.MADV_DONTNEED, start, offset + tensor.data.nbytes - start)


def physical_cores() -> int:
    """Physical cores of the host (distinct core ids per package in sysfs), else
    os.cpu_count()."""
    cores = set()
    for cpu in range(os.cpu_count() or 1):
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with (
                open(topology + "physical_package_id") as package,
                open(topology + "core_id") as core,
            ):
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            continue
    return len(cores) or os.cpu_count() or 1


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


def compile_kernels(kv_dtype: str = "f16") -> None:
    """Compile (or load from numba's cache) the kernels a step takes, for the argument types
    it gives them: the matmul of both weight layouts, RMSNorm (its gain read-only, as a
    model file's), RoPE (of one row, and of a chunk's rows: strided), attention over a KV
    pool of `kv_dtype`."""
    x = np.ones((1, Q8_BLOCK), dtype=np.float32)
    for packed in (np.zeros((1, 1, 16), np.uint8), np.zeros((1, 1, 32), np.int8)):
        q8_matmul(x, BlockMatrix.from_blocks(packed, np.ones((1, 1), dtype=np.float16)))
    gain = np.ones(Q8_BLOCK, dtype=np.float32)
    gain.flags.writeable = False
    rms_norm_rows(x, gain, 1e-5, np.empty_like(x))
    qkv, table = np.ones((2, 3, 2), dtype=np.float32), np.ones((1, 1), dtype=np.float32)
    for rows in (qkv[:1, :2], qkv[:, :2]):
        positions = np.zeros(len(rows), dtype=np.int32)
        rope_rows(rows, positions, table, table, np.empty(rows.shape, dtype=np.float32))
    head = np.ones((1, 1, Q8_BLOCK), dtype=np.float32)
    bits = _pool_bits(kv_dtype)
    keys_t, values = np.zeros((1, Q8_BLOCK, 1), bits), np.zeros((1, 1, Q8_BLOCK), bits)
    with PARALLEL_KERNELS:
        attend(head, keys_t, values, np.zeros(1, np.int64), np.float32(1), np.empty_like(head))


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


class SlotRun(NamedTuple):
    """A step's rows of one KV slot, for one attention call: the rows (a slice where they are
    consecutive) and their positions (int64)."""

    slot: int
    rows: slice | np.ndarray
    positions: np.ndarray


def slot_runs(batch: StepBatch) -> list[SlotRun]:
    """The step's rows by slot, in slot order."""
    slots, positions = batch.slots, batch.positions.astype(np.int64)
    if len(slots) and (slots == slots[0]).all():  # a decode row, or one sequence's chunk
        groups: list[tuple[int, slice | np.ndarray]] = [(int(slots[0]), slice(0, len(slots)))]
    else:
        groups = [(int(slot), np.flatnonzero(slots == slot)) for slot in np.unique(slots)]
    return [SlotRun(slot, rows, positions[rows]) for slot, rows in groups]


def rowwise_matmul(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x @ weight.T, one BLAS call per row: each row's call is the same alone or batched."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    for r in range(x.shape[0]):
        np.matmul(np.ascontiguousarray(x[r]), weight.T, out=out[r])
    return out


class CpuBackend:
    """Weight uploader and forward ops over numpy arrays; owns the KV pool storage."""

    ragged_steps = True  # a step may mix sequences' decode rows and prompt chunks

    name = "cpu"

    def __init__(
        self,
        hparams: HParams,
        n_slots: int,
        n_ctx: int,
        activations: str = "q8",
        lookahead: bool = False,
        threads: int | None = None,
        kv_dtype: str = "f16",
    ) -> None:
        """`lookahead`: take part in pipelined decode (StepRunner) the lazy way: a step
        issued ahead runs when it is taken, and not at all when it is dropped. The host has
        nothing to overlap it with, so it is off by default; the engine's tests turn it on.
        `threads`: the matmul's threads (numba's pool) and the BLAS pools' limit; None: the
        physical cores, at most numba's maximum. `kv_dtype`: the KV pool's elements, "f16"
        or "fp8" (`step/kv_format.py`)."""
        if activations not in ("q8", "f32"):
            raise ValueError(f"activations must be 'q8' or 'f32', got {activations!r}")
        self.kv_dtype = check_kv_dtype(kv_dtype)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = min(threads or physical_cores(), numba.config.NUMBA_NUM_THREADS)
        # Process-wide: BLAS runs only between the kernels, on as many threads as they use.
        self._blas_limits = threadpool_limits(limits=self.threads, user_api="blas")
        self.hparams = hparams
        self.activations = activations
        self.lookahead = lookahead
        # The step issued ahead: the step before it, its output, and the forward to run.
        self._ahead: tuple[StepBatch, StepOutput, Callable[[StepBatch], np.ndarray]] | None = None
        self.n_ctx = n_ctx
        # The KV pool: float16, or fp8 E4M3 bytes (uint8). Keys are held positions innermost
        # ([slot, KV head, dim, position]: `attend` reads them along positions); `k_cache` is
        # each layer's view of them as [slot, position, KV head, dim], the layout of
        # `v_cache` and the GPU's.
        shape_k = (n_slots, hparams.n_head_kv, hparams.head_dim_k, n_ctx)
        shape_v = (n_slots, n_ctx, hparams.n_head_kv, hparams.head_dim_v)
        pool = KV_ELEMENT_DTYPES[self.kv_dtype]
        self.keys_t = [np.zeros(shape_k, dtype=pool) for _ in range(hparams.n_layer)]
        self.k_cache = [keys.transpose(0, 3, 1, 2) for keys in self.keys_t]
        self.v_cache = [np.zeros(shape_v, dtype=pool) for _ in range(hparams.n_layer)]
        self.rope_cos, self.rope_sin = rope_tables(hparams, n_ctx)
        self.attention_scale = np.float32(1.0 / np.sqrt(hparams.head_dim_k))
        # The step being run and its rows by slot (`slot_runs`), found once for all layers.
        self._runs: tuple[StepBatch | None, list[SlotRun]] = (None, [])

    def device_info(self) -> dict[str, object]:
        # Row-independent matmuls: a token's logits do not depend on the rows beside it.
        return {"backend": self.name, "device": "cpu", "threads": self.threads,
                "batch_invariant": True, "kv_dtype": self.kv_dtype}  # fmt: skip

    def to_host(self, values: np.ndarray) -> np.ndarray:
        return values

    def run_step(
        self,
        batch: StepBatch,
        forward: Callable[[StepBatch], np.ndarray],
        want_logits: bool,
        ahead: bool = False,
    ) -> StepOutput:
        self._ahead = None
        out = self._step(batch, forward, want_logits)
        if ahead and self.lookahead and not want_logits and self._fits_next(batch):
            self._ahead = (batch, out, forward)
        return replace(out, ahead=self._ahead is not None)

    def take_ahead(self, again: bool) -> StepOutput:
        if self._ahead is None:
            raise BackendError("no step was issued ahead")
        before, before_out, forward = self._ahead
        batch = before.next_decode(before_out.tokens)
        out = self._step(batch, forward, False)
        self._ahead = (batch, out, forward) if again and self._fits_next(batch) else None
        return replace(out, ahead=self._ahead is not None)

    def discard_ahead(self) -> None:
        self._ahead = None

    def _fits_next(self, batch: StepBatch) -> bool:
        """Whether the decode step after `batch` (a decode step) stays inside its slots."""
        return batch.decode_shaped and batch.next_decode_fits(self.n_ctx)

    @staticmethod
    def _step(
        batch: StepBatch, forward: Callable[[StepBatch], np.ndarray], want_logits: bool
    ) -> StepOutput:
        logits = forward(batch)
        picked = []
        for r, (row, position) in enumerate(zip(logits, batch.draw_positions, strict=True)):
            params, seed, recent = batch.sampling.row(r)
            picked.append(sample_row(row, params, seed, int(position), recent))
        return StepOutput(
            np.array([p.token for p in picked], dtype=np.int32),
            np.array([p.logprob for p in picked], dtype=np.float32),
            tuple(p.top for p in picked),
            logits if want_logits else None,
        )

    def warm_up(self) -> None:
        """Compile the kernels now (the daemon's warm-up, before `ready`), not on the first
        step."""
        numba.set_num_threads(self.threads)
        compile_kernels(self.kv_dtype)

    # --- weights -------------------------------------------------------------------
    def weights_uploaded(self, tensors: Iterable[WeightTensor]) -> None:
        """After the upload: the weights are copies, so the file's pages (the header's too)
        leave the RSS."""
        drop_mapped_pages(tensors, whole_files=True)

    def linear(self, *tensors: WeightTensor) -> BlockMatrix | np.ndarray:
        """A BlockMatrix where every tensor is Q4_0/Q8_0, else float32 [n_out, n_in]; the
        tensors' file pages leave the RSS right after, so that the load's peak is about the
        weights held plus the matrix in hand."""
        if all(is_block_quantized(t) for t in tensors):
            matrix = BlockMatrix.from_tensors(*tensors)
        else:
            matrix = np.ascontiguousarray(np.concatenate([dequantize(t) for t in tensors]))
        drop_mapped_pages(tensors)
        return matrix

    def vector(self, tensor: WeightTensor) -> np.ndarray:
        return dequantize(tensor)

    def embedding(self, tensor: WeightTensor) -> BlockMatrix | np.ndarray:
        return self.linear(tensor)

    # --- forward ops -----------------------------------------------------------------
    def embed(self, table: BlockMatrix | np.ndarray, batch: StepBatch) -> np.ndarray:
        if isinstance(table, BlockMatrix):
            return table.rows(batch.tokens)
        return table[batch.tokens].astype(np.float32)

    def _matmul(self, x: np.ndarray, weight: BlockMatrix | np.ndarray) -> np.ndarray:
        if self.activations == "f32":
            dense = weight.dense if isinstance(weight, BlockMatrix) else weight
            return rowwise_matmul(x, dense)
        if isinstance(weight, BlockMatrix):
            numba.set_num_threads(self.threads)  # per calling thread: set where it runs
            return q8_matmul(x, weight)
        return rowwise_matmul(quantize_q8(x), weight)

    def norm_matmul(self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """The matmul of x normalized: `rms_normalize`'s float32 arithmetic, compiled
        (`rms_norm_rows`; x and the gain are float32 here)."""
        normed = np.empty(x.shape, dtype=np.float32)
        rms_norm_rows(x, norm, self.hparams.rms_eps, normed)
        return self._matmul(normed, weight)

    def norm_qkv_rope(
        self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray, layer: int, batch: StepBatch
    ) -> np.ndarray:
        """q of the normalized QKV projection, rotated; k and v rotated into the KV pool."""
        return self.rope_kv_append(self.norm_matmul(x, norm, weight), layer, batch)

    def rope_kv_append(self, qkv: np.ndarray, layer: int, batch: StepBatch) -> np.ndarray:
        """Adjacent-pair RoPE of q's and k's heads (one compiled pass, `rope_rows`) at the
        rows' positions; k and v into the KV pool, in its format (fp16: numpy's cast; fp8:
        `float32_to_e4m3`), from float32."""
        hp = self.hparams
        n, heads = qkv.shape[0], hp.n_head + hp.n_head_kv
        qk = qkv[:, : hp.q_dim + hp.kv_dim_k].reshape(n, heads, hp.head_dim_k)
        rotated = np.empty(qk.shape, dtype=np.float32)
        rope_rows(qk, batch.positions, self.rope_cos, self.rope_sin, rotated)
        v = qkv[:, hp.q_dim + hp.kv_dim_k :].reshape(n, hp.n_head_kv, hp.head_dim_v)
        entries = (batch.slots, batch.positions)
        self.k_cache[layer][entries] = self._pool_elements(rotated[:, hp.n_head :])
        self.v_cache[layer][entries] = self._pool_elements(v)
        return rotated[:, : hp.n_head]

    def _pool_elements(self, x: np.ndarray) -> np.ndarray:
        """float32 values as the pool takes them: as they are for fp16 (the assignment casts
        them, to nearest even), as fp8 E4M3 bytes for fp8."""
        return float32_to_e4m3(x) if self.kv_dtype == "fp8" else x

    def attention(self, q: np.ndarray, layer: int, batch: StepBatch) -> np.ndarray:
        """Causal grouped-query attention of each token over its own slot's cache.

        Each row by the compiled kernel (`cpu_attention.attend`): its own operations, in one
        order, whether it is decoded alone, batched with other sessions or in a prompt chunk.
        """
        hp = self.hparams
        queries = np.ascontiguousarray(q).reshape(q.shape[0], hp.n_head, hp.head_dim_k)
        out = np.empty((q.shape[0], hp.n_head, hp.head_dim_v), dtype=np.float32)
        planned, runs = self._runs
        if planned is not batch:
            runs = slot_runs(batch)
            self._runs = (batch, runs)
        bits = _pool_bits(self.kv_dtype)
        for run in runs:
            keys = self.keys_t[layer][run.slot].view(bits)  # [Hkv, D, n_ctx]
            values = self.v_cache[layer][run.slot].view(bits)  # [n_ctx, Hkv, D]
            mixed = out[run.rows]  # a view of the rows where they are a slice, else a copy
            with PARALLEL_KERNELS:
                attend(queries[run.rows], keys, values, run.positions, self.attention_scale, mixed)
            if not isinstance(run.rows, slice):
                out[run.rows] = mixed
        return out.reshape(q.shape[0], hp.n_head * hp.head_dim_v)

    def matmul_add(self, x: np.ndarray, weight: np.ndarray, residual: np.ndarray) -> np.ndarray:
        return residual + self._matmul(x, weight)

    def norm_gate_up_swiglu(
        self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray
    ) -> np.ndarray:
        gate_up = self.norm_matmul(x, norm, weight)
        gate, up = gate_up[:, : self.hparams.n_ff], gate_up[:, self.hparams.n_ff :]
        return silu(gate) * up

    def lm_head(
        self, x: np.ndarray, norm: np.ndarray, weight: np.ndarray, batch: StepBatch
    ) -> np.ndarray:
        return self.norm_matmul(x[batch.logit_rows], norm, weight)
