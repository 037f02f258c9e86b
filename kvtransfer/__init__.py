"""Moving KV cache between engines: headers, layouts, re-sharding and the transports.

Imports no worker and nothing of the engine (shared KV pool files come from kvpool/, which both
use; see docs/architecture.md section 2): everything here speaks in tensors, block ids and token
ranges.
"""

from pdserve.kvtransfer.layout import KVLayout, LayoutMismatch
from pdserve.kvtransfer.state import TransferState
from pdserve.kvtransfer.wire import WIRE_VERSION, ChunkHeader, decode_frame, encode_frame

__all__ = [
    "KVLayout",
    "LayoutMismatch",
    "TransferState",
    "ChunkHeader",
    "WIRE_VERSION",
    "encode_frame",
    "decode_frame",
]
