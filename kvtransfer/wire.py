"""Frames on the wire: a msgpack header (versioned, with the layout fingerprint) + raw KV bytes.

Frame = u32 little-endian header length | msgpack header | payload. Five kinds travel on one
channel, in order: "kv" chunks (and for a hybrid model one "state" frame per linear-attention
layer; with an EAGLE head, "draft" chunks), then one "commit" (carrying every sequence's first token in first_tokens, one for n=1;
with logprobs, theirs in first_logprobs) or one "abort". A request
whose KV comes over several channels (a pipelined prefill worker: each stage pushes its own
layers) marks its commit await_kv, since the other channels' frames may land after it.
The payload of a "kv" chunk is one layer's K and V for tokens [start, end) and kv heads
[head_start, head_end), contiguous, in the header's dtype: shape
[2, end - start, head_end - head_start, head_dim]. The payload of a "state" frame is linear
layer `layer`'s recurrent state after the prompt (engine/recurrent_state.py): its conv window,
then its delta-rule matrices, float32, contiguous, as large as the receiver's slot holds.
A "draft" chunk is laid out as a "kv" chunk of layer 0 of an EAGLE head's own cache
(engine/spec/eagle.py), its fingerprint the head's layout's. Never pickle.

A header is checked field by field when it is built (so also when one is decoded): types,
lengths of strings and non-negative bounded ints, before any receiver does work with them. What
needs the receiver's layout (layer < num_layers, the head range, the prompt length) is checked
where the layout is known (kvtransfer.reshard.check_chunk); the first token's range against the
vocabulary is the decode worker's.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass

import msgpack

from pdserve.protos.limits import MAX_ID_CHARS, MAX_N

WIRE_VERSION = 2  # 2: a commit's first tokens are one list (first_tokens), whatever n
_LEN = struct.Struct("<I")
MAX_REQUEST_ID_CHARS = MAX_ID_CHARS  # what the router accepts as a request_id
MAX_FINGERPRINT_CHARS = 64
MAX_DTYPE_CHARS = 32
MAX_GRANT_CHARS = 64
MAX_TRACEPARENT_CHARS = 64  # W3C traceparent version 00 is 55 characters
# fields left out of an encoded header when empty: the frames of backends and requests that do
# not use them stay as they were
OMIT_WHEN_EMPTY = ("grant", "traceparent", "await_kv")
MAX_HEADER_BYTES = 4096  # a legal header is well under 2 KiB
MAX_INDEX = 1 << 31  # layers, tokens, heads, head_dim
_INT64 = 1 << 63


class WireError(ValueError):
    """A frame that cannot be used. request_id: the request it names, when that much was readable
    (the server then fails that request instead of only dropping the frame)."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


KINDS = ("kv", "commit", "abort", "state", "draft")
PAYLOAD_KINDS = ("kv", "state", "draft")  # (a "kv" frame written in place carries none)
_INDEX_FIELDS = ("layer", "start", "end", "head_start", "head_end", "head_dim")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ChunkHeader:
    request_id: str
    fingerprint: str
    layer: int = 0
    start: int = 0  # token range [start, end) of the prompt
    end: int = 0
    head_start: int = 0  # global kv heads [head_start, head_end)
    head_end: int = 0
    head_dim: int = 0
    dtype: str = ""
    kind: str = "kv"
    version: int = WIRE_VERSION
    in_place: bool = (
        False  # "kv" only: the sender already wrote the KV into the receiver's cache (shm)
    )
    # "commit" only: each sequence's first token, in index order (one for n=1)
    first_tokens: tuple[int, ...] = ()
    # "commit" only, when the request asked for logprobs: the first tokens' logprobs, in order
    first_logprobs: tuple[float, ...] = ()
    # the claiming backends (nixl, shm): the write grant of the reservation (its
    # KVEndpoint.write_grant), on every frame; empty elsewhere, and then left out of the header
    grant: str = ""
    # the sender's W3C trace context (its prefill span) when the request is traced, on every
    # frame; empty otherwise, and then left out of the encoded header. The receiver only reads
    # it (a link on its kv.receive span); a malformed one is ignored there, never an error
    traceparent: str = ""
    # "commit" only: other senders (the later stages of a pipelined prefill worker, each on its
    # own channel) push part of this request's KV, so it may land after this commit; the
    # receiver holds the commit until every layer has arrived (the reservation's lease bounds
    # the wait) instead of failing it. False is left out of the encoded header
    await_kv: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise WireError(f"frame kind {self.kind!r} is not one of {KINDS}")
        if (
            not isinstance(self.request_id, str)
            or not 0 < len(self.request_id) <= MAX_REQUEST_ID_CHARS
        ):
            raise WireError(
                f"frame request_id must be a string of 1 to {MAX_REQUEST_ID_CHARS} "
                f"characters, got {_describe(self.request_id)}"
            )
        for name, limit in (
            ("fingerprint", MAX_FINGERPRINT_CHARS),
            ("dtype", MAX_DTYPE_CHARS),
            ("grant", MAX_GRANT_CHARS),
            ("traceparent", MAX_TRACEPARENT_CHARS),
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > limit:
                raise WireError(
                    f"frame {name} must be a string of at most {limit} characters, "
                    f"got {_describe(value)}"
                )
        for name in _INDEX_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or not 0 <= value < MAX_INDEX:
                raise WireError(
                    f"frame {name} must be an int in [0, {MAX_INDEX}), got {_describe(value)}"
                )
        if self.end < self.start or self.head_end < self.head_start:
            raise WireError(
                f"frame ranges must not run backwards: tokens [{self.start}, {self.end}), "
                f"heads [{self.head_start}, {self.head_end})"
            )
        tokens = self.first_tokens
        if (
            not isinstance(tokens, list | tuple)
            or len(tokens) > MAX_N
            or not all(_is_int(t) and -_INT64 <= t < _INT64 for t in tokens)
        ):
            raise WireError(
                f"frame first_tokens must be at most {MAX_N} 64-bit ints, got {_describe(tokens)}"
            )
        if isinstance(tokens, list):  # msgpack decodes arrays as lists; the header stays hashable
            object.__setattr__(self, "first_tokens", tuple(tokens))
        lps = self.first_logprobs
        if (
            not isinstance(lps, list | tuple)
            or len(lps) > MAX_N
            or not all(isinstance(x, float | int) and not isinstance(x, bool) for x in lps)
        ):
            raise WireError(
                f"frame first_logprobs must be at most {MAX_N} numbers, got {_describe(lps)}"
            )
        if isinstance(lps, list):
            object.__setattr__(self, "first_logprobs", tuple(float(x) for x in lps))
        for name in ("in_place", "await_kv"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise WireError(f"frame {name} must be true or false, got {_describe(value)}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.end - self.start, self.head_end - self.head_start, self.head_dim)


def _describe(value) -> str:
    """A value for an error message, cut short (it may come from a stranger)."""
    text = repr(value)
    if len(text) <= 80:
        return text
    size = f" of {len(value)}" if hasattr(value, "__len__") else ""
    return f"{text[:60]}... ({type(value).__name__}{size})"


def encode_frame(
    header: ChunkHeader, payload: bytes | memoryview = b""
) -> list[bytes | memoryview]:
    """Pieces to write in order (no copy of the payload)."""
    fields = asdict(header)
    for name in OMIT_WHEN_EMPTY:
        if not fields[name]:
            del fields[name]
    head = msgpack.packb(fields)
    return [_LEN.pack(len(head)), head, payload]


def split_frame(data: bytes | memoryview) -> tuple[dict, memoryview]:
    """A frame's raw header fields and what follows the header. WireError: the framing itself is
    broken (nothing after it can be located)."""
    view = memoryview(data)
    if len(view) < _LEN.size:
        raise WireError("frame shorter than its length prefix")
    (n,) = _LEN.unpack_from(view)
    if n > MAX_HEADER_BYTES or n > len(view) - _LEN.size:
        raise WireError(
            f"frame header of {n} bytes does not fit the frame ({len(view)} bytes) or "
            f"exceeds {MAX_HEADER_BYTES} bytes"
        )
    try:
        fields = msgpack.unpackb(view[_LEN.size : _LEN.size + n])
    except Exception as e:
        raise WireError(f"bad frame header: {e}") from None
    if not isinstance(fields, dict):
        raise WireError(f"a frame header is a msgpack map, got {type(fields).__name__}")
    return fields, view[_LEN.size + n :]


def header_from_fields(fields: dict) -> ChunkHeader:
    """WireError (with the request id when readable): a field is missing, unknown or out of range."""
    rid = fields.get("request_id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_CHARS else None
    version = fields.get("version")
    if not _is_int(version) or version != WIRE_VERSION:
        raise WireError(
            f"wire version {_describe(version)} is not supported (this side speaks {WIRE_VERSION})",
            rid,
        )
    try:
        return ChunkHeader(**fields)
    except (TypeError, WireError) as e:
        raise WireError(f"bad frame header fields: {e}", rid) from None


def decode_frame(data: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    fields, rest = split_frame(data)
    return header_from_fields(fields), rest
