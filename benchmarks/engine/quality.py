"""Quality per serving mode: perplexity on real text and greedy agreement with float32.

  python -m benchmarks.engine.quality                          # float32, bfloat16, int8, int4: ~10 min on 2 cores
  python -m benchmarks.engine.quality --modes float32 --tokens 4096
  python -m benchmarks.engine.quality --modes float32,default,int8 --tokens 2048 --window 2048   # issue #48 c, d

Mode "default" is what `LLM("smollm2")` serves: quantization="auto" and kv_cache_dtype="auto"
(its mode note says what the probe chose). Per mode, besides the corpus perplexity: the
teacher-forced top-1 agreement with float32 over the scored tokens (the share of positions whose
most likely next token is float32's, `prompt_logprobs=1`), the perplexity of the probe text
that quantization="auto" judges modes on (engine/quality.py; bound: QUALITY_BOUNDS), and the
greedy answer to the README's `pdserve chat` example through the chat template.

Corpus: the Python Language Reference topics that every CPython ships for `help()`
(`pydoc_data.topics.topics`: English technical prose, offline on every machine, and the same for
a given Python version, which the result records). The first `--tokens` tokens are cut into
windows of `--window` tokens, and perplexity is exp(mean negative log-likelihood) of every token
after the first of each window, from `SamplingParams(prompt_logprobs=0)`. Greedy agreement: per
mode, the share of `--prompts` varied prompts whose `--new` greedy tokens equal float32's, and the
mean share of tokens before the first divergence. Every mode runs in this process one after the
other, with the same threads; writes benchmarks/results/quality.json.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time

from benchmarks.bench_common import (
    add_out_arg,
    log,
    run_header,
    script_parser,
    write_result,
)

MODES = {
    "float32": dict(dtype="float32"),
    "default": dict(),
    "bfloat16": dict(dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int8-kvbf16": dict(dtype="float32", quantization="int8", kv_cache_dtype="bfloat16"),
    "int4": dict(dtype="float32", quantization="int4"),
}

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Photosynthesis is the process by which",
    "Once upon a time, in a village by the sea,",
    "The three laws of thermodynamics state that",
    "import numpy as np\n\n# compute the mean of each column\n",
    "A list of the planets of the solar system, in order from the sun:",
    "The French Revolution began in 1789 when",
    "To make a cup of tea, first",
    "SELECT name, COUNT(*) FROM orders",
    "The most important idea in machine learning is",
    "Dear hiring manager, I am writing to apply for",
]
QUESTIONS = [
    "What is the boiling point of water at sea level?",
    "Explain recursion to a child in two sentences.",
    "Write a haiku about autumn.",
    "What are the main differences between Python lists and tuples?",
]


def corpus_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the corpus (its 79 topics joined in sorted order, 465 KB,
    tokenized with the model's tokenizer). The int8 mode calibrates, and dtype="auto" probes, on
    the corpus's last 1,024 tokens (engine/quality.py), which this benchmark never scores."""
    from pdserve.engine.quality import corpus_ids as all_ids

    ids = all_ids(tokenizer)
    if len(ids) < num_tokens:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than --tokens {num_tokens}")
    return ids[:num_tokens]


def windows(ids: list[int], size: int, bos: int | None) -> list[list[int]]:
    """`ids` cut into windows of `size` tokens, each starting with BOS when the model has one."""
    step = size - (1 if bos is not None else 0)
    out = []
    for a in range(0, len(ids) - 1, step):
        chunk = ids[a : a + step]
        if len(chunk) >= 2:
            out.append(([bos] if bos is not None else []) + chunk)
    return out


def chat_ids(tokenizer, question: str) -> list[int]:
    """`question` as one user turn through the chat template (as `pdserve chat` sends it)."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompts_for(tokenizer) -> list[list[int]]:
    """The greedy-agreement prompts: plain text and a code start, then chat-templated questions
    when the model has a chat template."""
    out = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    if getattr(tokenizer, "chat_template", None):
        out += [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True
            )
            for q in QUESTIONS
        ]
    return [list(p["input_ids"] if hasattr(p, "keys") else p) for p in out]


README_QUESTION = "What is the capital of France?"


def perplexity(rows, ids):
    from pdserve.engine.quality import perplexity as ppl

    return ppl(rows, ids)


def run_mode(args, name: str, texts: list[list[int]], prompts: list[list[int]], extra) -> dict:
    from pdserve.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    # windows prefilled in chunks: every chunk after the first reads its context back from the KV
    # cache, so a narrower cache (int8-kvbf16) shows in the perplexity, not only in greedy decoding
    llm = LLM(
        args.model,
        max_model_len=max(args.window, 2048),
        max_num_batched_tokens=args.chunk,
        **MODES[name],
    )
    load_s = time.perf_counter() - t0
    mode_note = llm.engine.mode_note
    try:
        t0 = time.perf_counter()
        outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        nll, n, top1 = 0.0, 0, []
        for out, ids in zip(outs, texts):
            # the BOS's successor is scored too: it is a corpus token
            for p in range(1, len(ids)):
                row = out.prompt_logprobs[p]
                nll -= row[ids[p]]
                top1.append(max(row, key=row.__getitem__))
                n += 1
        ppl_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True),
            use_tqdm=False,
        )
        greedy = [list(o.outputs[0].token_ids) for o in gen]
        greedy_s = time.perf_counter() - t0
        probe, readme = extra
        out = llm.generate([probe], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        probe_ppl = perplexity(out[0].prompt_logprobs[1:], probe)
        readme_out = llm.generate(
            [readme], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
        )[0].outputs[0]
    finally:
        llm.shutdown()
    result = {
        "perplexity": math.exp(nll / n),
        "scored_tokens": n,
        "windows": len(texts),
        "mode_note": mode_note,
        "greedy": greedy,
        "top1": top1,
        "probe_perplexity": probe_ppl,
        "readme_answer": readme_out.text,
        "readme_tokens": list(readme_out.token_ids),
        "load_s": round(load_s, 1),
        "perplexity_s": round(ppl_s, 1),
        "greedy_s": round(greedy_s, 1),
    }
    log(f"{name}: perplexity {result['perplexity']:.4f} over {n} tokens ({ppl_s:.0f} s)")
    return result


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--modes", default="float32,bfloat16,int8,int4", help=f"of {sorted(MODES)}; float32 first"
    )
    p.add_argument("--tokens", type=int, default=20480)
    p.add_argument("--window", type=int, default=512)
    p.add_argument(
        "--chunk",
        type=int,
        default=128,
        help="prompt tokens per step (windows are prefilled in chunks)",
    )
    p.add_argument("--new", type=int, default=32, help="greedy tokens per agreement prompt")
    p.add_argument("--threads", type=int, default=2)
    add_out_arg(p, "quality.json")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if modes[0] != "float32" or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: float32 first, then any of {sorted(MODES)}")
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    import torch

    from pdserve.engine.loader import resolve_model
    from pdserve.engine.quality import PROBE_TOKENS, QUALITY_BOUNDS, probe_ids
    from pdserve.engine.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(resolve_model(args.model))
    texts = windows(corpus_ids(tokenizer, args.tokens), args.window, tokenizer.bos_token_id)
    prompts = prompts_for(tokenizer)
    probe = probe_ids(tokenizer, PROBE_TOKENS)
    readme = chat_ids(tokenizer, README_QUESTION)
    results = {m: run_mode(args, m, texts, prompts, (probe, readme)) for m in modes}
    ref_ppl, ref = results["float32"]["perplexity"], results["float32"]["greedy"]
    f32 = results["float32"]
    ref_top1 = f32["top1"]
    for m, r in results.items():
        r["perplexity_vs_float32"] = r["perplexity"] / ref_ppl - 1
        r["top1_agreement"] = sum(a == b for a, b in zip(r["top1"], ref_top1)) / len(ref_top1)
        r["probe_perplexity_vs_float32"] = r["probe_perplexity"] / f32["probe_perplexity"] - 1
        r["readme_as_float32"] = r["readme_tokens"] == f32["readme_tokens"]
        del r["top1"]
        same = [a == b for a, b in zip(r["greedy"], ref)]
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) / len(b)
            for a, b in zip(r["greedy"], ref)
        ]
        r["greedy_identical"] = f"{sum(same)}/{len(same)}"
        r["greedy_prefix_share"] = statistics.mean(prefix)
        # a KV variant keeps its weights' bound; the default's is the mode it chose
        bound = QUALITY_BOUNDS.get(m.split("-")[0])
        r["bound"] = bound
        r["pass"] = None if bound is None else r["perplexity_vs_float32"] <= bound
    report = {
        **run_header("benchmarks.engine.quality", argv),
        "threads": args.threads,
        "corpus": f"pydoc_data.topics of Python {platform.python_version()}, sorted topics, "
        f"first {args.tokens} tokens, windows of {args.window} prefilled {args.chunk} tokens per step",
        "modes": results,
    }
    write_result(args.out, report)
    print(
        "| mode | perplexity | vs float32 | bound | greedy identical to float32 "
        "| mean share before first divergence | top-1 agreement | probe text vs float32 "
        "| README answer as float32's |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m, r in results.items():
        bound = (
            "-" if r["bound"] is None else f"<= +{r['bound']:.0%} {'PASS' if r['pass'] else 'FAIL'}"
        )
        print(
            f"| {m} | {r['perplexity']:.4f} | {r['perplexity_vs_float32']:+.2%} | {bound} "
            f"| {r['greedy_identical']} | {r['greedy_prefix_share']:.0%} "
            f"| {r['top1_agreement']:.2%} | {r['probe_perplexity_vs_float32']:+.2%} "
            f"| {'yes' if r['readme_as_float32'] else 'no'} |"
        )
    for m, r in results.items():
        print(f"{m}: {r['mode_note']}\n  README answer: {r['readme_answer']!r}")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
