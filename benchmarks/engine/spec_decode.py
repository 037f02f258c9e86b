"""Speculative decoding in the engine, with and without, on copy-heavy prompts (issue #31,
must-shows a, c and d; the served figures are benchmarks/engine/spec_served.py's).

  python -m benchmarks.engine.spec_decode                  # ~6 min on 2 cores
  python -m benchmarks.engine.spec_decode --wait-idle 300  # first wait for a quiet CPU, each pair
  python -m benchmarks.engine.spec_decode --quick --out /tmp/spec_quick.json

The model is the embedded default (SmolLM2-135M-Instruct), the prompts benchmarks/engine/spec_tasks.py's
(edit a given piece of code, quote a given text, summarize a given text) in its chat template,
greedy. Each pair builds two engines side by side in this one process, without speculation and
with it, torch at --threads threads, and runs the same workloads on both, alternating between
them so that the machine's drift over minutes (several percent here) falls on both alike:

  ngram:  dtype "auto" (the default mode: quantization picked by its probe) with and without
          {"method": "ngram", "num_speculative_tokens": 4};
  draft:  float32 with and without {"method": "draft_model", "model": "self",
          "quantization": "int4", "num_speculative_tokens": 4}: the target's own int4 copy.

Workloads: (1) one stream: each of --prompts copy tasks alone, max_tokens --new; decode tok/s =
(tokens - 1) / (time of the last token - time of the first), per prompt and over all of them;
(2) 32 concurrent streams (copy_tasks(32), max_tokens --new32) added at once, --rounds times on
each engine (off, on, off, on, ...); decode tok/s = tokens made after the step at which every
request had its first token / the time of those steps; the ratio is the median round's, with
every round's kept.
Before each, two throwaway requests warm the engine and let the gate (engine/spec/gate.py)
measure its step costs. Tokens of every request are compared with the run without speculation;
acceptance is the engine's spec_stats over the measured part.

Writes benchmarks/results/spec_decode.json (--out): the header (command, date, commit, CPU model
and flags), per pair and workload the figures, the ratios and the token comparisons.
"""

from __future__ import annotations

import gc
import statistics
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
from benchmarks.engine.spec_tasks import compare_tokens, copy_tasks

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {
    "method": "draft_model",
    "model": "self",
    "quantization": "int4",
    "num_speculative_tokens": 4,
}
PAIRS = {"ngram": ({"dtype": "auto"}, NGRAM), "draft": ({"dtype": "float32"}, DRAFT)}


def _prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        for _, msgs in copy_tasks(n)
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def spec_delta(engine, before: dict) -> dict:
    now = engine.spec_stats()
    out = {k: now[k] - before.get(k, 0) for k in now if k != "spec_accepted_per_pos"}
    old = before.get("spec_accepted_per_pos") or [0] * len(now["spec_accepted_per_pos"])
    out["spec_accepted_per_pos"] = [a - b for a, b in zip(now["spec_accepted_per_pos"], old)]
    drafted = out["spec_draft_tokens"]
    out["acceptance"] = out["spec_accepted_tokens"] / drafted if drafted else None
    return out


def _run(engine, prompts: list[list[int]], new: int) -> dict:
    """All prompts at once; per request its tokens and token times, and the decode rate."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    times: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
    tokens: dict[str, list[int]] = {}
    steps: list[tuple[float, int]] = []  # (end time, tokens made in the step)
    while engine.has_unfinished_requests():
        made = 0
        outs = engine.step()
        t = time.perf_counter()
        for out in outs:
            got = out.outputs[0].token_ids
            made += len(got) - len(times[out.request_id])
            times[out.request_id] += [t] * (len(got) - len(times[out.request_id]))
            if out.finished:
                tokens[out.request_id] = list(got)
        steps.append((t, made))
    t_all = max(ts[0] for ts in times.values())
    after = sum(m for t, m in steps if t > t_all)
    t_last = steps[-1][0]
    per = [
        (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else None
        for ts in times.values()
    ]
    return {
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
        "decode_tok_s": after / (t_last - t_all) if t_last > t_all else None,
        "per_request_tok_s": per,
        "num_tokens": sum(len(v) for v in tokens.values()),
    }


def _engines(kwargs: dict, spec: dict, pair_name: str):
    """The pair's two engines, built side by side in this process: off (no speculation), on."""
    from pdserve.engine import LLM

    log(f"{pair_name}: building the engines without and with {spec}")
    return LLM("smollm2", speculative_config=None, **kwargs), LLM(
        "smollm2", speculative_config=spec, **kwargs
    )


def _pair(kwargs: dict, spec: dict, name: str, prompts1, prompts32, args) -> dict:
    """Each workload on both engines, alternating between them (the machine's speed drifts by
    several percent over minutes: one engine's run after the other's would carry that drift into
    the ratio). One stream: prompt by prompt, off then on; 32 streams: --rounds rounds, each off
    then on; per round the ratio, and the summary's the median round."""
    llms = _engines(kwargs, spec, name)
    engines = {"off": llms[0].engine, "on": llms[1].engine}
    try:
        out = {
            side: {
                "mode_note": e.mode_note,
                "spec_note": e.spec.mode_note if e.spec else None,
                "one_stream": {"tokens": [], "per_prompt_tok_s": []},
            }
            for side, e in engines.items()
        }
        for e in engines.values():
            _run(e, prompts1[:2], 32)  # warm-up: shapes built, step costs measured
        before = engines["on"].spec_stats()
        for p in prompts1:
            for side, e in engines.items():
                r = _run(e, [p], args.new)
                out[side]["one_stream"]["tokens"].append(r["tokens"][0])
                out[side]["one_stream"]["per_prompt_tok_s"].append(r["per_request_tok_s"][0])
        out["on"]["one_stream"]["spec"] = spec_delta(engines["on"], before)
        for side in engines:
            o = out[side]["one_stream"]
            made = sum(len(t) - 1 for t in o["tokens"])
            took = sum((len(t) - 1) / r for t, r in zip(o["tokens"], o["per_prompt_tok_s"]) if r)
            o["decode_tok_s"] = made / took
        if prompts32:
            for e in engines.values():
                _run(e, prompts32[:8], 16)
            before = engines["on"].spec_stats()
            rounds = {"off": [], "on": []}
            for _ in range(args.rounds):
                for side, e in engines.items():
                    rounds[side].append(_run(e, prompts32, args.new32))
            for side in engines:
                out[side]["streams32"] = {
                    "rounds_tok_s": [r["decode_tok_s"] for r in rounds[side]],
                    "tokens": rounds[side][0]["tokens"],
                }
            out["on"]["streams32"]["spec"] = spec_delta(engines["on"], before)
            out["streams32_round_tokens"] = [
                compare_tokens(a["tokens"], b["tokens"])
                for a, b in zip(rounds["off"], rounds["on"])
            ]
        return out
    finally:
        for llm in llms:
            llm.shutdown()
        del llms, engines
        gc.collect()


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3, help="one-stream prompts (default 3)")
    ap.add_argument("--new", type=int, default=256, help="one-stream max_tokens (default 256)")
    ap.add_argument("--new32", type=int, default=128, help="32-stream max_tokens (default 128)")
    ap.add_argument("--rounds", type=int, default=5, help="32-stream rounds per engine (default 5)")
    ap.add_argument("--pairs", default="ngram,draft")
    ap.add_argument("--no-32", action="store_true", help="one stream only")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 prompt x 32 tokens")
    add_out_arg(ap, "spec_decode.json")
    add_wait_idle_arg(ap, "each pair")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new, args.new32, args.rounds = 1, 32, 16, 1
    import torch

    from pdserve.engine.loader import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(resolve_model("smollm2"))
    prompts1 = _prompts(tok, args.prompts)
    prompts32 = [] if args.no_32 else _prompts(tok, 8 if args.quick else 32)
    report = run_header("benchmarks.engine.spec_decode", argv)
    report.update(threads=args.threads, new=args.new, new32=args.new32, rounds=args.rounds)
    report["pairs"] = {}
    summary = {}
    for name in args.pairs.split(","):
        kwargs, spec = PAIRS[name]
        if args.wait_idle:
            report.setdefault("idle_waits", {})[name] = wait_for_idle_machine(args.wait_idle)
        pair = _pair(kwargs, spec, name, prompts1, prompts32, args)
        off, on = pair["off"], pair["on"]
        pair.update(engine_kwargs=kwargs, speculative_config=spec)
        s = {
            "one_stream_off_tok_s": off["one_stream"]["decode_tok_s"],
            "one_stream_on_tok_s": on["one_stream"]["decode_tok_s"],
            "one_stream_tokens": compare_tokens(
                off["one_stream"]["tokens"], on["one_stream"]["tokens"]
            ),
            "one_stream_acceptance": on["one_stream"]["spec"]["acceptance"],
        }
        s["one_stream_ratio"] = s["one_stream_on_tok_s"] / s["one_stream_off_tok_s"]
        if prompts32:
            offs, ons = off["streams32"]["rounds_tok_s"], on["streams32"]["rounds_tok_s"]
            ratios = [b / a for a, b in zip(offs, ons)]
            same = pair["streams32_round_tokens"]
            s.update(
                streams32_off_tok_s=statistics.median(offs),
                streams32_on_tok_s=statistics.median(ons),
                streams32_round_ratios=ratios,
                streams32_ratio=statistics.median(ratios),
                streams32_tokens={
                    "equal": min(c["equal"] for c in same),
                    "of": same[0]["of"],
                    "rounds": len(same),
                    "first_mismatch": [c["first_mismatch"] for c in same],
                },
                streams32_acceptance=on["streams32"]["spec"]["acceptance"],
                streams32_drafts=on["streams32"]["spec"]["spec_drafts"],
            )
        pair["summary"] = summary[name] = s
        report["pairs"][name] = pair
        log(f"{name}: {s}")
        write_result(args.out, report)
    report["summary"] = summary
    write_result(args.out, report)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
