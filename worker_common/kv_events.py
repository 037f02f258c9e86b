"""A worker's KV events on the wire: what a Stats call that asks for them (the router's block
index, router/kv_index.py) gets from the engine's block manager (engine/block_manager.py), as
WorkerStats.kv_events. Stateless: the reader says where it is in the stream, and each answer is
read from the manager's ring (or, on a reset, its snapshot) on the gRPC thread, never waiting for
the engine loop. Both worker services call it from their Stats, and `tier_stats` for the host
tier's figures (engine/kv_host_tier.py) and the prefix hits by source.

Each event carries the tier its block is in: "device" (the worker's KV cache) or "host" (its
host-memory tier); a block moving from the cache to the tier is a "removed" (device) then a
"stored" (host), one pushed out of the tier a "removed" (host), as is one its disk level lost to a
failed write (engine/block_manager.py reap_tier). A reset brings the host tier's hashes in
`host_snapshot`. A hybrid model's worker also reports where a recurrent state is held after a
block ("state" events, `state_snapshot`) and says so in every answer (`states`).
"""

from __future__ import annotations

from pdserve.engine.block_manager import CLEARED, DEVICE
from pdserve.protos.pdserve.v1 import worker_pb2

# at most this many events in one answer (16 bytes a hash: 256 KiB); a reader further behind gets
# the rest with its next polls, or a reset once they fall out of the ring
MAX_EVENTS_PER_ANSWER = 16_384
# at most this many hashes in a reset's snapshot (1 MiB): the most recently registered ones
MAX_SNAPSHOT = 65_536
TIER = DEVICE  # the tier of an event that names none: the worker's KV cache


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
        epoch=got.epoch,
        last_seq=got.last_seq,
        reset=got.reset,
        truncated=got.truncated,
        states=getattr(block_manager, "kept_states", None) is not None,
    )
    if got.reset:
        out.snapshot = b"".join(map(hash_bytes, got.snapshot))
        out.host_snapshot = b"".join(map(hash_bytes, got.host_snapshot))
        out.state_snapshot = b"".join(map(hash_bytes, got.state_snapshot))
        return out
    run_kind, run_tier, run = None, None, []
    for event in got.events + [(None, None)]:  # the sentinel closes the last run
        kind, h = event[0], event[1]
        tier = event[2] if len(event) > 2 else TIER
        if kind != run_kind or tier != run_tier or kind == CLEARED:
            if run_kind is not None:
                out.runs.add(kind=run_kind, tier=run_tier, block_hashes=b"".join(run))
            run_kind, run_tier, run = kind, tier, []
        if h is not None:
            run.append(hash_bytes(h))
    return out


def tier_stats(block_manager) -> dict:
    """WorkerStats fields of the host tier and its disk level (zeros when there is none) and the
    prefix-hit tokens by source; read on the gRPC thread (plain counters the engine thread
    writes)."""
    from pdserve.engine.kv_host_tier import HostTier

    tier = getattr(block_manager, "tier", None)
    out = {}
    for field, name in (
        ("prefix_hit_tokens_device", "hit_tokens_device"),
        ("prefix_hit_tokens_host", "hit_tokens_host"),
        ("prefix_hit_tokens_peer", "hit_tokens_peer"),
        ("prefix_hit_tokens_disk", "hit_tokens_disk"),
    ):
        value = getattr(block_manager, name, 0)
        if isinstance(value, int):  # (a test's stand-in engine may have none)
            out[field] = value
    if isinstance(tier, HostTier):
        out.update(
            kv_host_tier_bytes=tier.bytes,
            kv_host_tier_capacity_bytes=tier.capacity_bytes,
            kv_host_tier_capacity_blocks=tier.capacity_blocks,
            kv_host_tier_stored=tier.stored,
            kv_host_tier_restored=tier.restored,
            kv_host_tier_evicted=tier.evicted,
            kv_host_tier_refused=tier.refused,
            kv_host_tier_states_stored=tier.states_stored,
            kv_host_tier_states_restored=tier.states_restored,
            kv_host_tier_states_refused=tier.states_refused,
        )
        disk = tier.disk  # its disk level (engine/kv_disk_tier.py), when on
        if disk is not None:
            out.update(
                kv_disk_tier_bytes=disk.bytes,
                kv_disk_tier_capacity_bytes=disk.capacity_bytes,
                kv_disk_tier_stored=disk.stored,
                kv_disk_tier_restored=disk.restored,
                kv_disk_tier_evicted=disk.evicted,
                kv_disk_tier_dropped=disk.dropped,
                kv_disk_tier_refused=disk.refused,
                kv_disk_tier_write_errors=disk.write_errors,
            )
    return out


def engine_fingerprint(engine) -> str:
    """Peer fetch (kvtransfer/peer.py): the fingerprint every fetched block is checked against,
    the engine's KV layout and its tensor-parallel size (engine/kv_host_tier.py `fingerprint`),
    in hex."""
    from pdserve.engine.kv_host_tier import fingerprint

    return fingerprint(engine.kv_layout_spec(), engine.config.tensor_parallel_size).hex()


def fetch_supported(engine) -> bool:
    """Whether this engine's pools can be read and written a block at a time here: not with
    pipeline stages (their pools are split by layer range across processes). A hybrid model's
    fetch carries the recurrent state after its last block too (FetchKVBlock.state)."""
    return getattr(engine.config, "pipeline_parallel_size", 1) == 1
