"""Priority scheduling under overload through `pdserve up` (issue 52, must-show c): requests of
priority 0 and of priority 10 sent at the same time, more than the deployment serves at once;
the TTFT P90 of each class, goal: priority 0's at least 3x lower.

    python -m benchmarks.cluster.priority                 # the full size (about 4 min of load)
    python -m benchmarks.cluster.priority --quick         # short: about 1 min of load
    python -m benchmarks.cluster.priority --with-fcfs     # the same load under fcfs as well

`pdserve up deploy/examples/local-cpu.yaml --scheduling-policy priority` (the embedded SmolLM2,
1P+1D, a child process; the router on a free port, gRPC only) with router.max_inflight set to
MAX_INFLIGHT, so at most that many requests run at once and the rest wait in the router's
admission queue (max_queue_wait_s raised so none times out). The run:

1. calibration: CALIBRATION requests at a concurrency of MAX_INFLIGHT, all priority 0: the
   deployment's capacity in requests per second (completed / wall time);
2. the load, open loop: pairs of requests (one priority 0, one priority 10, the same prompt
   length and max_tokens, sent at the same instant, the pair's order alternating) at a pair rate
   that makes the whole load LOAD x the capacity, so priority 0 alone is LOAD/2 of it, for
   `duration_s`; every request is greedy with ignore_eos, so each does the same work;
3. each request's TTFT (send to the first TokenDelta, on the client) and end, per class: P50,
   P90, the mean and the count; the goal is met when P90(priority 10) >= 3 x P90(priority 0).

Under overload the backlog grows by (LOAD - 1) x capacity per second; FCFS would spread the wait
over both classes, priority gives it to priority 10 alone while priority 0's own load fits the
capacity. With --with-fcfs the same load runs under `--scheduling-policy fcfs` (every priority 0,
the classes only labels) for comparison. The machine is shared: the result records the CPU other
processes used during the load. Writes benchmarks/results/priority.json.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from benchmarks import bench_common as bc
from benchmarks.chaos_harness import example_config, pct, up_child

MAX_INFLIGHT = 4  # requests the router runs at once (router.max_inflight)
LOAD = 1.6  # the offered load over the measured capacity
PROMPT_LEN = 64
MAX_TOKENS = 24
CALIBRATION = 12
SIZES = {"full": dict(duration_s=240.0), "quick": dict(duration_s=60.0)}
CLASSES = (0, 10)


def one_request(
    stub, pb, prompt: list[int], label: int, t_start: float, priority: int | None = None
) -> dict:
    """One streamed Generate of class `label`, sent at `priority` (None: the label): its send
    time, TTFT and end (s since t_start), or its error."""
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        priority=label if priority is None else priority,
    )
    sent = time.perf_counter()
    row: dict = {"priority": label, "sent_s": round(sent - t_start, 4)}
    try:
        first = None
        for r in stub.Generate(req, timeout=1800):
            if first is None and r.HasField("delta") and r.delta.token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        row.update(ttft_s=round(first - sent, 4), e2e_s=round(end - sent, 4))
    except Exception as e:  # a failed request is recorded, never retried
        details = e.details() if hasattr(e, "details") else str(e)
        row["error"] = f"{type(e).__name__}: {details}"[:300]
    return row


def calibrate(stub, pb, prompts) -> dict:
    """CALIBRATION requests, MAX_INFLIGHT at a time: the capacity in requests per second."""
    t0 = time.perf_counter()
    rows, wall = bc.closed_loop(prompts, MAX_INFLIGHT, lambda p: one_request(stub, pb, p, 0, t0))
    ok = [r for r in rows if "error" not in r]
    return dict(
        requests=len(rows),
        failed=len(rows) - len(ok),
        wall_s=round(wall, 2),
        capacity_rps=round(len(ok) / wall, 3),
        ttft_p50_s=pct([r["ttft_s"] for r in ok], 50) if ok else None,
        e2e_p50_s=pct([r["e2e_s"] for r in ok], 50) if ok else None,
    )


def run_load(stub, pb, capacity_rps: float, duration_s: float, seed: int, policy: str) -> dict:
    """The open-loop load (module docstring, step 2) and its per-class figures; under fcfs every
    request is sent at priority 0 (the classes are labels)."""
    pair_interval = 2.0 / (LOAD * capacity_rps)  # two requests per pair
    n_pairs = max(1, int(duration_s / pair_interval))
    prompts = bc.random_prompts(seed, 2 * n_pairs, PROMPT_LEN)
    rows: list[dict] = []
    lock = threading.Lock()
    threads = []
    mon = bc.CpuMonitor()
    t0 = time.perf_counter()

    def send(prompt, priority):
        sent_at = priority if policy == "priority" else 0
        row = one_request(stub, pb, prompt, priority, t0, sent_at)
        with lock:
            rows.append(row)

    for k in range(n_pairs):
        wait = t0 + k * pair_interval - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        order = CLASSES if k % 2 == 0 else CLASSES[::-1]
        for j, priority in enumerate(order):
            t = threading.Thread(target=send, args=(prompts[2 * k + j], priority), daemon=True)
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    cpu = mon.stop()
    out: dict = dict(
        pair_interval_s=round(pair_interval, 4),
        pairs=n_pairs,
        offered_rps=round(2 / pair_interval, 3),
        wall_s=round(time.perf_counter() - t0, 1),
        cpu=cpu,
        classes={},
    )
    for priority in CLASSES:
        mine = [r for r in rows if r["priority"] == priority]
        ok = [r for r in mine if "error" not in r]
        ttft = [r["ttft_s"] for r in ok]
        out["classes"][str(priority)] = dict(
            requests=len(mine),
            failed=len(mine) - len(ok),
            errors=sorted({r["error"] for r in mine if "error" in r})[:3],
            ttft_p50_s=pct(ttft, 50) if ttft else None,
            ttft_p90_s=pct(ttft, 90) if ttft else None,
            ttft_mean_s=round(sum(ttft) / len(ttft), 4) if ttft else None,
            e2e_p90_s=pct([r["e2e_s"] for r in ok], 90) if ok else None,
        )
    p0, p10 = (out["classes"][str(c)]["ttft_p90_s"] for c in CLASSES)
    out["p90_ratio_10_over_0"] = round(p10 / p0, 2) if p0 and p10 else None
    out["requests"] = sorted(rows, key=lambda r: r["sent_s"])
    return out


def run_deployment(policy: str, duration_s: float) -> dict:
    """`pdserve up` under `policy`, calibrated, then the load."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    config = example_config(0, 1, 1)
    config["router"]["http_port"] = None  # gRPC only: no fixed HTTP port on a shared machine
    config["router"]["max_inflight"] = MAX_INFLIGHT
    config["router"]["max_queue_wait_s"] = 3600.0  # the backlog waits; none is refused
    out: dict = {"policy": policy}
    t0 = time.perf_counter()
    with up_child(config, policy, out, ("--scheduling-policy", policy)) as (address, _):
        out["up_s"] = round(time.perf_counter() - t0, 1)
        bc.log(f"{policy}: `pdserve up` ready on {address} after {out['up_s']} s")
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            one_request(stub, pb, bc.random_prompts(999, 1, PROMPT_LEN)[0], 0, t0)  # warm-up
            out["calibration"] = calibrate(stub, pb, bc.random_prompts(7, CALIBRATION, PROMPT_LEN))
            bc.log(f"{policy}: calibration {out['calibration']}")
            capacity = out["calibration"]["capacity_rps"]
            out["load"] = run_load(stub, pb, capacity, duration_s, 11, policy)
        summary = {k: v for k, v in out["load"].items() if k != "requests"}
        bc.log(f"{policy}: load {summary}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = bc.script_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="about 1 min of load instead of 4")
    p.add_argument("--with-fcfs", action="store_true", help="the same load under fcfs too")
    bc.add_out_arg(p, "priority.json")
    args = p.parse_args(argv)
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    size = SIZES["quick" if args.quick else "full"]

    def run() -> dict:
        report: dict = dict(
            size="quick" if args.quick else "full",
            max_inflight=MAX_INFLIGHT,
            load=LOAD,
            prompt_len=PROMPT_LEN,
            max_tokens=MAX_TOKENS,
            duration_s=size["duration_s"],
            runs={},
        )
        for policy in ("priority", "fcfs") if args.with_fcfs else ("priority",):
            report["runs"][policy] = run_deployment(policy, size["duration_s"])
        load = report["runs"]["priority"]["load"]
        ratio = load["p90_ratio_10_over_0"]
        failed = sum(c["failed"] for c in load["classes"].values())
        report["goal"] = dict(
            p90_ratio_10_over_0=ratio, met=ratio is not None and ratio >= 3.0, failed=failed
        )
        return report

    return bc.run_and_write("benchmarks.cluster.priority", argv, args.out, run)


if __name__ == "__main__":
    sys.exit(main())
