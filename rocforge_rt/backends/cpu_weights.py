"""The CPU backend's weights: their layout in memory, and what holding them costs.

Q4_0 and Q8_0 weights stay quantized: their blocks' packed quants and fp16 scales
(`BlockMatrix`), the file's bytes, read from it a tile at a time, in the compiled kernels'
tiled layout (`cpu_kernels`); F16/F32 ones are dequantized to float32 at load (`dequantize`).
`held_bytes` is what the backend holds for a matrix (the start-up memory check's figure), and
`drop_mapped_pages` takes a tensor's file pages out of the resident set once it is copied.
"""

import contextlib
import mmap
from collections.abc import Iterable, Sequence
from functools import cached_property

import numpy as np
from gguf import GGMLQuantizationType, quants

from rocforge_rt.backends.cpu_kernels import LANES
from rocforge_rt.model.gguf_file import WeightTensor

Q8_BLOCK = 32  # elements per quant block; the canonical sum takes them in stages of two

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
        mapping = tensor.mapping
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
