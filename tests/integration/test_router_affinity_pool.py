"""Prefill picking by queued tokens and prefix-cache affinity in a WorkerPool (router/pool.py,
router/affinity.py); the pool is never started, but it makes a gRPC channel per worker. The
affinity table alone: tests/unit/test_router_affinity.py."""

from __future__ import annotations

from pdserve.router.affinity import CHUNK
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
