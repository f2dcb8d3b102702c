"""GGUF model files: memory-mapped loading with validation (writing them: gguf_writer.py).

`load_model_file` maps a GGUF read-only (tensor data is never copied) and checks
that it describes a llama-family model this runtime can run: metadata, RoPE
form and scaling (a linear factor and Llama 3.1's rope_freqs.weight are read into the
hyper-parameters; any other scaling is refused), tensor set, shapes and types. Every
problem raises `ModelFormatError` naming the file, the key or tensor, what was expected,
what was found and the fix.
"""

import functools
import mmap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from rocforge_rt.errors import LoadCancelled, ModelFormatError
from rocforge_rt.model.gguf_metadata import read_metadata
from rocforge_rt.model.hparams import HParams

Q = GGMLQuantizationType
LINEAR_SUFFIXES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
NORM_SUFFIXES = ("attn_norm", "ffn_norm")
EMBEDDING_TYPES = (Q.Q4_0, Q.Q8_0, Q.F16, Q.F32)
SUPPORTED_VERSIONS = (2, 3)
CONVERT_FIX = "convert it with `rocforge convert IN OUT`"
REDOWNLOAD_FIX = "re-download the file (or re-run the conversion that wrote it)"
RECONVERT_FIX = (
    "re-convert the original model with llama.cpp's convert_hf_to_gguf.py, "
    "then `rocforge convert IN OUT`"
)
MISSING_KEY_FIX = "the file is not a complete llama GGUF; " + RECONVERT_FIX


@dataclass(frozen=True)
class WeightTensor:
    """One tensor of a model file, its data a zero-copy view of the mapped file."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: (n_out, n_in) for 2-D weights, (n,) for norms
    data: np.ndarray  # quantized: uint8 (n_out, row_bytes); F32/F16 as such; BF16 as uint16
    mapping: mmap.mmap | None = None  # the file mapping `data` views (None: in memory)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class ModelFile:
    """A validated llama GGUF: metadata as plain values, hyper-parameters, mapped tensors."""

    path: Path
    metadata: dict[str, Any]
    hparams: HParams
    tensors: dict[str, WeightTensor]

    def tensor(self, name: str) -> WeightTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    def layer(self, i: int, suffix: str) -> WeightTensor:
        """The weight `blk.{i}.{suffix}.weight`, e.g. layer(3, "attn_q")."""
        return self.tensor(f"blk.{i}.{suffix}.weight")

    @property
    def lm_head(self) -> WeightTensor:
        """output.weight, or token_embd.weight when the embeddings are tied."""
        return self.tensors.get("output.weight") or self.tensors["token_embd.weight"]


def load_model_file(path: str | Path, should_stop: Callable[[], bool] | None = None) -> ModelFile:
    """Map and validate a Q4_0 llama GGUF (see the module docstring); LoadCancelled as soon as
    `should_stop()` is true while its header is read (seconds for a large vocabulary)."""
    path = Path(path)
    return model_from_reader(path, open_gguf(path, should_stop))


def _error(path: Path, subject: str, expected: str, found: str, fix: str) -> ModelFormatError:
    return ModelFormatError(f"{path}: {subject}: expected {expected}, found {found}; {fix}")


class _PastEndOfFile(Exception):
    def __init__(self, end: int, part: str) -> None:
        super().__init__(end, part)
        self.end, self.part = end, part


@functools.cache
def _itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


class _BoundedReader(gguf.GGUFReader):
    """GGUFReader that reports a read past the end of the file instead of short arrays, and
    stops (LoadCancelled) between two of its reads once `should_stop()` is true."""

    def __init__(self, path: Path, should_stop: Callable[[], bool] | None) -> None:
        self._should_stop = should_stop
        self._path = path
        self.mapping: mmap.mmap | None = None  # the file, mapped read-only (`data`)
        super().__init__(path, "r")

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, _memmap: np.ndarray) -> None:
        # gguf-py maps the file as an np.memmap; this reader maps it itself and reads it as
        # a plain array: gguf-py takes a view of it for each part of each field (some 150,000
        # for a 49k-token vocabulary), np.memmap's cost 3x a plain array's (seconds of a
        # warm start), and the tensors keep the mapping (`WeightTensor.mapping`).
        with self._path.open("rb") as f:
            self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self.mapping, np.uint8)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        if self._should_stop is not None and self._should_stop():
            raise LoadCancelled("loading stopped: asked to stop")
        end = offset + _itemsize(dtype) * int(count)
        if end > len(self._data):
            # data_offset is set once the header and tensor table are parsed
            part = "tensor data" if hasattr(self, "data_offset") else "header"
            raise _PastEndOfFile(end, part)
        return super()._get(offset, dtype, count, override_order)


def open_gguf(path: str | Path, should_stop: Callable[[], bool] | None = None) -> _BoundedReader:
    """A read-only GGUFReader on `path`; any unreadable file raises ModelFormatError, and
    `should_stop` stops the reading (LoadCancelled)."""
    path = Path(path)
    if not path.exists():
        raise _error(path, "model file", "a GGUF file", "nothing at this path", "check the path")
    if path.is_dir():
        raise _error(path, "model file", "a GGUF file", "a directory", "pass the .gguf file")
    size = path.stat().st_size
    if size == 0:
        raise _error(path, "model file", "a GGUF file", "an empty file (0 bytes)", REDOWNLOAD_FIX)
    with path.open("rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise _error(
            path,
            "magic",
            "b'GGUF'",
            repr(head[:4]),
            "this is not a GGUF file; export the model to GGUF with llama.cpp's "
            "convert_hf_to_gguf.py, then " + CONVERT_FIX,
        )
    if len(head) < 8:
        raise _error(path, "file size", "at least 8 bytes", f"{size} bytes", REDOWNLOAD_FIX)
    version = int.from_bytes(head[4:8], "little")
    if version not in SUPPORTED_VERSIONS:
        raise _error(
            path,
            "GGUF version",
            " or ".join(map(str, SUPPORTED_VERSIONS)),
            str(version),
            "re-export the model with a current llama.cpp / gguf-py converter (little-endian)",
        )
    try:
        return _BoundedReader(path, should_stop)
    except LoadCancelled:
        raise
    except _PastEndOfFile as e:
        raise _error(
            path,
            "file size",
            f"at least {e.end} bytes (its {e.part} is cut short)",
            f"{size} bytes: the file is truncated",
            REDOWNLOAD_FIX,
        ) from None
    except Exception as e:
        raise _error(
            path,
            "GGUF structure",
            "a well-formed header and tensor table",
            f"{type(e).__name__}: {e}",
            "the file is corrupt; " + REDOWNLOAD_FIX,
        ) from e


def _int(path: Path, meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise _error(
            path, f"metadata key {key!r}", "an integer", "nothing (key missing)", MISSING_KEY_FIX
        )
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _error(
            path, f"metadata key {key!r}", "a positive integer", repr(value), RECONVERT_FIX
        )
    return value


def _float(path: Path, meta: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = meta.get(key, default)
    if value is None:
        raise _error(
            path, f"metadata key {key!r}", "a number", "nothing (key missing)", MISSING_KEY_FIX
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _error(path, f"metadata key {key!r}", "a positive number", repr(value), RECONVERT_FIX)
    return float(value)


ROPE_FREQS = "rope_freqs.weight"
ROPE_SCALING_TYPES = ("none", "linear")  # what rope.scaling.type may say; absent means linear
ROPE_SCALING_FIX = (
    "RoPE scaling is not supported: this runtime applies linear scaling and Llama 3.1-style "
    "frequency factors (rope_freqs.weight) only; use a model without other scaling "
    "(e.g. Llama 3.1/3.2/3.3, SmolLM2)"
)


def _rope_freq_scale(path: Path, meta: Mapping[str, Any], arch: str) -> float:
    """llama.cpp's freq_scale, 1 / the linear scaling factor; other scaling types are refused.

    As llama.cpp reads the file: rope.scaling.type defaults to linear; the factor is
    rope.scaling.factor when that key exists, else the older rope.scale_linear, and 0 (or
    neither key) means 1. Type 'none' with a factor other than 1 contradicts itself and is
    refused, as is a rope.scaling.attn_factor other than 1 (it would scale cos and sin).
    """
    type_key = f"{arch}.rope.scaling.type"
    kind = meta.get(type_key, "linear")
    if kind not in ROPE_SCALING_TYPES:
        supported = " or ".join(repr(k) for k in ROPE_SCALING_TYPES)
        raise _error(
            path, f"metadata key {type_key!r}", supported, repr(kind), f"{kind} " + ROPE_SCALING_FIX
        )
    factor_key = next(
        (k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear") if k in meta),
        None,
    )
    factor = 1.0
    if factor_key is not None:
        value = meta[factor_key]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not np.isfinite(value)
            or value < 0
        ):
            raise _error(
                path,
                f"metadata key {factor_key!r}",
                "a finite number > 0 (0: no scaling)",
                repr(value),
                RECONVERT_FIX,
            )
        factor = float(value) or 1.0  # llama.cpp reads 0 as "unset"
    if kind == "none" and factor != 1.0:
        raise _error(
            path,
            f"metadata key {factor_key!r}",
            f"1.0, as {type_key!r} is 'none'",
            repr(factor),
            "the file contradicts itself; " + RECONVERT_FIX,
        )
    attn_key = f"{arch}.rope.scaling.attn_factor"
    attn_factor = meta.get(attn_key, 1.0)
    if attn_factor != 1.0:
        raise _error(path, f"metadata key {attn_key!r}", "1.0", repr(attn_factor), ROPE_SCALING_FIX)
    # float32, as llama.cpp holds it (exact for powers of two)
    return float(np.float32(1.0) / np.float32(factor))


def _rope_freq_factors(
    path: Path, tensors: Mapping[str, WeightTensor], rope_dims: int
) -> tuple[float, ...] | None:
    """rope_freqs.weight's factors (one per rotated pair; each pair's frequency is divided by
    its factor), or None where the file has no such tensor."""
    t = tensors.get(ROPE_FREQS)
    if t is None:
        return None
    subject, half = f"tensor {ROPE_FREQS!r}", rope_dims // 2
    if t.ggml_type != Q.F32:
        raise _error(path, subject, "F32 (RoPE frequency factors)", t.ggml_type.name, RECONVERT_FIX)
    if t.shape != (half,):
        raise _error(
            path,
            subject,
            f"shape ({half},): a factor per rotated pair (rope.dimension_count {rope_dims} / 2)",
            f"shape {t.shape}",
            RECONVERT_FIX,
        )
    values = np.asarray(t.data, dtype=np.float32).reshape(half)
    bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
    if bad.size:
        i = int(bad[0])
        raise _error(
            path,
            subject,
            "finite factors > 0",
            f"{float(values[i])} at pair {i} ({bad.size} of {half} pairs bad)",
            "the file is corrupt; " + RECONVERT_FIX,
        )
    return tuple(float(v) for v in values)


def _read_hparams(path: Path, meta: Mapping[str, Any], n_vocab_embd: int, tied: bool) -> HParams:
    """Hyper-parameters from llama metadata, with llama.cpp's defaults for optional keys."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise _error(
            path,
            "metadata key 'general.architecture'",
            "'llama'",
            "nothing (key missing)" if arch is None else repr(arch),
            "only llama-family models (Llama 2/3, SmolLM2, ...) are supported",
        )
    n_embd = _int(path, meta, f"{arch}.embedding_length")
    n_head = _int(path, meta, f"{arch}.attention.head_count")
    n_head_kv = _int(path, meta, f"{arch}.attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise _error(
            path,
            f"metadata key '{arch}.attention.head_count_kv'",
            f"a divisor of head_count {n_head}",
            str(n_head_kv),
            RECONVERT_FIX,
        )
    head_dim_k = _int(path, meta, f"{arch}.attention.key_length", n_embd // n_head or None)
    rope_dims = _int(path, meta, f"{arch}.rope.dimension_count", head_dim_k)
    if rope_dims > head_dim_k or rope_dims % 2:
        raise _error(
            path,
            f"metadata key '{arch}.rope.dimension_count'",
            f"an even number <= key_length {head_dim_k}",
            str(rope_dims),
            RECONVERT_FIX,
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    return HParams(
        arch=arch,
        n_layer=_int(path, meta, f"{arch}.block_count"),
        n_embd=n_embd,
        n_ff=_int(path, meta, f"{arch}.feed_forward_length"),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=_int(path, meta, f"{arch}.attention.value_length", n_embd // n_head or None),
        n_vocab=_int(
            path, meta, f"{arch}.vocab_size", len(tokens) if tokens else n_vocab_embd or None
        ),
        n_ctx_train=_int(path, meta, f"{arch}.context_length"),
        rope_base=_float(path, meta, f"{arch}.rope.freq_base", 10000.0),
        rope_dims=rope_dims,
        rms_eps=_float(path, meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        tied_embeddings=tied,
        rope_freq_scale=_rope_freq_scale(path, meta, arch),
    )


def expected_tensors(hp: HParams) -> dict[str, tuple[tuple[int, ...], tuple[Q, ...]]]:
    """Every tensor a llama model needs: name -> (numpy shape, accepted types)."""
    q4 = (Q.Q4_0,)
    linear = {
        "attn_q": (hp.q_dim, hp.n_embd),
        "attn_k": (hp.kv_dim_k, hp.n_embd),
        "attn_v": (hp.kv_dim_v, hp.n_embd),
        "attn_output": (hp.n_embd, hp.n_head * hp.head_dim_v),
        "ffn_gate": (hp.n_ff, hp.n_embd),
        "ffn_up": (hp.n_ff, hp.n_embd),
        "ffn_down": (hp.n_embd, hp.n_ff),
    }
    spec = {"token_embd.weight": ((hp.n_vocab, hp.n_embd), EMBEDDING_TYPES)}
    if hp.rope_freq_factors is not None:  # not a weight: its values are in hp
        spec[ROPE_FREQS] = ((hp.rope_dims // 2,), (Q.F32,))
    for i in range(hp.n_layer):
        for suffix in NORM_SUFFIXES:
            spec[f"blk.{i}.{suffix}.weight"] = ((hp.n_embd,), (Q.F32,))
        for suffix, shape in linear.items():
            spec[f"blk.{i}.{suffix}.weight"] = (shape, q4)
    spec["output_norm.weight"] = ((hp.n_embd,), (Q.F32,))
    if not hp.tied_embeddings:
        spec["output.weight"] = ((hp.n_vocab, hp.n_embd), EMBEDDING_TYPES)
    return spec


def _weight_tensor(t: gguf.ReaderTensor, mapping: mmap.mmap | None) -> WeightTensor:
    data = t.data.view(np.uint16) if t.tensor_type == Q.BF16 else t.data
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return WeightTensor(t.name, Q(t.tensor_type), shape, data, mapping)


def model_from_reader(path: Path, reader: _BoundedReader, *, check_types: bool = True) -> ModelFile:
    """Validate an open GGUF as a llama model.

    `check_types=False` checks everything but tensor types (the converter's source check).
    """
    meta = read_metadata(reader)
    tensors = {t.name: _weight_tensor(t, reader.mapping) for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    hp = _read_hparams(path, meta, embd.shape[0] if embd else 0, "output.weight" not in tensors)
    hp = replace(hp, rope_freq_factors=_rope_freq_factors(path, tensors, hp.rope_dims))
    spec = expected_tensors(hp)
    for name, (shape, types) in spec.items():
        t = tensors.get(name)
        if t is None:
            raise _error(
                path,
                f"tensor {name!r}",
                f"present with shape {shape}",
                "nothing",
                "the file is incomplete; " + REDOWNLOAD_FIX,
            )
        if t.shape != shape:
            raise _error(
                path,
                f"tensor {name!r}",
                f"shape {shape} (from the metadata)",
                f"shape {t.shape}",
                RECONVERT_FIX,
            )
        if check_types and t.ggml_type not in types:
            raise _error(
                path,
                f"tensor {name!r}",
                " or ".join(q.name for q in types),
                t.ggml_type.name,
                f"convert it with `rocforge convert {path} OUT.gguf`",
            )
    extra = [t for t in tensors.values() if t.name not in spec]
    if extra:
        t = extra[0]
        raise _error(
            path,
            f"tensor {t.name!r}",
            "only the llama tensor set",
            f"an extra {t.ggml_type.name} tensor of shape {t.shape}",
            "this runtime would ignore it and compute wrong outputs",
        )
    return ModelFile(path, meta, hp, tensors)
