"""Writing GGUF files: `write_gguf` is the one GGUF writer of the package (conversion and
synthetic models): it streams tensors one at a time (`TensorOut`) into a temporary file that
replaces the destination only once complete (`atomic_output`). `copy_metadata` carries a
read GGUF's keys over with their value types.
"""

import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValue, GGUFValueType
from tqdm import tqdm


@dataclass(frozen=True)
class TensorOut:
    """A tensor to write: its data is produced only when the writer reaches it."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order, in elements
    produce: Callable[[], np.ndarray]  # raw file layout (uint8 blocks for quantized types)

    @property
    def nbytes(self) -> int:
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // block_size * type_size


@contextmanager
def atomic_output(dst: Path) -> Iterator[Path]:
    """Yield a temporary path beside `dst`; it replaces `dst` only if the block completes.

    On any exception (KeyboardInterrupt included) the temporary file is removed,
    so a half-written `dst` never exists.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_gguf(
    dst: Path,
    metadata: Mapping[str, GGUFValue],
    tensors: Sequence[TensorOut],
    *,
    progress: bool = True,
    desc: str = "writing",
) -> Path:
    """Write a GGUF atomically, streaming tensor data one tensor at a time.

    `metadata` maps every key (general.architecture included) to its value and GGUF
    type, in file order; general.alignment, when present, also sets the data alignment.
    """
    dst = Path(dst)
    arch = metadata["general.architecture"].value
    arch = arch.decode() if isinstance(arch, bytes) else arch
    with atomic_output(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            for key, value in metadata.items():
                if key == "general.alignment":
                    writer.add_custom_alignment(int(value.value))
                elif key != "general.architecture":  # the writer adds it first
                    writer.add_key_value(key, value.value, value.type, value.sub_type)
            for t in tensors:
                # a float dtype tells the writer `shape` is in elements, not bytes
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, t.ggml_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            with tqdm(tensors, desc=desc, unit="tensor", disable=not progress) as bar:
                for t in bar:
                    bar.set_postfix_str(t.name, refresh=False)
                    writer.write_tensor_data(np.ascontiguousarray(t.produce()))
        finally:
            writer.close()
    return dst


def copy_metadata(reader: gguf.GGUFReader) -> dict[str, GGUFValue]:
    """All key/value pairs of a GGUF with their original value types, ready for write_gguf.

    Strings stay raw bytes (no decode round trip). Empty arrays are dropped: a GGUF
    writer cannot write them, and they carry no values.
    """
    out: dict[str, GGUFValue] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or not field.data:
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub_type = field.types[-1]
            value: Any = [_raw_value(field.parts[i], sub_type) for i in field.data]
            out[key] = GGUFValue(value, vtype, sub_type)
        else:
            out[key] = GGUFValue(_raw_value(field.parts[field.data[0]], vtype), vtype)
    return out


def _raw_value(part: np.ndarray, vtype: GGUFValueType) -> Any:
    return bytes(part) if vtype == GGUFValueType.STRING else part.tolist()[0]
