"""Log-likelihood requests on long prompts (issue #47's must-show b): what lm-evaluation-harness
sends for a log-likelihood task, on a 7,000-token prompt, through a real deployment
(`deploy.launcher.up()` of the embedded SmolLM2, 1 prefill + 1 decode worker, the README's
example), with short requests sent to the same prefill worker meanwhile.

  python -m benchmarks.robustness.loglikelihood                  # ~15 min on a quiet 2-core machine
  python -m benchmarks.robustness.loglikelihood --prompt-tokens 3000 --shorts 3

The run, on HTTP /v1/completions:
  1. a short request alone (--short-tokens prompt tokens, max_tokens=1, streamed), --alone times:
     its time to first token (TTFT) alone;
  2. (i) a long request with vLLM's prompt_logprobs=1 and max_tokens=1; --short-delay-s after it
     starts, and then every --short-every-s seconds while it runs, a short request as in 1;
  3. (ii) the same with what lm-evaluation-harness's local-completions model sends for
     log-likelihood (lm_eval/models/openai_completions.py, 0.4.13: model, the prompt as a batch of
     token id lists, temperature 0, max_tokens 1, logprobs 1, seed 1234, echo true), with the
     short requests as in 2.
Checks: each long request answers 200 with one logprob per prompt token (the first None: nothing
precedes it) and, for echo, the generated token's too; every short request's TTFT during a long
prefill is within --ttft-slack-s (default 2 s) of the median TTFT alone. Every figure is in the
result file (benchmarks/results/loglikelihood.json).
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time

from benchmarks.bench_common import (
    add_out_arg,
    log,
    random_prompts,
    run_and_write,
    script_parser,
)
from benchmarks.chaos_harness import deployment, example_config

MODULE = "benchmarks.robustness.loglikelihood"


def post(url: str, body: dict, timeout_s: float) -> tuple[int, dict | None, float, float | None]:
    """(status, the JSON body or None, seconds to the whole answer, seconds to its first byte of
    content: the first streamed chunk when body["stream"], else None)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    t0 = time.monotonic()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        resp = conn.getresponse()
        if not body.get("stream"):
            data = resp.read()
            took = time.monotonic() - t0
            try:
                return resp.status, json.loads(data), took, None
            except ValueError:
                return resp.status, {"raw": data[:500].decode(errors="replace")}, took, None
        first = None
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data: ") and first is None and line.strip() != b"data: [DONE]":
                first = time.monotonic() - t0
        return resp.status, None, time.monotonic() - t0, first
    finally:
        conn.close()


def short_ttft(url: str, prompt: list[int], model: str) -> dict:
    body = dict(
        model=model, prompt=prompt, max_tokens=1, temperature=0, stream=True, ignore_eos=True
    )
    status, _, took, first = post(url, body, 600)
    return {
        "status": status,
        "ttft_s": round(first, 3) if first else None,
        "total_s": round(took, 3),
    }


def long_body(kind: str, prompt: list[int], model: str) -> dict:
    if kind == "prompt_logprobs":  # vLLM's extra field
        return dict(model=model, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=1)
    # lm-evaluation-harness 0.4.13, LocalCompletionsAPI._create_payload(generate=False)
    return dict(
        model=model, prompt=[prompt], temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True
    )


def check_long(kind: str, status: int, data: dict | None, n: int) -> dict:
    """What the long answer holds: the logprob counts and whether they are right."""
    out = {"status": status}
    if status != 200 or not data or "choices" not in data:
        out["error"] = data
        out["ok"] = False
        return out
    choice = data["choices"][0]
    if kind == "prompt_logprobs":
        lps = choice.get("prompt_logprobs") or []
        out["prompt_logprobs"] = len(lps)
        out["ok"] = len(lps) == n and lps[0] is None and all(e for e in lps[1:])
    else:
        lp = choice.get("logprobs") or {}
        tokens = lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or []
        out["token_logprobs"], out["top_logprobs"] = len(tokens), len(tops)
        # the prompt's n (the first None), then the generated token's
        out["ok"] = (
            len(tokens) == n + 1
            and tokens[0] is None
            and all(isinstance(v, float) for v in tokens[1:])
            and len(tops) == n + 1
        )
        # what lm-evaluation-harness computes from it (parse_logprobs, ctxlen 1)
        out["sum_logprob_1_to_n"] = round(sum(tokens[1:-1]), 3) if out["ok"] else None
    return out


def long_with_shorts(url: str, kind: str, prompt, shorts, args, model: str) -> dict:
    result: dict = {}

    def run_long():
        t0 = time.monotonic()
        status, data, took, _ = post(url, long_body(kind, prompt, model), args.timeout_s)
        result.update(check_long(kind, status, data, len(prompt)), took_s=round(took, 1))
        result["finished_at"] = time.monotonic() - t0

    t0 = time.monotonic()
    thread = threading.Thread(target=run_long, daemon=True)
    thread.start()
    during = []
    next_at = args.short_delay_s
    for i, short in enumerate(shorts):
        while time.monotonic() - t0 < next_at and thread.is_alive():
            time.sleep(0.05)
        if not thread.is_alive():
            break
        sent = time.monotonic() - t0
        row = short_ttft(url, short, model)
        row["sent_at_s"] = round(sent, 2)
        row["long_running_after"] = thread.is_alive()
        during.append(row)
        log(f"{kind}: short #{i} at +{sent:.1f} s: TTFT {row['ttft_s']} s")
        next_at = sent + args.short_every_s
    thread.join(args.timeout_s)
    result["shorts_during"] = during
    log(f"{kind}: {result.get('status')} in {result.get('took_s')} s, ok={result.get('ok')}")
    return result


def run(args) -> dict:
    data = example_config(port=0)
    data["router"]["http_port"] = 0  # a free port: another deployment may hold 8000
    if args.prefill_step_target_s is not None:  # the engine's long-prefill policy, to compare
        data["pools"]["prefill"]["prefill_step_target_s"] = args.prefill_step_target_s
    model = "smollm2"
    prompt = random_prompts(7, 1, args.prompt_tokens)[0]
    shorts = random_prompts(8, args.alone + 2 * args.shorts, args.short_tokens)
    report: dict = {
        "prompt_tokens": args.prompt_tokens,
        "short_tokens": args.short_tokens,
        "prefill_step_target_s": data["pools"]["prefill"].get("prefill_step_target_s", "default"),
        "deployment": "deploy/examples/local-cpu.yaml, 1 prefill + 1 decode, router and HTTP ports free ones",
    }
    times: dict = {}
    with deployment(data, "bench/loglikelihood", times) as (cluster, _):
        url = cluster.http_url
        short_ttft(url, shorts[0], model)  # the first request's one-time costs, not counted
        alone = [short_ttft(url, s, model) for s in shorts[1 : args.alone + 1]]
        ttfts = [r["ttft_s"] for r in alone if r["ttft_s"] is not None]
        base = statistics.median(ttfts) if ttfts else None
        report["short_alone"] = alone
        report["short_alone_median_ttft_s"] = base
        log(f"short alone: median TTFT {base} s over {len(ttfts)}")
        rest = shorts[args.alone + 1 :]
        for kind, batch in (
            ("prompt_logprobs", rest[: args.shorts]),
            ("echo_logprobs", rest[args.shorts :]),
        ):
            report[kind] = long_with_shorts(url, kind, prompt, batch, args, model)
    report.update(times)
    slack = args.ttft_slack_s
    during = [r for k in ("prompt_logprobs", "echo_logprobs") for r in report[k]["shorts_during"]]
    report["checks"] = {
        "long_requests_ok": all(report[k].get("ok") for k in ("prompt_logprobs", "echo_logprobs")),
        "shorts_during": len(during),
        "shorts_within_slack": sum(
            1
            for r in during
            if base is not None and r["ttft_s"] is not None and r["ttft_s"] <= base + slack
        ),
        "ttft_slack_s": slack,
        "worst_short_ttft_during_s": max((r["ttft_s"] or 1e9 for r in during), default=None),
    }
    log(f"checks: {report['checks']}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=7000)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--alone", type=int, default=5, help="short requests alone, for the baseline")
    ap.add_argument("--shorts", type=int, default=4, help="short requests during each long one")
    ap.add_argument("--short-delay-s", type=float, default=2.0)
    ap.add_argument("--short-every-s", type=float, default=15.0)
    ap.add_argument("--ttft-slack-s", type=float, default=2.0)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument(
        "--prefill-step-target-s",
        type=float,
        default=None,
        help="the prefill pool's prefill_step_target_s (0: the policy off); default: the YAML's",
    )
    add_out_arg(ap, "loglikelihood.json")
    args = ap.parse_args(argv)
    return run_and_write(MODULE, argv, args.out, lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
