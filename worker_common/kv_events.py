"""A worker's KV events on the wire: what a Stats call that asks for them (the router's block
index, router/kv_index.py) gets from the engine's block manager (engine/block_manager.py), as
WorkerStats.kv_events. Stateless: the reader says where it is in the stream, and each answer is
read from the manager's ring (or, on a reset, its snapshot) on the gRPC thread, never waiting for
the engine loop. Both worker services call it from their Stats.
"""

from __future__ import annotations

from pdserve.engine.block_manager import CLEARED
from pdserve.protos.pdserve.v1 import worker_pb2

# at most this many events in one answer (16 bytes a hash: 256 KiB); a reader further behind gets
# the rest with its next polls, or a reset once they fall out of the ring
MAX_EVENTS_PER_ANSWER = 16_384
# at most this many hashes in a reset's snapshot (1 MiB): the most recently registered ones
MAX_SNAPSHOT = 65_536
TIER = "device"  # where this worker's blocks are: its KV cache


def hash_bytes(h: int) -> bytes:
    return h.to_bytes(16, "little")


def kv_events(block_manager, request) -> worker_pb2.KVEvents | None:
    """The KVEvents answering `request` (a StatsRequest), or None when it did not ask for them
    or the engine keeps no prefix cache (nothing to report)."""
    if request is None or not request.want_kv_events:
        return None
    if not getattr(block_manager, "enable_prefix_caching", False):
        return None
    got = block_manager.kv_events(
        request.kv_events_after, request.kv_events_epoch, MAX_EVENTS_PER_ANSWER, MAX_SNAPSHOT
    )
    out = worker_pb2.KVEvents(
        epoch=got.epoch, last_seq=got.last_seq, reset=got.reset, truncated=got.truncated
    )
    if got.reset:
        out.snapshot = b"".join(map(hash_bytes, got.snapshot))
        return out
    run_kind, run = None, []
    for kind, h in got.events + [(None, None)]:  # the sentinel closes the last run
        if kind != run_kind or kind == CLEARED:
            if run_kind is not None:
                out.runs.add(kind=run_kind, tier=TIER, block_hashes=b"".join(run))
            run_kind, run = kind, []
        if h is not None:
            run.append(hash_bytes(h))
    return out
