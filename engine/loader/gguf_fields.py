"""Reading a GGUF file's metadata: one scalar value by its key (the GGUF conversion modules'
one way: gguf_convert.py, gguf_moe.py, gguf_deepseek.py)."""

from __future__ import annotations

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
