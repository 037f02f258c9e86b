"""Reading a GGUF file's metadata: one scalar value by its key, an array's values, a float32
value as the decimal it was written from (the GGUF conversion modules' one way: gguf_convert.py,
gguf_moe.py, gguf_deepseek.py, gguf_qwen35.py, gguf_lfm2moe.py)."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType


def field_value(reader: GGUFReader, key: str):
    """The scalar metadata value of `key` (a string decoded), or None where the file has none."""
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def field_array(reader: GGUFReader, key: str) -> list | None:
    """The values of the array metadata `key` (a per-layer count), or None where the file has
    none."""
    field = reader.fields.get(key)
    return None if field is None else [field.parts[i].tolist()[0] for i in field.data]


def as_written(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))
