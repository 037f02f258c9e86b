"""Adapter-aware routing and the catch-up of workers that missed a run-time change, with fake
workers and no sockets: the pool's picks (router/pool.py) send a LoRA adapter's requests only to
the workers whose Stats list it, preferring those where it is resident unless they are that much
busier, and leave the base model's alone; the router's adapters (router/lora.py) load on a
worker what its reports show it lacks (if_absent) and unload what was unloaded at run time,
once per change, and try a failed one again later; the per-worker metrics show the adapters
served and resident, and the loads and evictions."""

from __future__ import annotations

import threading
import time

import grpc

from helpers.stats_workers import Answered
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.lora import RouterAdapters
from pdserve.router.pool import RESIDENT_PREFILL_BONUS, WorkerPool, _Worker
from pdserve.router.worker_metrics import WorkerCollector


class FakeWorker:
    """A worker's stub: Stats from its adapters (served, resident) and KV blocks in use; LoadLoRA
    and UnloadLoRA change the adapters served, as a worker does, and are recorded."""

    def __init__(self, name, adapters=(), resident=(), used=0, fail=False):
        self.name, self.adapters, self.resident, self.used = name, list(adapters), resident, used
        self.calls, self.fail, self.lock = [], fail, threading.Lock()
        self.Stats = self

    def future(self, request, timeout=None):
        with self.lock:
            adapters = list(self.adapters)
        return Answered(
            worker_pb2.WorkerStats(
                worker_id=self.name,
                num_total_blocks=100,
                num_free_blocks=100 - self.used,
                block_size=16,
                lora_adapters=adapters,
                lora_adapters_count=len(adapters),
                lora_resident=list(self.resident),
                lora_loads=7,
                lora_evictions=5,
                lora_running=["sql"] if self.resident else [],
                lora_waiting=["poem", "sql"] if self.resident else [],
                lora_max=2,
            )
        )

    def LoadLoRA(self, request, timeout=None):
        return self._call(("load", request.lora_name, request.lora_path, request.if_absent))

    def UnloadLoRA(self, request, timeout=None):
        return self._call(("unload", request.lora_name))

    def _call(self, call):
        with self.lock:
            self.calls.append(call)
            if self.fail:
                raise Refused()
            if call[0] == "load" and call[1] not in self.adapters:
                self.adapters.append(call[1])
            if call[0] == "unload" and call[1] in self.adapters:
                self.adapters.remove(call[1])
        return worker_pb2.LoRAAdapters()


class Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return "no such directory"


class FakePool(WorkerPool):
    fakes: dict = {}

    def _connect(self, role, address, **fields):
        fields.setdefault("heard_at", self._clock())
        return _Worker(role, address, None, self.fakes[address], **fields)

    def close(self):
        pass


def _pool(decode=(), prefill=()) -> WorkerPool:
    FakePool.fakes = {w.name: w for w in (*decode, *prefill)}
    pool = FakePool([w.name for w in prefill], [w.name for w in decode], clock=lambda: 1000.0)
    pool.sweep(wait_s=1.0)
    return pool


def _first(pool, adapter, n=4) -> list[str]:
    """The first choice of n decode picks (each charges nothing)."""
    return [pool.decode_order(adapter=adapter)[0].address for _ in range(n)]


def test_decode_picks_only_workers_with_the_adapter():
    pool = _pool([FakeWorker("d0", ["sql"]), FakeWorker("d1", ["sql", "poem"])])
    assert _first(pool, "poem") == ["d1"] * 4
    assert [w.address for w in pool.decode_order(adapter="poem")] == ["d1"]  # no fallback to d0
    assert set(_first(pool, "sql")) == {"d0", "d1"}  # both have it: the rotation
    assert set(_first(pool, "")) == {"d0", "d1"}  # the base model: as before
    # none has it: every worker (each refuses it itself, as before)
    assert {w.address for w in pool.decode_order(adapter="verse")} == {"d0", "d1"}


def test_decode_picks_prefer_resident_unless_busier():
    d0 = FakeWorker("d0", ["sql", "poem"], resident=["sql"], used=5)
    d1 = FakeWorker("d1", ["sql", "poem"], resident=["poem"], used=0)
    pool = _pool([d0, d1])
    # sql resident on d0: it wins while within 10 of d1's blocks in use (10% of its 100)
    assert _first(pool, "sql") == ["d0"] * 4
    assert _first(pool, "poem") == ["d1"] * 4
    d0.used = 15  # busier than the bonus covers: sql's requests spread to d1
    pool.sweep(wait_s=1.0)
    assert _first(pool, "sql") == ["d1"] * 4


def test_prefill_picks_only_workers_with_the_adapter_resident_first():
    p0 = FakeWorker("p0", ["sql"], resident=["sql"])
    p1 = FakeWorker("p1", ["sql", "poem"])
    pool = _pool([FakeWorker("d0", ["sql", "poem"])], [p0, p1])
    prompt = list(range(64))
    for _ in range(3):
        worker, charge = pool.pick_prefill(prompt, adapter="poem")
        assert worker.address == "p1"
        pool.end_prefill(worker, charge)
    worker, charge = pool.pick_prefill(prompt, adapter="sql")
    assert worker.address == "p0"  # resident there: first while it is not busier
    pool.end_prefill(worker, charge)
    pool.charge_queued(pool.prefill[0], RESIDENT_PREFILL_BONUS + 1)  # p0 busier than that
    worker, charge = pool.pick_prefill(list(range(100, 164)), adapter="sql")
    assert worker.address == "p1"
    pool.end_prefill(worker, charge)


def _wait(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_catch_up_loads_what_a_worker_lacks_and_unloads_what_was_unloaded():
    d0 = FakeWorker("d0", ["sql", "poem"])
    late = FakeWorker("d1", ["sql", "poem"])  # its config's adapters only
    pool = _pool([d0])
    adapters = RouterAdapters(
        "base", True, {"sql": "/a/sql", "poem": "/a/poem"}, allow_runtime_updates=True, pool=pool
    )
    adapters.load("verse", "/a/verse")
    adapters.unload("poem")
    assert d0.calls == [("load", "verse", "/a/verse", False), ("unload", "poem")]
    pool.sweep(wait_s=1.0)  # d0 is up to date: nothing to catch up
    FakePool.fakes["d1"] = late
    pool.register("decode", "d1", "d1")
    assert _first(pool, "verse") == ["d0"] * 4  # nothing of verse before d1's Stats list it
    pool.sweep(wait_s=1.0)  # d1's first report: it lacks verse and has poem
    _wait(lambda: adapters.catch_ups == 2, "the catch-up calls")
    assert late.calls == [("load", "verse", "/a/verse", True), ("unload", "poem")]
    pool.sweep(wait_s=1.0)
    assert set(_first(pool, "verse")) == {"d0", "d1"}
    for _ in range(3):  # up to date: no more calls
        pool.sweep(wait_s=1.0)
    time.sleep(0.1)
    assert len(late.calls) == 2 and adapters.catch_up_failures == 0


def test_catch_up_that_fails_is_tried_again_later(monkeypatch):
    d0 = FakeWorker("d0", ["sql"])
    pool = _pool([d0])
    adapters = RouterAdapters("base", True, {"sql": "/a/sql"}, True, pool=pool)
    adapters.load("verse", "/a/verse")
    bad = FakeWorker("d1", ["sql"], fail=True)
    FakePool.fakes["d1"] = bad
    pool.register("decode", "d1", "d1")
    pool.sweep(wait_s=1.0)
    _wait(lambda: adapters.catch_up_failures == 1, "the failed catch-up")
    for _ in range(3):  # within CATCH_UP_RETRY_S: not tried again at each report
        pool.sweep(wait_s=1.0)
    time.sleep(0.1)
    assert len(bad.calls) == 1
    adapters._catch_ups._retry_at.clear()  # its retry time, as if it had passed
    bad.fail = False
    pool.sweep(wait_s=1.0)
    _wait(lambda: adapters.catch_ups == 1, "the retried catch-up")
    assert bad.adapters == ["sql", "verse"]


def test_worker_metrics_show_adapters():
    pool = _pool([FakeWorker("d0", ["sql", "poem"], resident=["sql"])])
    samples = {
        s.name: s.value
        for family in WorkerCollector(pool, "m").collect()
        for s in family.samples
        if "lora" in s.name
    }
    info = samples.pop("vllm:lora_requests_info")
    assert samples == {
        "pdserve:lora_adapters_served": 2,
        "pdserve:lora_adapters_resident": 1,
        "pdserve:lora_adapter_loads_total": 7,
        "pdserve:lora_adapter_evictions_total": 5,
    }
    assert abs(info - time.time()) < 60  # vLLM's: the value is a time, the newest wins
    (labels,) = [
        s.labels
        for family in WorkerCollector(pool, "m").collect()
        for s in family.samples
        if s.name == "vllm:lora_requests_info"
    ]
    assert (
        labels["max_lora"],
        labels["running_lora_adapters"],
        labels["waiting_lora_adapters"],
    ) == ("2", "sql", "poem,sql")  # comma-separated, as vLLM's and the GIE picker's parse


def test_a_dead_worker_is_skipped_by_a_load_and_caught_up_when_back():
    d0, d1 = FakeWorker("d0", ["sql"]), FakeWorker("d1", ["sql"])
    pool = _pool([d0, d1])
    adapters = RouterAdapters("base", True, {"sql": "/a/sql"}, True, pool=pool)
    dead = next(w for w in pool.decode if w.address == "d1")
    dead.dead = "silent"  # as the pool marks a static worker that stopped answering
    adapters.load("verse", "/a/verse")  # not refused for want of d1
    assert d0.calls == [("load", "verse", "/a/verse", False)] and d1.calls == []
    pool.sweep(wait_s=1.0)  # d1 answers again: its report lacks verse
    _wait(lambda: adapters.catch_ups == 1, "d1's catch-up")
    assert d1.calls == [("load", "verse", "/a/verse", True)]
