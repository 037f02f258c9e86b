"""Block-manager steps the prefix-cache tests share (tests/unit/test_block_manager_events.py,
test_kv_host_tier.py, test_kv_disk_tier.py): a finished request's blocks left cached, and the
hash chain of a token list's full blocks.

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
