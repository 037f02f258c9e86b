"""The host-memory tier below the KV cache (engine/kv_host_tier.py) with the block manager that
evicts into it and restores from it (engine/block_manager.py), the KV events that say so
(worker_common/kv_events.py) and the router's block index that keeps the tier per entry
(router/kv_index.py). Pools are small CPU tensors filled with distinct values; no model."""

from __future__ import annotations

import pytest
import torch

from helpers.blocks import chain, fill, poller
from helpers.stats_workers import EngineWorker, exported
from pdserve.engine.block_manager import (
    HOST,
    REMOVED,
    STORED,
    BlockManager,
)
from pdserve.engine.kv_host_tier import KV, HostTier, fingerprint
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.kv_index import DEVICE, HOST as INDEX_HOST, chain_hashes
from pdserve.worker_common import kv_events as wire

BS = 4
LAYERS, HEADS, DIM = 2, 2, 3
FP = fingerprint(dict(model="m", dtype="float32", block_size=BS), 1)


def pool(num_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, BS, HEADS, DIM, generator=g)


def block_bytes(cache: torch.Tensor) -> int:
    return cache[:, :, 0].numel() * cache.element_size()


def tiered(num_blocks: int, cap_blocks: float, caches=None, **kw):
    caches = caches if caches is not None else [pool(num_blocks)]
    cap = int(cap_blocks * sum(block_bytes(c) for c in caches))
    tier = HostTier(cap, lambda: caches, FP, **kw)
    bm = BlockManager(num_blocks, BS)
    bm.attach_tier(tier)
    return bm, tier, caches


def evict_all(bm: BlockManager) -> None:
    """Every block handed out and given back: each cached block is evicted once."""
    bm.free(bm.allocate(bm.num_free_blocks))


def test_evicted_blocks_restore_with_identical_bytes():
    bm, tier, (cache,) = tiered(4, cap_blocks=8)
    tokens = list(range(100, 116))  # four full blocks
    ids = fill(bm, tokens)
    want = [cache[:, :, b].clone() for b in ids]
    evict_all(bm)
    assert len(tier) == 4 and tier.bytes == 4 * block_bytes(cache)
    cache.zero_()  # the pool's bytes are gone: only the tier has them
    found = bm.find_cached_prefix(tokens, len(tokens))
    assert len(found) == 4 and tier.restored == 4
    for block_id, w in zip(found, want):
        assert torch.equal(cache[:, :, block_id], w)
    bm.take(found)
    bm.count_hits(found)
    assert (bm.hit_tokens_host, bm.hit_tokens_device) == (16, 0)
    bm.free(found)
    # a second admission of the same blocks finds them in the cache: device hits
    again = bm.find_cached_prefix(tokens, len(tokens))
    assert again == found and tier.restored == 4
    bm.count_hits(again)
    assert (bm.hit_tokens_host, bm.hit_tokens_device) == (16, 16)
    bm.check_consistency()


def test_a_restore_evicts_no_block_of_the_prefix_it_serves():
    # a pool of 3 blocks: the chain's first block is in the cache, the next two in the tier;
    # restoring them must take free blocks other than the first one's
    bm, tier, (cache,) = tiered(3, cap_blocks=8)
    tokens = list(range(12))
    fill(bm, tokens)
    h = chain(tokens)
    # evict the last two blocks only (least recently freed first: a sequence's tail first)
    bm.free(bm.allocate(2))
    assert [tier.contains(x) for x in h] == [False, True, True]
    found = bm.find_cached_prefix(tokens, len(tokens))
    assert len(found) == 3 and len(set(found)) == 3
    bm.check_consistency()


def test_tier_never_holds_more_than_its_cap_and_drops_to_the_watermark():
    bm, tier, (cache,) = tiered(4, cap_blocks=5, watermark=0.6)
    one = block_bytes(cache)
    peak = 0
    for r in range(6):  # 24 distinct blocks through a 4-block pool into a 5-block tier
        fill(bm, list(range(1000 * r, 1000 * r + 16)))
        evict_all(bm)
        peak = max(peak, tier.bytes)
        assert tier.bytes <= tier.capacity_bytes
    assert peak <= tier.capacity_bytes and tier.peak_bytes <= tier.capacity_bytes
    assert tier.evicted > 0
    # the watermark: a save that would pass the cap first pushes out down to 0.6 x the cap with
    # the new entry (3 of 5 blocks), not one entry at a time
    cache = pool(1)
    tier = HostTier(5 * one, lambda: [cache], FP, watermark=0.6)
    for h in range(5):
        assert tier.save(h, None, (h,), 0) == (True, [])
    assert tier.bytes == 5 * one
    assert tier.save(5, None, (5,), 0) == (True, [0, 1, 2])
    assert len(tier) == 3 and tier.bytes == 3 * one and tier.evicted == 3


def test_lru_keeps_the_entry_used_last():
    bm, tier, (cache,) = tiered(2, cap_blocks=2, watermark=1.0)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    fill(bm, a)
    fill(bm, b)
    evict_all(bm)  # a and b in the tier
    ha, hb, hc = chain(a)[0], chain(b)[0], chain(c)[0]
    assert tier.contains(ha) and tier.contains(hb)
    found = bm.find_cached_prefix(a, 4)  # a restored: its tier entry is used last
    assert len(found) == 1
    fill(bm, c)
    evict_all(bm)  # c (and a again, held already: only touched) go to the tier
    assert tier.contains(hc) and tier.contains(ha) and not tier.contains(hb)
    assert len(tier) == 2 and tier.bytes <= tier.capacity_bytes


def test_an_entry_larger_than_the_cap_is_not_kept():
    bm, tier, _ = tiered(2, cap_blocks=0.5)
    fill(bm, [1, 2, 3, 4])
    evict_all(bm)
    assert len(tier) == 0 and tier.bytes == 0


def test_another_fingerprint_cannot_reach_the_blocks():
    bm, tier, _ = tiered(2, cap_blocks=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    fill(bm, tokens)
    evict_all(bm)
    assert len(tier) == 2
    # the same tier seen by an engine of another layout (dtype, TP size, adapter...)
    tier.fingerprint = fingerprint(dict(model="m", dtype="bfloat16", block_size=BS), 1)
    assert not tier.contains(chain(tokens)[0])
    assert bm.find_cached_prefix(tokens, len(tokens)) == []
    assert tier.restored == 0 and tier.hashes() == []
    assert fingerprint(dict(model="m"), 1) != fingerprint(dict(model="m"), 2)


def test_an_entry_whose_chain_or_layout_does_not_match_is_refused_and_dropped():
    bm, tier, (cache,) = tiered(2, cap_blocks=4)
    tokens = [1, 2, 3, 4]
    fill(bm, tokens)
    evict_all(bm)
    h = chain(tokens)[0]
    # asked for other tokens under the same hash (a collision): refused
    assert not tier.load(h, None, (9, 9, 9, 9), 0)
    assert tier.refused == 1 and not tier.contains(h) and tier.bytes == 0
    # a shard whose shape does not fit the pool: refused
    fill(bm, tokens)
    evict_all(bm)
    key = (tier.fingerprint, h, KV)
    tier._entries[key].shards[0] = torch.zeros(1)
    assert bm.find_cached_prefix(tokens, 4) == []
    assert tier.refused == 2 and not tier.contains(h)
    events = bm.kv_events(0, bm.epoch, 1000, 1000).events
    assert events[-1] == (REMOVED, h, HOST)
    bm.check_consistency()
    # the refusals reach the router's metrics
    stats = worker_pb2.WorkerStats(**wire.tier_stats(bm))
    assert exported(stats)[("pdserve:kv_host_tier_refused_blocks_total", None)] == 2


def test_an_entry_whose_bytes_changed_after_saving_is_refused_and_recomputed():
    bm, tier, (cache,) = tiered(2, cap_blocks=4)
    tokens = [1, 2, 3, 4]
    ids = fill(bm, tokens)
    want = cache[:, :, ids[0]].clone()
    evict_all(bm)
    h = chain(tokens)[0]
    shard = tier._entries[(tier.fingerprint, h, KV)].shards[0]
    shard.view(-1)[5] += 1.0  # one value of one layer changed, under the right hash
    before = cache.clone()
    assert bm.find_cached_prefix(tokens, 4) == []  # a miss: the prefill computes it again
    assert tier.refused == 1 and not tier.contains(h) and tier.bytes == 0
    assert torch.equal(cache, before)  # nothing written
    # an intact entry of the same block restores its bytes
    ids = fill(bm, tokens)
    cache[:, :, ids[0]] = want
    bm.free(bm.allocate(bm.num_free_blocks))  # evicted again, saved with these bytes
    cache.zero_()
    found = bm.find_cached_prefix(tokens, 4)
    assert len(found) == 1 and torch.equal(cache[:, :, found[0]], want)
    bm.take(found)
    bm.check_consistency()


def test_reset_frees_the_tier():
    bm, tier, _ = tiered(4, cap_blocks=8)
    fill(bm, list(range(16)))
    evict_all(bm)
    assert tier.bytes > 0
    assert bm.reset_prefix_cache()
    assert tier.bytes == 0 and len(tier) == 0 and tier.hashes() == []


def test_every_rank_keeps_its_own_shard():
    caches = [pool(2, seed=1), pool(2, seed=2)]  # two tensor-parallel ranks' pools
    bm, tier, _ = tiered(2, cap_blocks=4, caches=caches)
    tokens = [1, 2, 3, 4]
    (b,) = fill(bm, tokens)
    want = [c[:, :, b].clone() for c in caches]
    evict_all(bm)
    for c in caches:
        c.zero_()
    (found,) = bm.find_cached_prefix(tokens, 4)
    for c, w in zip(caches, want):
        assert torch.equal(c[:, :, found], w)
    assert tier.capacity_blocks == 4


def test_events_say_which_tier_and_the_wire_keeps_it():
    bm, tier, _ = tiered(2, cap_blocks=1, watermark=1.0)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ha, hb = chain(a)[0], chain(b)[0]
    fill(bm, a)
    evict_all(bm)  # a: device -> host
    fill(bm, b)
    evict_all(bm)  # b: device -> host, pushing a out of the one-block tier
    got = bm.kv_events(0, bm.epoch, 100, 100)
    assert got.events == [
        (STORED, ha),
        (REMOVED, ha),
        (STORED, ha, HOST),
        (STORED, hb),
        (REMOVED, hb),
        (REMOVED, ha, HOST),
        (STORED, hb, HOST),
    ]
    msg = wire.kv_events(bm, worker_pb2.StatsRequest(want_kv_events=True, kv_events_epoch=0))
    assert msg.reset and msg.snapshot == b"" and msg.host_snapshot == wire.hash_bytes(hb)
    runs = wire.kv_events(
        bm, worker_pb2.StatsRequest(want_kv_events=True, kv_events_epoch=bm.epoch)
    ).runs
    assert [(r.kind, r.tier) for r in runs] == [
        ("stored", "device"),
        ("removed", "device"),
        ("stored", "host"),
        ("stored", "device"),
        ("removed", "device"),
        ("removed", "host"),
        ("stored", "host"),
    ]
    stats = wire.tier_stats(bm)
    assert stats["kv_host_tier_bytes"] == tier.bytes <= stats["kv_host_tier_capacity_bytes"]
    assert stats["kv_host_tier_stored"] == 2 and stats["kv_host_tier_evicted"] == 1
    worker_pb2.WorkerStats(**stats)  # every field is one of the message's


def test_the_index_keeps_the_tier_and_matches_host_blocks():
    bm, tier, _ = tiered(4, cap_blocks=8)
    index, worker, poll = poller(bm)

    tokens = list(range(200, 216))  # four blocks
    assert poll() == "reset"
    fill(bm, tokens)
    assert poll() == "events"
    assert index.matched_by_tier(tokens, {worker: BS}) == {worker: (16, 0)}
    bm.free(bm.allocate(2))  # the last two blocks move to the host tier
    assert poll() == "events"
    assert index.matched_by_tier(tokens, {worker: BS}) == {worker: (16, 8)}
    assert index.matched_tokens(tokens, {worker: BS}) == {worker: 16}
    hashes = chain_hashes(tokens, BS)
    assert {t for _, t in index._holders[hashes[3]]} == {INDEX_HOST}
    # restored: in both tiers; evicted again: in the host tier only (its copy was kept)
    bm.find_cached_prefix(tokens, 16)
    assert poll() == "events"
    assert {t for _, t in index._holders[hashes[3]]} == {DEVICE, INDEX_HOST}
    # a reset rebuilds both tiers from the snapshots
    index.forget(worker)
    assert poll() == "reset"
    assert {t for _, t in index._holders[hashes[3]]} == {DEVICE, INDEX_HOST}
    # cleared: nothing of the worker, in either tier
    assert bm.reset_prefix_cache()
    assert poll() == "events"
    assert index.matched_by_tier(tokens, {worker: BS}) == {worker: (0, 0)}
    assert len(index) == 0


def test_attach_needs_the_prefix_cache():
    bm = BlockManager(2, BS, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        bm.attach_tier(HostTier(1024, lambda: [pool(2)], FP))
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTier(0, lambda: [pool(2)], FP)


def test_the_yaml_key_reaches_the_engine_and_is_validated():
    from pdserve.deploy.config.load import validate_config
    from pdserve.engine.config import EngineConfig

    cfg = validate_config({"pools": {"decode": {"kv_host_tier_bytes": 1 << 30}}})
    assert cfg.pools.prefill.kv_host_tier_bytes == 0  # the documented default: off
    kwargs = cfg.engine_kwargs(cfg.pools.decode)
    assert kwargs["kv_host_tier_bytes"] == 1 << 30
    assert "kv_host_tier_bytes" not in cfg.engine_kwargs(cfg.pools.prefill)
    assert EngineConfig(model="m", **kwargs).kv_host_tier_bytes == 1 << 30
    for bad in (-1, 1.5, "1G"):
        with pytest.raises(ValueError, match="kv_host_tier_bytes"):
            validate_config({"pools": {"decode": {"kv_host_tier_bytes": bad}}})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        validate_config(
            {"pools": {"decode": {"kv_host_tier_bytes": 1024, "enable_prefix_caching": False}}}
        )


def test_the_router_exports_the_tier_per_worker():

    stats = worker_pb2.WorkerStats(
        kv_host_tier_bytes=3000,
        kv_host_tier_capacity_bytes=4096,
        kv_host_tier_stored=7,
        kv_host_tier_restored=5,
        kv_host_tier_evicted=2,
        prefix_hit_tokens_device=64,
        prefix_hit_tokens_host=32,
    )

    got = exported(stats)
    assert got[("pdserve:kv_host_tier_bytes", None)] == 3000
    assert got[("pdserve:kv_host_tier_capacity_bytes", None)] == 4096
    assert got[("pdserve:kv_host_tier_stored_blocks_total", None)] == 7
    assert got[("pdserve:kv_host_tier_restored_blocks_total", None)] == 5
    assert got[("pdserve:kv_host_tier_evicted_blocks_total", None)] == 2
    assert got[("vllm:external_prefix_cache_hits_total", None)] == 32
    assert got[("pdserve:prefix_cache_hit_tokens_by_source_total", "device")] == 64
    assert got[("pdserve:prefix_cache_hit_tokens_by_source_total", "host")] == 32


def _pool(fakes: dict):
    from pdserve.router.pool import WorkerPool, _Worker

    class Pool(WorkerPool):
        def _connect(self, role, address, **fields):
            fields.setdefault("heard_at", self._clock())
            return _Worker(role, address, None, fakes[address], **fields)

        def close(self):
            pass

    return Pool([], list(fakes), stats_ttl_s=0.5)


def test_a_decode_pick_prices_host_blocks_a_little_dearer_than_device_ones():
    from pdserve.router.pool import HOST_HIT_WEIGHT

    bm, tier, _ = tiered(16, cap_blocks=16)
    fakes = {"d0": EngineWorker("d0", bm), "d1": EngineWorker("d1", BlockManager(16, BS))}
    pool = _pool(fakes)
    d0, d1 = pool.decode
    turn = list(range(300, 340))  # ten blocks
    fill(bm, turn)
    fill(fakes["d1"].bm, turn)
    pool.sweep(wait_s=0.01)
    assert pool.decode_matches(turn) == {d0: 40, d1: 40}
    bm.free(bm.allocate(12))  # 6 never used, then d0's last six blocks: to its host tier
    pool.sweep(wait_s=0.01)
    held = pool.decode_matches(turn)
    assert held[d1] == 40 and held[d0] == 40 - int((1 - HOST_HIT_WEIGHT) * 24)
    assert 0 < HOST_HIT_WEIGHT < 1 and 16 < held[d0] < 40  # above its device blocks alone
    # the pick: the device holder first, the host holder before a worker holding nothing
    assert pool.decode_order(matched=held)[0] is d1
    fakes["d1"].bm.free(fakes["d1"].bm.allocate(16))  # d1 evicts all (no tier)
    pool.sweep(wait_s=0.01)
    held = pool.decode_matches(turn)
    assert d1 not in held and pool.decode_order(matched=held)[0] is d0
    pool.close()


def test_what_is_held_counts_the_tier_without_restoring_even_when_no_block_is_free():
    bm, tier, _ = tiered(4, cap_blocks=8)
    tokens = list(range(16))
    fill(bm, tokens)
    evict_all(bm)
    busy = bm.allocate(4)  # every block in use: a restore has nowhere to go now
    assert bm.held_prefix_tokens(tokens, 15) == 12  # whole blocks within 15 tokens
    assert bm.find_cached_prefix(tokens, 15) == [] and tier.restored == 0
    bm.free(busy)
    # a block freed since: the admission restores what the look counted
    assert len(bm.find_cached_prefix(tokens, 15)) == 3 and tier.restored == 3
    assert bm.held_prefix_tokens(list(range(100, 116)), 16) == 0
    bm.check_consistency()


def test_a_restore_whose_own_eviction_pushes_the_entry_out_records_one_removal():
    bm, tier, _ = tiered(1, cap_blocks=1)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    fill(bm, a)
    evict_all(bm)  # a in the tier
    fill(bm, b)  # b cached in the one block
    # restoring a takes the one block: b is evicted into the one-block tier, pushing a out
    assert bm.find_cached_prefix(a, 4) == []
    ha, hb = chain(a)[0], chain(b)[0]
    assert tier.contains(hb) and not tier.contains(ha) and tier.refused == 0
    events = bm.kv_events(0, bm.epoch, 100, 100).events
    assert events.count((REMOVED, ha, HOST)) == 1
    bm.check_consistency()


def test_a_lookup_for_an_admission_that_cannot_fit_restores_nothing():
    bm, tier, _ = tiered(8, cap_blocks=8)
    tokens = list(range(16))  # four blocks
    fill(bm, tokens)
    evict_all(bm)
    busy = bm.allocate(5)  # three blocks free: a 17-token admission needs five
    assert bm.find_cached_prefix(tokens, 16, admit_tokens=17) == [] and tier.restored == 0
    bm.free(busy[:2])  # five free: it fits now (the restored blocks count among them)
    assert len(bm.find_cached_prefix(tokens, 16, admit_tokens=17)) == 4
    assert tier.restored == 4
    bm.free(busy[2:])
    bm.check_consistency()


def test_a_restored_prefix_lies_in_consecutive_blocks_where_they_are_free():
    """Blocks restored one at a time each continue the run of the block before them in the
    prefix (BlockManager.allocate's `after`) rather than take the free queue's order, which
    after traffic gives a run backwards: the decode attention kernel reads it as slowly as
    scattered blocks."""
    bm, tier, (cache,) = tiered(16, cap_blocks=16)
    tokens = list(range(200, 216))  # four full blocks
    fill(bm, tokens)
    taken = bm.allocate(16)  # every block: the four cached ones go to the tier
    order = [b for pair in zip(range(8), range(8, 16)) for b in pair]  # 0, 8, 1, 9, ...
    bm.free(order[::-1])  # (free gives a table back tail first: the queue is `order`)
    assert len(taken) == 16 and list(bm._free)[:4] == [0, 8, 1, 9]
    found = bm.find_cached_prefix(tokens, len(tokens))
    assert tier.restored == 4
    assert found == [0, 1, 2, 3]  # in the queue's order: 0, 8, 1, 9
    bm.check_consistency()
