"""GGUF metadata as plain Python values."""

from pathlib import Path
from typing import Any

import gguf
from gguf import GGUFValueType


def field_value(field: gguf.ReaderField) -> Any:
    """Convert one reader field to str, int, float, bool or a list of those."""
    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        item_type = field.types[-1]
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    if field.types[0] == GGUFValueType.BOOL:
        return bool(value)
    return value


def read_metadata(source: gguf.GGUFReader | str | Path) -> dict[str, Any]:
    """All key/value pairs of a GGUF file (or an open reader), values as plain Python."""
    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source, "r")
    return {name: field_value(field) for name, field in reader.fields.items()}
