"""Part h of the chaos benchmark (benchmarks/robustness/chaos.py): workers that hang rather than die.

A stopped process (SIGSTOP: what a hung GPU, a swapped-out host or a half-open connection looks
like from outside) keeps its sockets open and answers nothing. Two runs on the embedded SmolLM2,
each first clean, then with one worker stopped for --stop-s (120 s) under 32 streams that keep
arriving, then continued (SIGCONT) and watched for a while:
  decode   one prefill and two decode workers; one decode worker is stopped mid-decode
  prefill  two prefill and one decode worker; one prefill worker is stopped
Each stream's token events are timed in the client process. The figures: for the streams in
flight at the stop, how long until each got its next token (the must-show: under 10 s; the same
figure 3 s before the stop shows what the load alone costs); the
longest time to first token of a stream started while the worker was stopped; errors; streams
token-identical to the clean run (greedy); streams in flight at the SIGCONT that changed; when
the stopped worker rejoined; whether every KV block was free at the end.

  python -m benchmarks.robustness.chaos --parts h                 # both runs, about 9 minutes on 2 cores
  python -m benchmarks.robustness.chaos --parts h --stop-s 30     # shorter stops
"""

from __future__ import annotations

import os
import signal
import time

from benchmarks.bench_common import log, random_prompts
from benchmarks.chaos_harness import (
    RPC_TIMEOUT,
    Child,
    deployment,
    example_config,
    jobs_for,
    kv_state,
    pct,
    run_streams,
    stream_counts,
    wait_kv_free,
)

CONCURRENCY = 32


def timed_stream(stub, job: dict) -> dict:
    """One greedy stream; every token event's arrival (time.monotonic(), shared by every process
    on this machine) and the workers its finish names."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=job["prompt"]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True),
    )
    row = {"i": job["i"], "start": time.monotonic(), "events": [], "tokens": [], "error": None}
    try:
        for resp in stub.Generate(request, timeout=RPC_TIMEOUT):
            if resp.HasField("delta") and resp.delta.token_ids:
                row["events"].append(time.monotonic())
                row["tokens"] += list(resp.delta.token_ids)
            elif resp.HasField("finish"):
                row["decode_worker"] = resp.finish.timings.decode_worker
                row["prefill_worker"] = resp.finish.timings.prefill_worker
    except grpc.RpcError as e:
        row["error"] = (e.code().name, e.details())
    row["end"] = time.monotonic()
    return row


def timed_loop(address: str, jobs: list[dict], concurrency: int, stop, conn) -> None:
    """Process body: `concurrency` threads, each running its jobs one after another until
    `stop`; sends back every row."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    rows = []

    def worker(k):
        n = 0
        while not stop.is_set():
            rows.append(timed_stream(stub, jobs[(k + n * concurrency) % len(jobs)]))
            n += 1

    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(worker, range(concurrency)))
    conn.send(rows)


def next_token_after(row: dict, t: float) -> float | None:
    """Seconds from `t` to `row`'s first token event after it (None: none came)."""
    return next((e - t for e in row["events"] if e > t), None)


def waits_at(rows: list[dict], t: float) -> dict:
    """For the streams in flight at `t`: seconds until each got its next token."""
    waits = [next_token_after(r, t) for r in rows if r["start"] < t < r["end"]]
    got = [w for w in waits if w is not None]
    return {
        "streams": len(waits),
        "max": round(max(got, default=0.0), 2),
        "p50": round(pct(got, 50), 2),
        "over_1s": sum(w is None or w > 1.0 for w in waits),
        "none": len(waits) - len(got),
    }


def analyse(rows: list[dict], want: list[list[int]], t_stop: float, t_cont: float) -> dict:
    during = [r for r in rows if t_stop <= r["start"] < t_cont]
    at_cont = [r for r in rows if r["start"] < t_cont < r["end"]]
    ttfts = [next_token_after(r, r["start"]) for r in during]
    changed, counts = stream_counts(rows, want)
    resumable = [r for r in changed if r["start"] < t_stop < r["end"]]  # in flight at the stop
    gaps = [b - a for r in rows for a, b in zip(r["events"], r["events"][1:])]
    return {
        **counts,
        # a resumed stream may differ after its resume point (docs/architecture.md: a prefill
        # recomputes the streamed tokens' KV, whose rounding can flip a near-tie); every other
        # stream must be identical
        "changed_in_flight_at_stop": len(resumable),
        "changed_others": len(changed) - len(resumable),
        # (tokens streamed before the stop, first token that differs): a difference right at
        # the resume point every time would be a resume bug, not rounding
        "resume_point_and_first_difference": sorted(
            (
                sum(e < t_stop for e in r["events"]),
                next(k for k, (a, b) in enumerate(zip(r["tokens"], want[r["i"]] + [-1])) if a != b),
            )
            for r in changed
        )[:20],
        "next_token_after_stop_s": waits_at(rows, t_stop),
        # the same figure 3 s before the stop: what the load alone costs
        "next_token_before_stop_s": waits_at(rows, t_stop - 3.0),
        "started_while_stopped": len(during),
        "ttft_while_stopped_s": {
            "max": round(max((t for t in ttfts if t is not None), default=0.0), 2),
            "p99": round(pct([t for t in ttfts if t is not None], 99), 2),
        },
        "in_flight_at_sigcont": len(at_cont),
        "changed_at_sigcont": sum(1 for r in at_cont if r["error"] or r["tokens"] != want[r["i"]]),
        "max_token_gap_s": round(max(gaps, default=0.0), 2),
    }


def busiest(cluster, role: str, timeout_s: float = 20.0):
    """(replica, its Stats figures): the worker of `role` running the most sequences, once one
    runs at least a quarter of the streams (or when timeout_s has passed)."""
    end = time.monotonic() + timeout_s
    while True:
        state = kv_state(cluster)
        name = max(
            (r.name for r in cluster.replicas if r.role == role and r.address),
            key=lambda n: state[n]["running"],
        )
        if state[name]["running"] >= CONCURRENCY // 4 or time.monotonic() > end:
            return next(r for r in cluster.replicas if r.name == name), state[name]
        time.sleep(0.05)


def run_one(role: str, args) -> dict:
    import ray

    from pdserve.deploy.launcher import RestartPolicy

    prefill, decode = (1, 2) if role == "decode" else (2, 1)
    prompts = random_prompts(2600, 64, args.prompt_len)
    config = example_config(prefill=prefill, decode=decode, prefix_caching=False)
    with deployment(config, restart=RestartPolicy(poll_s=0.5)) as (cluster, _):
        address, pool = cluster.router_address, cluster.router.pool
        jobs = jobs_for(prompts, args.max_tokens)
        clean = Child(run_streams, address, jobs, CONCURRENCY).result()
        want = [r["tokens"] for r in sorted(clean, key=lambda r: r["i"])]
        if any(r["error"] for r in clean):
            raise RuntimeError(f"the clean run failed: {[r['error'] for r in clean][:3]}")
        run = Child(timed_loop, address, jobs, CONCURRENCY, stop=Child.ctx.Event())
        time.sleep(args.warm_s)  # every thread has a stream going
        victim, state = busiest(cluster, role)
        pid = ray.get(victim.actor.pid.remote(), timeout=30)
        t_stop = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        log(f"h: SIGSTOP {victim.name} (pid {pid}) for {args.stop_s:.0f} s; it held {state}")
        dropped_s = None
        while time.monotonic() - t_stop < args.stop_s:
            members = [w.address for w in getattr(pool, role) if not w.down]
            if dropped_s is None and victim.address not in members:
                dropped_s = time.monotonic() - t_stop
            time.sleep(0.1)
        t_cont = time.monotonic()
        os.kill(pid, signal.SIGCONT)
        rejoined_s = None
        while time.monotonic() - t_cont < args.after_s:
            members = [w.address for w in getattr(pool, role) if not w.down]
            if rejoined_s is None and victim.address in members:
                rejoined_s = time.monotonic() - t_cont
            time.sleep(0.1)
        rows = run.result()
        free, waited, kv = wait_kv_free(cluster, timeout_s=30)
        out = {
            "workers": f"{prefill}P+{decode}D",
            "stopped": victim.name,
            "stop_s": args.stop_s,
            "victim_at_stop": state,
            "dropped_from_pool_after_s": None if dropped_s is None else round(dropped_s, 2),
            "rejoined_after_sigcont_s": None if rejoined_s is None else round(rejoined_s, 2),
            **analyse(rows, want, t_stop, t_cont),
            "kv_all_free": free,
            "kv_free_waited_s": round(waited, 2),
        }
        if not free:
            out["kv_state"] = kv
    n = out["next_token_after_stop_s"]
    log(
        f"h: {role}: {out['errors']} errors, {out['token_identical']}/{out['streams']} identical,"
        f" next token after the stop within {n['max']} s, KV free: {free}"
    )
    return out


def part_h(args) -> dict:
    """A decode worker (1P+2D) and a prefill worker (2P+1D) stopped under 32 streams."""
    return {role: run_one(role, args) for role in args.h_roles.split(",")}


def add_args(p) -> None:
    """part h's options, also on benchmarks/robustness/chaos.py's command line."""
    p.add_argument("--h-roles", default="decode,prefill", help="part h: which workers to stop")
    p.add_argument("--stop-s", type=float, default=120.0, help="part h: how long a worker stops")
    p.add_argument("--after-s", type=float, default=20.0, help="part h: watched after SIGCONT")
    p.add_argument("--warm-s", type=float, default=8.0, help="part h: streams before the stop")
    p.add_argument("--prompt-len", type=int, default=32, help="part h: prompt tokens")
