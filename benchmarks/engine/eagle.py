"""Speculative decoding with an EAGLE-3 head against prompt lookup and none, on open-ended answers
(where there is little to copy), in the engine.

  python -m benchmarks.engine.eagle_train   # once: the head (~15 min on 2 cores, to the cache)
  python -m benchmarks.engine.eagle         # ~8 min on 2 cores
  python -m benchmarks.engine.eagle --quick --out /tmp/eagle_quick.json

The model is the embedded default (SmolLM2-135M-Instruct) in the default mode (dtype "auto"), the
head the one benchmarks/engine/eagle_train.py trained here (no head is published for it); the
prompts ask about benchmarks/engine/eagle_train.py's EVAL_TOPICS, which its training never saw,
in the chat template, greedy, max_tokens --new. Three engines side by side in this process: no
speculation, prompt lookup ({"method": "ngram", "num_speculative_tokens": 4}, what the default
mode turns on) and the head ({"method": "eagle3", "num_speculative_tokens": --k}); each prompt
runs alone on each in turn (the machine's drift over minutes falls on all three alike), after
two throwaway requests that warm each engine and let its gate measure step costs. Decode tok/s
= (tokens - 1) / (time of the last token - time of the first), over all prompts; acceptance and
guesses kept per position from the engine's spec_stats; tokens compared with the engine without.

Writes benchmarks/results/eagle.json (--out): the header (command, date, commit, CPU model and
flags), the head's training figures (its train.json), per engine the figures, and the ratios.
"""

from __future__ import annotations

import gc
import json
import os
import time

from benchmarks.bench_common import add_out_arg, log, run_header, script_parser, write_result
from benchmarks.engine.eagle_train import EVAL_TOPICS, TEMPLATES, head_dir
from benchmarks.engine.spec_decode import spec_delta
from benchmarks.engine.spec_tasks import compare_tokens


def _specs(k: int) -> dict:
    return {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "eagle3": {"method": "eagle3", "model": head_dir(), "num_speculative_tokens": k},
    }


def _one(engine, prompt: list[int], new: int) -> tuple[list[int], float | None]:
    """One request alone: its tokens and its decode tok/s."""
    from pdserve.engine import SamplingParams

    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=new))
    times, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = out.outputs[0].token_ids
            times += [time.perf_counter()] * (len(got) - len(times))
            tokens = list(got)
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return tokens, rate


def _spec_delta(engine, before: dict) -> dict:
    out = spec_delta(engine, before)
    out["accepted_per_draft"] = out["spec_accepted_tokens"] / max(1, out["spec_drafts"])
    return out


def run(args) -> dict:
    import torch

    from pdserve.engine import LLM
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(resolve_model("smollm2"))
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": TEMPLATES[i % len(TEMPLATES)].format(topic)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i, topic in enumerate(EVAL_TOPICS[: args.prompts])
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    with open(os.path.join(head_dir(), "train.json")) as f:
        trained = json.load(f)
    llms = {
        name: LLM("smollm2", speculative_config=spec, dtype=args.dtype)
        for name, spec in _specs(args.k).items()
    }
    engines = {name: llm.engine for name, llm in llms.items()}
    try:
        for e in engines.values():
            for p in prompts[:2]:
                _one(e, p, 32)
        before = {name: e.spec_stats() for name, e in engines.items()}
        tokens = {name: [] for name in engines}
        rates = {name: [] for name in engines}
        for p in prompts:
            for name, e in engines.items():
                t, r = _one(e, p, args.new)
                tokens[name].append(t)
                rates[name].append(r)
        out = {}
        for name, e in engines.items():
            made = sum(len(t) - 1 for t in tokens[name])
            took = sum((len(t) - 1) / r for t, r in zip(tokens[name], rates[name]) if r)
            out[name] = {
                "mode_note": e.mode_note,
                "decode_tok_s": made / took,
                "per_prompt_tok_s": rates[name],
                "spec": _spec_delta(e, before[name]) if e.spec is not None else None,
                "tokens_vs_off": compare_tokens(tokens["off"], tokens[name]),
            }
        base = out["off"]["decode_tok_s"]
        summary = {
            name: {
                "decode_tok_s": o["decode_tok_s"],
                "ratio": o["decode_tok_s"] / base,
                "acceptance": (o["spec"] or {}).get("acceptance"),
                "accepted_per_draft": (o["spec"] or {}).get("accepted_per_draft"),
                "accepted_per_pos": (o["spec"] or {}).get("spec_accepted_per_pos"),
                "tokens_equal": o["tokens_vs_off"]["equal"],
            }
            for name, o in out.items()
        }
        return {"head_training": trained, "engines": out, "summary": summary}
    finally:
        for llm in llms.values():
            llm.shutdown()
        gc.collect()


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(EVAL_TOPICS))
    ap.add_argument("--new", type=int, default=192, help="max_tokens a prompt (default 192)")
    ap.add_argument("--k", type=int, default=3, help="the head's guesses a step (default 3)")
    ap.add_argument("--dtype", default="auto", help="the engines' dtype (default auto)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 prompts x 32 tokens")
    add_out_arg(ap, "eagle.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new = 3, 32
    report = run_header("benchmarks.engine.eagle", argv)
    report.update(threads=args.threads, new=args.new, k=args.k, prompts=args.prompts)
    report["dtype"] = args.dtype
    report.update(run(args))
    write_result(args.out, report)
    log(f"summary: {json.dumps(report['summary'], indent=1)}")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
