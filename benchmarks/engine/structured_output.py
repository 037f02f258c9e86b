"""Must-show b of issue #30 item 2: structured output through `pdserve up`.

    python -m benchmarks.engine.structured_output [--requests 200] [--concurrency 8] [--max-tokens 600]
    python -m benchmarks.engine.structured_output --router HOST:PORT --http http://HOST:PORT   # running

Starts the cluster `pdserve up` starts (experiments/http_cluster.py, --cluster up: a local Ray,
one prefill and one decode worker of the embedded smollm2), then:

1. sends --requests chat completions, each with a JSON schema of its own (generated from the
   seed: nested objects, enums, arrays, integers, numbers, booleans; strings, arrays and numbers
   bounded, so every output has an end a small model reaches) as OpenAI's
   response_format json_schema, --concurrency at a time, sampled (temperature 0.7); every output
   is parsed and validated against its schema with the `jsonschema` package;
2. reads the workers' WorkerStats before and after: rows the grammar masked and the time the
   mask took (fill the bitmask + apply it to the logits), per token, on each worker, and the
   grammar compiles;
3. sends --greedy-prompts completions greedily twice, without a schema and with one that any text
   satisfies (the regex `[\\s\\S]*`): the texts must be equal.

Result: benchmarks/results/structured_output.json.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time
import urllib.request

from benchmarks.bench_common import (
    add_out_arg,
    log,
    machine_info,
    run_header,
    script_parser,
    write_result,
)

ANY_TEXT = r"[\s\S]*"
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "red", "green", "blue", "north", "south"]
FIELDS = ["name", "id", "city", "score", "tags", "active", "level", "kind", "owner", "price"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(4, 16)}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 9999])}
    if kind == "number":
        # multipleOf bounds the decimals (else a small model may write digits until max_tokens);
        # 0.5, exact in binary: jsonschema's float check calls 1.15 no multiple of 0.01
        return {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.5}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"enum": rng.sample(WORDS, rng.randint(2, 5))}


def _node(rng: random.Random, depth: int) -> dict:
    r = rng.random()
    if depth > 0 and r < 0.3:
        return _object(rng, depth - 1)
    if r < 0.5:
        return {"type": "array", "items": _leaf(rng), "minItems": 1, "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(FIELDS, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {n: _node(rng, depth) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def schemas(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, depth=rng.randint(0, 2)) for _ in range(n)]


def _post(http: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(
        http + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _one(http: str, i: int, schema: dict, max_tokens: int, seed: int) -> dict:
    import jsonschema

    body = {
        "messages": [
            {
                "role": "user",
                "content": f"Write record {i} as JSON with fields {list(schema['properties'])}.",
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": seed + i,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": f"record_{i}", "schema": schema, "strict": True},
        },
    }
    t0 = time.monotonic()
    doc = _post(http, "/v1/chat/completions", body)
    choice = doc["choices"][0]
    text = choice["message"]["content"]
    out = {
        "i": i,
        "finish_reason": choice["finish_reason"],
        "completion_tokens": doc["usage"]["completion_tokens"],
        "latency_s": round(time.monotonic() - t0, 3),
    }
    try:
        jsonschema.validate(json.loads(text), schema)
        out["valid"] = True
    except Exception as e:  # recorded: the check is that none is invalid
        out.update(valid=False, error=f"{type(e).__name__}: {str(e)[:200]}", text=text[:400])
    return out


def worker_stats(router) -> dict:
    """role -> the structured-output counters of WorkerStats, straight from each worker."""
    from pdserve.protos.pdserve.v1 import worker_pb2

    out = {}
    for w in router.pool.members():
        s = w.stub.Stats(worker_pb2.StatsRequest(), timeout=10)
        out[w.role] = {
            k: getattr(s, k)
            for k in (
                "structured_rows",
                "structured_mask_ns",
                "grammar_compiles",
                "grammar_compile_ns",
            )
        }
    return out


def mask_cost(before: dict, after: dict) -> dict:
    out = {}
    for role in after:
        d = {k: after[role][k] - before.get(role, {}).get(k, 0) for k in after[role]}
        rows = d["structured_rows"]
        out[role] = {
            "masked_rows": rows,
            "mask_us_per_token": round(d["structured_mask_ns"] / rows / 1e3, 2) if rows else None,
            "grammar_compiles": d["grammar_compiles"],
            "compile_ms_per_grammar": round(
                d["grammar_compile_ns"] / d["grammar_compiles"] / 1e6, 2
            )
            if d["grammar_compiles"]
            else None,
        }
    return out


def greedy_equality(http: str, n: int, max_tokens: int) -> dict:
    prompts = [f"Tell me one fact about the number {k}." for k in range(n)]
    same, diffs = 0, []
    for p in prompts:
        base = {"prompt": p, "max_tokens": max_tokens, "temperature": 0}
        free = _post(http, "/v1/completions", base)["choices"][0]["text"]
        shaped = _post(http, "/v1/completions", {**base, "structured_outputs": {"regex": ANY_TEXT}})
        shaped = shaped["choices"][0]["text"]
        if free == shaped:
            same += 1
        else:
            diffs.append({"prompt": p, "free": free[:200], "with_schema": shaped[:200]})
    return {
        "regex": ANY_TEXT,
        "prompts": n,
        "max_tokens": max_tokens,
        "equal": same,
        "diffs": diffs,
    }


def main(argv: list[str] | None = None) -> None:
    from experiments import http_cluster

    ap = script_parser(__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--greedy-prompts", type=int, default=10)
    ap.add_argument("--greedy-max-tokens", type=int, default=48)
    ap.add_argument("--router", default=None, help="a running router's gRPC address")
    ap.add_argument("--http", default=None, help="a running router's HTTP base URL")
    ap.add_argument("--seed", type=int, default=30)
    add_out_arg(ap, "structured_output.json")
    http_cluster.add_args(ap)
    args = ap.parse_args(argv)
    report = {**run_header("benchmarks.engine.structured_output", argv), "machine": machine_info(1)}
    cluster, _, http, how = http_cluster.open_cluster(args)
    report["cluster"] = how
    router = cluster.router if cluster is not None else None
    try:
        log("warm-up")
        _post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        before = worker_stats(router) if router is not None else {}
        shapes = schemas(args.seed, args.requests)
        t0 = time.monotonic()
        log(f"{args.requests} requests with their own JSON schemas, {args.concurrency} at a time")
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            results = list(
                pool.map(
                    lambda a: _one(http, a[0], a[1], args.max_tokens, args.seed),
                    enumerate(shapes),
                )
            )
        wall = time.monotonic() - t0
        after = worker_stats(router) if router is not None else {}
        valid = sum(r["valid"] for r in results)
        report["schemas"] = {
            "requests": len(results),
            "valid": valid,
            "invalid": [r for r in results if not r["valid"]],
            "finish_reasons": {
                k: sum(r["finish_reason"] == k for r in results)
                for k in {r["finish_reason"] for r in results}
            },
            "completion_tokens": sum(r["completion_tokens"] for r in results),
            "wall_s": round(wall, 1),
            "example_schema": shapes[0],
        }
        report["mask_cost"] = mask_cost(before, after) if after else None
        log(f"valid {valid}/{len(results)}; mask cost {report['mask_cost']}")
        log("greedy: no schema against a schema any text satisfies")
        report["greedy_any_text"] = greedy_equality(
            http, args.greedy_prompts, args.greedy_max_tokens
        )
        log(f"greedy equal: {report['greedy_any_text']['equal']}/{args.greedy_prompts}")
    finally:
        if cluster is not None:
            cluster.stop()
    write_result(args.out, report)
    print(json.dumps({k: report[k] for k in ("schemas", "mask_cost", "greedy_any_text")}, indent=1))


if __name__ == "__main__":
    main()
