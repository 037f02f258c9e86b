"""`pdserve bench`: an open-loop load test of a running router, `vllm bench serve` style, and a
rate sweep that finds the DistServe goodput; or closed-loop multi-turn chat sessions, whose turns
send the answers the model gave, to measure prefix reuse.

    pdserve bench --trace azure_conv --scale 0.1 --max-prompt 512 --num-requests 200 --slo ttft=500ms,tpot=100ms
    pdserve bench --trace azure_code --rate 2 --burstiness 0.5 --out result.json
    pdserve bench --prompt-len 256 --output-len 32 --rate 1 --num-requests 50
    pdserve bench --trace azure_conv --scale 0.1 --sweep-rates 0.5,1,2,4 --slo ttft=1s,tpot=100ms --out sweep.json
    pdserve bench --dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts 200 --request-rate 4 --max-concurrency 32 --save-result
    pdserve bench --sessions 6 --turns 5 --message-len 256 --answer-len 128 --concurrency 1
    pdserve bench --sessions 8 --turns 4 --message-len 64 --answer-len 64 --doc-len 2048 --shared-doc
    pdserve bench --sessions-from mooncake --scale 0.05 --sessions 20 --concurrency 4 --out s.json
    pdserve bench --backend openai --base-url http://127.0.0.1:8000 --vocab-size 49152 --dataset-name random --num-prompts 100 --request-rate 4

Arrivals: the trace's own times, or re-timed to --rate (gamma gaps, --burstiness 1 = Poisson;
`inf` sends everything at once). Synthetic requests without --rate are sent all at once.
--max-concurrency N holds a request that arrives while N are in flight until one ends (its wait is
reported as client_queue_time, apart from its TTFT). Requests go to the router's gRPC API as token
ids, greedy and with ignore_eos, so each produces exactly its output length.

Over HTTP, to any server with OpenAI's completions API (pdserve's HTTP front, vLLM, SGLang), so
one tool compares them on the same requests: --backend openai --base-url URL (vLLM's names;
--base-url alone implies it; default http://127.0.0.1:8000). Each request is POST
{URL}{--endpoint, default /v1/completions} with the token ids, temperature 0, max_tokens,
ignore_eos and stream with include_usage, the key (--api-key, else PDSERVE_API_KEY) as a Bearer
token; TTFT at the first SSE chunk with text, ITL one gap per chunk, output tokens from the usage
chunk; an HTTP error status is recorded as its name (TOO_MANY_REQUESTS). The model (the first
card, or --model) and its max_model_len come from GET {URL}/v1/models; no standard field gives the
vocabulary, so give --vocab-size, else the prompts' ids stay below 16000, which every real
vocabulary holds (the result file says which). The result records the backend and the URL; the
server's stage timings and KV bytes are the gRPC API's only; --sessions runs over gRPC only.

`vllm bench serve`'s names work too: --num-prompts, --request-rate, --max-concurrency,
--dataset-name random with --random-input-len/--random-output-len (also --input-len; vLLM's
defaults 1024 and 128; --random-range-ratio 0 only), --goodput ttft:500 tpot:50 (ms, for --slo),
--percentile-metrics ttft,tpot,itl,e2el and --metric-percentiles 50,90,99 (what the table shows and
the result file has; default all four at P90 and P99), --save-result [--result-dir D]
[--result-filename F] (for --out; vLLM's file name by default), --append-result (one JSON line
added to the file), --label L (the result's label and the file name's prefix), --metadata
KEY=VALUE ... (recorded at the file's top level), --save-detailed, --disable-tqdm,
--ignore-eos (always on here). The metrics are vLLM's: TTFT to the first token, ITL one gap per
streamed message after the first (several tokens in one message count once, as vLLM counts an SSE
chunk), TPOT (E2E - TTFT) / (output tokens - 1); pdserve's per-token ITL (each message's gap split
over its tokens) is itl_per_token in the result. The result file has vLLM's flat keys
(mean_ttft_ms, std_itl_ms, p99_tpot_ms, request_throughput, ...) beside pdserve's "summary"
and "requests". --tls-ca/--tls-cert/--tls-key/--tls-server-name reach a router with router.tls,
as `pdserve generate` does (--tls-ca/--tls-cert/--tls-key an https:// --base-url too).

Sessions (--sessions N or --sessions-from, instead of the open-loop options): each session is
--turns turns; turn 1 sends [a --doc-len document, one for all sessions with --shared-doc] and a
--message-len user message, each later turn the previous turn's prompt, the answer the model
returned (exactly --answer-len tokens: greedy, ignore_eos) and a new message, all random token
ids from --seed. A session sends a turn once the previous one ended and --think-time passed;
sessions start at once or one every 1/--session-rate s, at most --concurrency in flight
(1: one after another). --sessions-from mooncake takes the shapes from the Mooncake trace's
hash-id chains (lengths x --scale, capped by --max-message/--max-answer, at most --turns turns;
tuning/sessions.py says how). Prompts that would not fit the model's context are refused up front
(trace shapes: the turns that do not fit are cut). The table is per turn index: TTFT and ITL
P50/P90 and the share of reusable prompt tokens (the previous turn's prompt and answer) that the
server reported as cached; --out writes every turn's record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys
from dataclasses import dataclass, replace

from pdserve import client
from pdserve.tuning import metrics, workload
from pdserve.tuning.slo import latency_slos


def add_args(p: argparse.ArgumentParser, default_router: str) -> None:
    p.add_argument(
        "--router", default=default_router, help="the router's host:port (default: %(default)s)"
    )
    p.add_argument("--model", default="", help="a served model id (default: the router's default)")
    _add_http_args(p)
    _add_request_args(p)
    _add_load_args(p)
    _add_session_args(p)
    _add_result_args(p)
    client.add_tls_args(p)


def _add_http_args(p: argparse.ArgumentParser) -> None:
    """The HTTP mode's options (tuning/http_load.py), with `vllm bench serve`'s names."""
    from pdserve.tuning.http_load import DEFAULT_BASE_URL, DEFAULT_ENDPOINT, FALLBACK_VOCAB

    web = p.add_argument_group(
        "over HTTP: an OpenAI-compatible server (pdserve's front, vLLM, ...)"
    )
    web.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help=f"{GRPC}: the router's gRPC API at --router (default); openai: POST --base-url's "
        f"--endpoint, streamed (vLLM's name)",
    )
    web.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help=f"the server's root, e.g. {DEFAULT_BASE_URL} (vLLM's; implies --backend openai, "
        f"whose default it is)",
    )
    web.add_argument(
        "--endpoint",
        default=DEFAULT_ENDPOINT,
        help="the completions path under --base-url (default %(default)s)",
    )
    web.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help=f"the model's vocabulary size, for the prompts' random token ids (no standard "
        f"field gives it over HTTP; default: ids below {FALLBACK_VOCAB}, which every real "
        f"vocabulary holds)",
    )


def _add_request_args(p: argparse.ArgumentParser) -> None:
    """The open loop's requests: a trace's, or synthetic lengths (vLLM's random dataset)."""
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
    src.add_argument(
        "--prompt-len",
        "--input-len",
        "--random-input-len",
        type=int,
        default=None,
        help="synthetic: prompt tokens",
    )
    src.add_argument(
        "--output-len",
        "--random-output-len",
        type=int,
        default=None,
        help="synthetic: output tokens",
    )
    src.add_argument(
        "--dataset-name",
        default=None,
        metavar="random",
        help="vLLM's: `random` is the synthetic lengths (default 1024 in, 128 out); else --trace",
    )
    src.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="vLLM's: 0 only (every synthetic request has the same lengths)",
    )
    src.add_argument(
        "--num-requests", "--num-prompts", type=int, default=100, help="default %(default)s"
    )
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


def _add_load_args(p: argparse.ArgumentParser) -> None:
    """The open loop's arrivals, concurrency cap, SLOs and rate sweep."""
    load = p.add_argument_group("load")
    load.add_argument(
        "--rate",
        "--request-rate",
        type=float,
        default=None,
        help="req/s (re-times a trace); inf = all at once",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="at most N requests in flight; a request that arrives at the cap waits for one to "
        "end (vLLM's; default no cap)",
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
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="vLLM's form of --slo: ttft:500 tpot:100 (ms; also e2el:)",
    )
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


def _add_result_args(p: argparse.ArgumentParser) -> None:
    """What the table shows and where the result goes, with `vllm bench serve`'s names."""
    out = p.add_argument_group("the table and the result file")
    out.add_argument(
        "--out",
        default=None,
        help="write every request and the summary here (JSON); "
        "a sweep also writes PNG plots beside it",
    )
    out.add_argument(
        "--save-result",
        action="store_true",
        help="vLLM's: write the result as --result-dir/--result-filename (for --out)",
    )
    out.add_argument("--result-dir", default=None, help="vLLM's: --save-result's folder")
    out.add_argument(
        "--result-filename",
        default=None,
        help="vLLM's: --save-result's file (default <label>-<rate>qps[-concurrency<N>]-<model>-"
        "<date>.json)",
    )
    out.add_argument(
        "--append-result",
        action="store_true",
        help="vLLM's: append the result to the file as one JSON line instead of replacing it",
    )
    out.add_argument(
        "--label",
        default=None,
        help="vLLM's: the result's label, and --save-result's file name prefix (default pdserve)",
    )
    out.add_argument(
        "--metadata",
        nargs="*",
        default=None,
        metavar="KEY=VALUE",
        help="vLLM's: KEY=VALUE pairs recorded at the result file's top level (e.g. version=0.3 "
        "tp=1)",
    )
    out.add_argument(
        "--save-detailed",
        action="store_true",
        help="vLLM's: also its per-request lists (ttfts, itls, latencies, ...) at the top level",
    )
    out.add_argument(
        "--percentile-metrics",
        default=None,
        metavar="M1,M2,..",
        help=f"the table's metrics, of {','.join(metrics.LATENCY_METRICS)} "
        "(default ttft,tpot,itl,e2el)",
    )
    out.add_argument(
        "--metric-percentiles",
        default=None,
        metavar="P1,P2,..",
        help="the table's percentiles, e.g. 50,90,99 (default 90,99)",
    )
    out.add_argument(
        "--disable-tqdm", action="store_true", help="no progress bar (or PDSERVE_NO_PROGRESS=1)"
    )
    out.add_argument(
        "--ignore-eos",
        action="store_true",
        help="vLLM's; always on here: every request runs to its output length",
    )


def _add_session_args(p: argparse.ArgumentParser) -> None:
    """The closed-loop chat sessions' options (tuning/sessions.py)."""
    ses = p.add_argument_group(
        "closed-loop chat sessions (instead of --trace/--prompt-len and the load and SLO options)"
    )
    ses.add_argument(
        "--sessions",
        type=int,
        default=None,
        metavar="N",
        help="run N chat sessions (with --sessions-from: the trace's first N, default all)",
    )
    ses.add_argument(
        "--sessions-from",
        default=None,
        metavar="mooncake|PATH",
        help="session shapes from a Mooncake-format trace's hash_ids chains (x --scale)",
    )
    ses.add_argument(
        "--turns", type=int, default=None, help="turns per session (--sessions-from: at most)"
    )
    ses.add_argument("--message-len", type=int, default=None, help="tokens per user message")
    ses.add_argument("--answer-len", type=int, default=None, help="tokens per answer")
    ses.add_argument(
        "--doc-len", type=int, default=0, help="document tokens before turn 1's message (default 0)"
    )
    ses.add_argument(
        "--shared-doc", action="store_true", help="one document for all sessions (else one each)"
    )
    ses.add_argument(
        "--max-message", type=int, default=None, help="--sessions-from: cap a turn's new tokens"
    )
    ses.add_argument(
        "--max-answer", type=int, default=None, help="--sessions-from: cap an answer's tokens"
    )
    ses.add_argument(
        "--think-time",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="between a turn's end and the next turn's send (default %(default)s)",
    )
    ses.add_argument(
        "--think-dist",
        choices=("fixed", "exponential"),
        default="fixed",
        help="think times: --think-time each, or exponential with that mean (default fixed)",
    )
    ses.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="sessions in flight at most (default all; 1: one after another)",
    )
    ses.add_argument(
        "--session-rate",
        type=float,
        default=None,
        metavar="R",
        help="start a session every 1/R s (default: all at once, as --concurrency allows)",
    )


# the options of each kind of run, by dest: an option of the other kind is refused
OPEN_LOOP_ONLY = (
    "trace", "trace_start", "max_prompt", "max_output", "prompt_len", "output_len",
    "num_requests", "rate", "burstiness", "slo", "sweep_rates", "attainment", "slo_scales",
    "max_concurrency", "goodput", "dataset_name", "random_range_ratio",
)  # fmt: skip
SESSIONS_ONLY = (
    "turns", "message_len", "answer_len", "doc_len", "shared_doc", "max_message", "max_answer",
    "think_time", "think_dist", "concurrency", "session_rate",
)  # fmt: skip
OPTION_SHAPES_ONLY = ("message_len", "answer_len", "doc_len", "shared_doc")  # not with a trace
TRACE_SHAPES_ONLY = ("max_message", "max_answer", "scale")  # not with --sessions shapes


def _defaults() -> dict:
    p = argparse.ArgumentParser()
    add_args(p, "")
    return vars(p.parse_args([]))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args, dests, defaults) -> list[str]:
    return [_flag(d) for d in dests if getattr(args, d) != defaults[d]]


class BenchError(Exception):
    """Arguments that do not go together, or a router that cannot serve them."""


GRPC, OPENAI = "pdserve-grpc", "openai"
BACKENDS = (GRPC, OPENAI)


@dataclass
class Plan:
    requests: list[workload.RequestSpec]
    card: object  # the router's ModelCard; over HTTP, http_load.HttpCard
    slo: dict[str, float] | None
    rates: list[float] | None  # a sweep's rates; None = one run
    scales: list[float]
    target: object = None  # over HTTP: the http_load.Target; None: the router's gRPC API


def run(args) -> int:
    from pdserve.tuning import loadgen  # grpc and friends: only once the arguments are parsed

    sessions = args.sessions is not None or args.sessions_from is not None
    try:
        _vllm_options(args)
        _backend_options(args, sessions)
        plan = _plan_sessions(args) if sessions else _plan(args)
    except (ValueError, BenchError, loadgen.LoadgenError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    try:
        return _execute_sessions(args, plan) if sessions else _execute(args, plan)
    except KeyboardInterrupt:
        return 130


# vLLM's random dataset's lengths when --dataset-name random names none (vllm/benchmarks/datasets)
VLLM_RANDOM_INPUT_LEN, VLLM_RANDOM_OUTPUT_LEN = 1024, 128
# --goodput's names (vLLM's, in ms) -> --slo's
_GOODPUT_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}


def _vllm_options(args) -> None:
    """`vllm bench serve`'s options turned into pdserve's, in place: --dataset-name random's
    lengths, --goodput as --slo, --save-result's file as --out; and the table's metrics and
    percentiles checked. What pdserve bench cannot do is refused with what it does instead."""
    if args.dataset_name is not None:
        if args.dataset_name != "random":
            raise BenchError(
                f"--dataset-name {args.dataset_name}: pdserve bench has `random` (synthetic "
                f"lengths, --random-input-len/--random-output-len) and traces (--trace "
                f"{'|'.join(workload.TRACES)}|PATH)"
            )
        if args.trace:
            raise BenchError("--dataset-name random and --trace exclude each other")
        if args.prompt_len is None:
            args.prompt_len = VLLM_RANDOM_INPUT_LEN
        if args.output_len is None:
            args.output_len = VLLM_RANDOM_OUTPUT_LEN
    if args.random_range_ratio != 0:
        raise BenchError(
            f"--random-range-ratio {args.random_range_ratio:g}: pdserve bench's synthetic "
            f"requests all have the same lengths (0); replay a trace for mixed lengths (--trace)"
        )
    if args.goodput is not None:
        if args.slo is not None:
            raise BenchError("--goodput and --slo say the same: give one")
        args.slo = _goodput_as_slo(args.goodput)
    saving = args.save_result or args.result_dir or args.result_filename
    if saving and args.out:
        raise BenchError(
            "--out and --save-result/--result-dir/--result-filename say the same: give one"
        )
    if saving:
        # the model's id is the router's: _name_result fills {model} in once it is known
        name = args.result_filename or _vllm_file_name(args)
        args.out = os.path.join(args.result_dir, name) if args.result_dir else name
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
    table_metrics(args)
    table_percentiles(args)
    _result_options(args)


def _backend_options(args, sessions: bool) -> None:
    """--backend resolved in place (openai when --base-url is given, else gRPC; --base-url then
    defaults to http_load.DEFAULT_BASE_URL) and the HTTP options checked against it."""
    from pdserve.tuning import http_load

    if args.backend is None:
        args.backend = OPENAI if args.base_url is not None else GRPC
    if args.backend == GRPC:
        given = [
            flag
            for flag, on in (
                ("--base-url", args.base_url is not None),
                ("--endpoint", args.endpoint != http_load.DEFAULT_ENDPOINT),
                ("--vocab-size", args.vocab_size is not None),
            )
            if on
        ]
        if given:
            raise BenchError(
                f"{', '.join(given)}: the openai backend's (HTTP); the {GRPC} backend sends to "
                f"--router and reads the vocabulary from the router's model card"
            )
        return
    if sessions:
        raise BenchError(
            "--sessions/--sessions-from run over the router's gRPC API only (each turn sends back "
            "the previous answer's token ids): leave out --backend openai and --base-url"
        )
    args.base_url = (args.base_url or http_load.DEFAULT_BASE_URL).rstrip("/")
    endpoint = args.endpoint.rstrip("/")
    if not endpoint.endswith("/completions") or endpoint.endswith("/chat/completions"):
        raise BenchError(
            f"--endpoint {args.endpoint}: pdserve bench sends token-id prompts to the "
            f"completions API ({http_load.DEFAULT_ENDPOINT}), not chat"
        )
    if args.vocab_size is not None and args.vocab_size < 1:
        raise BenchError(f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.tls_server_name:
        raise BenchError(
            "--tls-server-name is the gRPC backend's: over https the server's certificate must "
            "name --base-url's host"
        )


def _goodput_as_slo(pairs: list[str]) -> str:
    """vLLM's --goodput ["ttft:500", "tpot:50"] (ms) as an --slo string, "ttft=500ms,tpot=50ms"."""
    items = []
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name.strip().lower() not in _GOODPUT_NAMES:
            raise BenchError(
                f"--goodput {pair!r}: expected KEY:VALUE with KEY one of "
                f"{', '.join(_GOODPUT_NAMES)} and VALUE in ms, e.g. ttft:500 tpot:50"
            )
        items.append(f"{_GOODPUT_NAMES[name.strip().lower()]}={value.strip()}ms")
    return ",".join(items)


def _result_options(args) -> None:
    """--append-result needs a result file; --metadata's pairs are KEY=VALUE (kept, parsed, in
    args.metadata_pairs)."""
    if args.append_result and not args.out:
        raise BenchError("--append-result appends to the result file: give --save-result or --out")
    pairs = {}
    for item in args.metadata or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BenchError(f"--metadata takes KEY=VALUE pairs; got {item[:80]!r}")
        pairs[key.strip()] = value.strip()
    args.metadata_pairs = pairs


def _write_result(args, result: dict) -> None:
    """The result file: --metadata's pairs at its top level (a key the result has keeps the
    result's value, as vLLM's does, said on stderr), replaced, or appended as one JSON line
    with --append-result (vLLM's: a line break before it unless the file is empty)."""
    pairs = getattr(args, "metadata_pairs", {})
    shadowed = sorted(k for k in pairs if k in result)
    if shadowed:
        print(
            f"pdserve bench: --metadata {', '.join(shadowed)}: the result's own kept",
            file=sys.stderr,
        )
    result = {**pairs, **result}
    if not args.append_result:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        return
    with open(args.out, "a+", encoding="utf-8") as f:
        if f.tell():
            f.write("\n")
        json.dump(result, f)


def _vllm_file_name(args) -> str:
    """vLLM's default result file name, <label>-<rate>qps[-concurrency<N>]-<model>-<date>.json,
    the label --label's (default "pdserve") and {model} left for _name_result."""
    if args.sweep_rates:
        rate = "sweep"
    elif args.sessions is not None or args.sessions_from is not None:
        rate = "sessions"
    else:
        rate = f"{float('inf') if args.rate is None else args.rate}qps"
    cap = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{args.label or 'pdserve'}-{rate}{cap}-{{model}}-{date}.json"


def _name_result(args, card) -> None:
    """--save-result's default file name gets the served model's id (its last path part)."""
    if args.save_result and not args.result_filename and args.out:
        args.out = args.out.replace("{model}", card.id.rstrip("/").split("/")[-1])


def table_metrics(args) -> tuple[str, ...]:
    """--percentile-metrics as a tuple of metrics.LATENCY_METRICS (default report.TABLE_METRICS)."""
    from pdserve.tuning import report

    if args.percentile_metrics is None:
        return report.TABLE_METRICS
    names = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    bad = [m for m in names if m not in metrics.LATENCY_METRICS]
    if bad or not names:
        raise BenchError(
            f"--percentile-metrics {args.percentile_metrics!r}: each one of "
            f"{', '.join(metrics.LATENCY_METRICS)}, comma-separated"
        )
    return names


def table_percentiles(args) -> tuple[float, ...]:
    """--metric-percentiles as floats in [0, 100] (default report.TABLE_PERCENTILES)."""
    from pdserve.tuning import report

    if args.metric_percentiles is None:
        return report.TABLE_PERCENTILES
    try:
        values = tuple(float(v) for v in args.metric_percentiles.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or not all(0 <= v <= 100 for v in values):
        raise BenchError(
            f"--metric-percentiles {args.metric_percentiles!r}: comma-separated percentiles "
            f"from 0 to 100, e.g. 50,90,99"
        )
    return values


@dataclass
class SessionPlan:
    sessions: list  # tuning.sessions.Session
    card: object
    fit: dict  # fit_sessions' counts: turns cut, sessions dropped


def _out_folder_exists(args) -> None:
    if args.out and not pathlib.Path(args.out).resolve().parent.is_dir():
        raise BenchError(
            f"--out {args.out}: folder {pathlib.Path(args.out).resolve().parent} does not exist"
        )


def _plan(args) -> Plan:
    """Every check that can fail before a request is sent: arguments, trace, router, model."""
    from pdserve.tuning import loadgen

    given = _given(args, SESSIONS_ONLY, _defaults())
    if given:
        raise BenchError(
            f"{', '.join(given)} shape chat sessions: give --sessions N or --sessions-from too"
        )
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
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    _out_folder_exists(args)
    requests = _requests(args)
    if args.backend == OPENAI:
        from pdserve.tuning import http_load

        target = http_load.Target.of(args.base_url, args.endpoint, tls=args)
        card = http_load.model_card(target, args.model, args.vocab_size)
        if card.max_model_len is not None:
            loadgen.check_fits(requests, card.max_model_len)
    else:
        target, card = None, loadgen.model_card(args.router, args.model, **_tls(args))
        loadgen.check_fits(requests, card.max_model_len)
    _name_result(args, card)
    return Plan(requests, card, slo, rates, scales, target)


def _tls(args) -> dict:
    """The loadgen calls' `tls` keyword: the --tls-* options when any is given (else none, the
    calls' plaintext default)."""
    from pdserve.tuning import loadgen

    return dict(tls=args) if loadgen.uses_tls(args) else {}


def _progress(args) -> bool:
    return not args.disable_tqdm and os.environ.get("PDSERVE_NO_PROGRESS", "") in ("", "0")


def _header(args, card, num_prompts: int) -> dict:
    """The result file's top: the command's options (the API key left out), the model, and
    `vllm bench serve`'s run keys (date, backend, model_id, num_prompts, request_rate, ...)."""
    rate = args.rate if args.rate is not None else float("inf")
    out = dict(
        config={k: v for k, v in vars(args).items() if k not in ("cmd", "api_key")},
        model=dict(
            id=card.id,
            max_model_len=card.max_model_len,
            vocab_size=card.vocab_size,
            dtype=card.dtype,
        ),
        date=datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        endpoint_type="pdserve-grpc",
        backend="pdserve-grpc",
        label=args.label,
        model_id=card.id,
        tokenizer_id=None,
        num_prompts=num_prompts,
        request_rate="inf" if math.isinf(rate) else rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
    )
    if getattr(args, "backend", GRPC) == OPENAI:  # which server ran, and how the ids were drawn
        out.update(endpoint_type=OPENAI, backend=OPENAI, base_url=args.base_url)
        out.update(endpoint=args.endpoint, prompt_token_ids=card.prompt_ids())
        out["model"]["vocab_size"] = card.vocab_size if card.vocab_size_given else None
    return out


def _vllm_result(args, summary: dict, records) -> dict:
    """A run's `vllm bench serve` keys: metrics.vllm_keys, and with --save-detailed its
    per-request lists."""
    out = metrics.vllm_keys(summary, table_metrics(args), table_percentiles(args))
    if args.save_detailed:
        out.update(metrics.vllm_detailed(records))
    return out


def _execute(args, plan: Plan) -> int:
    from pdserve.tuning import loadgen, report

    card, requests, slo = plan.card, plan.requests, plan.slo
    result = _header(args, card, len(requests))
    common = dict(
        model=args.model,
        request_timeout_s=args.request_timeout,
        progress=_progress(args),
        max_concurrency=args.max_concurrency,
    )
    address, load = args.router, loadgen.run_load
    if plan.target is None:
        common.update(_tls(args))
    else:  # over HTTP: the body names the served id; the target has the URL, key and TLS
        from pdserve.tuning import http_load

        address, load, common["model"] = plan.target, http_load.run_load, card.id
        if not card.vocab_size_given:
            print(f"pdserve bench: {card.prompt_ids()}", file=sys.stderr)
    prompt_seed = args.seed if args.prompt_seed is None else args.prompt_seed
    percentiles = table_percentiles(args)
    table = dict(metrics=table_metrics(args), percentiles=percentiles)
    if plan.rates is None:
        prompts = workload.build_prompts(requests, card.vocab_size, prompt_seed)
        records, duration_s = load(address, requests, prompts, **common)
        summary = metrics.summarize(records, duration_s, slo, percentiles)
        load = (*report.describe_load(args), report.describe_server(args))
        print(report.format_summary(summary, load=load, **table))
        result.update(_vllm_result(args, summary, records))
        result.update(kind="run", summary=summary, requests=[r.to_json() for r in records])
        done = summary["completed"]
    else:
        runs = loadgen.run_sweep(
            address,
            requests,
            lambda k: workload.build_prompts(requests, card.vocab_size, prompt_seed + k),
            plan.rates,
            burstiness=args.burstiness,
            seed=args.seed,
            load=None if plan.target is None else load,
            **common,
        )
        summaries = [metrics.summarize(r.records, r.duration_s, slo, percentiles) for r in runs]
        result.update(_sweep_result(args, plan, runs, summaries))
        done = sum(s["completed"] for s in summaries)
    if args.out:
        _write_result(args, result)
        print(
            f"wrote {args.out}" + "".join(f", {p}" for p in result.get("plots", ())),
            file=sys.stderr,
        )
    return 0 if done else 1


def _sweep_result(args, plan: Plan, runs, summaries: list[dict]) -> dict:
    """A sweep's goodput, printed, and its part of the result file (each run with its summary,
    vLLM's keys and requests; the plots beside --out)."""
    from pdserve.tuning import report

    slo = plan.slo
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
    load = (*report.describe_load(args), report.describe_server(args))
    print(report.format_sweep(runs, summaries, goodput, scaled, load))
    return dict(
        kind="sweep",
        goodput=goodput,
        slo_scales=scaled,
        runs=[
            dict(
                rate=r.rate,
                duration_s=r.duration_s,
                **_vllm_result(args, s, r.records),
                summary=s,
                requests=[x.to_json() for x in r.records],
            )
            for r, s in zip(runs, summaries)
        ],
        plots=report.plot_sweep(pathlib.Path(args.out), runs, goodput, slo),
    )


def _plan_sessions(args) -> SessionPlan:
    """The sessions' checks before a turn is sent: options, trace, router, model, context."""
    from pdserve.tuning import loadgen, sessions

    defaults = _defaults()
    given = _given(args, OPEN_LOOP_ONLY, defaults)
    if given:
        raise BenchError(
            f"{', '.join(given)} {'is an open-loop option' if len(given) == 1 else 'are open-loop options'}: "
            f"not with --sessions/--sessions-from (sessions are a closed loop; see --concurrency, "
            f"--session-rate, --think-time)"
        )
    if args.sessions_from is not None:
        given = _given(args, OPTION_SHAPES_ONLY, defaults)
        if given:
            raise BenchError(
                f"{', '.join(given)}: --sessions-from takes the shapes from the trace; cap them "
                f"with --max-message, --max-answer and --turns"
            )
        shapes = sessions.from_trace(
            args.sessions_from,
            scale=args.scale,
            max_message=args.max_message,
            max_answer=args.max_answer,
            max_turns=args.turns,
            max_sessions=args.sessions,
        )
    else:
        given = _given(args, TRACE_SHAPES_ONLY, defaults)
        if given:
            raise BenchError(
                f"{', '.join(given)} shape(s) a trace's sessions: give --sessions-from"
            )
        missing = [
            _flag(d) for d in ("turns", "message_len", "answer_len") if getattr(args, d) is None
        ]
        if missing:
            raise BenchError(f"--sessions N needs {', '.join(missing)} too")
        shapes = sessions.option_sessions(
            args.sessions, args.turns, args.message_len, args.answer_len, args.doc_len,
            args.shared_doc,
        )  # fmt: skip
    if args.concurrency is not None and args.concurrency < 1:
        raise BenchError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.session_rate is not None and not args.session_rate > 0:
        raise BenchError(f"--session-rate must be > 0 sessions/s, got {args.session_rate}")
    if not args.think_time >= 0:
        raise BenchError(f"--think-time must be >= 0 s, got {args.think_time}")
    _out_folder_exists(args)
    card = loadgen.model_card(args.router, args.model, **_tls(args))
    shapes, fit = sessions.fit_sessions(
        shapes, card.max_model_len, cap=args.sessions_from is not None
    )
    _name_result(args, card)
    return SessionPlan(shapes, card, fit)


def _execute_sessions(args, plan: SessionPlan) -> int:
    from pdserve.tuning import report, sessions

    card = plan.card
    seed = args.seed if args.prompt_seed is None else args.prompt_seed
    if plan.fit["turns_cut"]:
        print(
            f"pdserve bench: {plan.fit['turns_cut']} turns do not fit max_model_len "
            f"{card.max_model_len} and are not sent ({plan.fit['sessions_dropped']} sessions "
            f"dropped whole)",
            file=sys.stderr,
        )
    prompts = sessions.build_session_prompts(plan.sessions, card.vocab_size, seed)
    records, duration_s = sessions.run_sessions(
        args.router,
        plan.sessions,
        prompts,
        **_tls(args),
        concurrency=args.concurrency,
        session_rate=args.session_rate,
        think_time_s=args.think_time,
        think_dist=args.think_dist,
        seed=args.seed,
        model=args.model,
        request_timeout_s=args.request_timeout,
        progress=_progress(args),
    )
    percentiles = table_percentiles(args)
    summary = metrics.summarize(records, duration_s, percentiles=percentiles)
    turns = metrics.summarize_turns(records, sessions.planned_turns(plan.sessions))
    load = report.describe_sessions(args, len(plan.sessions))
    print(
        report.format_summary(
            summary, load=load, metrics=table_metrics(args), percentiles=percentiles
        )
    )
    print(report.format_turns(turns))
    if args.out:
        result = dict(
            _header(args, card, len(records)),
            kind="sessions",
            **_vllm_result(args, summary, records),
            fit=plan.fit,
            summary=summary,
            turns=turns,
            sessions=sessions.shapes_json(plan.sessions),
            requests=[r.to_json() for r in records],
        )
        _write_result(args, result)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if summary["completed"] else 1


def _requests(args) -> list[workload.RequestSpec]:
    synthetic = args.prompt_len is not None or args.output_len is not None
    if args.trace and synthetic:
        raise BenchError("give either --trace or --prompt-len/--output-len, not both")
    if not args.trace and not (args.prompt_len and args.output_len):
        raise BenchError(
            "give --trace NAME|PATH, or --prompt-len N and --output-len M (both >= 1; or "
            "--dataset-name random)"
        )
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
