"""What `pdserve bench` prints and writes: the `vllm bench serve` style table of a run, the sweep's
attainment and goodput lines, and the sweep's plots (attainment vs rate, TTFT and TPOT CDFs); for
chat sessions, the per-turn table (metrics.summarize_turns) and the reuse on/off comparison
(metrics.compare_runs)."""

from __future__ import annotations

import pathlib

from pdserve.tuning.loadgen import Run
from pdserve.tuning.metrics import percentile_key

WIDTH = 50
# each latency metric's section header and short name, vLLM's for vLLM's four
_SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
    "itl_per_token": ("Inter-token Latency per token (pdserve)", "ITL/token"),
    "client_queue_time": ("Client-side Queueing", "Client Queue Time"),
}
# the table's metrics and percentiles unless --percentile-metrics/--metric-percentiles say
TABLE_METRICS = ("ttft", "tpot", "itl", "e2el")
TABLE_PERCENTILES = (90.0, 99.0)


def _line(label: str, value) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<40}{text:<10}"


def describe_load(args) -> tuple[str, str]:
    """(the requests, their arrivals) of a `pdserve bench` run, from its arguments: what the
    summary names, so that a table pasted elsewhere still says what it measured."""
    if args.trace:
        shaped = [f"x{args.scale:g}"] if args.scale != 1 else []
        shaped += [f"from {args.trace_start:g}s"] if args.trace_start else []
        shaped += [f"prompt <= {args.max_prompt}"] if args.max_prompt else []
        shaped += [f"output <= {args.max_output}"] if args.max_output else []
        what = f"trace {args.trace}" + (f" ({', '.join(shaped)})" if shaped else "")
    else:
        what = f"synthetic {args.prompt_len} in / {args.output_len} out"
    if getattr(args, "sweep_rates", None):
        rate = f"sweep {args.sweep_rates} req/s"
    elif args.rate is None:
        rate = "the trace's own arrival times" if args.trace else "all at once"
    elif args.rate == float("inf"):
        rate = "all at once (inf)"
    else:
        gaps = "Poisson" if args.burstiness == 1 else f"gamma, burstiness {args.burstiness:g}"
        rate = f"{args.rate:g} req/s ({gaps})"
    if getattr(args, "max_concurrency", None):
        rate += f", at most {args.max_concurrency} in flight"
    return f"{what}, {args.num_requests} requests", rate


def describe_server(args) -> str:
    """What a `pdserve bench` run loaded: the router's gRPC API, or an OpenAI-compatible server's
    HTTP endpoint (--backend openai), for the summary's "Server" line."""
    if getattr(args, "backend", None) == "openai":
        return f"OpenAI-compatible HTTP, {args.base_url.rstrip('/')}{args.endpoint}"
    return f"pdserve gRPC, {args.router}"


def _load_lines(load: tuple[str, ...] | None) -> list[str]:
    """The summary's first lines: the workload, the rate and, where given, the server."""
    if load is None:
        return []
    lines = [f"Workload: {load[0]}", f"Request rate: {load[1]}"]
    return lines + [f"Server: {load[2]}"] if len(load) > 2 else lines


def format_summary(
    s: dict,
    title: str = "Serving Benchmark Result",
    load: tuple[str, ...] | None = None,
    metrics: tuple[str, ...] = TABLE_METRICS,
    percentiles: tuple[float, ...] = TABLE_PERCENTILES,
) -> str:
    """The run's table; `load` (describe_load, and describe_server's line) names the workload, the
    rate it ran and the server; for each of
    `metrics` (keys of _SECTIONS) its mean, median and `percentiles` (in the summary: summarize's
    `percentiles`)."""
    lines = [f" {title} ".center(WIDTH, "="), *_load_lines(load)]
    lines += [
        _line("Successful requests:", s["completed"]),
        _line("Failed requests:", s["failed"]),
    ]
    lines += [_line(f"  {code}:", n) for code, n in sorted(s["errors"].items())]
    lines += [
        _line("Benchmark duration (s):", s["duration"]),
        _line("Total input tokens:", s["total_input_tokens"]),
        _line("  served from prefix cache:", s["cached_prompt_tokens"]),
        _line("Total generated tokens:", s["total_output_tokens"]),
        _line("Request throughput (req/s):", s["request_throughput"]),
        _line("Input token throughput (tok/s):", s["input_throughput"]),
        _line("Output token throughput (tok/s):", s["output_throughput"]),
        _line("Total token throughput (tok/s):", s["total_token_throughput"]),
        _line("Peak concurrent requests:", s["max_concurrent_requests"]),
        _line("Max send lag (ms):", s["max_send_lag_ms"]),
    ]
    if "slo_s" in s:
        slo = " ".join(f"{k}<={v * 1e3:g}ms" for k, v in s["slo_s"].items())
        lines += [
            _line("SLO attainment (%):", s["slo_attainment"] * 100),
            _line("  SLOs:", slo),
            _line("Request goodput (req/s):", s["request_goodput"]),
        ]
    for key in metrics:
        section, short = _SECTIONS[key]
        lines.append(f"{section}".center(WIDTH, "-"))
        stats = ("mean", "median", *(percentile_key(p) for p in percentiles))
        lines += [
            _line(
                f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {short} (ms):",
                s[f"{stat}_{key}_ms"],
            )
            for stat in stats
        ]
    if s.get("server_ms"):
        lines.append("Server stages, mean / p90 (ms)".center(WIDTH, "-"))
        lines += [
            _line(f"{stage}:", f"{v['mean']:.2f} / {v['p90']:.2f}")
            for stage, v in s["server_ms"].items()
        ]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep(
    runs: list[Run],
    summaries: list[dict],
    goodput: dict,
    scales: list[dict],
    load: tuple[str, ...] | None = None,
) -> str:
    lines = [
        " Rate sweep ".center(WIDTH + 22, "="),
        *_load_lines(load),
        f"{'rate':>8} {'done':>6} {'failed':>6} {'attain':>7} {'p90 TTFT':>10} {'p90 TPOT':>10} "
        f"{'goodput':>9} {'lag':>8}",
        f"{'req/s':>8} {'':>6} {'':>6} {'%':>7} {'ms':>10} {'ms':>10} {'req/s':>9} {'ms':>8}",
    ]
    for run, s in zip(runs, summaries):
        p90 = [s[k] for k in ("p90_ttft_ms", "p90_tpot_ms")]
        p90 = [f"{v:.1f}" if v is not None else "-" for v in p90]
        lines.append(
            f"{run.rate:>8g} {s['completed']:>6} {s['failed']:>6} {s['slo_attainment'] * 100:>7.1f} "
            f"{p90[0]:>10} {p90[1]:>10} {s['request_goodput']:>9.2f} {s['max_send_lag_ms']:>8.1f}"
        )
    lines.append(
        "(goodput column: vLLM's --goodput, requests meeting both SLOs per second at that rate)"
    )
    lines.append(
        f"DistServe goodput (>= {goodput['threshold'] * 100:g}% attain both SLOs): "
        f"{_rate(goodput)} req/s"
    )
    if goodput["note"]:
        lines.append(f"  note: {goodput['note']}")
    lines.append("SLO scale -> goodput (req/s):")
    for g in scales:
        slo = ", ".join(f"{k}<={v * 1e3:g}ms" for k, v in g["slo_s"].items())
        lines.append(f"  x{g['scale']:<5g} {_rate(g):>10}   ({slo})")
    lines.append("=" * (WIDTH + 22))
    return "\n".join(lines)


def _rate(g: dict) -> str:
    return (">= " if g["lower_bound"] else "") + f"{g['rate']:.3g}"


def plot_sweep(
    out: pathlib.Path, runs: list[Run], goodput: dict, slo: dict[str, float]
) -> list[str]:
    """Three PNGs beside `out` (result.json -> result_attainment.png, ..._ttft_cdf, ..._tpot_cdf)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    paths = []
    fig = Figure(figsize=(6, 4), tight_layout=True)
    ax = fig.add_subplot()
    rates = [r.rate for r in runs]
    ax.plot(rates, [a * 100 for a in goodput["attainment"]], "o-", label="both SLOs met")
    ax.axhline(
        goodput["threshold"] * 100,
        color="gray",
        ls="--",
        label=f"{goodput['threshold'] * 100:g}% target",
    )
    if goodput["rate"] > 0:
        ax.axvline(
            goodput["rate"], color="tab:red", ls=":", label=f"goodput {_rate(goodput)} req/s"
        )
    ax.set(
        xlabel="request rate (req/s)",
        ylabel="SLO attainment (%)",
        ylim=(0, 105),
        title=", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slo.items()),
    )
    ax.legend()
    paths.append(_save(fig, out, "attainment"))
    for metric in ("ttft", "tpot"):
        fig = Figure(figsize=(6, 4), tight_layout=True)
        ax = fig.add_subplot()
        for run in runs:
            values = sorted(
                v * 1e3
                for r in run.records
                if r.ok
                for v in [r.ttft_s if metric == "ttft" else r.tpot_s]
                if v is not None
            )
            if values:  # y: share of all requests, so failed ones keep the curve below 1
                ax.step(
                    values,
                    [(i + 1) / len(run.records) for i in range(len(values))],
                    where="post",
                    label=f"{run.rate:g} req/s",
                )
        if metric in slo:
            ax.axvline(slo[metric] * 1e3, color="gray", ls="--", label="SLO")
        ax.set(
            xlabel=f"{metric.upper()} (ms)",
            ylabel="share of requests",
            ylim=(0, 1.02),
            title=f"{metric.upper()} CDF per request rate",
        )
        ax.legend()
        paths.append(_save(fig, out, f"{metric}_cdf"))
    return paths


def _save(fig, out: pathlib.Path, name: str) -> str:
    path = out.with_name(f"{out.stem}_{name}.png")
    fig.savefig(path, dpi=100)
    return str(path)


def describe_sessions(args, n_sessions: int) -> tuple[str, str]:
    """(the sessions, how they start) of a `pdserve bench --sessions` run, as describe_load."""
    if args.sessions_from:
        caps = [f"x{args.scale:g}"] if args.scale != 1 else []
        caps += [f"message <= {args.max_message}"] if args.max_message else []
        caps += [f"answer <= {args.max_answer}"] if args.max_answer else []
        caps += [f"<= {args.turns} turns"] if args.turns else []
        what = f"{n_sessions} sessions from {args.sessions_from}" + (
            f" ({', '.join(caps)})" if caps else ""
        )
    else:
        doc = ""
        if args.doc_len:
            doc = f", {'shared ' if args.shared_doc else ''}document {args.doc_len}"
        what = (
            f"{n_sessions} sessions x {args.turns} turns, message {args.message_len}, "
            f"answer {args.answer_len}{doc}"
        )
    start = "all at once" if args.session_rate is None else f"{args.session_rate:g} sessions/s"
    think = f"think {args.think_time:g} s" + (
        " (exponential)" if args.think_dist == "exponential" else ""
    )
    inflight = f"at most {args.concurrency} in flight" if args.concurrency else "all in flight"
    return what, f"closed loop: {start}, {inflight}, {think}"


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_turns(turns: list[dict], title: str = "Per turn") -> str:
    """One line per turn index: requests (and failed, skipped), mean prompt tokens, TTFT and ITL
    P50/P90 (ms), cached / reusable prompt tokens and their share; cache hits by source below
    when the server reported them."""
    width = WIDTH + 40
    lines = [
        f" {title} ".center(width, "="),
        f"{'turn':>4} {'reqs':>5} {'fail':>4} {'skip':>4} {'prompt':>7} {'TTFT p50':>9} "
        f"{'p90':>8} {'ITL p50':>8} {'p90':>7} {'cached/reusable':>17} {'hit %':>6}",
    ]
    for t in turns:
        share = "-" if t["hit_share"] is None else f"{t['hit_share'] * 100:.1f}"
        prompt = "-" if t["mean_prompt_tokens"] is None else f"{t['mean_prompt_tokens']:.0f}"
        cached = f"{t['cached_prompt_tokens']}/{t['reusable_prompt_tokens']}"
        lines.append(
            f"{t['turn']:>4} {t['requests']:>5} {t['failed']:>4} {t['skipped']:>4} {prompt:>7} "
            f"{_ms(t['median_ttft_ms']):>9} {_ms(t['p90_ttft_ms']):>8} "
            f"{_ms(t['median_itl_ms']):>8} {_ms(t['p90_itl_ms']):>7} {cached:>17} {share:>6}"
        )
    for t in turns:
        if t["cache_hits"]:
            hits = ", ".join(f"{k} {v}" for k, v in t["cache_hits"].items())
            lines.append(f"  turn {t['turn']} cache hits by source: {hits}")
        if t["errors"]:
            lines.append(f"  turn {t['turn']} errors: {t['errors']}")
    lines.append("(TTFT and ITL in ms; hit %: cached over reusable prompt tokens, the previous")
    lines.append(" turn's prompt and answer, over the turn's completed requests)")
    lines.append("=" * width)
    return "\n".join(lines)


def _x(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def format_comparison(cmp: dict, title: str = "Reuse on / reuse off") -> str:
    """metrics.compare_runs as a table: per turn the on/off ratios and the TTFT saved."""
    width = WIDTH + 30
    lines = [
        f" {title} ".center(width, "="),
        f"{'turn':>4} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p90':>8} {'saved/req':>10} "
        f"{'saved':>8} {'hit % on':>9}",
        f"{'':>4} {'x':>9} {'x':>9} {'x':>8} {'ms':>10} {'s':>8} {'':>9}",
    ]
    for t in cmp["turns"]:
        on = t["hit_share"][0]
        lines.append(
            f"{t['turn']:>4} {_x(t['ttft_p50_ratio']):>9} {_x(t['ttft_p90_ratio']):>9} "
            f"{_x(t['itl_p90_ratio']):>8} {_ms(t['ttft_saved_ms_mean']):>10} "
            f"{t['ttft_saved_s']:>8.2f} {'-' if on is None else f'{on * 100:.1f}':>9}"
        )
    o = cmp["overall"]
    lines += [
        f"all: TTFT p50 x{_x(o['ttft_p50_ratio'])}, p90 x{_x(o['ttft_p90_ratio'])}, ITL p90 "
        f"x{_x(o['itl_p90_ratio'])}, output tok/s x{_x(o['output_throughput_ratio'])}, wall "
        f"time saved {o['time_saved_s']:.2f} s",
        "=" * width,
    ]
    return "\n".join(lines)
