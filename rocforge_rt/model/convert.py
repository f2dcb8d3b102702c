"""Requantize a llama GGUF of any tensor type gguf.quants reads to the layout this runtime runs.

Source types: every type `gguf.quants.dequantize` implements (`SOURCE_TYPES`, found by
asking gguf itself, not a hand list): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the
K-quants Q2_K-Q6_K, the IQ and ternary types and MXFP4 with gguf 0.19. Output:

- attention and FFN weights (blk.N.*): Q4_0; Q4_0 sources are copied as they are;
- token_embd: kept when Q8_0, Q4_0, F16 or F32, else Q8_0;
- a separate output.weight: kept when Q8_0 or Q4_0, else Q8_0 (a matmul every step:
  Q8_0 keeps the precision a K-quant file gives it, F16/F32 would cost bandwidth);
- norms: F32;
- rope_freqs.weight (Llama 3.1's RoPE frequency factors, F32 by validation): copied.

Each tensor goes source bytes -> f32 -> output type a slice of rows at a time
(`CHUNK_VALUES` values), so memory holds one output tensor and one slice of f32, never
the model in f32. All metadata is copied with its original value types,
`general.file_type` becomes MOSTLY_Q4_0, and tensor order is kept. The output is written
atomically (nothing is left at `dst` on failure or Ctrl-C) with a per-tensor progress bar.

The returned `ConversionReport` measures what requantization cost: for each (source type,
output type), the RMS of (requantized - source) relative to the RMS of the source, both
as f32, and the worst tensor.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFValue,
    GGUFValueType,
    LlamaFileType,
    quants,
)

from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model.gguf_file import (
    LINEAR_SUFFIXES,
    ModelFile,
    WeightTensor,
    model_from_reader,
    open_gguf,
)
from rocforge_rt.model.gguf_writer import TensorOut, copy_metadata, write_gguf
from rocforge_rt.model.tokenizer import Tokenizer

Q = GGMLQuantizationType
EMBEDDING_KEPT_TYPES = (Q.Q4_0, Q.Q8_0, Q.F16, Q.F32)
OUTPUT_KEPT_TYPES = (Q.Q4_0, Q.Q8_0)
CHUNK_VALUES = 1 << 22  # values requantized at a time: 16 MiB of f32 per buffer


def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf.quants can dequantize `qtype` (asked on one all-zero block)."""
    try:
        type_size = GGML_QUANT_SIZES[qtype][1]
        quants.dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except Exception:  # NotImplementedError, or a type gguf has no block size for
        return False
    return True


SOURCE_TYPES = tuple(q for q in Q if _dequantizable(q))


@dataclass(frozen=True)
class TensorReport:
    """What converting one tensor cost: squared error and squared source, summed as f64."""

    name: str
    source_type: GGMLQuantizationType
    output_type: GGMLQuantizationType
    elements: int
    error_sq: float  # sum of (requantized - source)^2
    source_sq: float  # sum of source^2
    copied: bool  # the bytes were copied: no error by construction

    @property
    def rel_rms(self) -> float:
        return _rel_rms(self.error_sq, self.source_sq)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source_type": self.source_type.name,
            "output_type": self.output_type.name,
            "elements": self.elements,
            "rel_rms": self.rel_rms,
            "copied": self.copied,
        }


@dataclass(frozen=True)
class TypeReport:
    """One (source type, output type) pair over all its tensors."""

    source_type: GGMLQuantizationType
    output_type: GGMLQuantizationType
    tensors: tuple[TensorReport, ...]

    @property
    def rel_rms(self) -> float:
        """RMS of the error over all the pair's values, relative to their RMS."""
        return _rel_rms(
            sum(t.error_sq for t in self.tensors), sum(t.source_sq for t in self.tensors)
        )

    @property
    def copied(self) -> bool:
        return all(t.copied for t in self.tensors)

    @property
    def worst(self) -> TensorReport:
        return max(self.tensors, key=lambda t: t.rel_rms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source_type": self.source_type.name,
            "output_type": self.output_type.name,
            "tensors": len(self.tensors),
            "elements": sum(t.elements for t in self.tensors),
            "rel_rms": self.rel_rms,
            "copied": self.copied,
            "worst_tensor": self.worst.name,
            "worst_rel_rms": self.worst.rel_rms,
        }


@dataclass(frozen=True)
class ConversionReport:
    """The converted file and what requantizing each tensor cost."""

    path: Path
    tensors: tuple[TensorReport, ...]  # in file order

    @property
    def by_type(self) -> tuple[TypeReport, ...]:
        """One entry per (source type, output type), in order of first appearance."""
        groups: dict[tuple[Q, Q], list[TensorReport]] = {}
        for t in self.tensors:
            groups.setdefault((t.source_type, t.output_type), []).append(t)
        return tuple(TypeReport(s, o, tuple(ts)) for (s, o), ts in groups.items())

    def pair(self, source: GGMLQuantizationType, output: GGMLQuantizationType) -> TypeReport:
        """The entry of one (source type, output type); StopIteration if none."""
        return next(g for g in self.by_type if (g.source_type, g.output_type) == (source, output))

    @property
    def worst(self) -> TensorReport | None:
        """The requantized tensor with the largest relative RMS error (None: all copied)."""
        changed = [t for t in self.tensors if not t.copied]
        return max(changed, key=lambda t: t.rel_rms) if changed else None

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "path": str(self.path),
            "types": [g.to_dict() for g in self.by_type],
            "worst": worst.to_dict() if worst else None,
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def format(self) -> str:
        """The report as text: a line per (source, output) type pair, then the worst tensor."""
        lines = [
            "requantization error: RMS(requantized - source) / RMS(source), as f32",
            f"  {'source':>7} -> {'output':<6} {'tensors':>7} {'rel RMS':>9}  worst tensor",
        ]
        for g in self.by_type:
            pair = f"  {g.source_type.name:>7} -> {g.output_type.name:<6} {len(g.tensors):>7}"
            if g.copied:
                lines.append(f"{pair} {'copied':>9}")
            else:
                w = g.worst
                lines.append(f"{pair} {g.rel_rms:>9.4f}  {w.rel_rms:.4f} {w.name}")
        worst = self.worst
        lines.append(
            "worst: nothing requantized (every tensor copied)"
            if worst is None
            else f"worst: {worst.name} ({worst.source_type.name} -> "
            f"{worst.output_type.name}): {worst.rel_rms:.4f}"
        )
        return "\n".join(lines)


def _rel_rms(error_sq: float, source_sq: float) -> float:
    if source_sq > 0:
        return math.sqrt(error_sq / source_sq)
    return 0.0 if error_sq == 0 else math.inf


def convert_to_q4_0(src: Path, dst: Path, *, progress: bool = True) -> ConversionReport:
    """Write `src` in the runtime's layout (module docstring) to `dst`; report the cost.

    The source must be a valid llama GGUF apart from its tensor types, with a vocabulary
    the tokenizer reads (or none); that and every tensor's type are checked before
    anything is written: a type gguf.quants cannot dequantize raises ModelFormatError
    naming the tensor, its type and SOURCE_TYPES.
    """
    src, dst = Path(src), Path(dst)
    reader = open_gguf(src)
    model = model_from_reader(src, reader, check_types=False)
    _check_vocabulary(model)
    plan = [(t, _output_type(model, t)) for t in model.tensors.values()]
    reports: list[TensorReport] = []
    tensors = [
        TensorOut(t.name, out_type, t.shape, partial(_convert, t, out_type, reports.append))
        for t, out_type in plan
    ]
    metadata = copy_metadata(reader)
    metadata["general.file_type"] = GGUFValue(int(LlamaFileType.MOSTLY_Q4_0), GGUFValueType.UINT32)
    write_gguf(dst, metadata, tensors, progress=progress, desc=f"converting {src.name}")
    return ConversionReport(dst, tuple(reports))


def _check_vocabulary(model: ModelFile) -> None:
    """A vocabulary the runtime cannot read fails now, not when the converted file loads."""
    if model.metadata.get("tokenizer.ggml.model") == "none":  # token ids only
        return
    try:
        Tokenizer.from_metadata(model.metadata)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{model.path}: {exc}") from None


def _output_type(model: ModelFile, t: WeightTensor) -> GGMLQuantizationType:
    """The type `t` is written as; ModelFormatError if it cannot be."""
    if t.ggml_type not in SOURCE_TYPES:
        raise ModelFormatError(
            f"{model.path}: tensor {t.name!r}: expected a type gguf.quants can dequantize "
            f"({', '.join(q.name for q in SOURCE_TYPES)}), found {t.ggml_type.name}; "
            "this type cannot be converted: export the model again as F16, BF16, Q8_0 "
            "or a K-quant"
        )
    if t.name == "token_embd.weight":
        out = t.ggml_type if t.ggml_type in EMBEDDING_KEPT_TYPES else Q.Q8_0
    elif t.name == "output.weight":
        out = t.ggml_type if t.ggml_type in OUTPUT_KEPT_TYPES else Q.Q8_0
    elif t.name.startswith("blk.") and t.name.split(".")[-2] in LINEAR_SUFFIXES:
        out = Q.Q4_0
    else:  # a norm, or rope_freqs.weight (F32, so copied): validation admits no other
        out = Q.F32
    block_size = GGML_QUANT_SIZES[out][0]
    if out != t.ggml_type and t.shape[-1] % block_size:
        raise ModelFormatError(
            f"{model.path}: tensor {t.name!r}: expected rows of a multiple of {block_size} "
            f"values to write it as {out.name}, found shape {t.shape}; this model's shape "
            "cannot run here"
        )
    return out


def _convert(
    t: WeightTensor, out_type: GGMLQuantizationType, record: Callable[[TensorReport], None]
) -> np.ndarray:
    """`t`'s data in `out_type` (raw file layout); records its error."""
    elements = math.prod(t.shape)
    if out_type == t.ggml_type:
        record(TensorReport(t.name, t.ggml_type, out_type, elements, 0.0, 0.0, copied=True))
        return np.asarray(t.data)
    data, error_sq, source_sq = requantize(t, out_type)
    record(TensorReport(t.name, t.ggml_type, out_type, elements, error_sq, source_sq, False))
    return data


def requantize(
    t: WeightTensor, out_type: GGMLQuantizationType, chunk_values: int | None = None
) -> tuple[np.ndarray, float, float]:
    """`t` as `out_type` bytes (rows, row bytes), with the sums of squared error and of
    squared source values. Rows go through f32 `chunk_values` values at a time (at least
    one row; default CHUNK_VALUES): memory never holds the tensor in f32."""
    n_in = t.shape[-1]
    n_rows = math.prod(t.shape) // n_in
    rows = t.data.view(np.uint8).reshape(n_rows, -1)  # gguf.quants reads raw bytes (BF16 too)
    block_size, type_size = GGML_QUANT_SIZES[out_type]
    out = np.empty((n_rows, n_in // block_size * type_size), dtype=np.uint8)
    step = max(1, (chunk_values or CHUNK_VALUES) // n_in)
    error_sq = source_sq = 0.0
    for start in range(0, n_rows, step):
        values = quants.dequantize(rows[start : start + step], t.ggml_type)
        values = values.astype(np.float32, copy=False)
        packed = quants.quantize(values, out_type)
        diff = quants.dequantize(packed.view(np.uint8), out_type) - values
        error_sq += float(np.add.reduce(np.square(diff).ravel(), dtype=np.float64))
        source_sq += float(np.add.reduce(np.square(values).ravel(), dtype=np.float64))
        out[start : start + step] = packed.view(np.uint8)
    return out, error_sq, source_sq
