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
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
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


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--flips", type=int, default=20)
    p.add_argument("--pause-s", type=float, default=3.0, help="between two flips")
    p.add_argument("--drain-s", type=float, default=None, help="default: router.flip_drain_s")
    p.add_argument("--warm-s", type=float, default=8.0)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    add_out_arg(p, "flips.json")
    args = p.parse_args(argv)
    return run_and_write("benchmarks.robustness.flips", argv, args.out, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
