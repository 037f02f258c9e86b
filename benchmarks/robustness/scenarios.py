"""The chaos scenario suite (issue #47 item 6): every scenario declared as data (SUITE), played by
one runner (benchmarks/robustness/faults.py) at two sizes, with the same checks after each.

  python -m benchmarks.robustness.scenarios                    # every scenario, full size
  python -m benchmarks.robustness.scenarios --only sigstop_decode,flip_under_sigstop
  python -m benchmarks.robustness.scenarios --list

Full size (this script): each scenario on a fresh `deploy.launcher.up()` deployment (what `pdserve
up` runs) of the embedded SmolLM2 (deploy/examples/local-cpu.yaml, prefix caching off so that a
replay does a clean run's work), with the launcher's supervisor restarting what dies; 64 streams
of 32 prompt tokens and 64 output tokens, 32 at a time, faults of 30-60 s. CI size
(tests/chaos/test_scenarios.py): the same scenarios on a tiny random model, workers in child
processes of the test (tests/helpers/scenario_cluster.py), 8 streams and faults of a few seconds.

A scenario (faults.Scenario): a name, a topology (prefill and decode workers), a load, faults
with their timing, and `known_failure` where it is expected to fail today. The checks
(faults.CHECKS) after every scenario: no client error where a survivor of each role exists,
every stream token-identical to a clean run of the same load, every KV block and reservation
free on every worker, every worker serving the role the router holds it in (its own
role_state) within the scenario's settle_s, and the router still serving a fresh pass.

At full size a kill -9 is always followed by the supervisor's restart (restart=False only changes
which workers the checks read); engine_hang hangs one worker through the engine's test hook
(engine/engine_loop.py): `up()` runs with PDSERVE_TEST_ENGINE_HANG_FILE set, which its workers
inherit, and the file `<that path>.<worker>-engine` hangs that worker's engine while it exists.
Writes benchmarks/results/scenarios.json (machine, commit, command, each scenario's record);
scenarios not run keep their last record.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import time

from benchmarks.robustness.faults import (
    AbortStorm,
    CpuHog,
    EngineHang,
    Flip,
    Kill9,
    Load,
    Scenario,
    SigStop,
    Topology,
    clean_run,
    failures,
    run_scenario,
)
from pdserve.engine.engine_loop import HANG_FILE_ENV


@dataclasses.dataclass(frozen=True)
class Size:
    """The numbers that differ between CI's chaos lane and a full run; the scenarios are the
    same."""

    load: Load
    stop_s: float  # a SIGSTOP
    hog_s: float  # a CPU hog
    hang_s: float  # a hung engine: longer than the router's bound, so its streams must move
    storm: int  # streams of an abort storm
    flip_back_s: float  # between a flip and the flip back
    flip_stop_s: float  # a SIGSTOP in a flip's drain: past its Drain call and undo (5 s each)
    at_s: float  # a fault's start after the load is under way
    tail_s: float  # the load after the last fault


SIZES = {
    "ci": Size(
        load=Load(streams=8, concurrency=8, prompt_len=16, max_tokens=32),
        stop_s=3.0,
        hog_s=4.0,
        hang_s=12.0,
        storm=32,
        flip_back_s=1.0,
        flip_stop_s=12.0,
        at_s=0.3,
        tail_s=1.0,
    ),
    "full": Size(
        load=Load(streams=64, concurrency=32, prompt_len=32, max_tokens=64),
        stop_s=30.0,
        hog_s=60.0,
        hang_s=20.0,
        storm=200,
        flip_back_s=5.0,
        flip_stop_s=30.0,
        at_s=3.0,
        tail_s=10.0,
    ),
}


def suite(size: str) -> tuple[Scenario, ...]:
    """Every scenario, at `size` ("ci" or "full")."""
    z = SIZES[size]
    one_one, one_two, two_one = Topology(1, 1), Topology(1, 2), Topology(2, 1)
    flip = Flip("decode-1", "prefill", at_s=z.at_s, after="busy")
    scenario = functools.partial(Scenario, tail_s=z.tail_s)
    return (
        scenario("clean", one_one, z.load, describe="no fault: the checks' own baseline"),
        scenario(
            "sigstop_decode",
            one_two,
            z.load,
            (SigStop("decode-1", z.stop_s, at_s=z.at_s, after="busy"),),
            describe="a decode worker stopped mid-stream; its streams resume on the other",
        ),
        scenario(
            "sigstop_prefill",
            two_one,
            z.load,
            (SigStop("prefill-1", z.stop_s, at_s=z.at_s),),
            describe="a prefill worker stopped; its prefills are retried on the other",
        ),
        scenario(
            "kill9_decode",
            one_two,
            z.load,
            (Kill9("decode-1", restart=True, at_s=z.at_s, after="busy"),),
            describe="kill -9 of a decode worker mid-stream, then its restart",
        ),
        scenario(
            "kill9_prefill_gone",
            two_one,
            z.load,
            (Kill9("prefill-1", restart=False, at_s=z.at_s),),
            describe="kill -9 of a prefill worker that stays dead (CI size; full size restarts)",
        ),
        scenario(
            "cpu_hog",
            one_one,
            z.load,
            (CpuHog(2, z.hog_s, at_s=z.at_s),),
            describe="two busy processes on the workers' cores: slower, never an error",
        ),
        scenario(
            "abort_storm",
            one_one,
            z.load,
            (AbortStorm(z.storm, at_s=z.at_s),),
            describe="streams cancelled by their clients at random points beside the load",
        ),
        scenario(
            "flip",
            one_two,
            z.load,
            (dataclasses.replace(flip, back_after_s=z.flip_back_s),),
            describe="a decode worker flipped to prefill and back under load",
        ),
        scenario(
            "flip_under_sigstop",
            one_two,
            z.load,
            (flip, SigStop("decode-1", z.flip_stop_s, at_s=z.at_s, after="draining")),
            describe="a flip whose worker is stopped during its drain",
        ),
        scenario(
            "flip_under_kill9",
            one_two,
            z.load,
            (flip, Kill9("decode-1", restart=True, at_s=z.at_s, after="draining")),
            describe="a flip whose worker is killed during its drain and restarted",
        ),
        scenario(
            "flip_under_hog",
            one_two,
            z.load,
            (dataclasses.replace(flip, back_after_s=z.flip_back_s), CpuHog(2, z.hog_s)),
            describe="a flip there and back while two busy processes hog the workers' cores",
        ),
        scenario(
            "engine_hang",
            one_two,
            z.load,
            (EngineHang("decode-1", z.hang_s, at_s=z.at_s, after="busy"),),
            settle_s=20.0,
            describe="a decode worker's engine thread blocked while its server answers",
        ),
    )


# ---- full size: deploy.launcher.up() ------------------------------------------------------------
class UpTarget:
    """A faults.Target over a running `deploy.launcher.up()` cluster (benchmarks/chaos_harness.py
    deployment)."""

    def __init__(self, cluster):
        import grpc  # noqa: F401

        from pdserve.protos.pdserve.v1 import worker_pb2_grpc

        self.cluster = cluster
        self.router = cluster.router
        self.address = cluster.router_address
        self.roles = {r.name: r.role for r in cluster.replicas}
        self.channel = cluster.security.channel(self.address)
        self._admin = worker_pb2_grpc.AdminStub(self.channel)

    def replica(self, worker: str):
        return next(r for r in self.cluster.replicas if r.name == worker)

    def prompts(self, load: Load) -> list[list[int]]:
        from benchmarks.bench_common import random_prompts

        return random_prompts(load.seed, load.streams, load.prompt_len)

    def pid(self, worker: str) -> int:
        import ray

        return ray.get(self.replica(worker).actor.pid.remote(), timeout=30)

    def stats(self, worker: str):
        import grpc

        from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

        r = self.replica(worker)
        if not r.address:
            return None
        with self.cluster.security.channel(r.address) as channel:
            for stub in (worker_pb2_grpc.DecodeWorkerStub, worker_pb2_grpc.PrefillWorkerStub):
                try:
                    return stub(channel).Stats(worker_pb2.StatsRequest(), timeout=5.0)
                except grpc.RpcError:
                    continue
        return None

    def admin(self):
        return self._admin

    def killed(self, worker: str, restart: bool) -> None:
        """The supervisor relaunches it whatever `restart` says: wait for that."""
        from benchmarks.chaos_harness import wait_replaced

        r = self.replica(worker)
        old = r.actor
        members = sum(role == r.role for role in self.roles.values())
        t0 = time.monotonic()
        while r.actor is old and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        wait_replaced(self.cluster, r, old, r.role, members)

    def set_hang(self, worker: str, on: bool) -> None:
        flag = f"{os.environ[HANG_FILE_ENV]}.{worker}-engine"  # run_full set the variable
        if on:
            open(flag, "w").close()
        elif os.path.exists(flag):
            os.remove(flag)

    def close(self) -> None:
        self.channel.close()


def run_full(scenario: Scenario, want_cache: dict) -> dict:
    from benchmarks.chaos_harness import example_config

    t = scenario.topology
    config = example_config(prefill=t.prefill, decode=t.decode, prefix_caching=False)
    # the workers inherit the hook's variable; nothing hangs until set_hang makes a worker's file
    hang_dir = tempfile.mkdtemp(prefix="pdserve-scenario-hang-")
    os.environ[HANG_FILE_ENV] = os.path.join(hang_dir, "hang")
    try:
        return _run_up(scenario, config, want_cache)
    finally:
        os.environ.pop(HANG_FILE_ENV, None)
        shutil.rmtree(hang_dir, ignore_errors=True)


def _run_up(scenario: Scenario, config, want_cache: dict) -> dict:
    from benchmarks.chaos_harness import deployment
    from pdserve.deploy.launcher import RestartPolicy

    with deployment(config, restart=RestartPolicy(poll_s=0.5, backoff_s=0.5)) as (cluster, drops):
        target = UpTarget(cluster)
        try:
            if scenario.load not in want_cache:
                want_cache[scenario.load] = clean_run(target, scenario.load)
            result = run_scenario(scenario, target, want_cache[scenario.load])
        finally:
            target.close()
        result["workers_dropped"] = len(drops.dropped)
        result["drop_messages"] = drops.dropped[:5]
    return result


def main(argv=None) -> int:
    from benchmarks.bench_common import add_out_arg, log, script_parser, write_result
    from benchmarks.chaos_harness import cluster_report

    p = script_parser(__doc__)
    p.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    add_out_arg(p, "scenarios.json")
    args = p.parse_args(argv)
    scenarios = suite("full")
    if args.list:
        for s in scenarios:
            flag = f"  [expected to fail: {s.known_failure}]" if s.known_failure else ""
            print(f"{s.name:20s} {s.describe}{flag}")
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {s.name for s in scenarios})
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; --list shows them")
    chosen = [s for s in scenarios if not names or s.name in names]
    report = cluster_report("benchmarks.robustness.scenarios", argv)
    if os.path.exists(args.out):  # scenarios not run this time keep their last record
        with open(args.out) as f:
            report["scenarios"] = json.load(f).get("scenarios", {})
    report.setdefault("scenarios", {})
    want_cache: dict = {}
    for scenario in chosen:
        t0 = time.perf_counter()
        try:
            result = run_full(scenario, want_cache)
        except Exception as e:  # recorded, and the next scenario still runs
            result = {**scenario.to_dict(), "passed": False, "error": repr(e)[:1000]}
        result["run"] = {
            "date": report["date"],
            "commit": report["commit"],
            "cpu_model": report["cpu_model"],
            "took_s": round(time.perf_counter() - t0, 1),
        }
        report["scenarios"][scenario.name] = result
        write_result(args.out, report)  # after each: a later failure keeps it
        bad = failures(result) if "checks" in result else [result.get("error", "")]
        log(f"{scenario.name}: {'passed' if result['passed'] else 'FAILED'} {bad}")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
