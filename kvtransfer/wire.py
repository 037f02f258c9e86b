"""Frames on the wire: a msgpack header (versioned, with the layout fingerprint) + raw KV bytes.

Frame = u32 little-endian header length | msgpack header | payload. Three kinds travel on one
channel, in order: "kv" chunks, then one "commit" (carrying the first token) or one "abort".
The payload of a "kv" chunk is one layer's K and V for tokens [start, end) and kv heads
[head_start, head_end), contiguous, in the header's dtype: shape
[2, end - start, head_end - head_start, head_dim]. Never pickle.
"""
from __future__ import annotations

import struct
from dataclasses import asdict, dataclass

import msgpack

WIRE_VERSION = 1
_LEN = struct.Struct("<I")


class WireError(ValueError):
    pass


KINDS = ("kv", "commit", "abort")


@dataclass(frozen=True)
class ChunkHeader:
    request_id: str
    fingerprint: str
    layer: int = 0
    start: int = 0      # token range [start, end) of the prompt
    end: int = 0
    head_start: int = 0  # global kv heads [head_start, head_end)
    head_end: int = 0
    head_dim: int = 0
    dtype: str = ""
    kind: str = "kv"
    first_token: int = -1   # "commit" only
    version: int = WIRE_VERSION
    in_place: bool = False  # "kv" only: the sender already wrote the KV into the receiver's cache (shm)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise WireError(f"frame kind {self.kind!r} is not one of {KINDS}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.end - self.start, self.head_end - self.head_start, self.head_dim)


def encode_frame(header: ChunkHeader, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """Pieces to write in order (no copy of the payload)."""
    head = msgpack.packb(asdict(header))
    return [_LEN.pack(len(head)), head, payload]


def decode_frame(data: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    view = memoryview(data)
    if len(view) < _LEN.size:
        raise WireError("frame shorter than its length prefix")
    (n,) = _LEN.unpack_from(view)
    try:
        fields = msgpack.unpackb(view[_LEN.size:_LEN.size + n])
    except Exception as e:
        raise WireError(f"bad frame header: {e}") from None
    version = fields.get("version") if isinstance(fields, dict) else None
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version!r} is not supported (this side speaks {WIRE_VERSION})")
    try:
        header = ChunkHeader(**fields)
    except (TypeError, WireError) as e:
        raise WireError(f"bad frame header fields: {e}") from None
    return header, view[_LEN.size + n:]
