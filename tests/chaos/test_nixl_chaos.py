"""The nixl KV backend under misbehaving clients and a dying sender (issue 50, must-show c at CI
scale): an abort storm (streams cancelled by their clients at random moments, many of them
during their hand-offs) leaves every stream that was not cancelled token-identical to a clean
run, all KV free, and no hold left stuck; a prefill process that wrote and went silent keeps its
aborted reservation held (never handed to another request), past the claim's bound with the
worker reporting itself unhealthy (Stats fails UNAVAILABLE), and once that process is killed the
blocks go and the worker is healthy again; the same for a sender whose claim names no process
(one on another host), freed once its control connection closes from its side. Skipped where
NIXL is not installed."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random

import grpc
import pytest
import torch

from helpers.chaos import SecureCluster, abort_storm, wait_until
from helpers.models import random_prompts
from helpers.worker import GREEDY, start_decode
from pdserve.kvtransfer.backends.nixl_backend import nixl_available
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install 'pdserve[nixl]'"
)


def test_abort_storm_over_nixl(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    cluster = SecureCluster(model_dir, kv_backend="nixl")
    try:
        prompts = random_prompts([random.Random(i).randint(20, 60) for i in range(8)], seed=5)
        abort_storm(cluster.api, prompts)
        wait_until(cluster.kv_all_free, 20, "all KV free after the storm")
        grants = cluster.decode.handoff.grants
        assert grants.num_held == 0 and grants.num_stuck_total == 0 and not grants.stuck()
    finally:
        cluster.stop()


def dying_sender(address: str, grant: str, block_ids: list, layout, ready, die, remote) -> None:
    """A prefill process that claims the reservation, writes two layers, goes silent (no commit
    or abort: a stuck transfer, as far as the decode side can tell) and dies when told. remote:
    its claim names no process (as a claim from another host: nothing the decode side can prove
    about it)."""
    from pdserve.kvtransfer.backends import connect, nixl_backend
    from pdserve.kvtransfer.transport import Destination
    from pdserve.kvtransfer.wire import ChunkHeader

    if remote:
        nixl_backend.process_identity = dict  # {}
    tx = connect("nixl", address)
    dest = Destination(block_ids, layout, grant=grant)
    heads, dim = layout.num_kv_heads, layout.head_dim
    for layer in range(2):
        header = ChunkHeader("doomed", layout.fingerprint, layer, 0, 20, 0, heads, dim, "float32")
        tx.send(header, torch.randn(2, 20, heads, dim), dest)
    ready.set()
    die.wait(120)
    os._exit(3)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_a_silent_sender_past_the_bound_makes_the_worker_unhealthy_until_it_dies(
    tiny_models, remote
):
    """A local sender's death is proven by its process id; a remote one's (its claim names no
    process: issue 50's follow-up) by its control connection closing from its side. Either way
    the aborted reservation stays held (never handed to another request) past the claim's bound,
    the worker reports itself unhealthy, and once the sender is gone the blocks are freed and the
    worker is healthy again without a restart (a sender that never ends: under `pdserve up` the
    worker exits to be replaced, deploy/workers.py ExitWatch). The Grants logic alone:
    tests/unit/test_nixl_peer_gone.py."""
    model_dir, _ = tiny_models("llama-gqa")
    decode = start_decode(
        model_dir,
        engine=dict(kv_cache_memory=1 << 17, max_model_len=64),
        kv_backend="nixl",
        kv_options={"grants": {"window_s": 0.5, "xfer_timeout_s": 0.5}},  # a bound of 6 s
        lease_ms=60_000,  # the sender process may take a while to start on a loaded machine
    )
    channel = grpc.insecure_channel(decode.address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)

    def stats():
        return stub.Stats(worker_pb2.StatsRequest(), timeout=10)

    def unhealthy() -> str:
        try:
            stats()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return e.details()
        return ""

    ctx = multiprocessing.get_context("spawn")
    ready, die = ctx.Event(), ctx.Event()
    try:
        total = stats().num_total_blocks
        res = stub.Reserve(
            worker_pb2.ReserveRequest(
                request_id="doomed", prompt_token_ids=random_prompts([20], seed=4)[0],
                sampling=GREEDY,
            ),
            timeout=10,
        )  # fmt: skip

        layout = dataclasses.replace(decode.layout, block_size=res.block_size)
        args = (
            res.endpoint.address,
            res.endpoint.write_grant,
            list(res.block_ids),
            layout,
            ready,
            die,
            remote,
        )
        proc = ctx.Process(target=dying_sender, args=args)
        proc.start()
        assert ready.wait(60), "the sender never wrote"
        assert stub.Abort(worker_pb2.WorkerAbortRequest(request_id="doomed"), timeout=10).found
        s = stats()
        assert s.num_reserved == 1 and s.num_free_blocks < total  # held, not handed out
        # a second abort (the router's Abort after its leg's stream went away, or the other way
        # round) finds the reservation held and leaves it so
        assert stub.Abort(worker_pb2.WorkerAbortRequest(request_id="doomed"), timeout=10).found
        s = stats()
        assert s.num_reserved == 1 and s.num_free_blocks < total, s
        grants = decode.handoff.grants
        wait_until(unhealthy, 60, "the worker never reported the stuck hold")
        assert "held past the nixl write bound" in unhealthy() and "'doomed'" in unhealthy()
        # what a worker under `pdserve up` watches to exit and be replaced past UNHEALTHY_EXIT_S
        # (deploy/workers.py ExitWatch), were the sender never to end
        assert "held past the nixl write bound" in decode.unhealthy()
        assert decode.handoff.num_held == 1 and grants.num_stuck_total == 1  # still held
        assert decode.handoff.loop.load()["num_free_blocks"] < total
        die.set()  # the sender's process ends (and its kernel closes its connections)
        proc.join(30)
        assert proc.exitcode == 3
        wait_until(lambda: not unhealthy(), 60, "the worker stayed unhealthy")
        assert decode.unhealthy() == ""

        def freed():  # the engine frees the blocks on its loop thread, just after the grant ends
            s = stats()
            return s.num_reserved == 0 and s.num_free_blocks == total

        wait_until(freed, 10, f"the held reservation was not freed: {stats()}")
        if remote:  # freed by its closed connection, not by a proof about its process
            assert grants.num_released_peer_gone == 1 and grants.num_released_sender_gone == 0
        else:
            assert grants.num_released_sender_gone == 1
    finally:
        die.set()
        channel.close()
        decode.stop()


# ---- the chaos scenario suite's faults on the nixl backend ----------------------------------------

# the abort storm's size: CI's (32 streams); PDSERVE_NIXL_STORM=300 runs hundreds by hand
STORM = int(os.environ.get("PDSERVE_NIXL_STORM", "0") or 0)
# The abort storm scenario runs where PDSERVE_NIXL_STORM sizes it (hundreds of requests, the issue's
# run); at CI size test_abort_storm_over_nixl above is the storm over nixl.
NIXL_SCENARIOS = ("kill9_prefill_gone", "kill9_decode") + (("abort_storm",) if STORM else ())


def nixl_scenarios():
    from benchmarks.robustness.faults import AbortStorm
    from benchmarks.robustness.scenarios import suite

    for s in suite("ci"):
        if s.name not in NIXL_SCENARIOS:
            continue
        if STORM and s.name == "abort_storm":
            faults = tuple(
                dataclasses.replace(f, n=STORM) if isinstance(f, AbortStorm) else f
                for f in s.faults
            )
            s = dataclasses.replace(s, faults=faults)
        yield pytest.param(s, id=s.name)


@pytest.mark.parametrize("scenario", nixl_scenarios())
def test_chaos_scenario_over_nixl(scenario, tiny_models):
    """A prefill worker killed mid-write (its held blocks go once its process is proven gone,
    not at the bound), a decode worker killed mid-receive, an abort storm: the suite's checks
    (survivors token-identical to a clean run, every block and reservation free, every worker
    serving: a stuck hold would fail its Stats) with every worker on the nixl backend."""
    import json

    from benchmarks.robustness.faults import clean_run, failures, run_scenario
    from helpers.scenario_cluster import LocalTarget

    model_dir, _ = tiny_models("llama-gqa")
    topology = scenario.topology
    target = LocalTarget(model_dir, topology.prefill, topology.decode, kv_backend="nixl")
    try:
        result = run_scenario(scenario, target, clean_run(target, scenario.load))
    finally:
        target.stop()
    print(json.dumps(result, default=str))  # pytest shows it with the failure, or with -s
    assert result["passed"], "\n".join(failures(result))
