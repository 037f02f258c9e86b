"""Tracing's cost on serving (issue #51, must-show b): `pdserve up` (the README's example, 1P+1D,
SmolLM2) with OpenTelemetry tracing off and on, 16 concurrent greedy streams, output throughput.

  python -m benchmarks.cluster.tracing_overhead --wait-idle 60     # ~6 min on 2 cores
  python -m benchmarks.cluster.tracing_overhead --rounds 1 --requests 32

Each round starts one deployment with tracing off and one with it on (`--otlp-traces-endpoint`
pointing at an OTLP/gRPC collector this script runs, which counts what it receives), warms each
with one request, then sends --requests requests of 256 random prompt tokens and 64 new tokens,
16 at a time (all queued at once; the router admits 16 at a time), and takes output tokens per
second from the first send to the last token. The ratio on/off is judged against the issue's goal
(>= 0.97); with more than one round the rounds alternate off/on and each mode's median is
reported with its spread. Writes benchmarks/results/tracing_overhead.json.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent import futures

from benchmarks import bench_common as bc
from benchmarks.chaos_harness import (
    START_TIMEOUT_S,
    example_config,
    fail_up,
    router_address,
    start_up,
    stop_up,
)

CONCURRENCY, PROMPT, NEW = 16, 256, 64


class Collector:
    """An OTLP/gRPC trace endpoint that counts spans (by service)."""

    def __init__(self):
        import grpc
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        self.counts: dict[str, int] = {}
        lock = threading.Lock()

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(inner, request, context):  # noqa: N805 - grpc's signature
                with lock:
                    for rs in request.resource_spans:
                        name = next(
                            (a.value.string_value for a in rs.resource.attributes
                             if a.key == "service.name"), "?",
                        )  # fmt: skip
                        n = sum(len(ss.spans) for ss in rs.scope_spans)
                        self.counts[name] = self.counts.get(name, 0) + n
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self):
        self.server.stop(0)


def run_once(traced: bool, endpoint: str, requests: int) -> dict:
    import grpc
    import yaml

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    work = tempfile.mkdtemp(prefix="tracing-")
    config = example_config(0, 1, 1)
    config["router"]["http_port"] = None
    config["router"]["max_inflight"] = CONCURRENCY
    if traced:
        config["observability"] = {"otlp_traces_endpoint": endpoint}
    path = os.path.join(work, "deploy.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    label = f"tracing {'on' if traced else 'off'}"
    up, err_path = start_up([sys.executable, "-m", "pdserve", "up", path], work)
    try:
        address = router_address(up, START_TIMEOUT_S)
        prompts = bc.random_prompts(4242, requests + 1, PROMPT)
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)

            def one(ids):
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling)
                n = 0
                for resp in stub.Generate(req, timeout=600):
                    if resp.HasField("delta"):
                        n += len(resp.delta.token_ids)
                return n

            one(prompts[-1])  # warm-up
            t0 = time.perf_counter()
            with futures.ThreadPoolExecutor(CONCURRENCY) as pool:
                tokens = sum(pool.map(one, prompts[:requests]))
            seconds = time.perf_counter() - t0
        out = dict(traced=traced, tokens=tokens, seconds=round(seconds, 2),
                   output_tok_s=round(tokens / seconds, 1))  # fmt: skip
        bc.log(f"{label}: {out}")
        return out
    except BaseException:
        fail_up(up, err_path, label)
        raise
    finally:
        stop_up(up)
        shutil.rmtree(config["ray"]["temp_dir"], ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    ap = bc.script_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    bc.add_out_arg(ap, "tracing_overhead.json")
    bc.add_wait_idle_arg(ap, "each deployment")
    args = ap.parse_args(argv)

    def run() -> dict:
        collector = Collector()
        endpoint = f"http://127.0.0.1:{collector.port}"
        runs = []
        try:
            for _ in range(args.rounds):
                for traced in (False, True):
                    if args.wait_idle:
                        bc.wait_for_idle_machine(args.wait_idle)
                    runs.append(run_once(traced, endpoint, args.requests))
        finally:
            collector.stop()
        off = [r["output_tok_s"] for r in runs if not r["traced"]]
        on = [r["output_tok_s"] for r in runs if r["traced"]]
        ratio = statistics.median(on) / statistics.median(off)
        return dict(
            concurrency=CONCURRENCY, prompt_tokens=PROMPT, new_tokens=NEW,
            requests=args.requests, runs=runs, spans_received=collector.counts,
            off_tok_s=off, on_tok_s=on, on_over_off=round(ratio, 3),
            goal=dict(min_on_over_off=0.97, met=ratio >= 0.97),
        )  # fmt: skip

    return bc.run_and_write("benchmarks.cluster.tracing_overhead", argv, args.out, run)


if __name__ == "__main__":
    raise SystemExit(main())
