"""Sliding-window KV bookkeeping: which of a sequence's blocks a model whose every layer slides
still reads, and giving back the ones it does not.

When every layer attends only its last `window` tokens (ModelConfig.kv_window), the query at
position p reads positions p - window + 1 .. p. A sequence that has computed `c` tokens computes
position c next, and no later query reads a position below c - window + 1, so its blocks that lie
wholly below that point are released while it runs. A released block's entry in the sequence's
block table becomes the engine's null block: a block that no sequence holds and nothing writes,
kept out of the pool by the model runner, so the table stays a valid index for the attention
kernels (which mask every position outside the window and so never use what they read there).

A long generation then holds at most ceil(window / block_size) + 1 blocks between steps and
during a decode step; a prompt chunk of n tokens holds those of its own tokens and of the
window - 1 before it (`max_blocks_held`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.request import Sequence


def skipped_blocks(num_computed: int, window: int | None, block_size: int) -> int:
    """How many leading blocks no query from position `num_computed` on reads (0 without a
    window): those that end at or before num_computed - window + 1."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def max_blocks_held(window: int, block_size: int, max_chunk: int) -> int:
    """The most blocks one sequence holds at once: a chunk of `max_chunk` tokens and the
    window - 1 tokens before it, which may straddle one more block boundary."""
    return -(-(window - 1 + max_chunk) // block_size) + 1


def release_skipped(bm: BlockManager, seq: Sequence, window: int | None) -> int:
    """Give back the blocks of `seq` that lie wholly before its window and put the null block in
    their table entries; returns how many were released. Blocks the prefix cache registered stay
    cached as evictable blocks until the allocator reuses them (a later hit on their chain takes
    them back only while every block of the chain is still there)."""
    skip = min(skipped_blocks(seq.num_computed_tokens, window, bm.block_size), len(seq.block_ids))
    released = []
    # Entries before an already released one were released by an earlier call.
    for i in range(skip - 1, -1, -1):
        if seq.block_ids[i] == bm.null_block:
            break
        released.append(seq.block_ids[i])
        seq.block_ids[i] = bm.null_block
    if released:
        bm.free(released)
    return len(released)
