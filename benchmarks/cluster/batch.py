"""A batch job beside interactive traffic through `pdserve up`: the interactive requests' TTFT
alone, beside a Batch API batch (router/openai/batches_api.py), and beside the same requests sent
the way a client does without the Batch API (all at once, as ordinary requests); and the batch's
requests completed meanwhile.

    python -m benchmarks.cluster.batch            # 90 s of load in each of the three phases
    python -m benchmarks.cluster.batch --quick    # 30 s each
    python -m benchmarks.cluster.batch --phases alone,batch_api   # some of the phases

`pdserve up deploy/examples/local-cpu.yaml` (the embedded SmolLM2, 1P+1D, a child process; the
router's gRPC port and HTTP front on free ports) with router.max_inflight = MAX_INFLIGHT and
router.batch_max_inflight = BATCH_INFLIGHT, max_queue_wait_s raised so that nothing times out.
Every request is a completion of PROMPT_LEN random token ids, greedy, MAX_TOKENS tokens with
ignore_eos, so each does the same work. The run:

1. calibration: CALIBRATION requests MAX_INFLIGHT at a time: the capacity in requests per second;
2. `alone`: interactive requests (gRPC, streamed) sent open-loop at INTERACTIVE_LOAD x the
   capacity for the phase's length: their TTFT (send to first token, on the client);
3. `batch_api`: the same interactive load while a batch of such completions runs
   (uploaded and created just before the phase; cancelled at its end, its count then read);
4. `all_at_once`: the same interactive load while the same batch's completions are sent as
   ordinary requests at the phase's start (cancelled at its end).

The batch has as many requests as the calibrated capacity finishes in a phase: the Batch API,
at BATCH_INFLIGHT of the MAX_INFLIGHT slots, is busy throughout the phase, and sent all at once
they are a phase's worth of work queued ahead of the interactive requests that follow.
Each phase records its interactive TTFT P50 and P90 and failures, and the batch requests completed
in it (per second). The machine is shared: each phase records the CPU other processes used.
Writes benchmarks/results/batch.json.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
import urllib.request
import uuid

from benchmarks import bench_common as bc
from benchmarks.chaos_harness import example_config, pct, up_child

MAX_INFLIGHT = 8  # requests the router runs at once (router.max_inflight)
BATCH_INFLIGHT = 2  # of which a batch's at most (router.batch_max_inflight)
INTERACTIVE_LOAD = 0.4  # the interactive requests' rate over the measured capacity
PROMPT_LEN = 64
MAX_TOKENS = 24
CALIBRATION = 16
SIZES = {"full": dict(phase_s=90.0), "quick": dict(phase_s=30.0)}
PHASES = ("alone", "batch_api", "all_at_once")


def completion(stub, pb, prompt: list[int], t_start: float, cancel=None, metadata=()) -> dict:
    """One streamed Generate (with the gRPC `metadata`): its send time, TTFT and end (s since
    t_start), or its error; it is cancelled once `cancel` (a threading.Event) is set."""
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    sent = time.perf_counter()
    row: dict = {"sent_s": round(sent - t_start, 4)}
    try:
        first = None
        call = stub.Generate(req, timeout=3600, metadata=metadata)
        if cancel is not None:
            watch = threading.Thread(target=lambda: cancel.wait() and call.cancel(), daemon=True)
            watch.start()
        for r in call:
            if first is None and r.HasField("delta") and r.delta.token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        row.update(ttft_s=round(first - sent, 4), e2e_s=round(end - sent, 4))
    except Exception as e:  # a failed or cancelled request is recorded, never retried
        details = e.details() if hasattr(e, "details") else str(e)
        row["error"] = f"{type(e).__name__}: {details}"[:300]
    return row


def calibrate(stub, pb, inflight: int = MAX_INFLIGHT, metadata=()) -> dict:
    """CALIBRATION requests, `inflight` at a time: the capacity in requests per second."""
    prompts = bc.random_prompts(7, max(CALIBRATION, 2 * inflight), PROMPT_LEN)
    t0 = time.perf_counter()
    rows, wall = bc.closed_loop(
        prompts, inflight, lambda p: completion(stub, pb, p, t0, metadata=metadata)
    )
    ok = [r for r in rows if "error" not in r]
    return dict(
        requests=len(rows),
        failed=len(rows) - len(ok),
        wall_s=round(wall, 2),
        capacity_rps=round(len(ok) / wall, 3),
        ttft_p50_s=pct([r["ttft_s"] for r in ok], 50) if ok else None,
    )


def interactive(stub, pb, rate_rps: float, phase_s: float, seed: int, metadata=()) -> list[dict]:
    """Open-loop interactive requests at `rate_rps` for `phase_s` (with the gRPC `metadata`);
    their rows once all ended."""
    n = max(1, int(phase_s * rate_rps))
    prompts = bc.random_prompts(seed, n, PROMPT_LEN)
    rows, lock, threads = [], threading.Lock(), []
    t0 = time.perf_counter()

    def send(prompt):
        row = completion(stub, pb, prompt, t0, metadata=metadata)
        with lock:
            rows.append(row)

    for k, prompt in enumerate(prompts):
        wait = t0 + k / rate_rps - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        t = threading.Thread(target=send, args=(prompt,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return rows


def summary(rows: list[dict]) -> dict:
    """Requests' count, failures (the first three errors) and TTFT P50 / P90 and E2E P50."""
    ok = [r for r in rows if "error" not in r]
    ttft = [r["ttft_s"] for r in ok]
    return dict(
        requests=len(rows),
        failed=len(rows) - len(ok),
        errors=sorted({r["error"] for r in rows if "error" in r})[:3],
        ttft_p50_s=pct(ttft, 50) if ttft else None,
        ttft_p90_s=pct(ttft, 90) if ttft else None,
        e2e_p50_s=pct([r["e2e_s"] for r in ok], 50) if ok else None,
    )


def http(base: str, method: str, path: str, body=None, headers=None) -> dict:
    req = urllib.request.Request(base + path, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def upload_batch(base: str, prompts: list[list[int]]) -> str:
    """The batch's input file (a completion of each prompt), uploaded; its id."""
    lines = io.BytesIO()
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
        lines.write(json.dumps(line).encode() + b"\n")
    boundary = uuid.uuid4().hex
    form = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + lines.getvalue()
        + f"\r\n--{boundary}--\r\n".encode()
    )
    kind = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    return http(base, "POST", "/files", form, kind)["id"]


def phase(stub, pb, base: str, kind: str, rate_rps: float, phase_s: float, n: int) -> dict:
    """One phase (module docstring, steps 2-4), the batch `n` requests: the interactive rows'
    figures, and the batch requests completed during it."""
    prompts = bc.random_prompts(23, n, PROMPT_LEN)
    background: dict = {}
    cancel = threading.Event()
    threads = []
    if kind == "batch_api":
        file_id = upload_batch(base, prompts)
        body = json.dumps({"input_file_id": file_id, "endpoint": "/v1/completions",
                           "completion_window": "24h"}).encode()  # fmt: skip
        batch = http(base, "POST", "/batches", body, {"Content-Type": "application/json"})
    elif kind == "all_at_once":
        rows, lock = [], threading.Lock()
        t_bg = time.perf_counter()

        def send(prompt):
            row = completion(stub, pb, prompt, t_bg, cancel)
            with lock:
                rows.append(row)

        for prompt in prompts:
            t = threading.Thread(target=send, args=(prompt,), daemon=True)
            t.start()
            threads.append(t)
    mon = bc.CpuMonitor()
    t0 = time.perf_counter()
    rows_i = interactive(stub, pb, rate_rps, phase_s, seed=11)
    wall = time.perf_counter() - t0
    cpu = mon.stop()
    if kind == "batch_api":
        done = http(base, "POST", f"/batches/{batch['id']}/cancel", b"")
        while done["status"] not in ("cancelled", "completed"):
            time.sleep(0.2)
            done = http(base, "GET", f"/batches/{batch['id']}")
        background = dict(completed=done["request_counts"]["completed"])
    elif kind == "all_at_once":
        with lock:
            background = dict(completed=sum("error" not in r for r in rows))
        cancel.set()
        for t in threads:
            t.join(60)
    out = dict(interactive=summary(rows_i), wall_s=round(wall, 1), cpu=cpu)
    if background:
        background["per_s"] = round(background["completed"] / wall, 3)
        out["batch_requests"] = background
    return out


def main(argv: list[str] | None = None) -> int:
    p = bc.script_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="30 s of load a phase instead of 90")
    p.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="the phases to run, in order (default: %(default)s)",
    )
    bc.add_out_arg(p, "batch.json")
    args = p.parse_args(argv)
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    size = SIZES["quick" if args.quick else "full"]
    phases = args.phases.split(",")
    if not set(phases) <= set(PHASES):
        p.error(f"--phases: each of {', '.join(PHASES)}")

    def run() -> dict:
        import grpc

        from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

        report: dict = dict(
            size="quick" if args.quick else "full",
            max_inflight=MAX_INFLIGHT,
            batch_max_inflight=BATCH_INFLIGHT,
            interactive_load=INTERACTIVE_LOAD,
            prompt_len=PROMPT_LEN,
            max_tokens=MAX_TOKENS,
            phase_s=size["phase_s"],
        )
        config = example_config(0, 1, 1)
        config["router"].update(
            http_port=0,
            max_inflight=MAX_INFLIGHT,
            batch_max_inflight=BATCH_INFLIGHT,
            max_queued=4096,
            max_queue_wait_s=3600.0,
        )
        with up_child(config, "batch", report) as (address, base):
            bc.log(f"`pdserve up` ready: gRPC {address}, HTTP {base}")
            with grpc.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                completion(stub, pb, bc.random_prompts(999, 1, PROMPT_LEN)[0], 0.0)
                report["calibration"] = calibrate(stub, pb)
                bc.log(f"calibration {report['calibration']}")
                rate = INTERACTIVE_LOAD * report["calibration"]["capacity_rps"]
                report["interactive_rps"] = round(rate, 3)
                n = int(report["calibration"]["capacity_rps"] * size["phase_s"]) + 1
                report["batch_requests"] = n
                report["phases"] = {}
                for kind in phases:
                    report["phases"][kind] = phase(stub, pb, base, kind, rate, size["phase_s"], n)
                    bc.log(f"{kind}: {report['phases'][kind]}")
        return report

    return bc.run_and_write("benchmarks.cluster.batch", argv, args.out, run)


if __name__ == "__main__":
    sys.exit(main())
