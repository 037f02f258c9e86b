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
import os
import random

import pytest

from helpers.chaos import SecureCluster, abort_storm, silent_sender_held, wait_until
from helpers.models import random_prompts
from pdserve.kvtransfer.backends.nixl_backend import nixl_available

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


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_a_silent_sender_past_the_bound_makes_the_worker_unhealthy_until_it_dies(
    tiny_models, remote
):
    """A local sender's death is proven by its process id; a remote one's (its claim names no
    process: issue 50's follow-up) by its control connection closing from its side
    (helpers/chaos.py `silent_sender_held`). The Grants logic alone:
    tests/unit/test_nixl_peer_gone.py."""
    silent_sender_held(tiny_models, "nixl", remote)


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
