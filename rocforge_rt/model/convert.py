"""Requantize a llama GGUF to the Q4_0 layout this runtime runs.

Every 2-D linear weight (attention, FFN and a separate output.weight) goes
source type -> f32 (`gguf.quants.dequantize`) -> Q4_0 (`gguf.quants.quantize`);
Q4_0 weights are copied as they are. token_embd is kept when it is Q8_0, Q4_0,
F16 or F32 (Q4_1 or BF16 embeddings become Q8_0); norms are stored as F32.
All metadata is copied with its original value types, `general.file_type`
becomes MOSTLY_Q4_0, and tensor order is kept. The output is written atomically.
"""

from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValue, GGUFValueType, LlamaFileType, quants

from rocforge_rt.errors import ModelFormatError
from rocforge_rt.model.gguf_file import (
    LINEAR_SUFFIXES,
    ModelFile,
    TensorOut,
    WeightTensor,
    copy_metadata,
    model_from_reader,
    open_gguf,
    write_gguf,
)

Q = GGMLQuantizationType
LINEAR_SOURCE_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32)
EMBEDDING_KEPT_TYPES = (Q.Q4_0, Q.Q8_0, Q.F16, Q.F32)
EMBEDDING_REQUANTIZED_TYPES = (Q.Q4_1, Q.BF16)
NORM_SOURCE_TYPES = (Q.F32, Q.F16, Q.BF16)


def convert_to_q4_0(src: Path, dst: Path, *, progress: bool = True) -> Path:
    """Write `src` with Q4_0 linear weights to `dst`; return `dst`.

    The source must be a valid llama GGUF apart from its tensor types (checked
    before anything is written); a tensor type that cannot be converted raises
    ModelFormatError naming the tensor and its type.
    """
    src, dst = Path(src), Path(dst)
    reader = open_gguf(src)
    model = model_from_reader(src, reader, check_types=False)
    tensors = [_plan(model, t) for t in model.tensors.values()]
    metadata = copy_metadata(reader)
    metadata["general.file_type"] = GGUFValue(int(LlamaFileType.MOSTLY_Q4_0), GGUFValueType.UINT32)
    return write_gguf(dst, metadata, tensors, progress=progress, desc=f"converting {src.name}")


def _is_linear(name: str) -> bool:
    return name == "output.weight" or (
        name.startswith("blk.") and name.split(".")[-2] in LINEAR_SUFFIXES
    )


def _plan(model: ModelFile, t: WeightTensor) -> TensorOut:
    """How one source tensor is written: its output type and a producer of its data."""
    if _is_linear(t.name):
        allowed, out_type = LINEAR_SOURCE_TYPES, Q.Q4_0
    elif t.name == "token_embd.weight":
        allowed = EMBEDDING_KEPT_TYPES + EMBEDDING_REQUANTIZED_TYPES
        out_type = t.ggml_type if t.ggml_type in EMBEDDING_KEPT_TYPES else Q.Q8_0
    else:  # a norm: validation admits no other tensor
        allowed, out_type = NORM_SOURCE_TYPES, Q.F32
    if t.ggml_type not in allowed:
        raise ModelFormatError(
            f"{model.path}: tensor {t.name!r}: expected one of "
            f"{', '.join(q.name for q in allowed)}, found {t.ggml_type.name}; "
            "this type cannot be converted: export the model again as F16, BF16 or Q8_0"
        )
    if out_type == t.ggml_type:
        return TensorOut(t.name, out_type, t.shape, partial(np.asarray, t.data))
    return TensorOut(t.name, out_type, t.shape, partial(_requantize, t, out_type))


def _requantize(t: WeightTensor, out_type: GGMLQuantizationType) -> np.ndarray:
    # gguf.quants reads every type from its raw bytes (BF16 included, held as uint16)
    values = quants.dequantize(t.data.view(np.uint8), t.ggml_type).reshape(t.shape)
    return quants.quantize(values.astype(np.float32, copy=False), out_type)
