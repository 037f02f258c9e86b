"""Block-manager steps the prefix-cache tests share (tests/unit/test_block_manager_events.py,
test_kv_host_tier.py, test_kv_disk_tier.py): a finished request's blocks left cached, the hash
chain of a token list's full blocks, and the router's block index fed from a block manager's KV
events.

Not a test module: imported as `from helpers.blocks import ...` (tests/helpers/ is a package on
pytest's sys.path).
"""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager, block_hash


def fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    """A finished request: the full blocks of `tokens` allocated, registered and freed (cached);
    returns their ids."""
    ids = bm.allocate(bm.blocks_needed(len(tokens)))
    bm.register_full_blocks(ids, tokens, 0, len(tokens))
    bm.free(ids)
    return ids


def chain(tokens: list[int], block_size: int = 4) -> list[int]:
    """The block hashes of `tokens`' full blocks, each chained through its parent's."""
    hashes, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = block_hash(parent, tuple(tokens[i : i + block_size]))
        hashes.append(parent)
    return hashes


def poller(bm: BlockManager):
    """The router's block index fed from `bm`'s KV events as the pool's Stats polls feed it:
    (the index, the worker's key in it, a poll that applies the next answer)."""
    from pdserve.protos.pdserve.v1 import worker_pb2
    from pdserve.router.kv_index import KVIndex
    from pdserve.worker_common import kv_events as wire

    index, worker = KVIndex(), object()

    def poll():
        epoch, after = index.position(worker)
        request = worker_pb2.StatsRequest(
            want_kv_events=True, kv_events_epoch=epoch, kv_events_after=after
        )
        return index.apply(worker, (epoch, after), wire.kv_events(bm, request))

    return index, worker, poll
