"""Reading a GGUF file's metadata: one scalar value by its key, an array's values, a float32
value as the decimal it was written from (the GGUF conversion modules' one way: gguf_convert.py,
gguf_moe.py, gguf_deepseek.py, gguf_qwen35.py, gguf_lfm2moe.py); and the skeleton of a family's
tensor converter that names tensors back per layer (`LayerTensors`: gguf_lfm2moe.py,
gguf_falcon_h1.py)."""

from __future__ import annotations

import re

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


def arch_field(reader: GGUFReader, arch: str, key: str, default=None):
    """The scalar metadata value `<arch>.<key>` (field_value's), else `default`; a ValueError
    naming the key where the file has none and no default is given (a family's config builder
    reads its keys through this)."""
    found = field_value(reader, f"{arch}.{key}")
    if found is None and default is None:
        raise ValueError(f"{arch} GGUF: no {arch}.{key}")
    return default if found is None else found


def field_array(reader: GGUFReader, key: str) -> list | None:
    """The values of the array metadata `key` (a per-layer count), or None where the file has
    none."""
    field = reader.fields.get(key)
    return None if field is None else [field.parts[i].tolist()[0] for i in field.data]


def as_written(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class LayerTensors:
    """The skeleton of a family's tensor converter (gguf_convert's `convert(name, arr)` ->
    [(hub name, array)], then `check_complete()`): a tensor outside the blocks is named back whole
    through `names` (GGUF name -> the hub's); a block's, `blk.N.rest`, has N checked against the
    file's `layers` and counted, and the family's `layer_tensors(name, prefix, rest, arr)` says
    what it becomes (prefix: `model.layers.N.`); `check_complete` names the layers that had
    none."""

    family = ""  # the architecture, for the messages

    def __init__(self, names: dict[str, str], layers: int):
        self.names, self.layers = names, layers
        self.seen: set[int] = set()

    def unknown(self, name: str) -> ValueError:
        return ValueError(f"{self.family} GGUF tensor {name!r} is not one this loader knows")

    def convert(self, name: str, arr: np.ndarray):
        match = _BLOCK_RE.match(name)
        if match is None:
            if name not in self.names:
                raise self.unknown(name)
            return [(self.names[name], arr)]
        layer, rest = int(match.group(1)), match.group(2)
        if layer >= self.layers:
            raise ValueError(
                f"{self.family} GGUF tensor {name!r}: past the file's {self.layers} layers"
            )
        self.seen.add(layer)
        return self.layer_tensors(name, f"model.layers.{layer}.", rest, arr)

    def layer_tensors(self, name: str, prefix: str, rest: str, arr: np.ndarray) -> list:
        raise NotImplementedError

    def check_complete(self) -> None:
        missing = sorted(set(range(self.layers)) - self.seen)
        if missing:
            raise ValueError(f"{self.family} GGUF: layers {missing} have no tensors")
