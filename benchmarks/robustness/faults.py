"""The chaos scenario suite's parts (issue #47 item 6), shared by its two sizes: a scenario
declared as data (a topology, a load, faults with their timing), the faults' injectors, the
client processes that play the load, the checks run after every scenario, and the runner that
ties them together.

A scenario is a `Scenario`: `Topology(prefill, decode)` (the model is the size's: a tiny random
model in CI's chaos lane, the embedded SmolLM2 at full size), a `Load` (streams, concurrency,
prompt and output lengths; greedy with ignore_eos, so every output is comparable with a clean
run of the same prompts) and a tuple of faults, each with `at_s`, its start in seconds after the
load is under way: `SigStop(worker, for_s)`, `Kill9(worker, restart)`, `CpuHog(processes,
for_s)`, `AbortStorm(n)`, `Flip(worker, role)` and `EngineHang(worker, for_s)`. Workers are named
as the launcher names its replicas ("prefill-0", "decode-1"). Faults run each on a thread of its
own, so a flip declared beside a SIGSTOP runs under it.

`run_scenario` plays one scenario against a `Target`, the deployment it runs on (the two sizes
implement it: tests/helpers/scenario_cluster.py's child-process workers, and
benchmarks/robustness/scenarios.py's `deploy.launcher.up()`): a clean run of the load's prompts
once per load (cached by the caller), then the load looping until every fault has ended, then
the shared checks (CHECKS, each a function of the run): no client error where a survivor of
each role exists, every stream token-identical to the clean run (a cancelled one a prefix of
it), every KV block and reservation free on every worker, every worker serving the role the
router holds it in within a bound, and the router still serving (a health check and a fresh pass
of the load). It returns a plain dict (JSON-ready): what each fault did and when, the load's
counts and each check's verdict with its detail.

Nothing here keeps state between runs; the client bodies run in spawned processes (Child) so that
the router's process (the test's, or `up()`'s) does not share its GIL with them.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from benchmarks.chaos_harness import Child

RPC_TIMEOUT = 120.0
CHILD_TIMEOUT_S = 900.0


# ---- declarations -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """How many prefill and decode workers; named prefill-0.., decode-0.. as the launcher names
    its replicas."""

    prefill: int = 1
    decode: int = 1

    def roles(self) -> dict[str, str]:
        """Worker name -> the role it is launched with."""
        names = {f"prefill-{i}": "prefill" for i in range(self.prefill)}
        return names | {f"decode-{i}": "decode" for i in range(self.decode)}


@dataclass(frozen=True)
class Load:
    """`streams` greedy streams of `prompt_len` random tokens and `max_tokens` output tokens,
    `concurrency` at a time. While faults run, each client thread loops over its share of the
    prompts until every fault has ended, so the faults always hit a loaded deployment."""

    streams: int = 8
    concurrency: int = 8
    prompt_len: int = 16
    max_tokens: int = 24
    seed: int = 47


@dataclass(frozen=True)
class SigStop:
    """SIGSTOP of `worker` for `for_s`, then SIGCONT: a hung host, seen from outside."""

    worker: str
    for_s: float
    at_s: float = 0.0
    after: str = ""  # a trigger (TRIGGERS) at_s then waits for, on its worker
    kills_worker = True  # its role has no survivor in it while it is stopped


@dataclass(frozen=True)
class Kill9:
    """kill -9 of `worker`; restart=True: the target relaunches it as the supervisor does and
    the fault ends once it serves again; restart=False: it stays dead (the checks then leave it
    out)."""

    worker: str
    restart: bool = True
    at_s: float = 0.0
    after: str = ""  # a trigger (TRIGGERS) at_s then waits for, on its worker
    kills_worker = True


@dataclass(frozen=True)
class CpuHog:
    """`processes` busy processes on the workers' cores for `for_s`: load is not death."""

    processes: int
    for_s: float
    at_s: float = 0.0
    kills_worker = False


@dataclass(frozen=True)
class AbortStorm:
    """`n` more streams of the load's prompts (`concurrency` at a time, from a client process of
    their own), each cancelled by its client at a random point: before its first token (a timer,
    a quarter of them) or after a random number of tokens."""

    n: int
    concurrency: int = 8
    seed: int = 7
    at_s: float = 0.0
    kills_worker = False


@dataclass(frozen=True)
class Flip:
    """A role flip of `worker` to `role` through the router's Admin service (what `pdserve ctl
    flip` sends); `drain_s` its drain bound (0: the router's flip_drain_s); with back_after_s,
    `back_after_s` seconds after the first flip's answer a second flip takes it back to the role
    it had. Whether the router completes a flip or gives it up, the checks want every worker
    serving afterwards."""

    worker: str
    role: str
    at_s: float = 0.0
    after: str = ""  # a trigger (TRIGGERS) at_s then waits for, on its worker
    drain_s: float = 0.0
    back_after_s: float | None = None  # then flipped back to its role before, after this
    kills_worker = False


@dataclass(frozen=True)
class EngineHang:
    """The engine loop thread of `worker` blocked for `for_s` while its gRPC server answers (the
    test hook PDSERVE_TEST_ENGINE_HANG_FILE: the engine blocks while that file exists)."""

    worker: str
    for_s: float
    at_s: float = 0.0
    after: str = ""  # a trigger (TRIGGERS) at_s then waits for, on its worker
    kills_worker = True


Fault = SigStop | Kill9 | CpuHog | AbortStorm | Flip | EngineHang
# A worker fault's `after`: once at_s has passed, it waits (at most TRIGGER_TIMEOUT_S) until its
# worker runs a sequence ("busy") or reports the role state "draining" (a flip reached it); a
# trigger never met fails the scenario, which then did not test what it declares.
TRIGGERS = ("", "busy", "draining")
TRIGGER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Scenario:
    """One declared scenario. `known_failure`: why it is expected to fail today (an open item of
    an issue), so the CI lane marks it xfail(strict=False) and the full run records it; `needs`:
    what it needs that a checkout may lack (a skip reason when `needs_met` is false)."""

    name: str
    topology: Topology
    load: Load
    faults: tuple = ()
    tail_s: float = 1.0  # the load goes on this long after the last fault ended
    known_failure: str | None = None
    needs: str | None = None
    # how long after the faults end the workers have to serve again, and KV to be free
    settle_s: float = 10.0
    kv_free_s: float = 20.0
    describe: str = ""

    def survivors(self) -> dict[str, bool]:
        """Role -> whether a worker of it is never the target of a fault that takes a worker
        away (SIGSTOP, kill -9, a hung engine)."""
        hit = {f.worker for f in self.faults if f.kills_worker}
        roles = self.topology.roles()
        return {
            role: any(r == role and name not in hit for name, r in roles.items())
            for role in ("prefill", "decode")
        }

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "topology": dataclasses.asdict(self.topology),
            "load": dataclasses.asdict(self.load),
            "faults": [{"kind": type(f).__name__, **dataclasses.asdict(f)} for f in self.faults],
            "known_failure": self.known_failure,
        }


def engine_hang_hook_present() -> bool:
    """Whether this checkout's engine reads PDSERVE_TEST_ENGINE_HANG_FILE (issue #47 item 3 adds
    it): the engine_hang scenarios need it, and hang nothing without it."""
    import pdserve

    root = os.path.dirname(os.path.dirname(pdserve.__file__))
    for folder in ("engine", "worker_common", "prefill_worker", "decode_worker"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        if "PDSERVE_TEST_ENGINE_HANG_FILE" in f.read():
                            return True
    return False


HANG_HOOK = "PDSERVE_TEST_ENGINE_HANG_FILE"
NEEDS = {HANG_HOOK: engine_hang_hook_present}


# ---- the deployment a scenario runs on ----------------------------------------------------------
class Target(Protocol):
    """What the runner needs of a deployment (tests/helpers/scenario_cluster.py: workers in child
    processes; benchmarks/robustness/scenarios.py: `deploy.launcher.up()`)."""

    address: str  # the router's client API
    router: object  # the Router object, in this process in both sizes
    roles: dict[str, str]  # worker name -> the role it was launched with

    def prompts(self, load: Load) -> list[list[int]]: ...
    def pid(self, worker: str) -> int: ...
    def stats(self, worker: str):  # WorkerStats, or None when it does not answer
        ...
    def admin(self): ...  # an Admin stub through the cluster secret
    def killed(self, worker: str, restart: bool) -> None: ...  # after its kill -9; returns once
    # it serves again (restart) or once it is gone
    def set_hang(self, worker: str, on: bool) -> None: ...


# ---- client processes ---------------------------------------------------------------------------
def timed_stream(stub, job: dict) -> dict:
    """One greedy stream; each token event's arrival (time.monotonic()), the workers its finish
    names, and how it ended. job: i, prompt, max_tokens, optional cancel_after (tokens) or
    cancel_delay_s."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=job["prompt"]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True),
    )
    row = {"i": job["i"], "start": time.monotonic(), "events": [], "tokens": [], "error": None}
    row.update(finish=None, cancelled=False, prefill_worker="", decode_worker="")
    call = stub.Generate(request, timeout=RPC_TIMEOUT)
    timer = None
    if job.get("cancel_delay_s") is not None:
        timer = threading.Timer(job["cancel_delay_s"], call.cancel)
        timer.start()
    try:
        for resp in call:
            if resp.HasField("delta") and resp.delta.token_ids:
                row["events"].append(time.monotonic())
                row["tokens"] += list(resp.delta.token_ids)
                if (
                    job.get("cancel_after") is not None
                    and len(row["tokens"]) >= job["cancel_after"]
                ):
                    call.cancel()
            elif resp.HasField("finish"):
                row["finish"] = resp.finish.finish_reason
                row["decode_worker"] = resp.finish.timings.decode_worker
                row["prefill_worker"] = resp.finish.timings.prefill_worker
    except grpc.RpcError as e:
        cancelled = e.code() == grpc.StatusCode.CANCELLED and (
            job.get("cancel_after") is not None or job.get("cancel_delay_s") is not None
        )
        if cancelled:
            row["cancelled"] = True
        else:
            row["error"] = (e.code().name, (e.details() or "")[:300])
    finally:
        if timer is not None:
            timer.cancel()
    row["end"] = time.monotonic()
    return row


def looping_load(address: str, jobs: list[dict], concurrency: int, stop, conn) -> None:
    """Process body: thread k runs jobs k, k+concurrency, ... once, then keeps cycling through
    them until `stop`; sends back every row."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    rows = []

    def client(k):
        mine = jobs[k::concurrency]
        n = 0
        while mine and (n < len(mine) or not stop.is_set()):
            rows.append(timed_stream(stub, mine[n % len(mine)]))
            n += 1

    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(client, range(concurrency)))
    conn.send(rows)


def one_pass(address: str, jobs: list[dict], concurrency: int, conn) -> None:
    """Process body: every job once, `concurrency` at a time; sends back the rows."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        with ThreadPoolExecutor(concurrency) as pool:
            rows = list(pool.map(lambda j: timed_stream(stub, j), jobs))
    conn.send(rows)


def busy_loop() -> None:
    """A CPU hog's body (run with `python -c`)."""
    while True:
        pass


def jobs_for(prompts: list[list[int]], max_tokens: int) -> list[dict]:
    return [{"i": i, "prompt": p, "max_tokens": max_tokens} for i, p in enumerate(prompts)]


def clean_run(target: Target, load: Load) -> list[list[int]]:
    """The load's prompts once through the deployment with no fault: each prompt's tokens."""
    jobs = jobs_for(target.prompts(load), load.max_tokens)
    rows = Child(one_pass, target.address, jobs, load.concurrency).result(CHILD_TIMEOUT_S)
    bad = [r["error"] for r in rows if r["error"]]
    if bad:
        raise RuntimeError(f"the clean run failed: {bad[:3]}")
    return [r["tokens"] for r in sorted(rows, key=lambda r: r["i"])]


# ---- fault injectors ----------------------------------------------------------------------------
class Recorder:
    """Every fault's events, timed from the start of the faults (t0, time.monotonic())."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.events: list[dict] = []
        self.storm_rows: list[dict] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def note(self, fault, what: str, **extra) -> None:
        with self._lock:
            self.events.append(
                {
                    "t_s": round(time.monotonic() - self.t0, 3),
                    "fault": type(fault).__name__,
                    "what": what,
                    **extra,
                }
            )


def worker_cores(target: Target) -> list[int]:
    """The CPUs the workers may run on (the union of their affinities)."""
    cores: set[int] = set()
    for name in target.roles:
        try:
            cores |= os.sched_getaffinity(target.pid(name))
        except (OSError, RuntimeError, KeyError):
            continue
    return sorted(cores) or sorted(os.sched_getaffinity(0))


def wait_trigger(target: Target, worker: str, after: str) -> float | None:
    """Seconds until `worker` meets the trigger `after` (TRIGGERS), or None past the timeout."""
    if after not in TRIGGERS:
        raise ValueError(f"after must be one of {TRIGGERS}, got {after!r}")
    t0 = time.monotonic()
    while time.monotonic() - t0 < TRIGGER_TIMEOUT_S:
        s = target.stats(worker)
        if s is not None and (
            (after == "busy" and s.num_running > 0)
            or (after == "draining" and s.role_state == "draining")
        ):
            return time.monotonic() - t0
        time.sleep(0.005)
    return None


def held(target: Target, worker: str) -> dict | None:
    """What `worker` holds now (its Stats' KV figures), or None when it does not answer."""
    s = target.stats(worker)
    return kv_state(s) if s is not None else None


def inject(fault, target: Target, rec: Recorder, load_jobs: list[dict]) -> None:
    """Runs `fault` from its at_s to its end (on a thread of the runner)."""
    time.sleep(max(0.0, rec.t0 + fault.at_s - time.monotonic()))
    after = getattr(fault, "after", "")
    if after:
        waited = wait_trigger(target, fault.worker, after)
        if waited is None:
            raise RuntimeError(f"{fault.worker} was never {after} within {TRIGGER_TIMEOUT_S:.0f} s")
        rec.note(fault, f"{fault.worker} {after}", waited_s=round(waited, 3))
    if isinstance(fault, SigStop):
        pid, holds = target.pid(fault.worker), held(target, fault.worker)
        os.kill(pid, signal.SIGSTOP)
        rec.note(fault, "SIGSTOP", worker=fault.worker, pid=pid, held=holds)
        try:
            time.sleep(fault.for_s)
        finally:
            os.kill(pid, signal.SIGCONT)
            rec.note(fault, "SIGCONT", worker=fault.worker, pid=pid)
    elif isinstance(fault, Kill9):
        pid, holds = target.pid(fault.worker), held(target, fault.worker)
        os.kill(pid, signal.SIGKILL)
        rec.note(fault, "SIGKILL", worker=fault.worker, pid=pid, held=holds)
        target.killed(fault.worker, fault.restart)
        rec.note(fault, "restarted" if fault.restart else "gone", worker=fault.worker)
    elif isinstance(fault, CpuHog):
        cores = worker_cores(target)
        hogs = [
            subprocess.Popen(
                [sys.executable, "-c", "while True: pass"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
            for _ in range(fault.processes)
        ]
        try:
            for hog in hogs:
                os.sched_setaffinity(hog.pid, cores)
            rec.note(fault, "hogs started", cores=cores, pids=[h.pid for h in hogs])
            time.sleep(fault.for_s)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait(30)
            rec.note(fault, "hogs stopped")
    elif isinstance(fault, AbortStorm):
        rng = random.Random(fault.seed)
        jobs = []
        for k in range(fault.n):
            job = dict(load_jobs[k % len(load_jobs)])
            max_tokens = job["max_tokens"]
            if rng.random() < 0.25:
                job["cancel_delay_s"] = rng.uniform(0.0, 0.5)
            else:
                job["cancel_after"] = rng.randint(1, max(1, max_tokens - 1))
            jobs.append(job)
        rec.note(fault, "storm started", streams=fault.n)
        rows = Child(one_pass, target.address, jobs, fault.concurrency).result(CHILD_TIMEOUT_S)
        rec.storm_rows.extend(rows)
        rec.note(fault, "storm ended", cancelled=sum(r["cancelled"] for r in rows))
    elif isinstance(fault, Flip):
        before = target.roles[fault.worker]
        for k, role in enumerate(
            (fault.role, before) if fault.back_after_s is not None else (fault.role,)
        ):
            if k:
                time.sleep(fault.back_after_s)
            flip(target, rec, fault, role)
    elif isinstance(fault, EngineHang):
        holds = held(target, fault.worker)
        target.set_hang(fault.worker, True)
        rec.note(fault, "engine hung", worker=fault.worker, held=holds)
        try:
            time.sleep(fault.for_s)
        finally:
            target.set_hang(fault.worker, False)
            rec.note(fault, "engine released", worker=fault.worker)
    else:
        raise TypeError(f"not a fault: {fault!r}")


def flip(target: Target, rec: Recorder, fault: Flip, role: str) -> None:
    """One Admin.Flip of fault.worker to `role`, its answer recorded."""
    import grpc

    from pdserve.protos.pdserve.v1 import worker_pb2

    rec.note(fault, "flip asked", worker=fault.worker, role=role)
    request = worker_pb2.FlipRequest(
        worker_id=fault.worker, role=role, drain_timeout_ms=int(fault.drain_s * 1000)
    )
    try:
        reply = target.admin().Flip(request, timeout=RPC_TIMEOUT)
        rec.note(
            fault,
            "flip done",
            worker=fault.worker,
            role=reply.role,
            drain_ms=reply.drain_ms,
            switch_ms=reply.switch_ms,
            moved=reply.moved_streams,
        )
    except grpc.RpcError as e:
        rec.note(fault, "flip refused", worker=fault.worker, role=role, code=e.code().name,
                 details=(e.details() or "")[:300])  # fmt: skip


def wait_loaded(target: Target, load: Load, timeout_s: float = 60.0) -> float:
    """Seconds until the decode workers run at least half the load's concurrency (or the
    timeout): the moment the faults' at_s count from."""
    t0 = time.monotonic()
    want = max(1, min(load.concurrency, load.streams) // 2)
    while time.monotonic() - t0 < timeout_s:
        running = 0
        for name in target.roles:
            s = target.stats(name)
            if s is not None and (s.role or target.roles[name]) == "decode":
                running += s.num_running
        if running >= want:
            break
        time.sleep(0.05)
    return time.monotonic() - t0


# ---- checks -------------------------------------------------------------------------------------
@dataclass
class Run:
    """What a scenario's run left for the checks."""

    scenario: Scenario
    target: Target
    want: list[list[int]]
    rows: list[dict]
    rec: Recorder
    gone: set[str] = field(default_factory=set)  # workers killed and not restarted


def check_no_client_errors(run: Run) -> tuple[bool | None, dict]:
    """No stream of the load (nor of an abort storm) ends in an error, where a survivor of each
    role exists (None, not judged, where the scenario takes every worker of a role away)."""
    errors = [r["error"] for r in run.rows + run.rec.storm_rows if r["error"]]
    survivors = run.scenario.survivors()
    detail = {"errors": len(errors), "first": errors[:5], "survivors": survivors}
    if not all(survivors.values()):
        return None, detail
    return not errors, detail


def check_token_identical(run: Run) -> tuple[bool, dict]:
    """Every stream that finished is token-identical to the clean run of its prompt; a cancelled
    one is a prefix of it."""
    finished = [r for r in run.rows + run.rec.storm_rows if not r["error"] and not r["cancelled"]]
    changed = [r["i"] for r in finished if r["tokens"] != run.want[r["i"]]]
    cancelled = [r for r in run.rec.storm_rows + run.rows if r["cancelled"]]
    not_prefix = [r["i"] for r in cancelled if r["tokens"] != run.want[r["i"]][: len(r["tokens"])]]
    detail = {
        "finished": len(finished),
        "changed": len(changed),
        "changed_prompts": sorted(set(changed))[:10],
        "cancelled": len(cancelled),
        "cancelled_not_prefix": len(not_prefix),
    }
    return not changed and not not_prefix and bool(finished), detail


def kv_state(s) -> dict:
    return {
        "free": s.num_free_blocks,
        "total": s.num_total_blocks,
        "running": s.num_running,
        "waiting": s.num_waiting,
        "reserved": s.num_reserved,
    }


def kv_free(s) -> bool:
    return (
        s.num_free_blocks == s.num_total_blocks
        and not s.num_running
        and not s.num_waiting
        and not s.num_reserved
    )


def check_kv_free(run: Run) -> tuple[bool, dict]:
    """Every block and reservation free on every worker within the scenario's kv_free_s."""
    t0 = time.monotonic()
    names = [n for n in run.target.roles if n not in run.gone]
    while True:
        stats = {n: run.target.stats(n) for n in names}
        ok = all(s is not None and kv_free(s) for s in stats.values())
        if ok or time.monotonic() - t0 > run.scenario.kv_free_s:
            state = {n: kv_state(s) if s is not None else None for n, s in stats.items()}
            return ok, {"waited_s": round(time.monotonic() - t0, 2), "state": state}
        time.sleep(0.1)


def router_view(target: Target) -> dict[str, tuple[str, str]]:
    """Worker name -> (role, state) as the router holds it (Admin.ListWorkers)."""
    from pdserve.protos.pdserve.v1 import worker_pb2

    reply = target.admin().ListWorkers(worker_pb2.ListWorkersRequest(), timeout=30)
    return {w.worker_id: (w.role, w.state) for w in reply.workers}


def check_no_worker_stuck(run: Run) -> tuple[bool, dict]:
    """Within the scenario's settle_s, every worker (but one killed for good) reports
    role_state "serving" in the role the router holds it in, the router holds it "serving", and
    each role keeps a worker. The role each flip asked for is recorded beside it."""
    names = [n for n in run.target.roles if n not in run.gone]
    t0 = time.monotonic()
    while True:
        view = router_view(run.target)
        own = {}
        for n in names:
            s = run.target.stats(n)
            own[n] = (s.role, s.role_state) if s is not None else None
        stuck = [
            n
            for n in names
            if own[n] is None
            or n not in view
            or view[n][1] != "serving"
            or (own[n][0] and (own[n][0] != view[n][0] or own[n][1] != "serving"))
        ]
        pools = {
            role: any(view.get(n, ("", ""))[0] == role for n in names)
            for role in ("prefill", "decode")
        }
        ok = not stuck and all(pools.values())
        if ok or time.monotonic() - t0 > run.scenario.settle_s:
            asked = {}
            for e in run.rec.events:
                if e["what"] in ("flip done", "flip refused"):
                    asked[e["worker"]] = e.get("role") if e["what"] == "flip done" else None
            return ok, {
                "waited_s": round(time.monotonic() - t0, 2),
                "stuck": stuck,
                "router": {n: list(v) for n, v in view.items()},
                "worker": {n: list(v) if v else None for n, v in own.items()},
                "flips_done_to": asked,
            }
        time.sleep(0.2)


def check_router_serving(run: Run) -> tuple[bool, dict]:
    """The router answers its health check SERVING, and a fresh pass of the load's prompts runs
    with no error and token-identical; which workers served it is recorded."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from benchmarks.chaos_harness import serving

    with grpc.insecure_channel(run.target.address) as channel:
        healthy = serving(health_pb2_grpc.HealthStub(channel))
    load = run.scenario.load
    jobs = jobs_for(run.target.prompts(load), load.max_tokens)
    rows = Child(one_pass, run.target.address, jobs, load.concurrency).result(CHILD_TIMEOUT_S)
    errors = [r["error"] for r in rows if r["error"]]
    same = sum(r["tokens"] == run.want[r["i"]] for r in rows)
    detail = {
        "health": health_pb2.HealthCheckResponse.SERVING if healthy else None,
        "streams": len(rows),
        "errors": errors[:5],
        "identical": same,
        "prefill_workers": sorted({r["prefill_worker"] for r in rows} - {""}),
        "decode_workers": sorted({r["decode_worker"] for r in rows} - {""}),
    }
    return healthy and not errors and same == len(rows), detail


CHECKS = {
    "no_client_errors": check_no_client_errors,
    "token_identical": check_token_identical,
    "kv_free": check_kv_free,
    "no_worker_stuck": check_no_worker_stuck,
    "router_serving": check_router_serving,
}


# ---- the runner ---------------------------------------------------------------------------------
def run_scenario(scenario: Scenario, target: Target, want: list[list[int]]) -> dict:
    """Plays `scenario` on `target`; `want`: the clean run of its load (clean_run). Returns the
    record: the scenario, the faults' events, the load's figures, every check's verdict
    (True, False, or None where not judged) and `passed` (no check False)."""
    load = scenario.load
    jobs = jobs_for(target.prompts(load), load.max_tokens)
    t_start = time.monotonic()
    stop = Child.ctx.Event()
    client = Child(looping_load, target.address, jobs, load.concurrency, stop=stop)
    warm_s = wait_loaded(target, load)
    rec = Recorder(time.monotonic())
    threads = []
    for fault in scenario.faults:
        t = threading.Thread(target=_guarded, args=(fault, target, rec, jobs), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(CHILD_TIMEOUT_S)
    faults_s = time.monotonic() - rec.t0
    time.sleep(scenario.tail_s)
    rows = client.result(CHILD_TIMEOUT_S)  # sets stop: each client ends its current stream
    gone = {f.worker for f in scenario.faults if isinstance(f, Kill9) and not f.restart}
    run = Run(scenario, target, want, rows, rec, gone)
    checks = {}
    for name, check in CHECKS.items():
        try:
            ok, detail = check(run)
        except Exception as e:  # a check that cannot run is a failed check, with its reason
            ok, detail = False, {"exception": repr(e)[:500]}
        checks[name] = {"ok": ok, **detail}
    if rec.errors:
        checks["faults_injected"] = {"ok": False, "errors": rec.errors}
    return {
        **scenario.to_dict(),
        "warm_s": round(warm_s, 2),
        "faults_s": round(faults_s, 2),
        "took_s": round(time.monotonic() - t_start, 1),
        "streams": len(rows),
        "storm_streams": len(rec.storm_rows),
        "events": rec.events,
        "checks": checks,
        "passed": all(c["ok"] is not False for c in checks.values()),
    }


def _guarded(fault, target, rec, jobs) -> None:
    try:
        inject(fault, target, rec, jobs)
    except Exception as e:  # recorded: a fault that could not be injected fails the scenario
        rec.errors.append(f"{type(fault).__name__}: {e!r}"[:500])


def failures(result: dict) -> list[str]:
    """The checks that failed, each with its detail, for an assertion message."""
    return [f"{name}: {c}" for name, c in result["checks"].items() if c["ok"] is False]
