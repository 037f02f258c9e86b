"""Pool membership that changes at run time: health sweeps that skip a failing worker and bring
it back, picking that never waits on a hung Stats call, static workers, and the registry
(Register, Heartbeat, drop-out) with the workers' registration client.

These tests use fake workers that only answer Stats, so they need no engine; the registry tests
run the router in this process over 127.0.0.1. Requests that outlive their decode worker are in
test_router_failover.py.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent import futures

import grpc
import pytest

from helpers.router import (
    LONG_GREEDY,
    RPC_TIMEOUT,
    generate_call,
    start_router,
    stop_router,
)
from helpers.threads import wait_until
from helpers.worker import start_decode
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.router.affinity import CHUNK
from pdserve.router.pool import WorkerPool
from pdserve.worker_common.registration import Registration


# ---- fake workers: Stats only -------------------------------------------------------------------
class FakeWorker(worker_pb2_grpc.DecodeWorkerServicer, worker_pb2_grpc.PrefillWorkerServicer):
    """Answers Stats ("ok"), fails it ("fail"), does not answer in time ("hang") or answers
    after `slow_s` ("slow")."""

    def __init__(self, worker_id: str, num_free_blocks: int = 10, num_total_blocks=None):
        self.worker_id = worker_id
        self.num_free_blocks = num_free_blocks
        self.num_total_blocks = num_free_blocks if num_total_blocks is None else num_total_blocks
        self.mode = "ok"
        self.slow_s = 0.0
        self.release = threading.Event()  # ends hung calls
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, self.server)
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Stats(self, request, context):
        if self.mode == "fail":
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake outage")
        if self.mode == "hang":
            self.release.wait(5)
        if self.mode == "slow":
            self.release.wait(self.slow_s)
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id,
            num_free_blocks=self.num_free_blocks,
            num_total_blocks=self.num_total_blocks,
            block_size=16,
        )

    def stop(self):
        self.release.set()
        self.server.stop(0).wait(5)


@pytest.fixture
def fakes():
    made = []

    def make(worker_id, num_free_blocks=10, num_total_blocks=None):
        made.append(FakeWorker(worker_id, num_free_blocks, num_total_blocks))
        return made[-1]

    yield make
    for fake in made:
        fake.stop()


def test_worker_failing_stats_is_skipped_and_comes_back_after_one_answer(fakes, caplog):
    a, b = fakes("a", num_free_blocks=5), fakes("b", num_free_blocks=9)
    p, q = fakes("p"), fakes("q")
    pool = WorkerPool([p.address, q.address], [a.address, b.address], silence_s=30.0)
    try:
        pool.sweep(wait_s=5)
        assert [w.worker_id for w in pool.decode_order()] == ["b", "a"]  # most free blocks first
        b.mode = q.mode = "fail"
        with caplog.at_level(logging.INFO, logger="pdserve.router.pool"):
            for _ in range(3):  # a failed Stats: down (no new work) at once, not dead
                pool.sweep(wait_s=5)
                assert [w.worker_id for w in pool.decode_order()] == ["a", "b"]  # b: fallback
                picked, charge = pool.pick_prefill()
                pool.end_prefill(picked, charge)
                assert picked.worker_id == "p"
            assert not any(w.dead for w in pool.members())
            a.mode = p.mode = "fail"
            pool.sweep(wait_s=5)  # every worker of each role down: try them all rather than none
            assert {w.worker_id for w in pool.decode_order()} == {"a", "b"}
            b.mode = q.mode = "ok"
            pool.sweep(wait_s=5)  # one answer brings a worker back
            assert [w.worker_id for w in pool.decode_order()] == ["b", "a"]
            assert all(pool.pick_prefill(exclude=None)[0].worker_id == "q" for _ in range(3))
        messages = [r.getMessage() for r in caplog.records]
        assert sum("b is down" in m for m in messages) == 1  # each transition logged once
        assert sum("b is back up" in m for m in messages) == 1
    finally:
        pool.close()


def test_decode_workers_rank_by_blocks_in_use_not_free_blocks(fakes):
    """Caches of different sizes (a worker flipped from the prefill pool keeps its smaller one):
    the less loaded worker goes first though the other has more free blocks, and a full worker
    goes last however little it holds."""
    big = fakes("big", num_free_blocks=500, num_total_blocks=728)  # 228 in use
    small = fakes("small", num_free_blocks=446, num_total_blocks=546)  # 100 in use
    full = fakes("full", num_free_blocks=0, num_total_blocks=16)
    pool = WorkerPool([], [big.address, small.address, full.address])
    try:
        pool.sweep(wait_s=5)
        for _ in range(3):  # whatever the rotation
            assert [w.worker_id for w in pool.decode_order()] == ["small", "big", "full"]
        first = pool.decode_order()[0]
        pool.note_reserved(first, 200)  # small now holds 300: big is the less loaded
        assert [w.worker_id for w in pool.decode_order()] == ["big", "small", "full"]
    finally:
        pool.close()


def test_the_affinity_view_holds_what_the_prefill_caches_hold(fakes):
    """A sweep bounds the router's view of the prefill caches by their blocks times block size:
    a hash per CHUNK tokens (a looser bound kept evicted prefixes, and their stale matches kept
    prompts off local prefill)."""
    one, two = fakes("p1", num_total_blocks=1000), fakes("p2", num_total_blocks=600)
    pool = WorkerPool([one.address, two.address], [])
    try:
        pool.sweep(wait_s=5)
        assert pool._affinity.max_entries == (1000 + 600) * 16 // CHUNK
    finally:
        pool.close()


def test_picking_never_waits_on_a_hung_stats_call(fakes):
    hung, fine = fakes("hung"), fakes("fine")
    hung.mode = "hang"
    pool = WorkerPool(
        [fine.address],
        [hung.address, fine.address],
        stats_ttl_s=0.01,
        down_s=0.05,
    ).start(first_wait_s=0)  # the hung worker would hold the start up to that bound
    try:
        wait_until(lambda: pool.num_sweeps >= 1, 5, "one health sweep")
        wait_until(lambda: pool.decode[0].down, 5, "the hung worker marked down")
        for _ in range(20):  # its Stats poll is outstanding all along
            t0 = time.monotonic()
            order = pool.decode_order()
            assert time.monotonic() - t0 < 0.25  # the hung poll takes up to 4 s
            assert [w.address for w in order] == [fine.address, hung.address]  # down: last
            time.sleep(0.01)
    finally:
        hung.release.set()
        pool.close()


def test_a_static_worker_slow_to_answer_is_named_when_the_start_returns(fakes):
    """A loaded machine answers the first Stats late (here 1 s, two sweep periods): start()
    waits for it, so a request right after the start reports the worker by its id, not its
    address (CI once saw the prefill worker's address in a Finish's timings)."""
    slow, fine = fakes("p-slow"), fakes("d-fine")
    slow.mode, slow.slow_s = "slow", 1.0
    pool = WorkerPool([slow.address], [fine.address], stats_ttl_s=0.5).start()
    try:
        assert [pool.name(w) for w in pool.members()] == ["p-slow", "d-fine"]
        assert pool.decode[0].stats.num_total_blocks == 10  # and its blocks known
    finally:
        pool.close()


def test_static_workers_never_drop_out_and_registering_them_adds_no_duplicate(fakes):
    static, joined = fakes("d-static"), fakes("d-joined")
    pool = WorkerPool([], [static.address], stats_ttl_s=0.02, down_s=0.1, silence_s=0.2).start()
    try:
        joined.mode = "fail"  # a registered worker that never answers: silent
        assert pool.register("decode", "d-static", static.address) in pool.decode
        pool.register("decode", "d-joined", joined.address)
        pool.register("prefill", "d-joined", joined.address)  # same id, new role: moves
        assert [w.address for w in pool.decode] == [static.address]
        assert [w.address for w in pool.prefill] == [joined.address]
        wait_until(lambda: not pool.prefill, 15, "the registered worker dropped out")
        assert [w.address for w in pool.decode] == [static.address]  # no heartbeat needed
        assert pool.heartbeat("d-static") and not pool.heartbeat("d-joined")
    finally:
        pool.close()


def test_registry_register_heartbeat_drop_out_and_bad_inputs(model_dir, fakes, caplog):
    # no static workers: waits for them; silent (no heartbeat, no Stats answer) 0.3 s: dropped
    router = start_router(model_dir, heartbeat_ms=100, worker_down_s=0.2, worker_silence_s=0.3)
    fake = fakes("d-fake")
    try:
        with pytest.raises(grpc.RpcError) as err:
            next(generate_call(router, [5, 6], LONG_GREEDY))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no prefill worker is registered" in err.value.details()

        model_id = router.servicer.options.model_id
        bad = [
            (
                dict(worker_id="x", role="encoder", address=fake.address),
                grpc.StatusCode.INVALID_ARGUMENT,
                "role must be one of",
            ),
            (
                dict(worker_id="", role="decode", address=fake.address),
                grpc.StatusCode.INVALID_ARGUMENT,
                "worker_id",
            ),
            (
                dict(worker_id="x", role="decode", address=""),
                grpc.StatusCode.INVALID_ARGUMENT,
                "address",
            ),
            (
                dict(
                    worker_id="x",
                    role="decode",
                    address=fake.address,
                    model=pdserve_pb2.ModelCard(id="other-model"),
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
                f"serves model 'other-model' but this router serves {model_id!r}",
            ),
        ]
        for fields, code, named in bad:
            with pytest.raises(grpc.RpcError) as err:
                router.registry.Register(worker_pb2.RegisterRequest(**fields), timeout=RPC_TIMEOUT)
            assert err.value.code() == code and named in err.value.details(), err.value
        assert router.pool.num_workers("decode") == 0

        reply = router.registry.Register(
            worker_pb2.RegisterRequest(
                worker_id="d-fake",
                role="decode",
                address=fake.address,
                model=pdserve_pb2.ModelCard(id=model_id),
            ),
            timeout=RPC_TIMEOUT,
        )
        assert reply.heartbeat_ms == 100
        assert [w.address for w in router.pool.decode] == [fake.address]
        beat = worker_pb2.HeartbeatRequest(worker_id="d-fake")
        assert not router.registry.Heartbeat(
            worker_pb2.HeartbeatRequest(worker_id="nobody"), timeout=RPC_TIMEOUT
        ).known
        end = time.monotonic() + 0.6  # twice the drop-out time, heartbeating: stays
        while time.monotonic() < end:
            assert router.registry.Heartbeat(beat, timeout=RPC_TIMEOUT).known
            time.sleep(0.05)
        assert router.pool.num_workers("decode") == 1

        moved = fakes("d-fake")  # re-registering under the same id replaces the old address
        moved.mode = "hang"  # and it answers nothing: silent once its heartbeats stop
        last_beat = time.monotonic()
        router.registry.Register(
            worker_pb2.RegisterRequest(worker_id="d-fake", role="decode", address=moved.address),
            timeout=RPC_TIMEOUT,
        )
        assert [w.address for w in router.pool.decode] == [moved.address]

        with caplog.at_level(logging.WARNING, logger="pdserve.router.pool"):
            wait_until(lambda: router.pool.num_workers("decode") == 0, 15, "d-fake dropped out")
        assert time.monotonic() - last_beat >= 0.3  # silent for worker_silence_s: out
        assert any(
            "d-fake" in r.getMessage() and "left the pool" in r.getMessage() for r in caplog.records
        )
        assert not router.registry.Heartbeat(beat, timeout=RPC_TIMEOUT).known
    finally:
        stop_router(router)


def fake_stats():
    return worker_pb2.WorkerStats(worker_id="d-fake", num_free_blocks=7, num_total_blocks=7)


def test_registration_client_registers_again_after_drop_out_and_router_restart(model_dir, fakes):
    fake = fakes("d-fake")
    router = start_router(model_dir, heartbeat_ms=100, worker_down_s=0.2, worker_silence_s=0.3)
    slow = threading.Event()

    def stats_fn():  # heartbeats and Stats stalled past worker_silence_s: the router drops it
        if slow.is_set():
            slow.clear()
            fake.mode = "hang"
            time.sleep(0.6)
            fake.mode = "ok"
        return fake_stats()

    registration = Registration(
        router.address,
        worker_pb2.RegisterRequest(worker_id="d-fake", role="decode", address=fake.address),
        stats_fn,
        rpc_timeout_s=1.0,
        max_backoff_s=0.2,
    ).start()
    try:
        assert registration.wait_registered(5) and registration.heartbeat_s == 0.1
        assert [w.worker_id for w in router.pool.decode] == ["d-fake"]
        slow.set()
        wait_until(
            lambda: router.pool.num_workers("decode") == 0, 15, "the stalled worker dropped out"
        )
        # the next Heartbeat answers known=false and the client registers again
        wait_until(
            lambda: registration.num_registrations == 2 and router.pool.num_workers("decode") == 1,
            15,
            "registered again after known=false",
        )

        port = router.address.rsplit(":", 1)[1]
        stop_router(router)
        wait_until(lambda: not registration.registered, 15, "heartbeats to the stopped router fail")
        router = start_router(
            model_dir, heartbeat_ms=100, worker_down_s=0.2, worker_silence_s=0.3, port=int(port)
        )
        # the router counts the worker inside Register, the client once Register returned
        wait_until(
            lambda: router.pool.num_workers("decode") == 1 and registration.num_registrations == 3,
            5,
            "registered with the new router",
        )
        assert registration.registered
    finally:
        registration.stop()
        stop_router(router)


def test_the_router_freezes_its_startup_heap_while_it_serves(model_dir):
    """Router.start freezes the heap it built (the cyclic GC no longer walks it: full collections
    of it stalled every thread under a connection flood); stop gives it back to the GC."""
    gc.unfreeze()
    router = start_router(model_dir)
    try:
        assert gc.get_freeze_count() > 10_000  # imports, tokenizer, servicers
    finally:
        stop_router(router)
    assert gc.get_freeze_count() == 0


def test_a_worker_freezes_its_startup_heap_while_it_serves(model_dir):
    """WorkerProcess.start freezes the heap it built (full collections of it stalled the engine
    loop's steps ~0.2 s every few hundred steps); stop gives it back to the GC."""
    gc.unfreeze()
    worker = start_decode(model_dir)
    try:
        assert gc.get_freeze_count() > 10_000  # torch, transformers, the engine's modules
    finally:
        worker.stop()
    assert gc.get_freeze_count() == 0
