"""Role flips under load (issue #27, must-show a): a real deployment of the embedded SmolLM2 with
one prefill and two decode workers (`deploy.launcher.up()`, as `pdserve up` runs it), 32
concurrent greedy streams that keep arriving, and --flips role flips back and forth, each by the
operators' command (`pdserve ctl flip`, a process of its own, with the cluster secret in a 0600
file). A cycle of four flips moves decode-1 to prefill, prefill-0 to decode, then both back, so
both kinds of worker drain and switch; the pools never hold fewer than one worker each.

  python -m benchmarks.robustness.flips                       # 20 flips, about 4 minutes on 2 cores
  python -m benchmarks.robustness.flips --flips 4 --pause-s 2

First a clean run: every prompt once, no flips, for the tokens each stream must have. Then the
flip run. What it records: each flip's drain and switch time as the router measured them (the
FlipResponse the command prints) and the command's own wall time; the streams the flips moved;
errors; streams token-identical to the clean run (a moved stream re-prefills its prompt and
tokens on the other worker, whose rounding can flip a near-tie after the move point: counted
apart, as the hang benchmark does); whether every KV block was free at the end; and that no
weights were reloaded (each worker process the same pid, its engine built once). Writes
benchmarks/results/flips.json.

  python -m benchmarks.robustness.flips --interrupt 20      # about 20-30 minutes on 2 cores

The interrupt part (issue #47, must-show c): --interrupt flips, each interrupted by SIGSTOP (for
a random 1-8 s, then SIGCONT) or kill -9 of the flipped worker's process (the supervisor starts it
again in its launch role), at one of five points: before the drain reaches it, during the drain
(its first Drain(true) answered, 4 streams running), between the drain and the switch (the
router marks it switching), during the switch (the router has registered it in the new pool, the
worker has not had the answer) and right after the flip returned; stop and kill alternate, the
points go round.
The flip runs in the router of this process (`cluster.router.flips`), hooked at those points. Per
trial: the flip's outcome; the seconds from SIGCONT (or from the restarted worker's registration)
until every worker's own report, received after that moment, matches what the router intends for
it and the router serves it (router/reconcile.py); then 16 streams, the hand-offs each worker did
(each serving worker must get some), and the client errors. A killed worker is killed only after
it served 65 s (the supervisor gives up on a worker that dies thrice within 60 s of its start).
Writes benchmarks/results/flips_interrupt.json.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.bench_common import (
    add_out_arg,
    log,
    random_prompts,
    run_and_write,
    script_parser,
)
from benchmarks.chaos_harness import (
    Child,
    deployment,
    example_config,
    jobs_for,
    loop_streams,
    pct,
    run_streams,
    stream_counts,
    wait_kv_free,
)
from benchmarks.robustness.chaos_hangs import timed_loop

CONCURRENCY = 32
CYCLE = (("decode-1", "prefill"), ("prefill-0", "decode"), ("prefill-0", "prefill"))
CYCLE += (("decode-1", "decode"),)
_REPLY = re.compile(
    r"(\S+): (\w+) -> (\w+) \(drain (\d+) ms, switch (\d+) ms, (\d+) streams moved\)"
)


def ctl_flip(router: str, secret_file: str, worker: str, role: str, drain_s: float | None):
    """`pdserve ctl flip` in a process of its own: (exit status, its output, wall seconds)."""
    cmd = [sys.executable, "-m", "pdserve", "ctl", "--router", router, "--secret-file"]
    cmd += [secret_file, "flip", worker, role]
    if drain_s is not None:
        cmd += ["--drain-s", str(drain_s)]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return done.returncode, (done.stdout + done.stderr).strip(), time.monotonic() - t0


def moved_at(rows: list[dict], moves: list[float]) -> list[dict]:
    """The rows in flight at one of the moments a flip moved streams."""
    return [r for r in rows if any(r["start"] < t < r["end"] for t in moves)]


def analyse(rows: list[dict], want: list[list[int]], moves: list[float]) -> dict:
    changed, counts = stream_counts(rows, want)
    exposed = moved_at(changed, moves)
    return {
        **counts,
        "changed_in_flight_at_a_move": len(exposed),
        "changed_others": len(changed) - len(exposed),
        "in_flight_at_a_move": len(moved_at(rows, moves)),
    }


def worker_pids(cluster) -> dict[str, int]:
    import ray

    return {r.name: ray.get(r.actor.pid.remote(), timeout=30) for r in cluster.replicas}


def run(args) -> dict:
    prompts = random_prompts(2700, 96, args.prompt_len)
    config = example_config(prefill=1, decode=2, prefix_caching=False)
    out: dict = {"workers": "1P+2D", "flips_asked": args.flips, "pause_s": args.pause_s}
    with deployment(config) as (cluster, _):
        address = cluster.router_address
        jobs = jobs_for(prompts, args.max_tokens)
        clean = Child(run_streams, address, jobs, CONCURRENCY).result()
        if any(r["error"] for r in clean):
            raise RuntimeError(f"the clean run failed: {[r['error'] for r in clean][:3]}")
        want = [r["tokens"] for r in sorted(clean, key=lambda r: r["i"])]
        pids = worker_pids(cluster)
        fd, secret_file = tempfile.mkstemp(prefix="pdserve-secret-")
        with os.fdopen(fd, "w") as f:  # mkstemp: 0600
            f.write(cluster.security.secret)
        flips, moves = [], []
        try:
            loop = Child(timed_loop, address, jobs, CONCURRENCY, stop=Child.ctx.Event())
            time.sleep(args.warm_s)  # every thread has a stream going
            for k in range(args.flips):
                worker, role = CYCLE[k % len(CYCLE)]
                t = time.monotonic()
                rc, text, wall = ctl_flip(address, secret_file, worker, role, args.drain_s)
                found = _REPLY.search(text)
                row = {"worker": worker, "to": role, "exit": rc, "command_s": round(wall, 2)}
                if found:
                    drain_ms, switch_ms, moved = (int(x) for x in found.groups()[3:])
                    row.update(drain_s=drain_ms / 1000, switch_s=switch_ms / 1000, moved=moved)
                    if moved:  # they moved at the drain bound, which the drain time ends past
                        moves.append(t + min(drain_ms / 1000, args.drain_s or 5.0))
                else:
                    row["output"] = text[-400:]
                flips.append(row)
                log(f"flip {k + 1}/{args.flips}: {text}")
                time.sleep(args.pause_s)
            rows = loop.result()
        finally:
            os.unlink(secret_file)
        free, waited, kv = wait_kv_free(cluster, timeout_s=30)
        pids_after = worker_pids(cluster)
        done = [f for f in flips if f["exit"] == 0 and "switch_s" in f]
        out.update(
            {
                "flips_done": len(done),
                "flips_failed": [f for f in flips if f["exit"] != 0],
                "drain_s": _spread([f["drain_s"] for f in done]),
                "switch_s": _spread([f["switch_s"] for f in done]),
                "command_s": _spread([f["command_s"] for f in done]),
                "streams_moved": sum(f.get("moved", 0) for f in done),
                **analyse(rows, want, moves),
                "kv_all_free": free,
                "kv_free_waited_s": round(waited, 2),
                "same_worker_processes": pids == pids_after,
                "roles_at_end": {w.worker_id: w.role for w in cluster.router.pool.members()},
                "flips": flips,
            }
        )
        if not free:
            out["kv_state"] = kv
    log(
        f"{out['flips_done']}/{args.flips} flips, switch max {out['switch_s']['max']} s, drain "
        f"median {out['drain_s']['p50']} s; {out['errors']} errors, {out['token_identical']}/"
        f"{out['streams']} identical ({out['changed_in_flight_at_a_move']} changed after a "
        f"move), KV free: {free}, same processes: {out['same_worker_processes']}"
    )
    return out


def _spread(xs: list[float]) -> dict:
    return {
        "n": len(xs),
        "p50": round(pct(xs, 50), 3),
        "max": round(max(xs, default=0.0), 3),
        "min": round(min(xs, default=0.0), 3),
    }


# ---- the interrupt part -------------------------------------------------------------------------
POINTS = ("before_drain", "during_drain", "drain_to_switch", "during_switch", "right_after")
CONVERGE_BOUND_S = 10.0  # must-show c: every worker serves its intended role within this
STABLE_WAIT_S = 65.0  # the supervisor's stable_s (60) and a margin, before a worker is killed


class Hooks:
    """The router's pool, hooked so that `fire()` runs when the flip of `target` reaches the
    armed point; also records each worker's registrations (time.monotonic())."""

    def __init__(self, router):
        self.router, self.pool = router, router.pool
        self.target, self.point, self.fire = None, None, None
        self.fired_at: float | None = None
        self.fired_state = ""
        self.registered: dict[str, list[float]] = {}
        pool = self.pool
        set_state, register = pool.set_state, pool.register

        def hooked_set_state(worker, state):
            set_state(worker, state)
            if state == "switching" and self._armed(worker, "drain_to_switch"):
                self._fire_now("drained")

        def hooked_register(role, worker_id, address, *rest):
            old = pool.registered(worker_id)
            worker = register(role, worker_id, address, *rest)
            if old is None or (old.role, old.address) != (role, address):  # a new pool entry
                self.registered.setdefault(worker_id, []).append(time.monotonic())
            if old is not None and old.role != role and self._armed(old, "during_switch"):
                self._fire_now("registered, unanswered")
            return worker

        pool.set_state, pool.register = hooked_set_state, hooked_register
        call = router.flips._call

        def hooked_call(method, request):
            reply = call(method, request)
            if getattr(request, "draining", False) and self._armed_name("during_drain"):
                self._fire_now("draining (its first Drain answered)")
            return reply

        router.flips._call = hooked_call

    def arm(self, target: str, point: str, fire) -> None:
        self.target, self.point, self.fire, self.fired_at = target, point, fire, None

    def _armed(self, worker, point: str) -> bool:
        return self._armed_name(point) and self.pool.name(worker) == self.target

    def _armed_name(self, point: str) -> bool:
        """`point` is armed (the flip under way is the target's: one at a time)."""
        return self.point == point and self.fired_at is None and self.fire is not None

    def _fire_now(self, state: str | None = None) -> None:
        """Fires once; state: where the flip was (None: the pool's state for the worker now)."""
        if self.fired_at is None and self.fire is not None:
            if state is None:
                worker = self.pool.registered(self.target)
                state = worker.state if worker is not None else "not in the pool"
            self.fired_at, self.fired_state = time.monotonic(), state
            fire, self.fire = self.fire, None
            fire()


def replica_named(cluster, name: str):
    return next(r for r in cluster.replicas if r.name == name)


def replica_pid(replica) -> int:
    import ray

    return ray.get(replica.actor.pid.remote(), timeout=60)


def every_worker_converged(router, names: list[str], after: dict[str, float]) -> bool:
    """Every worker of `names` is in the pool, serving its intended role as the router sees it,
    and its own last report (received after after[name], where given) says so."""
    now = time.monotonic()
    for name in names:
        worker = router.pool.registered(name)
        if worker is None or worker.down or worker.state != "serving":
            return False
        v = router.reconciler.view(worker)
        if v.mismatch or (v.intended_state, v.reported_state) != ("serving", "serving"):
            return False
        if (v.intended_role, v.reported_role) != (worker.role, worker.role):
            return False
        if name in after and (v.reported_age_s is None or now - v.reported_age_s < after[name]):
            return False
    return True


def handoffs(cluster) -> dict[str, int]:
    """Each worker's hand-offs so far (prefill: sent, decode: received), from the service of the
    role the router holds it in; -1 for one that does not answer."""
    from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

    stubs = {
        "prefill": worker_pb2_grpc.PrefillWorkerStub,
        "decode": worker_pb2_grpc.DecodeWorkerStub,
    }
    out = {}
    for r in cluster.replicas:
        worker = cluster.router.pool.registered(r.name)
        if worker is None or not r.address:
            out[r.name] = -1
            continue
        try:
            with cluster.security.channel(r.address) as ch:
                s = stubs[worker.role](ch).Stats(worker_pb2.StatsRequest(), timeout=10)
            out[r.name] = s.kv_transfers
        except Exception:
            out[r.name] = -1
    return out


def pick_flip(router, rng) -> tuple[str, str]:
    """A worker whose pool keeps another serving worker without it, and the other role."""
    members = [w for w in router.pool.members() if w.state == "serving" and not w.down]
    by_role = {role: [w for w in members if w.role == role] for role in ("prefill", "decode")}
    role = max(by_role, key=lambda r: len(by_role[r]))
    worker = rng.choice(by_role[role])
    return router.pool.name(worker), "decode" if role == "prefill" else "prefill"


def interrupt_trial(cluster, hooks, rng, k: int, args, jobs) -> dict:
    router = cluster.router
    kind = ("stop", "kill")[k % 2]
    point = POINTS[(k // 2) % len(POINTS)]
    names = [r.name for r in cluster.replicas]
    worker, role = pick_flip(router, rng)
    if kind == "kill":  # the worker that served longest, and not before it is stable
        candidates = [
            w for w in router.pool.members() if w.role == router.pool.registered(worker).role
        ]
        candidates = [router.pool.name(w) for w in candidates if w.state == "serving"]
        worker = min(candidates, key=lambda n: replica_named(cluster, n).serving_since or 1e18)
        since = replica_named(cluster, worker).serving_since or time.monotonic()
        wait = STABLE_WAIT_S - (time.monotonic() - since)
        if wait > 0:
            log(f"trial {k + 1}: waiting {wait:.0f} s until {worker} served {STABLE_WAIT_S:g} s")
            time.sleep(wait)
    replica = replica_named(cluster, worker)
    pid = replica_pid(replica)
    stop_s = round(rng.uniform(1.0, 8.0), 2)
    row = {"trial": k + 1, "kind": kind, "point": point, "worker": worker, "to": role}
    cont = {}

    def fire():
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGSTOP)

        def resume():
            os.kill(pid, signal.SIGCONT)
            cont["at"] = time.monotonic()

        threading.Timer(stop_s, resume).start()

    load = Child(loop_streams, cluster.router_address, jobs, 4, stop=Child.ctx.Event())
    time.sleep(2.0)  # streams on every worker, so that a drain has something to wait for
    hooks.arm(worker, point, fire)
    outcome = {}

    def do_flip():
        t = time.monotonic()
        try:
            r = router.flips.flip(worker, role)
            outcome.update(flip="done", drain_s=round(r.drain_s, 2), switch_s=round(r.switch_s, 2))
        except Exception as e:  # FlipRefused: given up or refused
            outcome.update(flip=f"failed: {str(e)[:160]}")
        outcome["flip_s"] = round(time.monotonic() - t, 2)

    if point == "before_drain":
        hooks._fire_now("serving (not yet asked to drain)")
    flipper = threading.Thread(target=do_flip)
    flipper.start()
    flipper.join(120)
    if point == "right_after" or hooks.fired_at is None:
        if hooks.fired_at is None and point != "right_after":
            row["fired_late"] = True  # the flip passed its point before the hook could fire
        hooks._fire_now("flip returned")
    row.update(outcome, fired_when=hooks.fired_state)
    if kind == "stop":
        row["stopped_s"] = stop_s
        wait_for(lambda: "at" in cont, stop_s + 30)
        t_ref, ref = cont["at"], "sigcont"
    else:

        def restarted():
            return any(t > hooks.fired_at for t in hooks.registered.get(worker, []))

        wait_for(restarted, 300)
        t_ref, ref = hooks.registered[worker][-1], "registered_after_restart"
        row["restart_s"] = round(t_ref - hooks.fired_at, 2)
    row["from"] = ref
    converged = wait_for(
        lambda: every_worker_converged(router, names, {worker: t_ref}), 60, poll_s=0.05
    )
    row["converge_s"] = round(time.monotonic() - t_ref, 2) if converged else None
    row["within_bound"] = converged and row["converge_s"] <= CONVERGE_BOUND_S
    bg = load.result()
    row["background_streams"], row["background_errors"] = len(bg), sum(1 for r in bg if r["error"])
    row["pool_before_load"] = {
        router.pool.name(w): f"{w.role} {w.state} down={w.down} used={w.num_used_blocks} "
        f"free={w.num_free_blocks}"
        for w in router.pool.members()
    }
    before = handoffs(cluster)
    # fresh prompts: the router's prefix affinity would send replayed ones where they went before
    fresh = jobs_for(random_prompts(9000 + k, 16, args.prompt_len), args.max_tokens)
    spread = Child(run_streams, cluster.router_address, fresh, 16).result()
    after = handoffs(cluster)
    row["load_errors"] = sum(1 for r in spread if r["error"])
    row["load_per_worker"] = {n: after[n] - before[n] for n in names}
    row["roles"] = {n: router.pool.registered(n).role for n in names if router.pool.registered(n)}
    row["every_worker_got_load"] = all(v > 0 for v in row["load_per_worker"].values())
    log(f"trial {k + 1}: {row}")
    return row


def wait_for(cond, timeout_s: float, poll_s: float = 0.1) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(poll_s)
    return cond()


def run_interrupts(args) -> dict:
    rng = random.Random(args.seed)
    prompts = random_prompts(4700, 64, args.prompt_len)
    config = example_config(prefill=1, decode=2, prefix_caching=False)
    config["router"]["http_port"] = 0  # a free port: the gRPC port is all it uses
    out: dict = {"workers": "1P+2D", "trials_asked": args.interrupt, "seed": args.seed}
    with deployment(config) as (cluster, _):
        router = cluster.router
        hooks = Hooks(router)
        jobs = jobs_for(prompts, args.max_tokens)
        names = [r.name for r in cluster.replicas]
        wait_for(lambda: every_worker_converged(router, names, {}), 60)
        trials = []
        for k in range(args.interrupt):
            try:
                trials.append(interrupt_trial(cluster, hooks, rng, k, args, jobs))
            except Exception as e:  # one trial's failure is a result, not the run's end
                log(f"trial {k + 1} failed: {e!r}")
                trials.append({"trial": k + 1, "error": repr(e)[:300]})
        ok = [t for t in trials if t.get("converge_s") is not None]
        out.update(
            {
                "trials": len(trials),
                "converged": len(ok),
                "within_10_s": sum(1 for t in trials if t.get("within_bound")),
                "converge_s": _spread([t["converge_s"] for t in ok]),
                "every_worker_got_load": sum(1 for t in trials if t.get("every_worker_got_load")),
                "load_errors": sum(t.get("load_errors", 0) for t in trials),
                "background_errors": sum(t.get("background_errors", 0) for t in trials),
                "flips_done": sum(1 for t in trials if t.get("flip") == "done"),
                "roles_at_end": {w.worker_id: w.role for w in router.pool.members()},
                "per_trial": trials,
            }
        )
    log(
        f"{out['within_10_s']}/{out['trials']} trials converged within {CONVERGE_BOUND_S:g} s "
        f"(max {out['converge_s']['max']} s); load reached every worker in "
        f"{out['every_worker_got_load']}; {out['load_errors']} load errors"
    )
    return out


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--flips", type=int, default=20)
    p.add_argument(
        "--interrupt",
        type=int,
        default=0,
        help="run the interrupt part instead, with this many trials (20: every point and kind "
        "twice)",
    )
    p.add_argument("--seed", type=int, default=47, help="the interrupt part's stop lengths")
    p.add_argument("--pause-s", type=float, default=3.0, help="between two flips")
    p.add_argument("--drain-s", type=float, default=None, help="default: router.flip_drain_s")
    p.add_argument("--warm-s", type=float, default=8.0)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    add_out_arg(p, "flips.json")
    args = p.parse_args(argv)
    if args.interrupt:
        if args.out == p.get_default("out"):
            args.out = os.path.join(os.path.dirname(args.out), "flips_interrupt.json")
        return run_and_write(
            "benchmarks.robustness.flips", argv, args.out, lambda: run_interrupts(args)
        )
    return run_and_write("benchmarks.robustness.flips", argv, args.out, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
