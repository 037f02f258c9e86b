"""BlockManager tested like an allocator: exact block ids, free counts, LRU order, prefix-cache hits
and misses, and a consistency/leak check after every operation."""

from __future__ import annotations

import pytest

import pdserve.engine.block_manager as block_manager_mod
from pdserve.engine.block_manager import BlockManager, NoFreeBlocks

BS = 4


def free_order(bm: BlockManager) -> list[int]:
    """The free queue, front (next to be allocated / evicted) first."""
    return list(bm._free)


def ok(bm: BlockManager) -> None:
    bm.check_consistency()
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert bm.num_free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)


def assert_no_leaks(bm: BlockManager) -> None:
    ok(bm)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def toks(*chunks) -> list[int]:
    """toks(10, 20) -> [10, 11, 12, 13, 20, 21, 22, 23]: one distinct block per chunk start."""
    return [c + i for c in chunks for i in range(BS)]


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, BS)


def test_allocation_order_from_fresh_manager():
    bm = BlockManager(8, BS)
    ok(bm)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert bm.allocate(3) == [0, 1, 2]
    ok(bm)
    assert bm.allocate(1) == [3]
    assert bm.allocate(0) == []
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 4
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert free_order(bm) == [4, 5, 6, 7]
    ok(bm)
    bm.free([0, 1, 2, 3])
    assert_no_leaks(bm)


def test_blocks_needed():
    bm = BlockManager(4, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_free_appends_tail_blocks_first_to_end_of_queue():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = bm.allocate(3)  # [0, 1, 2]
    b = bm.allocate(2)  # [3, 4]
    assert free_order(bm) == [5, 6, 7]
    bm.free(a)
    ok(bm)
    # reversed: the tail block 2 is first in line for eviction, the head block 0 last
    assert free_order(bm) == [5, 6, 7, 2, 1, 0]
    assert bm.num_free_blocks == 6
    bm.free(b)
    ok(bm)
    assert free_order(bm) == [5, 6, 7, 2, 1, 0, 4, 3]
    # allocation takes the queue's first five, in ascending order (consecutive blocks lie together
    # in memory)
    assert bm.allocate(5) == [1, 2, 5, 6, 7]
    ok(bm)
    assert free_order(bm) == [0, 4, 3]
    bm.free([5, 6, 7, 2, 1])
    assert_no_leaks(bm)


def test_take_free_block_removes_it_from_queue_and_used_block_only_bumps_refcount():
    bm = BlockManager(6, BS)
    ids = bm.allocate(2)  # [0, 1]
    bm.free(ids)  # queue [2, 3, 4, 5, 1, 0]
    assert bm.num_free_blocks == 6
    bm.take([1])
    ok(bm)
    assert bm.num_free_blocks == 5
    assert bm.ref_count(1) == 1
    assert free_order(bm) == [2, 3, 4, 5, 0]
    bm.take([1])  # used block: only the count moves
    ok(bm)
    assert bm.num_free_blocks == 5
    assert bm.ref_count(1) == 2
    assert free_order(bm) == [2, 3, 4, 5, 0]
    bm.free([1])
    ok(bm)
    assert bm.ref_count(1) == 1 and bm.num_free_blocks == 5
    bm.free([1])
    ok(bm)
    assert free_order(bm) == [2, 3, 4, 5, 0, 1]
    assert_no_leaks(bm)


def test_double_free_raises():
    bm = BlockManager(4, BS)
    ids = bm.allocate(2)
    bm.free(ids)
    ok(bm)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free([ids[0]])
    ok(bm)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free([3])  # never allocated
    assert_no_leaks(bm)


def test_allocate_more_than_free_raises_and_changes_nothing():
    bm = BlockManager(4, BS)
    held = bm.allocate(2)
    bm.free([held[1]])
    before = (free_order(bm), [b.ref_count for b in bm.blocks])
    with pytest.raises(NoFreeBlocks):
        bm.allocate(4)
    ok(bm)
    assert (free_order(bm), [b.ref_count for b in bm.blocks]) == before
    assert bm.allocate(3) == [1, 2, 3]  # the queue's three, ascending
    ok(bm)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(1)
    ok(bm)
    bm.free([0, 2, 3, 1])
    assert_no_leaks(bm)


# ---- prefix cache ------------------------------------------------------------------------------


def test_register_only_hashes_full_computed_blocks():
    bm = BlockManager(8, BS)
    tokens = toks(10, 20, 30) + [40, 41]  # 3 full blocks + a partial one
    ids = bm.allocate(4)
    # nothing computed: nothing hashed
    assert bm.register_full_blocks(ids, tokens, 0, 0) == 0
    assert bm._cached == {}
    # 7 computed tokens: only block 0 is full and computed
    assert bm.register_full_blocks(ids, tokens, 0, 7) == 1
    ok(bm)
    assert [bm.blocks[i].hash is not None for i in ids] == [True, False, False, False]
    assert bm.blocks[ids[0]].token_ids == tuple(toks(10))
    assert bm.blocks[ids[0]].parent_hash is None
    # everything computed: the partial last block is never hashed
    assert bm.register_full_blocks(ids, tokens, 1, len(tokens)) == 3
    ok(bm)
    assert [bm.blocks[i].hash is not None for i in ids] == [True, True, True, False]
    assert bm.blocks[ids[1]].parent_hash == bm.blocks[ids[0]].hash
    assert bm.blocks[ids[2]].parent_hash == bm.blocks[ids[1]].hash
    assert len(bm._cached) == 3
    # num_computed_tokens past the token list is clamped to the tokens that exist
    assert bm.register_full_blocks(ids, tokens, 3, 100) == 3
    # nothing new: the count is returned unchanged
    assert bm.register_full_blocks(ids, tokens, 3, len(tokens)) == 3
    ok(bm)
    bm.free(ids)
    assert_no_leaks(bm)


def four_cached_blocks():
    """(bm, tokens, ids): 4 full blocks of tokens 10, 20, 30, 40 allocated and in the cache."""
    bm = BlockManager(8, BS)
    tokens = toks(10, 20, 30, 40)
    ids = bm.allocate(4)
    assert bm.register_full_blocks(ids, tokens, 0, 16) == 4
    ok(bm)
    return bm, tokens, ids


def test_find_cached_prefix_chains_and_stops_at_first_miss():
    bm, tokens, ids = four_cached_blocks()
    assert bm.find_cached_prefix(tokens, 16) == ids
    assert bm.find_cached_prefix(tokens + [1, 2], 18) == ids
    # a miss in block 1 stops the walk even though blocks 2 and 3 match
    assert bm.find_cached_prefix(toks(10, 99, 30, 40), 16) == ids[:1]
    # the first block differs: nothing, even though the later chunks are equal
    assert bm.find_cached_prefix(toks(99, 20, 30, 40), 16) == []
    # a chunk seen at another position is not a hit (the chain includes the parent)
    assert bm.find_cached_prefix(toks(20, 30), 8) == []
    ok(bm)
    bm.free(ids)
    assert_no_leaks(bm)


def test_find_cached_prefix_respects_max_tokens():
    bm, tokens, ids = four_cached_blocks()
    assert bm.find_cached_prefix(tokens, 15) == ids[:3]  # only whole blocks within the limit
    assert bm.find_cached_prefix(tokens, 12) == ids[:3]
    assert bm.find_cached_prefix(tokens, 11) == ids[:2]
    assert bm.find_cached_prefix(tokens, 3) == []
    assert bm.find_cached_prefix(tokens, 0) == []
    ok(bm)
    bm.free(ids)
    assert_no_leaks(bm)


def test_hash_collision_with_different_tokens_is_not_served(monkeypatch):
    # every block of every prompt hashes alike: only the token comparison can tell them apart
    monkeypatch.setattr(block_manager_mod, "block_hash", lambda parent, token_ids: 7)
    bm = BlockManager(8, BS)
    a = bm.allocate(1)
    bm.register_full_blocks(a, toks(10), 0, 4)
    ok(bm)
    assert bm.find_cached_prefix(toks(10), 4) == a
    assert bm.find_cached_prefix(toks(20), 4) == []  # same hash, other tokens
    # a second block with the colliding hash is not registered over the first one
    b = bm.allocate(1)
    bm.register_full_blocks(b, toks(20), 0, 4)
    ok(bm)
    assert bm._cached == {7: a[0]} and bm.blocks[b[0]].hash is None
    assert bm.find_cached_prefix(toks(20), 4) == []
    bm.free(a + b)
    assert_no_leaks(bm)


def test_hash_collision_with_same_tokens_under_another_parent_is_not_served(monkeypatch):
    # the hash ignores the parent: the same chunk at another position collides
    monkeypatch.setattr(block_manager_mod, "block_hash", lambda parent, token_ids: hash(token_ids))
    bm = BlockManager(8, BS)
    ids = bm.allocate(2)
    bm.register_full_blocks(ids, toks(10, 20), 0, 8)
    ok(bm)
    assert bm.find_cached_prefix(toks(10, 20), 8) == ids
    # chunk 20 hashes to the block 1 entry and its tokens match, but it was cached under parent 10
    assert bm.find_cached_prefix(toks(20), 4) == []
    assert bm.find_cached_prefix(toks(20, 20), 8) == []
    bm.free(ids)
    assert_no_leaks(bm)


def test_freed_cached_blocks_are_found_until_reallocated_lru_evicts_least_recently_freed():
    bm = BlockManager(6, BS)
    a, b = toks(10, 20), toks(30, 40)
    ia = bm.allocate(2)  # [0, 1]
    bm.register_full_blocks(ia, a, 0, 8)
    ib = bm.allocate(2)  # [2, 3]
    bm.register_full_blocks(ib, b, 0, 8)
    bm.free(ia)  # queue [4, 5, 1, 0]
    bm.free(ib)  # queue [4, 5, 1, 0, 3, 2]
    ok(bm)
    assert bm.num_free_blocks == 6
    assert free_order(bm) == [4, 5, 1, 0, 3, 2]
    # freed but still cached: both prefixes hit, nothing taken by the lookup itself
    assert bm.find_cached_prefix(a, 8) == [0, 1]
    assert bm.find_cached_prefix(b, 8) == [2, 3]
    assert bm.num_free_blocks == 6
    # never-used blocks go first; the caches survive
    assert bm.allocate(2) == [4, 5]
    ok(bm)
    assert bm.find_cached_prefix(a, 8) == [0, 1]
    # next the least recently freed: a's tail block 1 is evicted, so a hits only its first block
    assert bm.allocate(1) == [1]
    ok(bm)
    assert bm.blocks[1].hash is None and bm.blocks[1].token_ids == ()
    assert bm.find_cached_prefix(a, 8) == [0]
    assert bm.find_cached_prefix(b, 8) == [2, 3]
    # reviving a hit removes it from the free queue, so it cannot be evicted under the holder
    bm.take([2, 3])
    ok(bm)
    assert free_order(bm) == [0]
    assert bm.allocate(1) == [0]  # evicts a's first block
    ok(bm)
    assert bm.find_cached_prefix(a, 8) == []
    assert bm.find_cached_prefix(b, 8) == [2, 3]
    with pytest.raises(NoFreeBlocks):
        bm.allocate(1)
    ok(bm)
    bm.free([4, 5, 1, 0, 2, 3])
    ok(bm)
    # b stays cached after the holders let go
    assert bm.find_cached_prefix(b, 8) == [2, 3]
    assert_no_leaks(bm)


def test_reregistering_after_eviction_uses_the_new_block():
    bm = BlockManager(2, BS)
    ids = bm.allocate(1)
    bm.register_full_blocks(ids, toks(10), 0, 4)
    bm.free(ids)
    # evict block 0 by allocating both blocks
    both = bm.allocate(2)
    assert both == [0, 1]
    ok(bm)
    assert bm.find_cached_prefix(toks(10), 4) == []
    bm.register_full_blocks([1], toks(10), 0, 4)
    ok(bm)
    assert bm.find_cached_prefix(toks(10), 4) == [1]
    bm.free(both)
    assert_no_leaks(bm)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    tokens = toks(10, 20, 30)
    ids = bm.allocate(3)
    assert bm.register_full_blocks(ids, tokens, 0, 12) == 0
    ok(bm)
    assert bm._cached == {} and all(b.hash is None for b in bm.blocks)
    assert bm.find_cached_prefix(tokens, 12) == []
    bm.free(ids)
    assert bm.find_cached_prefix(tokens, 12) == []
    assert_no_leaks(bm)


def test_register_continues_chain_across_calls_after_a_duplicate_block():
    """Two sequences computed the same first block; the second one's copy is not registered (the
    cache already holds one). When that sequence later fills its next block, the chain must go on
    from the first block's hash, not restart at the root: else its block 1 would be served as the
    first block of an unrelated prompt (KV computed at other positions, after other tokens)."""
    bm = BlockManager(8, BS)
    first, second = toks(10), toks(20)
    a = bm.allocate(1)
    b = bm.allocate(2)
    assert bm.register_full_blocks(a, first, 0, 4) == 1
    assert bm.register_full_blocks(b, first + second, 0, 4) == 1  # duplicate: not registered
    assert bm.blocks[b[0]].hash is None
    # b's second block fills in a later step
    assert bm.register_full_blocks(b, first + second, 1, 8) == 2
    ok(bm)
    assert bm.find_cached_prefix(first + second, 8) == [a[0], b[1]]
    # `second` at position 0 is another prompt: no hit
    assert bm.find_cached_prefix(second, 4) == []
    bm.free(a)
    bm.free(b)
    assert_no_leaks(bm)


def test_collision_of_the_parent_block_cannot_serve_kv_computed_after_other_tokens(monkeypatch):
    # every first block hashes alike; later blocks hash properly (through their parent)
    monkeypatch.setattr(
        block_manager_mod,
        "block_hash",
        lambda parent, token_ids: 0 if parent is None else hash((parent, token_ids)),
    )
    bm = BlockManager(8, BS)
    r = bm.allocate(1)
    bm.register_full_blocks(r, toks(10), 0, 4)  # [R] owns hash 0
    a = bm.allocate(2)
    bm.register_full_blocks(a, toks(20, 30), 0, 8)  # P collides (not cached), Q is cached
    ok(bm)
    # Q's KV was computed after P, so a prompt [R, Q] may reuse R but must recompute Q
    assert bm.find_cached_prefix(toks(10, 30), 8) == r


def test_allocate_after_continues_a_sequences_run_of_blocks():
    """`after` (a sequence's last block) is followed by the blocks after it in memory while they
    are free and taking them evicts no cached prefix out of turn; the rest follow the queue."""
    bm = BlockManager(16, BS)
    a = bm.allocate(4)  # [0, 1, 2, 3]
    b = bm.allocate(4)  # [4, 5, 6, 7]
    bm.free(b)  # queue: 8..15, then 7, 6, 5, 4 (never hashed)
    # 4 and 5 are deep in the queue but hold no cached prefix: a's run continues into them
    assert bm.allocate(2, after=a[-1]) == [4, 5]
    ok(bm)
    assert free_order(bm) == [8, 9, 10, 11, 12, 13, 14, 15, 7, 6]
    # a block that is not free ends the run; the rest come from the queue's head
    assert bm.allocate(2, after=1) == [8, 9]
    ok(bm)
    # the null block (a released sliding-window entry) is no position in memory
    nb = BlockManager(4, BS, null_block=4)
    assert nb.allocate(1, after=4) == [0]
    bm.free(a + [4, 5, 8, 9])
    assert_no_leaks(bm)


def test_allocate_after_never_evicts_a_cached_block_far_from_its_turn(monkeypatch):
    monkeypatch.setattr(block_manager_mod, "NEAR_HEAD", 2)
    bm = BlockManager(64, BS)  # (the head counts a 32nd of the pool at most: 2 blocks here)
    a = bm.allocate(1)  # [0]
    c = bm.allocate(1)  # [1]
    bm.register_full_blocks(c, toks(10), 0, 4)
    bm.free(c)  # queue: 2..63, then 1 (cached, last in line)
    # block 1 follows a's block 0 in memory, but taking it would evict its cached prefix long
    # before its turn: the queue's head is taken instead and the cache survives
    assert bm.allocate(1, after=a[-1]) == [2]
    ok(bm)
    assert bm.find_cached_prefix(toks(10), 4) == [1]
    d = bm.allocate(60)  # [3 .. 62]: now 1 is second in line
    assert free_order(bm) == [63, 1]
    # near the head (NEAR_HEAD = 2 here) it is taken out of turn, and its prefix evicted
    assert bm.allocate(1, after=a[-1]) == [1]
    ok(bm)
    assert bm.find_cached_prefix(toks(10), 4) == []
    bm.free(a + [2, 1] + d)
    assert_no_leaks(bm)
