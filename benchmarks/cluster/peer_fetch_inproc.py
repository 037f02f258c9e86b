"""The reuse paths of a conversation's turn, compared in one process (issue 49 item 4): a router,
one prefill and one decode worker of the embedded SmolLM2 over 127.0.0.1, no Ray (for a machine
whose memory cannot hold a `pdserve up`; `python -m benchmarks.cluster.multiturn --peer-fetch` is
the same comparison through `pdserve up`).

    python -m benchmarks.cluster.peer_fetch_inproc           # ~5 min on 2 idle cores
    python -m benchmarks.cluster.peer_fetch_inproc --quick   # smoke run

The same closed-loop sessions (benchmarks/cluster/multiturn.py's PEER_SHAPES, or smaller with
--quick) run under each router setting of PEER_RUNS in turn, on the same workers, whose prefix
caches are reset between settings (so each setting starts cold, and the same seeds give the same
prompts): local prefill alone (the router before peer fetch), the defaults, peer fetch alone,
recompute alone. Per setting and shape: TTFT P50/P90 per turn, ITL P90, hit share, the router's
counters (paths, hits by source, fetch seconds) and whether the greedy answers equal the first
setting's. The three processes' threads share the machine's cores here (in a deployment each
worker has its own). Writes benchmarks/results/peer_fetch_inproc.json.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from benchmarks import bench_common as bc
from benchmarks.cluster.multiturn import PEER_COUNTERS, PEER_RUNS, PEER_SHAPES, run_shape, strip

QUICK_SHAPES = {
    "a_sequential": dict(sessions=1, turns=3, message=32, answer=16, doc=256, shared=False,
                         concurrency=1, seed=101),
    "b_concurrent": dict(sessions=3, turns=2, message=32, answer=16, doc=128, shared=False,
                         concurrency=None, seed=102),
}  # fmt: skip
ENGINE = dict(block_size=16, max_model_len=4096, kv_cache_memory=256 << 20)


def counters(registry) -> dict:
    out: dict = {}
    for fam in registry.collect():
        for sample in fam.samples:
            label = PEER_COUNTERS.get(sample.name, False)
            if label is False:
                continue
            key = sample.name + (f"{{{sample.labels.get(label)}}}" if label else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def settle(workers, timeout_s: float = 60.0) -> None:
    """Until every worker is idle, then their prefix caches reset (each setting starts cold)."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        bm = w.loop.engine.block_manager
        while not w.loop.call(bm.reset_prefix_cache):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{w.config.worker_id} is not idle after {timeout_s} s")
            time.sleep(0.2)


def apply(router, setting: dict) -> None:
    """One of PEER_RUNS' router settings, on the running router."""
    from pdserve.planner.local_prefill import LocalPrefill
    from pdserve.router.peer_fetch import PeerFetch, PeerFetchCost

    legs = router.servicer.legs
    legs.local_prefill = dataclasses.replace(LocalPrefill(), **setting.get("local_prefill", {}))
    legs.peer_fetch = PeerFetchCost(PeerFetch(**setting.get("peer_fetch", {})))


def main(argv: list[str] | None = None) -> int:
    p = bc.script_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: small shapes")
    bc.add_out_arg(p, "peer_fetch_inproc.json")
    args = p.parse_args(argv)
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
    from pdserve.engine.loader import resolve_model
    from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
    from pdserve.router.server import Router, RouterConfig
    from pdserve.tuning import loadgen, metrics

    shapes = QUICK_SHAPES if args.quick else PEER_SHAPES
    model = str(resolve_model("smollm2"))
    t0 = time.perf_counter()
    decode = DecodeWorker(
        DecodeWorkerConfig(model=model, worker_id="decode-0", engine_kwargs=dict(ENGINE))
    ).start()
    prefill = PrefillWorker(
        PrefillWorkerConfig(model=model, worker_id="prefill-0", engine_kwargs=dict(ENGINE))
    ).start()
    router = Router(
        RouterConfig(
            model=model,
            prefill_addresses=(prefill.address,),
            decode_addresses=(decode.address,),
            max_model_len=ENGINE["max_model_len"],
        )
    ).start()
    report: dict = {
        **bc.run_header("benchmarks.cluster.peer_fetch_inproc", argv),
        "quick": args.quick,
        "shapes": shapes,
        "engine": ENGINE,
        "runs": PEER_RUNS,
    }
    runs = {}
    try:
        card = loadgen.model_card(router.address)
        for name, setting in PEER_RUNS.items():
            apply(router, setting)
            out: dict = {}
            for shape_name, shape in shapes.items():
                settle([prefill, decode])
                before = counters(router.metrics_registry)
                bc.log(f"{name}: shape {shape_name}")
                out[shape_name] = run_shape(router.address, shape, card)
                after = counters(router.metrics_registry)
                out[shape_name]["router"] = {
                    k: round(v - before.get(k, 0.0), 4) for k, v in sorted(after.items())
                }
                bc.log(f"  {name} {shape_name}: {out[shape_name]['router']}")
            runs[name] = out
            report[name] = strip(out)
            bc.write_timed(args.out, report, t0)
        first = next(iter(runs))
        report["compare"] = {}
        for name in runs:
            for shape_name in shapes:
                a, b = runs[name][shape_name], runs[first][shape_name]
                c = dict(
                    **metrics.compare_runs(a, b),
                    answers=metrics.same_answers(a["_records"], b["_records"]),
                )
                report["compare"][f"{name} / {first} {shape_name}"] = c
                bc.log(
                    f"{name} / {first} {shape_name}: TTFT p50 per turn "
                    f"{[None if t['ttft_p50_ratio'] is None else round(t['ttft_p50_ratio'], 3) for t in c['turns']]}, "
                    f"ITL p90 {c['overall']['itl_p90_ratio']}, answers identical "
                    f"{c['answers']['identical']}/{c['answers']['compared']}"
                )
        bc.write_timed(args.out, report, t0)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
    bc.log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
