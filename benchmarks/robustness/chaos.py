"""Chaos runs against a real deployment: `deploy.launcher.up()` (what `pdserve up` runs) of the
embedded SmolLM2 on this machine, with clients, probes and abusers in processes of their own.

  python -m benchmarks.robustness.chaos                       # every part, ~20 min on 2 cores
  python -m benchmarks.robustness.chaos --parts a,c --requests 100

Parts (issue #14's must-show; tests/chaos/ runs the same at CI scale on a tiny model), each
described in its function:
  a  500 streams, half of them cancelled at random points, under a health probe
  c  a 60 MB prompt and a 1,000,000-entry stop list: the router's CPU and another client's TTFT
  d  a second `pdserve up` on the same port, then kill -9 of the only decode worker
  e  kill -9 of a decode and of a prefill worker while a survivor of each serves
  h  SIGSTOP of a decode worker (1P+2D) and of a prefill worker (2P+1D) for 120 s under 32
     streams (benchmarks/robustness/chaos_hangs.py)
  s  kill -9 of a decode worker 5 times with the shm backend: pools in /dev/shm and the prefill
     worker's maps (benchmarks/robustness/chaos_shm.py)
Writes benchmarks/results/chaos.json (machine, commit, command, every figure).
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.bench_common import (
    REPO_ROOT,
    add_out_arg,
    log,
    random_prompts,
    script_parser,
    write_result,
)
from benchmarks.chaos_harness import (
    RPC_TIMEOUT,
    Child,
    cluster_report,
    deployment,
    example_config,
    free_port,
    jobs_for,
    kv_state,
    loop_streams,
    pct,
    probe_health,
    run_streams,
    wait_kv_free,
    wait_replaced,
)
from benchmarks.robustness import chaos_hangs, chaos_shm


# ---- a: cancellation storm ----------------------------------------------------------------------
def part_a(args) -> dict:
    """500 streams (--requests), 32 at a time (--concurrency), half cancelled by the client at
    random points (before the first token or after k tokens), a health probe every 100 ms: worker
    drop-outs, probe latency percentiles, the non-cancelled streams against a clean run of the same
    prompts, and the KV blocks after."""
    rng = random.Random(14)
    lengths = [rng.randint(16, 96) for _ in range(args.requests)]
    prompts = [random_prompts(7000 + i, 1, n)[0] for i, n in enumerate(lengths)]
    cancelled = set(rng.sample(range(args.requests), args.requests // 2))
    cancel = {}
    for i in cancelled:  # a quarter before any token (a timer), the rest after k tokens
        if rng.random() < 0.25:
            cancel[i] = {"cancel_delay_s": rng.uniform(0.0, 0.5)}
        else:
            cancel[i] = {"cancel_after": rng.randint(1, args.max_tokens - 1)}
    kept = [i for i in range(args.requests) if i not in cancelled]
    out = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "cancelled_by_client": len(cancelled),
        "probe_interval_ms": 100,
    }
    with deployment(example_config(prefix_caching=False)) as (cluster, drops):
        address = cluster.router_address
        # the clean run: the streams that will not be cancelled, same concurrency, no chaos
        t0 = time.perf_counter()
        clean = Child(
            run_streams,
            address,
            jobs_for([prompts[i] for i in kept], args.max_tokens),
            args.concurrency,
        ).result()
        out["clean_run_s"] = round(time.perf_counter() - t0, 1)
        want = {kept[r["i"]]: r["tokens"] for r in clean}
        out["clean_errors"] = [r["error"] for r in clean if r["error"]]
        stop = Child.ctx.Event()
        probe = Child(probe_health, address, 0.1, stop=stop)
        time.sleep(1.0)
        t0 = time.perf_counter()
        rows = Child(
            run_streams, address, jobs_for(prompts, args.max_tokens, cancel), args.concurrency
        ).result()
        out["chaos_run_s"] = round(time.perf_counter() - t0, 1)
        time.sleep(0.5)
        probes = probe.result()
        free, took, state = wait_kv_free(cluster)
    ok = [p for p in probes if p is not None]
    by_i = {r["i"]: r for r in rows}
    kept_rows = [by_i[i] for i in kept]
    out.update(
        {
            "workers_dropped": len(drops.dropped),
            "drop_messages": drops.dropped[:5],
            "probes": len(probes),
            "probe_failures": len(probes) - len(ok),
            "probe_ms": {"p50": pct(ok, 50), "p99": pct(ok, 99), "max": max(ok) if ok else None},
            "cancelled_streams_ended_cancelled": sum(by_i[i]["cancelled"] for i in cancelled),
            "cancelled_streams_that_finished_first": sum(
                by_i[i]["finish"] == "length" for i in cancelled
            ),
            "kept_streams": len(kept),
            "kept_complete": sum(
                r["finish"] == "length" and len(r["tokens"]) == args.max_tokens for r in kept_rows
            ),
            "kept_identical_to_clean": sum(r["tokens"] == want[r["i"]] for r in kept_rows),
            "kept_errors": [r["error"] for r in kept_rows if r["error"]][:5],
            "kv_all_free": free,
            "kv_free_after_s": round(took, 3),
            "kv_state": state,
        }
    )
    log(
        f"a: {out['workers_dropped']} dropped, probe p99 {out['probe_ms']['p99']} ms "
        f"({out['probe_failures']} failed of {len(probes)}), {out['kept_identical_to_clean']}/"
        f"{len(kept)} identical, KV free {free}"
    )
    return out


# ---- c: bounded work per request ----------------------------------------------------------------
# the 1-character stop list stays under the router's message cap (3 MB), so the router's own
# check refuses it; the others are past the cap and gRPC refuses them unread
ABUSES = ("text_60MB", "stop_list_1M", "stop_list_1M_short")


def abuse_payload(kind: str) -> bytes:
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    sampling = pb.SamplingParams(temperature=0.0, max_tokens=8)
    if kind == "text_60MB":
        request = pb.GenerateRequest(text="hello world " * (5 << 20), sampling=sampling)  # 62.9 MB
    else:
        sampling.stop.extend(["stop" if kind == "stop_list_1M" else "s"] * 1_000_000)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=sampling)
    return request.SerializeToString()


def abuser(address: str, commands, conn) -> None:
    """Process body: serialized once, each abusive request is sent as raw bytes. Answers each
    command (one of ABUSES, "loop", "quit") with the outcomes."""
    import grpc

    payloads = {k: abuse_payload(k) for k in ABUSES}
    with grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", 128 << 20)]
    ) as channel:
        generate = channel.unary_stream("/pdserve.v1.PDServe/Generate")

        def send(kind):
            t = time.perf_counter()
            try:
                list(generate(payloads[kind], timeout=RPC_TIMEOUT))
                status = ("OK", "")
            except grpc.RpcError as e:
                status = (e.code().name, e.details()[:160])
            return {"kind": kind, "wall_s": time.perf_counter() - t, "status": status}

        conn.send({"ready": {k: len(v) for k, v in payloads.items()}})
        while True:
            cmd = commands.get()
            if cmd == "quit":
                return
            if cmd == "loop":  # alternate until told to stop (the next command)
                sent = []
                while commands.empty():
                    sent.append(send(ABUSES[len(sent) % len(ABUSES)]))
                conn.send(sent)
            else:
                conn.send(send(cmd))


def router_cpu_s() -> float:
    """This process's CPU: the router runs in it (deploy.launcher.up starts it here)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def normal_ttfts(address: str, n: int, seed: int) -> list[float]:
    """A normal client's TTFTs, one request at a time; fresh prompts per seed (no prefix-cache hit)."""
    jobs = jobs_for(random_prompts(seed, n, 64), 4)
    rows = Child(run_streams, address, jobs, 1).result()
    bad = [r["error"] for r in rows if r["error"]]
    if bad:
        raise RuntimeError(f"normal client failed: {bad[:3]}")
    return [r["ttft_s"] * 1000 for r in rows]


def part_c(args) -> dict:
    """A 60 MB text prompt and a 1,000,000-entry stop list: the router process's CPU for each
    refusal (alone), then a normal client's TTFT with and without an abuser sending both in a
    loop."""
    out = {}
    with deployment(example_config()) as (cluster, drops):
        address = cluster.router_address
        normal_ttfts(address, 4, 8000)  # warm
        commands = Child.ctx.Queue()
        abuse = Child(abuser, address, commands)
        out["payload_bytes"] = abuse.parent.recv()["ready"]
        out["alone"] = {}
        for kind in ABUSES:
            runs = []
            for _ in range(3):
                time.sleep(0.5)
                c0 = router_cpu_s()
                commands.put(kind)
                got = abuse.parent.recv()
                time.sleep(0.2)  # let the router finish whatever it does after answering
                runs.append(
                    {
                        "router_cpu_s": round(router_cpu_s() - c0, 3),
                        "client_wall_s": round(got["wall_s"], 3),
                        "status": got["status"],
                    }
                )
            out["alone"][kind] = runs
            log(f"c: {kind}: router CPU {[r['router_cpu_s'] for r in runs]} s, {runs[0]['status']}")
        # idle CPU of this process over the same window, to read the numbers above against
        c0 = router_cpu_s()
        time.sleep(0.2)
        out["idle_cpu_s_per_0.2s"] = round(router_cpu_s() - c0, 4)
        base = normal_ttfts(address, args.ttft_requests, 8100)
        commands.put("loop")
        time.sleep(1.0)
        beside = normal_ttfts(address, args.ttft_requests, 8200)
        commands.put("quit")
        sent = abuse.parent.recv()
        abuse.proc.join(30)
        out["baseline_ttft_ms"] = {
            "median": statistics.median(base),
            "p90": pct(base, 90),
            "runs": base,
        }
        out["beside_abuser_ttft_ms"] = {
            "median": statistics.median(beside),
            "p90": pct(beside, 90),
            "runs": beside,
        }
        out["ttft_ratio_median"] = round(statistics.median(beside) / statistics.median(base), 3)
        out["abuser_requests_during"] = {k: sum(s["kind"] == k for s in sent) for k in ABUSES}
        out["abuser_statuses"] = sorted({s["status"][0] for s in sent})
        out["workers_dropped"] = len(drops.dropped)
    log(
        f"c: TTFT median {out['baseline_ttft_ms']['median']:.0f} -> {out['beside_abuser_ttft_ms']['median']:.0f}"
        f" ms (x{out['ttft_ratio_median']}) beside {out['abuser_requests_during']}"
    )
    return out


# ---- d: port collision, kill -9 of the only decode worker ---------------------------------------
def part_d(args) -> dict:
    """A second `pdserve up` on the router's port (time to exit, its message; the first still
    serves), then kill -9 of the only decode worker under 8 looping clients: the errors clients
    see, the time to a replacement and to the first served request, tokens against before."""
    import ray
    import yaml

    from pdserve.deploy.launcher import RestartPolicy

    out = {}
    port = free_port()
    data = example_config(port)
    probe_prompts = random_prompts(9000, 4, 48)
    with deployment(data, restart=RestartPolicy(poll_s=0.5, backoff_s=0.5)) as (cluster, drops):
        address = cluster.router_address
        before = Child(run_streams, address, jobs_for(probe_prompts, 16), 4).result()
        # a second `pdserve up` of the same YAML: same port
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump({**data, "ray": {"num_cpus": 2}}, f)
        t0 = time.perf_counter()
        second = subprocess.run(
            [sys.executable, "-m", "pdserve", "up", f.name],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.unlink(f.name)
        out["second_up"] = {
            "exit_code": second.returncode,
            "took_s": round(time.perf_counter() - t0, 2),
            "stderr_tail": second.stderr.strip().splitlines()[-3:],
        }
        after = Child(run_streams, address, jobs_for(probe_prompts, 16), 4).result()
        out["first_still_serves"] = all(not r["error"] for r in after) and [
            r["tokens"] for r in after
        ] == [r["tokens"] for r in before]
        log(
            f"d: second up exit {second.returncode} in {out['second_up']['took_s']} s; first serves: "
            f"{out['first_still_serves']}"
        )

        # kill -9 the only decode worker while 8 clients loop
        stop = Child.ctx.Event()
        load = Child(
            loop_streams, address, jobs_for(random_prompts(9100, 32, 48), 32), 8, stop=stop
        )
        time.sleep(5.0)
        decode = next(r for r in cluster.replicas if r.role == "decode")
        old_actor = decode.actor
        pid = ray.get(old_actor.pid.remote(), timeout=30)
        t_kill_wall = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        replaced = wait_replaced(cluster, decode, old_actor, "decode", 1)
        time.sleep(8.0)
        rows = load.result()
        after_kill = [r for r in rows if r["t"] + r["took_s"] > t_kill_wall]
        first_ok = min(
            (
                r["t"] + r["took_s"] - t_kill_wall
                for r in after_kill
                if not r["error"] and r["t"] > t_kill_wall
            ),
            default=None,
        )
        errors = {}  # the distinct messages per code, request ids blanked
        for r in after_kill:
            if r["error"]:
                message = re.sub(r"'[0-9a-f]{32}'", "'<id>'", r["error"][1][:300])
                errors.setdefault(r["error"][0], {}).setdefault(message, 0)
                errors[r["error"][0]][message] += 1
        out["kill_decode"] = {
            "replacement_registered_after_s": round(replaced, 2) if replaced else None,
            "first_request_served_after_s": round(first_ok, 2) if first_ok is not None else None,
            "first_served_request_sent_after_s": min(
                (
                    round(r["t"] - t_kill_wall, 2)
                    for r in after_kill
                    if not r["error"] and r["t"] > t_kill_wall
                ),
                default=None,
            ),
            "requests_after_kill": len(after_kill),
            "errors_by_code": {
                k: sum(r["error"] is not None and r["error"][0] == k for r in after_kill)
                for k in errors
            },
            "error_messages": errors,
        }
        again = Child(run_streams, address, jobs_for(probe_prompts, 16), 4).result()
        out["kill_decode"]["tokens_after_replacement_match_before"] = [
            r["tokens"] for r in again
        ] == [r["tokens"] for r in before]
        free, _, state = wait_kv_free(cluster)
        out["kill_decode"]["kv_all_free"] = free
    log(f"d: kill -9 decode: {out['kill_decode']}")
    return out


# ---- e: kill -9 with a survivor: streams token-identical ----------------------------------------
def part_e(args) -> dict:
    """Two prefill and two decode workers: 64 streams clean, then again with kill -9 of one decode
    worker mid-decode, then of one prefill worker mid-prefill: are the streams token-identical?"""
    import ray

    from pdserve.deploy.launcher import RestartPolicy

    out = {}
    prompts = random_prompts(9500, 64, 64)
    config = example_config(prefill=2, decode=2, prefix_caching=False)
    with deployment(config, restart=RestartPolicy(poll_s=0.5)) as (cluster, _):
        address = cluster.router_address
        clean = Child(run_streams, address, jobs_for(prompts, args.max_tokens), 32).result()
        want = [r["tokens"] for r in sorted(clean, key=lambda r: r["i"])]
        for role, busy in (("decode", 4), ("prefill", 1)):  # sequences running there at the kill
            victim = next(r for r in cluster.replicas if r.role == role and r.address)
            old_actor = victim.actor
            pid = ray.get(old_actor.pid.remote(), timeout=30)
            run = Child(run_streams, address, jobs_for(prompts, args.max_tokens), 32)
            t0 = time.perf_counter()
            state = {}
            while time.perf_counter() - t0 < 60:  # kill while it works
                state = kv_state(cluster).get(victim.name, {})
                if state.get("running", 0) >= busy:
                    break
                time.sleep(0.02)
            inflight = len(cluster.router.servicer._inflight)
            os.kill(pid, signal.SIGKILL)
            replaced = {}  # timed from the kill, while the streams still run
            watcher = threading.Thread(
                target=lambda: replaced.update(
                    s=wait_replaced(cluster, victim, old_actor, role, 2)
                ),
                daemon=True,
            )
            watcher.start()
            rows = sorted(run.result(), key=lambda r: r["i"])
            got = [r["tokens"] for r in rows]
            out[f"kill_{role}"] = {
                "killed": victim.name,
                "killed_after_s": round(time.perf_counter() - t0, 2),
                "victim_at_kill": state,
                "streams_in_flight_at_kill": inflight,
                "streams": len(rows),
                "errors": [r["error"] for r in rows if r["error"]][:5],
                "identical": sum(a == b for a, b in zip(got, want)),
            }
            log(
                f"e: kill -9 {victim.name}: {out[f'kill_{role}']['identical']}/{len(rows)} identical"
            )
            watcher.join(180)  # the supervisor brings it back before the next kill
            if "s" not in replaced:
                raise RuntimeError(f"{victim.name} was not replaced within 180 s")
            out[f"kill_{role}"]["replaced_after_kill_s"] = round(replaced["s"], 1)
        free, _, _ = wait_kv_free(cluster)
        out["kv_all_free"] = free
    return out


PARTS = {
    "a": part_a,
    "c": part_c,
    "d": part_d,
    "e": part_e,
    "h": chaos_hangs.part_h,
    "s": chaos_shm.part_s,
}


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--parts", default="a,c,d,e,h,s")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ttft-requests", type=int, default=20)
    chaos_hangs.add_args(p)
    chaos_shm.add_args(p)
    add_out_arg(p, "chaos.json")
    args = p.parse_args(argv)
    report = cluster_report("benchmarks.robustness.chaos", argv)
    if os.path.exists(args.out):  # parts not run this time keep their last figures
        with open(args.out) as f:
            old = json.load(f)
        report["parts"] = old.get("parts", {})
    report.setdefault("parts", {})
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        result = PARTS[name](args)
        result["run"] = {
            "date": report["date"],
            "commit": report["commit"],
            "cpu_model": report["cpu_model"],
            "took_s": round(time.perf_counter() - t0, 1),
        }
        report["parts"][name] = result
        write_result(args.out, report)  # after each part: a later part's failure keeps it
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
