"""`pdserve bench`: an open-loop load test of a running router, `vllm bench serve` style, and a
rate sweep that finds the DistServe goodput.

    pdserve bench --trace azure_conv --scale 0.1 --max-prompt 512 --num-requests 200 --slo ttft=500ms,tpot=100ms
    pdserve bench --trace azure_code --rate 2 --burstiness 0.5 --out result.json
    pdserve bench --prompt-len 256 --output-len 32 --rate 1 --num-requests 50
    pdserve bench --trace azure_conv --scale 0.1 --sweep-rates 0.5,1,2,4 --slo ttft=1s,tpot=100ms --out sweep.json

Arrivals: the trace's own times, or re-timed to --rate (gamma gaps, --burstiness 1 = Poisson;
`inf` sends everything at once). Synthetic requests without --rate are sent all at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
from dataclasses import dataclass, replace

from pdserve.tuning import metrics, workload
from pdserve.tuning.slo import latency_slos


def add_args(p: argparse.ArgumentParser, default_router: str) -> None:
    p.add_argument(
        "--router", default=default_router, help="the router's host:port (default: %(default)s)"
    )
    p.add_argument("--model", default="", help="a served model id (default: the router's default)")
    src = p.add_argument_group("requests: a trace, or synthetic lengths")
    src.add_argument(
        "--trace",
        default=None,
        metavar="NAME|PATH",
        help=f"{', '.join(workload.TRACES)} (bundled) or a .csv/.jsonl[.gz] file",
    )
    src.add_argument(
        "--trace-start",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="replay the trace from this many seconds into it (default 0)",
    )
    src.add_argument(
        "--scale", type=float, default=1.0, help="multiply the trace's lengths (default 1)"
    )
    src.add_argument(
        "--max-prompt", type=int, default=None, help="cap prompt tokens (after --scale)"
    )
    src.add_argument(
        "--max-output", type=int, default=None, help="cap output tokens (after --scale)"
    )
    src.add_argument("--prompt-len", type=int, default=None, help="synthetic: prompt tokens")
    src.add_argument("--output-len", type=int, default=None, help="synthetic: output tokens")
    src.add_argument("--num-requests", type=int, default=100, help="default %(default)s")
    src.add_argument(
        "--seed", type=int, default=0, help="arrivals and prompt token ids (default 0)"
    )
    src.add_argument(
        "--prompt-seed",
        type=int,
        default=None,
        help="prompt token ids only (default: --seed): runs with the same arrivals and fresh "
        "prompts, so that no run finds the last one's prompts in a prefix cache",
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--rate", type=float, default=None, help="req/s (re-times a trace); inf = all at once"
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, < 1 burstier (default 1)",
    )
    load.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (default 600)"
    )
    slo = p.add_argument_group("SLOs and goodput")
    slo.add_argument("--slo", default=None, help="e.g. ttft=500ms,tpot=100ms (ms or s; also e2e=)")
    slo.add_argument(
        "--sweep-rates",
        default=None,
        metavar="R1,R2,..",
        help="run the workload at each rate; needs --slo and --out",
    )
    slo.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="DistServe goodput target share of requests meeting both SLOs (default 0.9)",
    )
    slo.add_argument(
        "--slo-scales",
        default="0.5,1,2,4",
        help="sweep: goodput with the SLOs multiplied by each (default %(default)s)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="write every request and the summary here (JSON); "
        "a sweep also writes PNG plots beside it",
    )


class BenchError(Exception):
    """Arguments that do not go together, or a router that cannot serve them."""


@dataclass
class Plan:
    requests: list[workload.RequestSpec]
    card: object  # the router's ModelCard
    slo: dict[str, float] | None
    rates: list[float] | None  # a sweep's rates; None = one run
    scales: list[float]


def run(args) -> int:
    from pdserve.tuning import loadgen  # grpc and friends: only once the arguments are parsed

    try:
        plan = _plan(args)
    except (ValueError, BenchError, loadgen.LoadgenError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    try:
        return _execute(args, plan)
    except KeyboardInterrupt:
        return 130


def _plan(args) -> Plan:
    """Every check that can fail before a request is sent: arguments, trace, router, model."""
    from pdserve.tuning import loadgen

    slo = latency_slos(args.slo) if args.slo else None
    rates = (
        metrics.parse_positive_list(args.sweep_rates, "--sweep-rates") if args.sweep_rates else None
    )
    scales = metrics.parse_positive_list(args.slo_scales, "--slo-scales")
    if rates is not None:
        if args.rate is not None:
            raise BenchError("--rate and --sweep-rates exclude each other: the sweep sets the rate")
        if slo is None or args.out is None:
            raise BenchError(
                "--sweep-rates needs --slo (goodput is about SLOs) and --out (it writes JSON and plots)"
            )
    if not 0 < args.attainment <= 1:
        raise BenchError(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.out and not pathlib.Path(args.out).resolve().parent.is_dir():
        raise BenchError(
            f"--out {args.out}: folder {pathlib.Path(args.out).resolve().parent} does not exist"
        )
    requests = _requests(args)
    card = loadgen.model_card(args.router, args.model)
    loadgen.check_fits(requests, card.max_model_len)
    return Plan(requests, card, slo, rates, scales)


def _execute(args, plan: Plan) -> int:
    from pdserve.tuning import loadgen, report

    card, requests, slo = plan.card, plan.requests, plan.slo
    config = {k: v for k, v in vars(args).items() if k != "cmd"}
    result = dict(
        config=config,
        model=dict(
            id=card.id,
            max_model_len=card.max_model_len,
            vocab_size=card.vocab_size,
            dtype=card.dtype,
        ),
    )
    common = dict(
        model=args.model,
        request_timeout_s=args.request_timeout,
        progress=os.environ.get("PDSERVE_NO_PROGRESS", "") in ("", "0"),
    )
    prompt_seed = args.seed if args.prompt_seed is None else args.prompt_seed
    if plan.rates is None:
        prompts = workload.build_prompts(requests, card.vocab_size, prompt_seed)
        records, duration_s = loadgen.run_load(args.router, requests, prompts, **common)
        summary = metrics.summarize(records, duration_s, slo)
        print(report.format_summary(summary, load=report.describe_load(args)))
        result.update(kind="run", summary=summary, requests=[r.to_json() for r in records])
        done = summary["completed"]
    else:
        runs = loadgen.run_sweep(
            args.router,
            requests,
            lambda k: workload.build_prompts(requests, card.vocab_size, prompt_seed + k),
            plan.rates,
            burstiness=args.burstiness,
            seed=args.seed,
            **common,
        )
        summaries = [metrics.summarize(r.records, r.duration_s, slo) for r in runs]
        rates, attained = [r.rate for r in runs], [s["slo_attainment"] for s in summaries]
        goodput = dict(
            threshold=args.attainment,
            slo_s=slo,
            rates=rates,
            attainment=attained,
            **metrics.goodput_rate(rates, attained, args.attainment),
        )
        scaled = metrics.slo_scale_goodput(
            [(r.rate, r.records) for r in runs], slo, plan.scales, args.attainment
        )
        print(report.format_sweep(runs, summaries, goodput, scaled, report.describe_load(args)))
        result.update(
            kind="sweep",
            goodput=goodput,
            slo_scales=scaled,
            runs=[
                dict(
                    rate=r.rate,
                    duration_s=r.duration_s,
                    summary=s,
                    requests=[x.to_json() for x in r.records],
                )
                for r, s in zip(runs, summaries)
            ],
        )
        result["plots"] = report.plot_sweep(pathlib.Path(args.out), runs, goodput, slo)
        done = sum(s["completed"] for s in summaries)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        print(
            f"wrote {args.out}" + "".join(f", {p}" for p in result.get("plots", ())),
            file=sys.stderr,
        )
    return 0 if done else 1


def _requests(args) -> list[workload.RequestSpec]:
    synthetic = args.prompt_len is not None or args.output_len is not None
    if args.trace and synthetic:
        raise BenchError("give either --trace or --prompt-len/--output-len, not both")
    if not args.trace and not (args.prompt_len and args.output_len):
        raise BenchError("give --trace NAME|PATH, or --prompt-len N and --output-len M (both >= 1)")
    if args.num_requests < 1:
        raise BenchError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.rate is not None and not args.rate > 0:
        raise BenchError(f"--rate must be > 0 req/s (or inf), got {args.rate}")
    if args.burstiness != 1.0 and args.rate is None and args.sweep_rates is None:
        raise BenchError(
            "--burstiness shapes re-timed arrivals: give it with --rate or --sweep-rates"
        )
    if not args.burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.trace:
        if args.trace_start < 0:
            raise BenchError(f"--trace-start must be >= 0 seconds, got {args.trace_start:g}")
        reqs = workload.load_trace(
            args.trace,
            scale=args.scale,
            max_prompt=args.max_prompt,
            max_output=args.max_output,
            max_requests=args.num_requests,
            start_s=args.trace_start,
        )
    elif args.prompt_len < 1 or args.output_len < 1:
        raise BenchError("--prompt-len and --output-len must be >= 1")
    elif args.rate is not None and math.isfinite(args.rate):
        return workload.synthetic(
            args.num_requests,
            args.rate,
            args.prompt_len,
            args.output_len,
            args.burstiness,
            args.seed,
        )
    else:
        reqs = [workload.RequestSpec(0.0, args.prompt_len, args.output_len)] * args.num_requests
    if args.rate is None:
        return reqs  # the trace's own arrival times; synthetic: all at once
    if math.isinf(args.rate):
        return [replace(r, arrival_s=0.0) for r in reqs]
    return workload.retime(reqs, args.rate, args.burstiness, args.seed)
