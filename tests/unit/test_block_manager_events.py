"""KV events of the block manager (engine/block_manager.py): stored, removed and cleared, read by
sequence from a bounded ring, with a reset and a snapshot when the reader cannot continue."""

from __future__ import annotations

from helpers.blocks import chain, fill
from pdserve.engine.block_manager import CLEARED, REMOVED, STORED, BlockManager, block_hash

BS = 4


def test_stored_events_follow_registration_in_chain_order():
    bm = BlockManager(8, BS)
    tokens = list(range(10))  # two full blocks and a partial one
    fill(bm, tokens)
    got = bm.kv_events(0, bm.epoch, 100, 100)
    assert not got.reset
    assert got.events == [(STORED, h) for h in chain(tokens)]
    assert got.last_seq == 2
    # nothing new: an empty answer at the same sequence
    again = bm.kv_events(got.last_seq, bm.epoch, 100, 100)
    assert (again.events, again.last_seq, again.reset) == ([], 2, False)


def test_eviction_is_a_removed_event_and_a_revived_block_is_not_stored_twice():
    bm = BlockManager(2, BS)
    a = [1, 2, 3, 4]
    fill(bm, a)
    # a cache hit revives the block: no new event
    hit = bm.find_cached_prefix(a + [9], 4)
    bm.take(hit)
    bm.free(hit)
    # two fresh blocks evict the cached one
    ids = bm.allocate(2)
    got = bm.kv_events(0, bm.epoch, 100, 100)
    assert got.events == [(STORED, chain(a)[0]), (REMOVED, chain(a)[0])]
    bm.free(ids)


def test_reader_gets_at_most_max_events_and_continues_from_its_sequence():
    bm = BlockManager(16, BS)
    tokens = list(range(40))  # ten blocks
    fill(bm, tokens)
    first = bm.kv_events(0, bm.epoch, 3, 100)
    assert [h for _, h in first.events] == chain(tokens)[:3] and first.last_seq == 3
    rest = bm.kv_events(first.last_seq, bm.epoch, 100, 100)
    assert [h for _, h in rest.events] == chain(tokens)[3:] and rest.last_seq == 10


def test_a_reader_behind_the_ring_gets_a_reset_with_a_snapshot():
    bm = BlockManager(1, BS)  # the ring's floor: MIN_EVENTS events
    capacity = bm._events.maxlen
    for i in range(capacity // 2 + 1):  # each round: a stored and (but the first) a removed
        fill(bm, [i, i, i, i])
    got = bm.kv_events(0, bm.epoch, 100, 100)
    assert got.reset and got.events == []
    assert got.snapshot == [block_hash(None, (capacity // 2,) * 4)]
    assert got.last_seq == capacity + 1
    # from there on it reads events again
    fill(bm, [7, 7, 7, 8])
    after = bm.kv_events(got.last_seq, bm.epoch, 100, 100)
    assert not after.reset and [k for k, _ in after.events] == [REMOVED, STORED]


def test_another_epoch_or_a_sequence_ahead_is_a_reset():
    bm = BlockManager(8, BS)
    fill(bm, list(range(8)))
    assert bm.kv_events(0, 0, 100, 100).reset  # never read: epoch 0
    assert bm.kv_events(0, bm.epoch + 1, 100, 100).reset  # a restarted worker's numbers
    ahead = bm.kv_events(50, bm.epoch, 100, 100)
    assert ahead.reset and sorted(ahead.snapshot) == sorted(chain(list(range(8))))
    assert BlockManager(8, BS).epoch != bm.epoch


def test_snapshot_is_bounded_to_the_most_recently_registered():
    bm = BlockManager(8, BS)
    tokens = list(range(24))  # six blocks
    fill(bm, tokens)
    got = bm.kv_events(0, 0, 100, 2)
    assert got.reset and got.truncated and got.snapshot == chain(tokens)[-2:]
    assert bm.kv_events(0, 0, 100, 0).snapshot == []


def test_reset_prefix_cache_clears_only_when_nothing_is_in_use():
    bm = BlockManager(4, BS)
    fill(bm, list(range(8)))
    held = bm.allocate(1)
    assert not bm.reset_prefix_cache()
    bm.free(held)
    assert bm.reset_prefix_cache()
    assert bm.find_cached_prefix(list(range(8)), 8) == []
    got = bm.kv_events(0, bm.epoch, 100, 100)
    assert got.events[-1] == (CLEARED, None)
    bm.check_consistency()


def test_no_events_without_prefix_caching():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    fill(bm, list(range(8)))
    got = bm.kv_events(0, bm.epoch, 100, 100)
    assert got.events == [] and got.last_seq == 0
