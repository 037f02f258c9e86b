"""Issue #30 item 2: which grammar library masks the decode worker's logits, measured on this CPU.

    python -m experiments.structured_mask_cost [--tokens 200] [--out PATH]

With the embedded model's tokenizer (smollm2, vocab 49152), each library compiles a few JSON
schemas (cold, then again: cached) and then walks a fixed valid JSON document token by token,
timing per token: filling the next-token bitmask, applying the bitmask to a float32 logits row,
and advancing the matcher by the token. Libraries: xgrammar and llguidance (outlines-core where
it imports). Result: experiments/results/structured_mask_cost.json; the pick and why:
docs/experiments/structured-output-library.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time

import torch

from benchmarks.bench_common import REPO_ROOT, log, machine_info, run_header, write_result
from pdserve.engine.structured.grammar import apply_bitmask

VOCAB = 49152

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "enum_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["color", "tags"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "email": {"type": "string"},
                    "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}},
                },
                "required": ["id", "email", "roles"],
            },
            "active": {"type": "boolean"},
            "score": {"type": "number"},
        },
        "required": ["user", "active", "score"],
    },
    "any_object": {"type": "object"},
    # bounded strings and numeric ranges (benchmarks/engine/structured_output.py's schemas have them)
    "bounded": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "count": {"type": "integer", "minimum": 0, "maximum": 9999},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["name", "count", "price", "tags"],
        "additionalProperties": False,
    },
}

DOCS = {
    "flat": {"name": "Ada Lovelace", "age": 36},
    "enum_array": {"color": "green", "tags": ["math", "engine", "poetry"]},
    "nested": {
        "user": {"id": 1815, "email": "ada@example.org", "roles": ["admin", "dev"]},
        "active": True,
        "score": 99.5,
    },
    "any_object": {"a": [1, 2, {"b": "c"}], "d": None, "e": "some text here"},
    "bounded": {"name": "Ada Lovelace", "count": 1815, "price": 99.5, "tags": ["math", "poet"]},
}


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "median_us": round(statistics.median(xs) * 1e6, 2),
        "p90_us": round(xs[int(0.9 * (len(xs) - 1))] * 1e6, 2),
        "mean_us": round(statistics.fmean(xs) * 1e6, 2),
    }


def _walk(new_matcher, fill, apply, accept, ids: list[int], logits: torch.Tensor, bitmask) -> dict:
    """Times fill/apply/accept per token of `ids` on a fresh matcher, and the engine's own apply
    (pdserve.engine.structured.grammar.apply_bitmask) of the same bitmask."""
    m = new_matcher()
    t_fill, t_apply, t_accept, t_own = [], [], [], []
    for t in ids:
        row = logits.clone()
        own = logits.clone().view(1, -1)
        t0 = time.perf_counter()
        fill(m)
        t1 = time.perf_counter()
        apply(row)
        t2 = time.perf_counter()
        ok = accept(m, t)
        t3 = time.perf_counter()
        apply_bitmask(own, bitmask, [0])
        t4 = time.perf_counter()
        if not torch.equal(own.view(-1), row):
            raise RuntimeError("the engine's apply differs from the library's")
        t_own.append(t4 - t3)
        if not ok:
            raise RuntimeError(f"token {t} rejected")
        if row[t].item() == float("-inf"):
            raise RuntimeError(f"token {t} masked although accepted")
        t_fill.append(t1 - t0)
        t_apply.append(t2 - t1)
        t_accept.append(t3 - t2)
    return {
        "tokens": len(ids),
        "fill_bitmask": _stats(t_fill),
        "apply_to_logits": _stats(t_apply),
        "accept_token": _stats(t_accept),
        "engine_apply_to_logits": _stats(t_own),
        "total_median_us": round(
            (statistics.median(t_fill) + statistics.median(t_apply) + statistics.median(t_accept))
            * 1e6,
            2,
        ),
    }


def measure_xgrammar(tok, hf_dir) -> dict:
    import xgrammar as xgr

    out = {"version": importlib.metadata.version("xgrammar"), "schemas": {}}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    out["tokenizer_setup_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    logits = torch.randn(VOCAB)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    for name, schema in SCHEMAS.items():
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        s = json.dumps(schema)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(s, any_whitespace=False)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile_json_schema(s, any_whitespace=False)
        cached = time.perf_counter() - t0
        ids = tok.encode(json.dumps(DOCS[name]), add_special_tokens=False) + [tok.eos_token_id]

        def apply(row):
            xgr.apply_token_bitmask_inplace(row.view(1, -1), bitmask)

        walk = _walk(
            lambda c=compiled: xgr.GrammarMatcher(c),
            lambda m: m.fill_next_token_bitmask(bitmask, 0),
            apply,
            lambda m, t: m.accept_token(t),
            ids,
            logits,
            bitmask,
        )
        out["schemas"][name] = {
            "compile_cold_ms": round(cold * 1e3, 2),
            "compile_cached_ms": round(cached * 1e3, 4),
            **walk,
        }
    return out


def measure_llguidance(tok, hf_dir) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    out = {"version": importlib.metadata.version("llguidance"), "schemas": {}}
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    out["tokenizer_setup_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    logits = torch.randn(VOCAB)
    bitmask = lltorch.allocate_token_bitmask(1, VOCAB)
    for name, schema in SCHEMAS.items():
        s = json.dumps(schema)
        # "compile": the grammar text, checked, and a first matcher (llguidance builds its lexer
        # lazily as matchers advance); "cached": what the engine does per sequence once the spec
        # is compiled, a deep_copy of that matcher (engine/structured/grammar.py)
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            s, defaults={"whitespace_flexible": False}
        )
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        first = llguidance.LLMatcher(lltok, grammar)
        cold = time.perf_counter() - t0
        if error or first.is_error():
            raise RuntimeError(error or first.get_error())
        t0 = time.perf_counter()
        first.deep_copy()
        again = time.perf_counter() - t0
        # llguidance's compact JSON has no space after "," and ":" (xgrammar's has one)
        doc = json.dumps(DOCS[name], separators=(",", ":"))
        ids = tok.encode(doc, add_special_tokens=False) + [tok.eos_token_id]

        def apply(row):
            lltorch.apply_token_bitmask_inplace(row.view(1, -1), bitmask)

        def accept(m, t):
            return m.consume_token(t)

        walk = _walk(
            lambda f=first: f.deep_copy(),
            lambda m: lltorch.fill_next_token_bitmask(m, bitmask, 0),
            apply,
            accept,
            ids,
            logits,
            bitmask,
        )
        out["schemas"][name] = {
            "compile_cold_ms": round(cold * 1e3, 2),
            "compile_cached_ms": round(again * 1e3, 4),
            **walk,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=f"{REPO_ROOT}/experiments/results/structured_mask_cost.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    hf_dir = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    report = {
        **run_header("experiments.structured_mask_cost", argv),
        "machine": machine_info(1),
        "model": "smollm2",
        "vocab": VOCAB,
        "note": "per token, one logits row, one thread; apply_to_logits = the library's CPU bitmask "
        "apply, engine_apply_to_logits = pdserve.engine.structured.grammar.apply_bitmask; JSON without free "
        "whitespace, as the engine compiles it",
        "libraries": {},
    }
    for lib, fn in (("xgrammar", measure_xgrammar), ("llguidance", measure_llguidance)):
        log(f"measuring {lib}")
        try:
            report["libraries"][lib] = fn(tok, hf_dir)
        except Exception as e:  # recorded, the other library still runs
            report["libraries"][lib] = {"error": f"{type(e).__name__}: {e}"}
    try:
        import outlines_core  # noqa: F401

        report["libraries"]["outlines-core"] = {"error": "installed but not measured"}
    except ImportError:
        report["libraries"]["outlines-core"] = {"error": "not installed (pip: no wheel tried)"}
    write_result(args.out, report)
    print(json.dumps(report["libraries"], indent=1))


if __name__ == "__main__":
    main()
