"""Stand-ins for a decode worker's Stats stub in the router pool's tests (router/pool.py polls
`worker.stub.Stats.future(request, timeout)`): each answers at once from a real block manager,
with its KV events and its host tier's figures, as worker_common/kv_events.py puts them on the
wire. Used by tests/unit/test_kv_index.py and tests/unit/test_kv_host_tier.py; `exported` reads
what the router's /metrics makes of one decode worker's Stats (test_kv_host_tier.py,
test_kv_disk_tier.py)."""

from __future__ import annotations

from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.worker_common import kv_events as wire


class Answered:
    """A Stats future already answered."""

    def __init__(self, stats):
        self.stats = stats

    def done(self):
        return True

    def result(self, timeout=None):
        return self.stats

    def cancel(self):
        pass


class EngineWorker:
    """A decode worker's Stats, answered at once from a real block manager (and its tier)."""

    def __init__(self, worker_id, bm):
        self.worker_id, self.bm, self.Stats = worker_id, bm, self

    def future(self, request, timeout=None):
        stats = worker_pb2.WorkerStats(
            worker_id=self.worker_id,
            num_free_blocks=self.bm.num_free_blocks,
            num_total_blocks=self.bm.num_blocks,
            block_size=self.bm.block_size,
            **wire.tier_stats(self.bm),
        )
        events = wire.kv_events(self.bm, request)
        if events is not None:
            stats.kv_events.CopyFrom(events)
        return Answered(stats)


def exported(stats) -> dict:
    """The router's worker metrics (router/worker_metrics.py) for one serving decode worker whose
    Stats answer is `stats`: {(sample name, its "source" label or None): value}."""
    from pdserve.router.worker_metrics import WorkerCollector

    class Pool:
        def snapshot(self):
            return [("decode", "d0", stats, False, "serving")]

    got = {}
    for fam in WorkerCollector(Pool(), "m").collect():
        for sample in fam.samples:
            got[(sample.name, sample.labels.get("source"))] = sample.value
    return got
