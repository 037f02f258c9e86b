"""One tenant's flood beside another tenant's interactive requests through `pdserve up`: the quiet
tenant's TTFT alone, beside a flood sent under its own API key (one tenant: the admission queue
is first come, first served, as a server without tenants is), and beside the same flood sent
under another key (two tenants: router/admission.py shares the slots between them).

    python -m benchmarks.cluster.fairness                  # 90 s phases, max_inflight 8 and 64
    python -m benchmarks.cluster.fairness --quick          # 30 s phases
    python -m benchmarks.cluster.fairness --max-inflight 8 --phases alone,flood_other_tenant

For each router.max_inflight given, `pdserve up deploy/examples/local-cpu.yaml` (the embedded
SmolLM2, 1P+1D, a child process) with two API keys, max_queued and max_queue_wait_s raised so
that nothing is refused or times out. Every request is a completion of PROMPT_LEN random token
ids, greedy, MAX_TOKENS tokens with ignore_eos (benchmarks/cluster/batch.py's), so each does the
same work. The run:

1. calibration: max(16, 2 x max_inflight) requests, max_inflight at a time: the capacity in
   requests per second;
2. `alone`: the quiet tenant's requests (gRPC, streamed, its key) sent open-loop at
   INTERACTIVE_LOAD x the capacity for the phase's length: their TTFT (send to first token);
3. `flood_same_tenant`: the same quiet requests while a phase's worth of requests (the capacity
   x the phase's length) is sent at the phase's start under the quiet tenant's own key;
4. `flood_other_tenant`: the same, the flood under the other key.

The flood's requests still waiting at a phase's end are cancelled; each phase records the quiet
requests' TTFT P50 / P90 and failures, the flood's requests completed per second (what fairness
costs the flood), and the CPU other processes used. Writes benchmarks/results/fairness.json.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from benchmarks import bench_common as bc
from benchmarks.chaos_harness import example_config, up_child
from benchmarks.cluster.batch import PROMPT_LEN, calibrate, completion, interactive, summary

INTERACTIVE_LOAD = 0.4  # the quiet tenant's rate over the measured capacity
SIZES = {"full": dict(phase_s=90.0), "quick": dict(phase_s=30.0)}
PHASES = ("alone", "flood_same_tenant", "flood_other_tenant")
QUIET_KEY, FLOOD_KEY = "sk-bench-quiet-tenant", "sk-bench-flood-tenant"


def metadata(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def phase(stub, pb, kind: str, rate_rps: float, phase_s: float, n: int) -> dict:
    """One phase (module docstring, steps 2-4), the flood `n` requests."""
    cancel, threads, rows, lock = threading.Event(), [], [], threading.Lock()
    if kind != "alone":
        key = QUIET_KEY if kind == "flood_same_tenant" else FLOOD_KEY
        t_flood = time.perf_counter()

        def send(prompt):
            row = completion(stub, pb, prompt, t_flood, cancel, metadata(key))
            with lock:
                rows.append(row)

        for prompt in bc.random_prompts(23, n, PROMPT_LEN):
            threads.append(threading.Thread(target=send, args=(prompt,), daemon=True))
            threads[-1].start()
    mon = bc.CpuMonitor()
    t0 = time.perf_counter()
    quiet = interactive(stub, pb, rate_rps, phase_s, seed=11, metadata=metadata(QUIET_KEY))
    wall = time.perf_counter() - t0
    cpu = mon.stop()
    out = dict(quiet=summary(quiet), wall_s=round(wall, 1), cpu=cpu)
    if threads:
        with lock:
            completed = sum("error" not in r for r in rows)
        cancel.set()
        for t in threads:
            t.join(60)
        out["flood_requests"] = dict(completed=completed, per_s=round(completed / wall, 3))
    return out


def deployment(max_inflight: int, phases: list[str], phase_s: float) -> dict:
    """One `pdserve up` at `max_inflight`: its calibration and phases."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    report: dict = dict(max_inflight=max_inflight)
    config = example_config(0, 1, 1)
    config["router"].update(
        max_inflight=max_inflight,
        max_queued=4096,
        max_queue_wait_s=3600.0,
        api_keys=[QUIET_KEY, FLOOD_KEY],
    )
    with up_child(config, "fairness", report) as (address, _):
        bc.log(f"`pdserve up` (max_inflight {max_inflight}) ready: gRPC {address}")
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            warm = bc.random_prompts(999, 1, PROMPT_LEN)[0]
            completion(stub, pb, warm, 0.0, metadata=metadata(QUIET_KEY))
            report["calibration"] = calibrate(stub, pb, max_inflight, metadata(QUIET_KEY))
            bc.log(f"calibration {report['calibration']}")
            rate = INTERACTIVE_LOAD * report["calibration"]["capacity_rps"]
            report["quiet_rps"] = round(rate, 3)
            n = int(report["calibration"]["capacity_rps"] * phase_s) + 1
            report["flood_requests"] = n
            report["phases"] = {}
            for kind in phases:
                report["phases"][kind] = phase(stub, pb, kind, rate, phase_s, n)
                bc.log(f"{kind}: {report['phases'][kind]}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = bc.script_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="30 s of load a phase instead of 90")
    p.add_argument("--phases", default=",".join(PHASES), help="in order (default: %(default)s)")
    p.add_argument(
        "--max-inflight",
        default="8,64",
        help="router.max_inflight of each deployment, in order (default: %(default)s)",
    )
    bc.add_out_arg(p, "fairness.json")
    args = p.parse_args(argv)
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    size = SIZES["quick" if args.quick else "full"]
    phases = args.phases.split(",")
    if not set(phases) <= set(PHASES):
        p.error(f"--phases: each of {', '.join(PHASES)}")
    try:
        inflights = [int(v) for v in args.max_inflight.split(",")]
    except ValueError:
        p.error("--max-inflight: whole numbers separated by commas")

    def run() -> dict:
        return dict(
            size="quick" if args.quick else "full",
            interactive_load=INTERACTIVE_LOAD,
            phase_s=size["phase_s"],
            deployments=[deployment(m, phases, size["phase_s"]) for m in inflights],
        )

    return bc.run_and_write("benchmarks.cluster.fairness", argv, args.out, run)


if __name__ == "__main__":
    sys.exit(main())
