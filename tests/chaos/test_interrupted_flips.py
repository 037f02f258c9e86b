"""Role flips interrupted by a stopped or killed worker converge (router/reconcile.py; issue #47
item 4), the CI-sized twin of benchmarks/robustness/flips.py --interrupt.

The router, a prefill worker and a decode worker run in this process; the worker that is flipped
runs in a child process (a two-role worker, as the launcher builds it, registered through the
Registry), so that it can be stopped or killed without stopping the test:

- stopped (SIGSTOP) between its drain and its switch, longer than the flip's calls wait: the flip
  is given up, the switch call it sent still reaches the worker when it resumes (SIGCONT), and
  the router drives the worker back to its intended role, decode, within 10 s of the SIGCONT;
- flipped to prefill, then killed (kill -9) and started again in its launch role, decode (as the
  supervisor restarts a deployment's worker): the router drives it to prefill, the intent, within
  10 s of its registration.

After each, a short load (one wave of 8 streams at once) reaches every worker in its intended
role.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from helpers.hang import start_decode, start_prefill, stop_workers
from helpers.models import random_prompts
from helpers.router import MAX_MODEL_LEN, RPC_TIMEOUT, start_router, stop_router
from helpers.threads import wait_until
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.router.flips import FlipRefused

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")

CONVERGE_S = 10.0  # every worker serves its intended role within this after SIGCONT or restart
CHILD = f"""
import sys, time
from pdserve.decode_worker.server import DecodeWorkerConfig
from pdserve.deploy.workers import build_worker
role, model, registry, worker_id = sys.argv[1:5]
cfg = DecodeWorkerConfig(model=model, worker_id=worker_id, lease_ms=5000, stop_grace_s=0,
    engine_kwargs=dict(max_model_len={MAX_MODEL_LEN}, kv_cache_memory=1 << 20, block_size=16),
    registry_address=registry)
worker = build_worker(role, cfg, flippable=True).start()
print(worker.address, flush=True)
time.sleep(600)
"""


class Child:
    """A two-role worker in a child process, registered with the router."""

    def __init__(self, model_dir: str, registry: str, worker_id: str, role: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, role, model_dir, registry, worker_id],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.address = self.proc.stdout.readline().strip()
        assert self.address, f"the {role} worker process did not start"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = worker_pb2_grpc.DecodeWorkerStub(self.channel)

    def signal(self, sig) -> None:
        os.kill(self.proc.pid, sig)

    def stats(self):
        return self.stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


def converged(router, worker_id: str, role: str) -> bool:
    """The router holds `worker_id` in `role`'s pool, serving, intends that, and the worker's
    own last report says so."""
    worker = router.pool.registered(worker_id)
    if worker is None or worker.role != role or worker.state != "serving" or worker.down:
        return False
    view = router.reconciler.view(worker)
    return (
        (view.intended_role, view.intended_state) == (role, "serving")
        and (view.reported_role, view.reported_state) == (role, "serving")
        and not view.mismatch
    )


def time_to_converge(router, worker_id: str, role: str, since: float) -> float:
    wait_until(lambda: converged(router, worker_id, role), 30, f"{worker_id} serves {role}")
    return time.monotonic() - since


def load_reaches_every_worker(router, stubs: dict) -> dict[str, int]:
    """Hand-offs per worker over one wave of 8 streams at once; every worker must have had some.
    One wave: a decode pick charges its worker at once (router/pool.py decode_order), so a burst
    spreads even where the pool's view of a worker is a sweep old."""
    return spread_load(router, stubs)


def transfers(stubs: dict) -> dict[str, int]:
    return {
        name: stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT).kv_transfers
        for name, stub in stubs.items()
    }


def spread_load(router, stubs: dict, n: int = 8, seed: int = 47) -> dict[str, int]:
    """`n` streams at once; the hand-offs each worker did meanwhile (prefill: sent, decode:
    received)."""
    before = transfers(stubs)
    calls = [
        router.api.Generate(
            pdserve_pb2.GenerateRequest(
                token_ids=pdserve_pb2.TokenIds(ids=prompt),
                sampling=pdserve_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            ),
            timeout=RPC_TIMEOUT,
        )
        for prompt in random_prompts([24] * n, seed=seed)
    ]
    for call in calls:
        assert [r for r in call if r.HasField("finish")], "a stream ended without its finish"
    after = transfers(stubs)
    return {name: after[name] - before[name] for name in stubs}


@pytest.fixture
def cluster(model_dir):
    router = start_router(model_dir, heartbeat_ms=300)  # the default health bounds
    router.flips.rpc_timeout_s = 1.0  # the flip gives up on a stopped worker sooner
    workers = [start_prefill(model_dir, "p0", router.address)]
    workers += [start_decode(model_dir, "d1", router.address)]
    children = []

    def child(role: str) -> Child:
        children.append(Child(model_dir, router.address, "d0", role))
        return children[-1]

    try:
        yield router, workers, child
    finally:
        for c in children:
            c.close()
        stop_router(router)
        stop_workers(*workers)


def stop_at_switch(router, worker_id: str, act) -> threading.Event:
    """Calls `act()` when the flip of `worker_id` reaches its switch (the pool marks it switching,
    the moment between the drain and SwitchRole); the event says it did."""
    fired, set_state = threading.Event(), router.pool.set_state

    def hooked(worker, state):
        set_state(worker, state)
        if state == "switching" and router.pool.name(worker) == worker_id and not fired.is_set():
            act()
            fired.set()

    router.pool.set_state = hooked
    return fired


def test_a_flip_stopped_between_drain_and_switch_converges_after_sigcont(cluster):
    router, (p0, d1), child = cluster
    d0 = child("decode")
    wait_until(lambda: converged(router, "d0", "decode"), 30, "d0 serves decode")
    fired = stop_at_switch(router, "d0", lambda: d0.signal(signal.SIGSTOP))
    with pytest.raises(FlipRefused):  # SwitchRole went to a stopped process: given up
        router.flips.flip("d0", "prefill")
    assert fired.is_set()
    time.sleep(3.0)  # stopped well past the flip's give-up (its calls wait 1 s)
    d0.signal(signal.SIGCONT)
    took = time_to_converge(router, "d0", "decode", time.monotonic())
    assert took < CONVERGE_S, took
    s = d0.stats()
    assert (s.role, s.role_state) == ("decode", "serving")
    got = load_reaches_every_worker(router, {"p0": p0.stub, "d1": d1.stub, "d0": d0.stub})
    assert all(n > 0 for n in got.values()), got
    assert router.reconciler.view(router.pool.registered("d0")).mismatch is False


def test_a_flipped_worker_restarted_in_its_launch_role_is_driven_to_its_intended_one(cluster):
    router, (p0, d1), child = cluster
    d0 = child("decode")
    wait_until(lambda: converged(router, "d0", "decode"), 30, "d0 serves decode")
    router.flips.flip("d0", "prefill")  # done: the intent is prefill
    assert converged(router, "d0", "prefill")
    d0.signal(signal.SIGKILL)
    d0.proc.wait(10)
    wait_until(lambda: router.pool.registered("d0") is None, 10, "d0 dropped out")
    d0 = child("decode")  # restarted as launched
    wait_until(lambda: router.pool.registered("d0") is not None, 30, "d0 registered again")
    took = time_to_converge(router, "d0", "prefill", time.monotonic())
    assert took < CONVERGE_S, took
    s = d0.stats()
    assert (s.role, s.role_state) == ("prefill", "serving")
    # (each service of a two-role worker answers Stats with its own part's counters)
    as_prefill = worker_pb2_grpc.PrefillWorkerStub(d0.channel)
    got = load_reaches_every_worker(router, {"p0": p0.stub, "d1": d1.stub, "d0": as_prefill})
    assert all(n > 0 for n in got.values()), got
