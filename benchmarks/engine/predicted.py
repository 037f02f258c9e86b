"""Predicted outputs (OpenAI's Predicted Outputs) in the engine: code edits with and without the
client's prediction of the answer.

  python -m benchmarks.engine.predicted                  # ~3 min on 2 cores
  python -m benchmarks.engine.predicted --wait-idle 60 --out /tmp/predicted.json

The model is the embedded default (SmolLM2-135M-Instruct) in the default mode (dtype "auto"),
greedy, one stream at a time. Each of --tasks prompts asks for a Python module back with one
function renamed (benchmarks/engine/spec_tasks.py edit_tasks); the prediction is that module with
the rename done, as an editor would send it. Three ways, one after another per task, so that the
machine's drift falls on all alike: no speculation (an engine without it), prompt lookup (the
default mode's speculation, --k guesses at most), prompt lookup with the prediction (the same
engine; its runs of guesses up to --prediction-k, the engine's num_prediction_tokens), and
with the answer itself as the prediction (a ceiling: a retried request's client holds it). Per
way: decode tok/s = (tokens - 1) / (time of the last token - time of the first), over all
tasks; tokens compared with the way without speculation; for the prediction, the share of output
tokens that were accepted prediction guesses and the guesses rejected.

Writes benchmarks/results/predicted.json (--out): the header (command, date, commit, CPU model
and flags), per task and way the figures, and a summary.
"""

from __future__ import annotations

import time

from benchmarks.bench_common import (
    add_out_arg,
    add_wait_idle_arg,
    log,
    run_header,
    script_parser,
    wait_for_idle_machine,
    write_result,
)
from benchmarks.engine.spec_tasks import compare_tokens, edit_tasks

WAYS = ("off", "lookup", "predicted", "exact")


def _one(engine, prompt: list[int], params) -> dict:
    """One request alone: its tokens, decode rate and prediction counts."""
    engine.add_request("r", prompt, params)
    times, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            t = time.perf_counter()
            out = o.outputs[0]
            times += [t] * (len(out.token_ids) - len(times))
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return {
        "tokens": list(out.token_ids),
        "decode_s": span,
        "decode_tok_s": (len(times) - 1) / span if span > 0 else None,
        "accepted_prediction_tokens": out.accepted_prediction_tokens,
        "rejected_prediction_tokens": out.rejected_prediction_tokens,
    }


def _summary(runs: dict) -> dict:
    s = {}
    for way in WAYS:
        rs = runs[way]
        tokens = sum(len(r["tokens"]) - 1 for r in rs)
        s[f"{way}_tok_s"] = tokens / sum(r["decode_s"] for r in rs)
    for way in WAYS[1:]:
        s[f"{way}_vs_off"] = s[f"{way}_tok_s"] / s["off_tok_s"]
        s[f"{way}_tokens"] = compare_tokens(
            [r["tokens"] for r in runs["off"]], [r["tokens"] for r in runs[way]]
        )
    for way in ("predicted", "exact"):
        rs = runs[way]
        s[f"{way}_vs_lookup"] = s[f"{way}_tok_s"] / s["lookup_tok_s"]
        out = sum(len(r["tokens"]) for r in rs)
        s[f"{way}_accepted_share"] = sum(r["accepted_prediction_tokens"] for r in rs) / out
        s[f"{way}_rejected_tokens"] = sum(r["rejected_prediction_tokens"] for r in rs)
    return s


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=4, help="code edits (default 4)")
    ap.add_argument("--new", type=int, default=384, help="max_tokens (default 384)")
    ap.add_argument(
        "--k", type=int, default=4, help="num_speculative_tokens (default 4, the default mode's)"
    )
    ap.add_argument(
        "--prediction-k",
        type=int,
        default=None,
        help="num_prediction_tokens: the longest run of guesses from a prediction (default: the "
        "engine's, 16)",
    )
    add_out_arg(ap, "predicted.json")
    add_wait_idle_arg(ap, "the run")
    args = ap.parse_args(argv)
    import torch

    from pdserve.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    report = run_header("benchmarks.engine.predicted", argv)
    report.update(
        threads=args.threads,
        new=args.new,
        tasks=args.tasks,
        k=args.k,
        prediction_k=args.prediction_k,
    )
    if args.wait_idle:
        report["idle_wait"] = wait_for_idle_machine(args.wait_idle)
    log("building the engines: the default mode without and with prompt lookup")
    off = LLM("smollm2", dtype="auto", speculative_config=None)
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.prediction_k is not None:
        spec["num_prediction_tokens"] = args.prediction_k
    on = LLM("smollm2", dtype="auto", speculative_config=spec)
    tok = on.engine.tokenizer
    runs: dict = {way: [] for way in WAYS}
    for i, (messages, expected) in enumerate(edit_tasks(args.tasks)):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        plain = SamplingParams(temperature=0.0, max_tokens=args.new)
        predicted = SamplingParams(
            temperature=0.0,
            max_tokens=args.new,
            prediction_token_ids=tok.encode(expected, add_special_tokens=False),
        )
        if i == 0:  # warm both engines and let the gate measure its step costs
            for engine in (off, on):
                _one(engine.engine, prompt, SamplingParams(temperature=0.0, max_tokens=32))
        for way, engine, params in (
            ("off", off, plain),
            ("lookup", on, plain),
            ("predicted", on, predicted),
            ("exact", on, None),
        ):
            if params is None:  # the answer itself, as a retried request's client has it
                answer = runs["off"][-1]["tokens"]
                params = SamplingParams(
                    temperature=0.0, max_tokens=args.new, prediction_token_ids=answer
                )
            r = _one(engine.engine, prompt, params)
            r["prompt_tokens"] = len(prompt)
            runs[way].append(r)
            log(f"task {i} {way}: {r['decode_tok_s']:.1f} tok/s, {len(r['tokens'])} tokens")
    report["runs"] = runs
    report["summary"] = _summary(runs)
    log(f"summary: {report['summary']}")
    write_result(args.out, report)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
