"""Prefill picking by queued tokens and prefix-cache affinity (router/pool.py, router/affinity.py)."""

from __future__ import annotations

from pdserve.router.affinity import CHUNK, PrefixAffinity, prefix_hashes
from pdserve.router.pool import WorkerPool


def make_pool():
    # never started: no health thread, channels are created lazily and never used here
    return WorkerPool(
        prefill_addresses=("127.0.0.1:1", "127.0.0.1:2"), decode_addresses=("127.0.0.1:3",)
    )


def test_a_shared_prefix_goes_back_to_the_worker_that_has_it():
    pool = make_pool()
    try:
        system = list(range(1000, 1000 + 4 * CHUNK))
        first, charge = pool.pick_prefill(system + [1, 2, 3])
        assert charge == len(system) + 3
        pool.end_prefill(first, charge)
        for tail in ([4], [5, 6], [7, 8, 9]):  # round-robin alone would alternate
            worker, charge = pool.pick_prefill(system + tail)
            assert worker is first and charge == len(tail)
            pool.end_prefill(worker, charge)
        busy, _ = pool.pick_prefill(system + [10])  # stays in flight on the holder
        assert busy is first
        other, _ = pool.pick_prefill(list(range(5000, 5100)))  # nothing shared: the idle one
        assert other is not first
    finally:
        pool.close()


def test_a_busy_holder_loses_to_an_idle_worker_when_recomputing_is_cheaper():
    pool = make_pool()
    try:
        prefix = list(range(2 * CHUNK))
        holder, charge = pool.pick_prefill(prefix)
        pool.end_prefill(holder, charge)
        long_job, long_charge = pool.pick_prefill(list(range(9000, 9000 + 1000)))
        if long_job is not holder:  # make the holder the busy one
            pool.end_prefill(long_job, long_charge)
            holder.num_inflight += 1
            holder.queued_tokens += 1000
        # holder: 1000 queued + 0 new; the other: 0 queued + 64 new
        worker, charge = pool.pick_prefill(prefix + [1])
        assert worker is not holder and charge == len(prefix) + 1
        pool.end_prefill(worker, charge)
        assert worker.queued_tokens == 0 and worker.num_inflight == 0
    finally:
        pool.close()


def test_affinity_matches_whole_leading_chunks_only_and_forgets():
    aff = PrefixAffinity(max_entries=3)
    a = list(range(3 * CHUNK))
    aff.record(prefix_hashes(a), "w1")
    assert aff.matched_tokens(prefix_hashes(a + [7])) == {"w1": 3 * CHUNK}
    changed = a[:CHUNK] + [99999] + a[CHUNK + 1 :]  # differs in the second chunk
    assert aff.matched_tokens(prefix_hashes(changed)) == {"w1": CHUNK}
    assert aff.matched_tokens(prefix_hashes(a[: CHUNK - 1])) == {}  # shorter than one chunk
    aff.record(prefix_hashes(list(range(500, 500 + CHUNK))), "w2")  # 4 hashes > max_entries=3
    assert aff.matched_tokens(prefix_hashes(a)) == {}  # the oldest (first chunk) was evicted
    aff.forget("w2")
    assert aff.matched_tokens(prefix_hashes(list(range(500, 500 + CHUNK)))) == {}
