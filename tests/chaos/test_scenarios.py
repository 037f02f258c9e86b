"""The chaos scenario suite at CI size (issue #47 item 6): every scenario of
benchmarks/robustness/scenarios.py's SUITE, declared there as data, played by the same runner as
the full-size run (benchmarks/robustness/faults.py) on a tiny random model, with the shared
checks after each: no client error where a survivor exists, streams token-identical to a clean
run, KV all free, every worker serving the role the router holds it in, the router serving.

The router runs in this process and every worker in a child process of its own
(tests/helpers/scenario_cluster.py), so a scenario can stop, kill or starve one. Scenarios of the
same topology share a deployment while it is as launched (every worker serving its launch role);
after a scenario that fails, kills a worker for good or leaves a flip in place, the next gets a
fresh deployment. Scenarios expected to fail
today (`known_failure`: an open item of issue #47) are xfail(strict=False).
"""

from __future__ import annotations

import json
import signal

import pytest

from benchmarks.robustness.faults import CpuHog, Kill9, clean_run, failures, run_scenario
from benchmarks.robustness.scenarios import suite
from helpers.scenario_cluster import LocalTarget

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")

SCENARIOS = suite("ci")


def params():
    for s in SCENARIOS:
        marks = [pytest.mark.xfail(reason=s.known_failure, strict=False)] if s.known_failure else []
        if any(isinstance(f, CpuHog) for f in s.faults):
            marks.append(pytest.mark.serial)  # it loads the machine itself: no test beside it
        yield pytest.param(s, id=s.name, marks=marks)


class Clusters:
    """One LocalTarget per topology, kept while the scenarios on it pass; and the clean run of
    each load (the same on every topology: greedy on one model)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.targets: dict = {}
        self.wants: dict = {}

    def get(self, topology) -> LocalTarget:
        if topology in self.targets and not self.targets[topology].as_launched():
            self.discard(topology)  # a flip that held, or a restart in another role
        if topology not in self.targets:
            self.targets[topology] = LocalTarget(self.model_dir, topology.prefill, topology.decode)
        return self.targets[topology]

    def want(self, target: LocalTarget, load) -> list[list[int]]:
        if load not in self.wants:
            self.wants[load] = clean_run(target, load)
        return self.wants[load]

    def discard(self, topology) -> None:
        target = self.targets.pop(topology, None)
        if target is not None:
            target.stop()

    def close(self) -> None:
        for topology in list(self.targets):
            self.discard(topology)


@pytest.fixture(scope="module")
def clusters(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    c = Clusters(model_dir)
    yield c
    c.close()


@pytest.mark.parametrize("scenario", params())
def test_scenario(scenario, clusters):
    target = clusters.get(scenario.topology)
    try:
        result = run_scenario(scenario, target, clusters.want(target, scenario.load))
    except BaseException:
        clusters.discard(scenario.topology)
        raise
    gone = any(isinstance(f, Kill9) and not f.restart for f in scenario.faults)
    if gone or not result["passed"]:
        clusters.discard(scenario.topology)
    print(json.dumps(result, default=str))  # pytest shows it with the failure, or with -s
    assert result["passed"], "\n".join(failures(result))
