"""The disk level below the host KV tier (engine/kv_disk_tier.py), alone and under a host tier
and the block manager that evicts into them (engine/block_manager.py). Pools are small CPU
tensors filled with distinct values; no model. Each test's directory is its own tmp_path."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from helpers.blocks import chain, fill, poller
from helpers.stats_workers import exported
from pdserve.engine import kv_disk_tier
from pdserve.engine.block_manager import HOST, REMOVED, STORED, BlockManager, block_hash
from pdserve.engine.kv_disk_tier import DiskTier
from pdserve.engine.kv_host_tier import HostTier, fingerprint

BS = 4
LAYERS, HEADS, DIM = 2, 2, 3
FP = fingerprint(dict(model="m", dtype="float32", block_size=BS), 1)
OTHER_FP = fingerprint(dict(model="other", dtype="float32", block_size=BS), 1)


def pool(num_blocks: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, BS, HEADS, DIM, generator=g).to(dtype)


def block_bytes(cache: torch.Tensor) -> int:
    return cache[:, :, 0].numel() * cache.element_size()


def file_bytes(disk: DiskTier, cache: torch.Tensor) -> int:
    """One block's file: the header's size depends on the hashes and tokens, so measure one."""
    probe = DiskTier(1 << 30, disk.base, FP)
    try:
        shard = cache[:, :, 0].clone()
        probe.put(block_hash(None, (1, 2, 3, 4)), None, (1, 2, 3, 4), [shard], 0)
        assert probe.flush(30)
        return probe.files_bytes()
    finally:
        probe.close()


def tiered(tmp_path, num_blocks: int, host_blocks: float, disk_blocks: float, **disk_kw):
    caches = [pool(num_blocks)]
    bb = block_bytes(caches[0])
    disk = DiskTier(int(disk_blocks * (bb + 400)), str(tmp_path), FP, **disk_kw)
    host = HostTier(int(host_blocks * bb), lambda: caches, FP, disk=disk)
    bm = BlockManager(num_blocks, BS)
    bm.attach_tier(host)
    return bm, host, disk, caches


def push_to_disk(tmp_path, **kw):
    """A 4-block pool, a 2-block host tier and a roomy disk: prompt A's 4 blocks are computed,
    then prompt B's 4 evict them into the host tier, which pushes the first ones out to disk.
    Returns (bm, host, disk, caches, A, A's blocks' bytes as computed)."""
    bm, host, disk, caches = tiered(tmp_path, 4, 2, 16, **kw)
    a = list(range(100, 116))
    ids = fill(bm, a)
    want = [caches[0][:, :, b].clone() for b in ids]
    fill(bm, list(range(200, 216)))
    assert disk.flush(30)
    return bm, host, disk, caches, a, want


def test_a_block_pushed_to_disk_comes_back_bit_exact(tmp_path):
    bm, host, disk, caches, a, want = push_to_disk(tmp_path)
    hashes = chain(a)
    assert all(host.contains(h) for h in hashes)  # host memory or disk
    on_disk = [h for h in hashes if disk.contains(h)]
    assert on_disk and disk.stored >= len(on_disk)
    assert disk.files_bytes() == disk.bytes > 0
    found = bm.find_cached_prefix(a, len(a))
    assert len(found) == 4
    for block_id, w in zip(found, want):
        assert torch.equal(caches[0][:, :, block_id], w)
    # restoring takes free blocks, which evicts B's blocks into the host tier, which may push
    # A's remaining host entries out to disk first: at least those on disk before come from it
    assert disk.restored >= len(on_disk) and disk.refused == 0
    assert disk.restored + host.restored == 4
    bm.take(found)
    bm.count_hits(found)
    assert bm.hit_tokens_disk == disk.restored * BS
    assert bm.hit_tokens_host == host.restored * BS
    bm.free(found)
    host.close()
    assert not os.path.exists(disk.dir)


def test_pending_entries_are_served_from_memory(tmp_path):
    bm, host, disk, caches = tiered(tmp_path, 4, 2, 16)
    a = list(range(100, 116))
    ids = fill(bm, a)
    want = [caches[0][:, :, b].clone() for b in ids]
    # the writer may or may not have written them yet: either way the bytes come back
    fill(bm, list(range(200, 216)))
    found = bm.find_cached_prefix(a, len(a))
    assert [caches[0][:, :, b] for b in found] and all(
        torch.equal(caches[0][:, :, b], w) for b, w in zip(found, want)
    )
    host.close()


def test_directory_is_private_per_worker_and_removed_at_close(tmp_path):
    base = tmp_path / "tier"
    disk = DiskTier(1 << 20, str(base), FP)
    try:
        assert os.path.dirname(disk.dir) == str(base)
        assert stat.S_IMODE(os.stat(disk.dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(base).st_mode) == 0o700
        assert os.path.basename(disk.dir).startswith(f"w{os.getpid()}-")
    finally:
        disk.close()
    assert not os.path.exists(disk.dir)
    disk.close()  # idempotent


def test_stale_directories_of_dead_workers_are_removed_at_start(tmp_path, monkeypatch):
    dead, alive = tmp_path / "w999999999-abcd", tmp_path / f"w{os.getpid()}-old"
    for d in (dead, alive):
        d.mkdir()
        (d / "x.kv").write_bytes(b"stale")
    (tmp_path / "unrelated").mkdir()
    monkeypatch.setattr(kv_disk_tier, "pid_alive", lambda pid: pid == os.getpid())
    disk = DiskTier(1 << 20, str(tmp_path), FP)
    try:
        assert disk.stale_removed == [str(dead)]
        assert not dead.exists() and alive.exists() and (tmp_path / "unrelated").exists()
    finally:
        disk.close()


def test_an_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError, match="kv_disk_tier_dir"):
        DiskTier(1 << 20, str(blocker / "sub"), FP)


def test_the_cap_and_watermark_hold_on_disk(tmp_path):
    caches = [pool(64)]
    bb = block_bytes(caches[0])
    disk = DiskTier(1 << 30, str(tmp_path), FP)
    per_file = file_bytes(disk, caches[0])
    disk.close()
    cap = 5 * per_file + per_file // 2  # 5 files fit, not 6
    disk = DiskTier(cap, str(tmp_path), FP, watermark=0.6)
    host = HostTier(2 * bb, lambda: caches, FP, disk=disk)
    bm = BlockManager(4, BS)
    bm.attach_tier(host)
    peak = 0
    try:
        for r in range(12):
            fill(bm, list(range(1000 + 16 * r, 1016 + 16 * r)))
            assert disk.bytes <= cap
            peak = max(peak, disk.files_bytes())
            assert disk.flush(30)
            assert disk.files_bytes() <= cap
        assert peak <= cap and disk.peak_bytes <= cap
        assert disk.evicted > 0 and len(disk) <= 5
    finally:
        host.close()


def test_events_say_removed_only_when_both_levels_let_go(tmp_path):
    bm, host, disk, caches = tiered(tmp_path, 4, 2, 3)
    for r in range(8):
        fill(bm, list(range(1000 + 16 * r, 1016 + 16 * r)))
    # replaying the host-tier events gives exactly what the two levels hold together
    replay = set()
    ev = bm.kv_events(0, bm.epoch, 10_000, 0)
    for e in ev.events:
        if len(e) == 3 and e[2] == HOST:
            (replay.add if e[0] == STORED else replay.discard)(e[1])
    assert disk.evicted > 0 and host.evicted > 0  # both levels pushed entries out
    assert replay == set(host.hashes())
    assert len(host.hashes()) > 2  # more than host memory alone holds
    assert host.capacity_blocks == 2 + disk.capacity_bytes // block_bytes(caches[0])
    host.close()


def corrupt_first_disk_file(disk: DiskTier, how: str) -> int:
    assert disk.flush(30)
    (h,) = disk.hashes()[:1]
    path = disk.path(h)
    data = bytearray(open(path, "rb").read())
    if how == "byte":
        data[-7] ^= 0x40
    elif how == "truncate":
        data = data[: len(data) - 100]
    elif how == "header":
        data[20] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)
    return h


@pytest.mark.parametrize("how", ["byte", "truncate", "header"])
def test_a_damaged_file_is_refused_deleted_and_recomputed(tmp_path, how):
    bm, host, disk, caches, a, want = push_to_disk(tmp_path)
    h = corrupt_first_disk_file(disk, how)
    hashes = chain(a)
    k = hashes.index(h)
    found = bm.find_cached_prefix(a, len(a))
    assert len(found) == k  # the prefix stops at the damaged block: the rest is recomputed
    for block_id, w in zip(found, want):
        assert torch.equal(caches[0][:, :, block_id], w)
    assert disk.refused == 1 and host.refused == 1
    assert not disk.contains(h) and not host.contains(h)
    assert disk.flush(30)
    assert not os.path.exists(disk.path(h))
    ev = bm.kv_events(0, bm.epoch, 10_000, 0)
    assert (REMOVED, h, HOST) in ev.events
    host.close()


def test_a_file_of_another_fingerprint_is_refused(tmp_path):
    bm, host, disk, caches, a, want = push_to_disk(tmp_path)
    assert disk.flush(30)
    h = disk.hashes()[0]
    # a file written for another layout, put where this engine's file of `h` is
    other = DiskTier(1 << 20, str(tmp_path / "other"), OTHER_FP)
    other.put(h, None, tuple(a[:BS]), [caches[0][:, :, 0].clone()], 0)
    assert other.flush(30)
    os.replace(other.path(h), disk.path(h))
    other.close()
    # same size, so only the header's fingerprint tells them apart
    assert disk.load(h) is None
    assert disk.refused == 1 and not disk.contains(h)
    host.close()


def test_a_chain_mismatch_is_refused(tmp_path):
    bm, host, disk, caches, a, want = push_to_disk(tmp_path)
    assert disk.flush(30)
    h = disk.hashes()[0]
    block = bm.allocate(1)[0]
    assert host.load(h, 12345, (9, 9, 9, 9), block) is False
    assert disk.refused == 1 and host.refused == 1 and not disk.contains(h)
    bm.free([block])
    host.close()


def test_a_full_writer_queue_drops_the_entry(tmp_path):
    caches = [pool(8)]
    one = block_bytes(caches[0])
    disk = DiskTier(1 << 30, str(tmp_path), FP, queue_bytes=one + one // 2)  # one entry fits
    try:
        with disk._cond:  # the writer cannot take anything while this is held
            taken = [
                disk.put(block_hash(None, (i,)), None, (i,), [caches[0][:, :, i].clone()], 0)[0]
                for i in range(3)
            ]
        assert taken == [True, False, False] and disk.dropped == 2
        assert disk.flush(30) and len(disk) == 1
    finally:
        disk.close()


def test_clear_drops_both_levels_and_their_files(tmp_path):
    bm, host, disk, caches, a, want = push_to_disk(tmp_path)
    assert bm.reset_prefix_cache()
    assert len(host) == 0 and len(disk) == 0 and host.hashes() == []
    assert disk.flush(30) and disk.files_bytes() == 0
    host.close()


def test_bfloat16_round_trip(tmp_path):
    cache = pool(4, dtype=torch.bfloat16)
    disk = DiskTier(1 << 20, str(tmp_path), FP)
    try:
        shard = cache[:, :, 1].clone()
        h = block_hash(None, (5, 6, 7, 8))
        from pdserve.engine.kv_host_tier import _crc

        disk.put(h, None, (5, 6, 7, 8), [shard], _crc([shard]))
        assert disk.flush(30)
        got = disk.load(h)
        assert got.shards[0].dtype == torch.bfloat16
        assert torch.equal(got.shards[0].view(torch.int16), shard.view(torch.int16))
        assert got.token_ids == (5, 6, 7, 8) and got.parent_hash is None
    finally:
        disk.close()


def test_the_worker_reports_the_disk_tier_and_the_router_exports_it(tmp_path):
    from pdserve.protos.pdserve.v1 import worker_pb2
    from pdserve.worker_common import kv_events as wire

    bm, host, disk, caches, a, want = push_to_disk(tmp_path)
    found = bm.find_cached_prefix(a, len(a))
    bm.take(found)
    bm.count_hits(found)
    bm.free(found)
    fields = wire.tier_stats(bm)
    assert fields["kv_disk_tier_bytes"] == disk.bytes > 0
    assert fields["kv_disk_tier_capacity_bytes"] == disk.capacity_bytes
    assert fields["kv_disk_tier_stored"] == disk.stored > 0
    assert fields["kv_disk_tier_restored"] == disk.restored > 0
    assert fields["prefix_hit_tokens_disk"] == bm.hit_tokens_disk > 0
    stats = worker_pb2.WorkerStats(**fields)
    host.close()

    got = exported(stats)
    assert got[("pdserve:kv_disk_tier_bytes", None)] == fields["kv_disk_tier_bytes"]
    assert got[("pdserve:kv_disk_tier_capacity_bytes", None)] == disk.capacity_bytes
    assert got[("pdserve:kv_disk_tier_stored_blocks_total", None)] == disk.stored
    assert got[("pdserve:kv_disk_tier_restored_blocks_total", None)] == disk.restored
    assert got[("pdserve:kv_disk_tier_evicted_blocks_total", None)] == disk.evicted
    assert got[("pdserve:prefix_cache_hit_tokens_by_source_total", "disk")] == bm.hit_tokens_disk


def no_space(monkeypatch):
    """Every disk tier write from now on fails as on a full disk (os.writev is the writer's
    only use of it)."""

    def full(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_disk_tier.os, "writev", full)


def test_dropped_refused_and_failed_writes_reach_the_router(tmp_path, monkeypatch):
    bm, host, disk, caches, a, want = push_to_disk(tmp_path)
    # refused: a damaged file read back
    corrupt_first_disk_file(disk, "byte")
    bm.find_cached_prefix(a, len(a))
    assert disk.flush(30)  # (the restores' evictions pushed blocks to disk: none left queued)
    # dropped: a put while the writer's queue is at its bound
    disk.queue_bytes = block_bytes(caches[0])
    shards = [caches[0][:, :, 0].clone()]
    with disk._cond:  # the writer cannot take anything while this is held
        took = [disk.put(block_hash(None, (i,)), None, (i,), shards, 0)[0] for i in (1, 2)]
    assert took == [True, False]
    assert disk.flush(30)
    # a failed write
    no_space(monkeypatch)
    disk.put(block_hash(None, (3,)), None, (3,), shards, 0)
    assert disk.flush(30)
    assert disk.refused == 1 and disk.dropped == 1 and disk.write_errors == 1
    assert disk.stats()["kv_disk_tier_write_errors"] == 1

    from pdserve.protos.pdserve.v1 import worker_pb2
    from pdserve.worker_common import kv_events as wire

    fields = wire.tier_stats(bm)
    assert fields["kv_disk_tier_dropped"] == 1
    assert fields["kv_disk_tier_refused"] == 1
    assert fields["kv_disk_tier_write_errors"] == 1
    got = exported(worker_pb2.WorkerStats(**fields))
    host.close()
    assert got[("pdserve:kv_disk_tier_dropped_blocks_total", None)] == 1
    assert got[("pdserve:kv_disk_tier_refused_blocks_total", None)] == 1
    assert got[("pdserve:kv_disk_tier_write_errors_total", None)] == 1


def test_a_failed_write_is_reported_removed_and_leaves_the_router_index(tmp_path, monkeypatch):
    from pdserve.router.kv_index import HOST as INDEX_HOST

    no_space(monkeypatch)
    bm, host, disk, caches = tiered(tmp_path, 4, 2, 16)
    index, worker, poll = poller(bm)
    assert poll() == "reset"
    a = list(range(100, 116))
    fill(bm, a)
    fill(bm, list(range(200, 216)))  # A's blocks go to the host tier, which pushes two to disk
    assert disk.flush(30)
    lost = [h for h in chain(a) if not host.contains(h)]
    assert len(lost) == 2 and disk.write_errors == 2 and len(disk) == 0
    assert disk.files_bytes() == 0  # a failed write leaves no partial file
    assert poll() == "events"
    # the writer thread only queues the loss: the engine thread's next allocation reports it
    # (before its own eviction, which pushes A's other blocks to disk: those writes fail too)
    bm.free(bm.allocate(1))
    ev = bm.kv_events(0, bm.epoch, 10_000, 0)
    assert {e[1] for e in ev.events if e[0] == REMOVED and len(e) == 3} == set(lost)
    assert all(e[2] == HOST for e in ev.events if len(e) == 3 and e[1] in lost)
    assert poll() == "events"
    # A's prefix matches up to its first lost block (before it, host memory holds every block)
    held = chain(a).index(next(h for h in chain(a) if h in lost)) * BS
    assert index.matched_by_tier(a, {worker: BS}) == {worker: (held, held)}
    assert not any(h.to_bytes(16, "little") in index._holders for h in lost)
    # once every write has failed and been reported, the index lists A's blocks in the host
    # tier exactly where the tier holds them
    assert disk.flush(30)
    later = bm.reap_tier()
    assert later and bm.reap_tier() == []  # each reported once
    assert disk.write_errors == len(lost) + len(later)
    assert poll() == "events"
    for h in chain(a):
        holders = index._holders.get(h.to_bytes(16, "little"), ())
        assert ({t for _, t in holders} == {INDEX_HOST}) == host.contains(h)
    host.close()


def test_an_idle_engine_reports_a_lost_block_when_reaped(tmp_path, monkeypatch):
    bm, host, disk, caches, a, want = push_to_disk(tmp_path)
    no_space(monkeypatch)
    b = list(range(300, 316))
    fill(bm, b)  # more of A's and B's blocks pushed to disk: these writes fail
    assert disk.flush(30) and disk.write_errors > 0
    lost = bm.reap_tier()  # what the worker's engine loop calls between steps
    assert lost and not any(host.contains(h) for h in lost)
    ev = bm.kv_events(0, bm.epoch, 10_000, 0)
    assert {e[1] for e in ev.events if e[0] == REMOVED and len(e) == 3} >= set(lost)
    host.close()


def test_a_lost_block_held_again_is_not_reported(tmp_path, monkeypatch):
    caches = [pool(4)]
    bb = block_bytes(caches[0])
    disk = DiskTier(16 * (bb + 400), str(tmp_path), FP)
    host = HostTier(2 * bb, lambda: caches, FP, disk=disk)
    try:
        no_space(monkeypatch)
        h, tokens = block_hash(None, (1, 2, 3, 4)), (1, 2, 3, 4)
        assert disk.put(h, None, tokens, [caches[0][:, :, 0].clone()], 0)[0]
        assert disk.flush(30) and not disk.contains(h)
        assert host.save(h, None, tokens, 0)[0]  # host memory holds it again
        assert host.take_lost() == [] and disk.take_lost() == []
    finally:
        host.close()


def test_a_workers_idle_engine_loop_reports_a_lost_block(tmp_path, monkeypatch):
    """A worker's engine loop (worker_common/process.py engine_ticks) drains the lost blocks
    while nothing allocates: the failed writes happen after the last allocation."""
    import threading
    import time

    from pdserve.engine.engine_loop import EngineLoop
    from pdserve.worker_common.process import engine_ticks

    no_space(monkeypatch)
    bm, host, disk, caches = tiered(tmp_path, 4, 2, 16)
    gate = threading.Event()
    real_write = disk._write

    def held_write(key, header, entry):  # the writes fail only once the loop is idle
        gate.wait(30)
        return real_write(key, header, entry)

    monkeypatch.setattr(disk, "_write", held_write)
    a = list(range(100, 116))
    fill(bm, a)
    fill(bm, list(range(200, 216)))  # two of A's blocks pushed to disk, their writes held

    class Engine:
        block_manager = bm

        def has_unfinished_requests(self):
            return False

    monkeypatch.setattr("pdserve.worker_common.process.REAP_TIER_PERIOD_S", 0.05)
    loop = EngineLoop.build(Engine, name="t-reap", timeout=10)
    try:
        engine_ticks(loop)
        gate.set()
        assert disk.flush(30) and disk.write_errors == 2

        def removed():
            ev = bm.kv_events(0, bm.epoch, 10_000, 0)
            return {e[1] for e in ev.events if e[0] == REMOVED and len(e) == 3}

        lost = {h for h in chain(a) if not host.contains(h)}
        for _ in range(600):  # the loop's next tick, at most a few turns away
            if removed() == lost:
                break
            time.sleep(0.05)
        assert len(lost) == 2 and removed() == lost
    finally:
        loop.stop()
        host.close()
