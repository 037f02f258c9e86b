"""Mixture-of-experts decode throughput, engine vs HF transformers (issue #29, must-show b).

  python -m benchmarks.engine.moe              # ~5-6 min on 2 cores
  python -m benchmarks.engine.moe --quick --out /tmp/moe_quick.json   # smoke run: 8 x 16 tokens
  python -m benchmarks.engine.moe --wait-idle 300   # first wait for a quiet CPU, each side
  python -m benchmarks.engine.moe --no-served       # engine and HF only
  python -m benchmarks.engine.moe --family gpt-oss  # gpt-oss's layers at the same shape

The model: `build_moe_model(path)` saves a random-weight Mixtral (MixtralForCausalLM; HF's own
initialization, seed 0) of a realistic-but-CPU-sized shape, MOE_SHAPE below (hidden 512, 8
layers, 8 experts of intermediate 1792 with top-2 routing, GQA 8/4 heads of 64, vocab 32000,
untied head: ~0.9 GB float32), with a word-level tokenizer over its vocabulary, so the directory
serves as it is (`pdserve up --model DIR`). `--family gpt-oss` builds a GptOssForCausalLM of the
same shape instead (attention sinks, q/k/v/o biases, layers alternating a 128-token window and the
full context, YaRN, biased router and experts, clamped SwiGLU) and writes moe_decode_gpt_oss.json. Both sides load that directory in float32 and
decode greedily, torch at --threads threads, in this one process (engine first, then HF).

(1) The engine: LLM(DIR) (float32, block 16, prefix cache on), N requests of P prompt tokens
added at once (deterministic random ids, distinct prompts), `step()` until done, each step
timestamped. Decode tok/s = tokens made after the step at which every request has its first
token / the time of those steps (engine/bench.py's measure).
(2) HF: `model.generate` on the N prompts batched (equal lengths, no padding), greedy,
max_new_tokens = min_new_tokens = M. Decode tok/s = N * (M - 1) / (t_total - t_prefill), with
t_prefill the median time of the same call with max_new_tokens=1 (engine/bench.py's measure);
the per-step timestamps of a logits processor give a median-step figure too. HF's experts run
as transformers picks by default (recorded: `experts_implementation`).
(3) Served (run_served, unless --no-served): `pdserve up --model DIR` with one
prefill and one decode worker, each on 1 reserved core with --worker-threads torch threads (1),
the N prompts sent at once over gRPC, one stream each. Decode tok/s = tokens received after every
request has its first token / the time from that moment to the last token (the engine's measure,
as seen by a client). Since the workers run 1 thread each while (1) and (2) run --threads, the
engine runs again in this process at --worker-threads ("engine_worker_threads"): served vs that
compares one decode thread with one; served vs HF is the must-show's ratio (HF at --threads).
(4) Tokens: the engine's and HF's M tokens for the first --compare prompts, compared position by
position (random-weight logits are near-ties: a float32 rounding can flip one late; the first
mismatch index is recorded); and every served request's M tokens against the engine's (both
engine runs) for the same prompt.

Writes benchmarks/results/moe_decode.json (--out): the header (command, date, commit, CPU model,
count and ISA flags), the shape, each side's numbers, per-step times, the token comparisons, the
deployment's settings, and the summary ("summary": tok/s of each side, the ratios, agreement).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import threading
import time

from benchmarks.bench_common import (
    SEED_DECODE,
    SEED_WARMUP,
    CpuMonitor,
    TreeCpuMonitor,
    add_out_arg,
    add_wait_idle_arg,
    count_new_tokens,
    log,
    machine_info,
    median,
    run_header,
    script_parser,
    wait_for_idle_machine,
    write_result,
)
from benchmarks.chaos_harness import (
    START_TIMEOUT_S,
    decode_rate,
    fail_up,
    router_address,
    start_up,
    stop_up,
)

MOE_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1792,  # each expert's (3.5x hidden, as Mixtral 8x7B)
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


# the benchmark's families: transformers' config and model class names
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def build_moe_model(path, seed: int = 0, family: str = "mixtral", **overrides):
    """Save the benchmark's random-weight model of `family` (MOE_SHAPE, keys in `overrides` over
    it) and a word-level tokenizer ("t0" .. "tN" for its N ids, t0 BOS, t1 EOS) to `path`;
    returns the config's keys."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    keys = dict(MOE_SHAPE, bos_token_id=0, eos_token_id=1, pad_token_id=0, **overrides)
    config_class, model_class = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(seed)
    model = model_class(config_class(**keys)).eval()
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(keys["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1").save_pretrained(
        path
    )
    return keys


def vocab_prompts(seed: int, n: int, length: int) -> list[list[int]]:
    """Deterministic random prompts over the model's ids (2 .. vocab - 1: no BOS or EOS)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, MOE_SHAPE["vocab_size"], (n, length), generator=g).tolist()


def run_engine(model_dir: str, prompts: list[list[int]], new: int) -> dict:
    from pdserve.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype="float32", block_size=16, enable_prefix_caching=True)
    load_s = time.perf_counter() - t0
    eng = llm.engine
    try:
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(vocab_prompts(SEED_WARMUP, 2, 16), warm, use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        n = len(prompts)
        rids = [f"moe-{i}" for i in range(n)]
        made = dict.fromkeys(rids, 0)
        final: dict = {}
        steps = []  # (end time from start, duration, tokens made, every request has a token)
        mon = CpuMonitor()
        t_start = time.perf_counter()
        for rid, p in zip(rids, prompts):
            eng.add_request(rid, p, params)
        t_prev = t_start
        while len(final) < n:
            outs = eng.step()
            t_now = time.perf_counter()
            produced = count_new_tokens(outs, made, final)
            steps.append((t_now - t_start, t_now - t_prev, produced, min(made.values()) > 0))
            t_prev = t_now
        total = time.perf_counter() - t_start
        cpu = mon.stop()
        k = next(i for i, s in enumerate(steps) if s[3])
        decode_tokens = sum(s[2] for s in steps[k + 1 :])
        decode_time = steps[-1][0] - steps[k][0]
        full = [s[1] for s in steps[k + 1 :] if s[2] == n]
        return {
            "load_s": load_s,
            "t_total_s": total,
            "t_all_first_token_s": steps[k][0],
            "decode_tokens": decode_tokens,
            "decode_time_s": decode_time,
            "decode_tok_s": decode_tokens / decode_time,
            "median_step_s": median(full) if full else None,
            "decode_tok_s_median_step": n / median(full) if full else None,
            "e2e_tok_s": n * new / total,
            "step_durations_s": [round(s[1], 6) for s in steps],
            "cpu": cpu,
            "output_token_ids": [final[r].outputs[0].token_ids for r in rids],
        }
    finally:
        llm.shutdown()


def run_hf(model_dir: str, prompts: list[list[int]], new: int, prefill_repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    ids = torch.tensor(prompts)
    n, p = ids.shape

    def generate(max_new: int, clock=None):
        t = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock] if clock else []),
        )
        return out, time.perf_counter() - t

    times: list[float] = []

    def clock(_ids, scores):
        times.append(time.perf_counter())
        return scores

    warm = torch.tensor(vocab_prompts(SEED_WARMUP, 2, 16))
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False)
    prefill = [generate(1)[1] for _ in range(prefill_repeats)]
    mon = CpuMonitor()
    out, total = generate(new, clock)
    cpu = mon.stop()
    steps = [b - a for a, b in zip(times, times[1:])]
    t_prefill = median(prefill)
    return {
        "load_s": load_s,
        "experts_implementation": model.get_experts_implementation(),
        "t_prefill_s": t_prefill,
        "t_prefill_runs_s": prefill,
        "t_total_s": total,
        "decode_tok_s": n * (new - 1) / (total - t_prefill),
        "median_step_s": median(steps),
        "decode_tok_s_median_step": n / median(steps),
        "e2e_tok_s": n * new / total,
        "step_durations_s": [round(s, 6) for s in steps],
        "cpu": cpu,
        "output_token_ids": out[:, p:].tolist(),
    }


def compare(engine: list[list[int]], hf: list[list[int]]) -> list[dict]:
    rows = []
    for i, (a, b) in enumerate(zip(engine, hf)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows.append({"prompt": i, "identical": a == b, "first_mismatch": first})
    return rows


def agreement(reference: list[list[int]], served: list[list[int]]) -> dict:
    """How many of `served`'s sequences equal `reference`'s, and where the others first differ."""
    rows = compare(reference, served)
    return {
        "identical": sum(r["identical"] for r in rows),
        "of": len(rows),
        "first_mismatch": {r["prompt"]: r["first_mismatch"] for r in rows if not r["identical"]},
    }


def summarize(report: dict) -> dict:
    """The headline numbers: each side's decode tok/s, the ratios, the token agreement."""
    e, h = report["engine"], report["hf"]
    out = {
        "engine_tok_s": e["decode_tok_s"],
        "hf_tok_s": h["decode_tok_s"],
        "engine_over_hf": e["decode_tok_s"] / h["decode_tok_s"],
        "threads": report["setup"]["threads"],
    }
    s, e1 = report.get("served"), report.get("engine_worker_threads")
    if s:
        out.update(
            served_tok_s=s["decode_tok_s"],
            served_over_hf=s["decode_tok_s"] / h["decode_tok_s"],
            served_over_engine=s["decode_tok_s"] / e["decode_tok_s"],
            worker_threads=s["settings"]["worker_threads"],
            served_tokens_vs_engine=report["served_tokens"]["engine"],
        )
    if e1:
        out.update(
            engine_worker_threads_tok_s=e1["decode_tok_s"],
            served_over_engine_worker_threads=s["decode_tok_s"] / e1["decode_tok_s"],
            served_tokens_vs_engine_worker_threads=report["served_tokens"]["engine_worker_threads"],
        )
    out["like_with_like"] = (
        "engine vs HF: both in-process at `threads` torch threads. served vs "
        "engine_worker_threads: one decode worker of `worker_threads` threads vs the engine alone "
        "at as many. served vs HF (the must-show's ratio): the deployment (2 workers of "
        "`worker_threads` threads, 1 core each) vs HF at `threads` threads on the same 2 cores."
    )
    return out


# ---- served: the MoE model behind `pdserve up --model DIR` ----------------------------------
def kv_bytes(model_keys: dict, tokens: int, dtype_bytes: int = 4) -> int:
    """KV-cache bytes for `tokens` tokens of a model with these config keys."""
    head_dim = model_keys.get("head_dim") or (
        model_keys["hidden_size"] // model_keys["num_attention_heads"]
    )
    per_token = 2 * model_keys["num_hidden_layers"] * model_keys["num_key_value_heads"] * head_dim
    return per_token * dtype_bytes * tokens


def served_yaml(kv_cache_memory: int, threads: int, ray_tmp: str) -> dict:
    """The deployment YAML's keys that have no `pdserve up` flag (the model goes by --model)."""
    pool = {
        "resources": {"num_cpus": 1},
        "num_threads": threads,
        "kv_cache_memory": kv_cache_memory,
    }
    return {
        "pools": {"prefill": dict(pool), "decode": dict(pool)},
        "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
    }


def stream(stub, pb, ids: list[int], new: int, start: threading.Barrier | None = None):
    """One greedy Generate stream: [(arrival time, token ids)] per delta."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
    )
    if start is not None:
        start.wait()
    deltas = []
    for resp in stub.Generate(request, timeout=600):
        if resp.HasField("delta"):
            deltas.append((time.perf_counter(), list(resp.delta.token_ids)))
    return deltas


def run_served(
    model_dir: str, model_keys: dict, prompts: list[list[int]], new: int, threads: int = 1
) -> dict:
    """The served side: starts `pdserve up --model DIR --prefill-replicas 1 --decode-replicas 1
    --port 0 --http-port off --dtype float32 --max-model-len P+M` as a child process
    (chaos_harness.popen_up), with a small YAML for what has no flag (served_yaml: each pool's
    num_threads, resources and kv_cache_memory, sized for N sequences of P + M tokens plus a block
    each; a local Ray of 2 CPUs under a short temp dir). It reads the router's address from the
    child's stdout, warms the deployment with two short requests, sends the N prompts at once
    (one thread and one greedy Generate stream each, every delta timestamped), and stops the child
    with SIGTERM. Decode tok/s: chaos_harness.decode_rate."""
    import grpc
    import yaml

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    n, p = len(prompts), max(len(x) for x in prompts)
    block = 16
    tokens = n * (-(-(p + new) // block) + 1) * block  # each sequence's blocks, plus one
    kv = kv_bytes(model_keys, tokens)
    ray_tmp = tempfile.mkdtemp(prefix="pdray")  # short: Ray's socket paths live under it
    work = tempfile.mkdtemp(prefix="moe-served-")
    config = served_yaml(kv, threads, ray_tmp)
    config_path = os.path.join(work, "served.yaml")
    with open(config_path, "w") as f:
        yaml.safe_dump(config, f)
    command = [
        sys.executable, "-m", "pdserve", "up", config_path, "--model", model_dir,
        "--prefill-replicas", "1", "--decode-replicas", "1", "--port", "0",
        "--http-port", "off", "--dtype", "float32", "--max-model-len", str(p + new),
    ]  # fmt: skip
    settings = {
        "command": " ".join(["pdserve", *command[3:]]),
        "yaml": config,
        "kv_cache_tokens_per_pool": tokens,
        "worker_threads": threads,
        "note": "prefill and decode workers: 1 reserved core and `worker_threads` torch threads "
        "each; the router runs in the `pdserve up` process, the client threads in this one",
    }
    t0 = time.perf_counter()
    up, err_path = start_up(command, work)
    try:
        address = router_address(up, START_TIMEOUT_S)
        start_s = time.perf_counter() - t0
        log(f"served: `pdserve up` ready on {address} after {start_s:.0f} s")
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            for ids in vocab_prompts(SEED_WARMUP, 2, 16):  # warm-up, as the engine side's
                stream(stub, pb, ids, 4)
            barrier = threading.Barrier(n + 1)
            results: list = [None] * n

            def client(i: int) -> None:
                try:
                    results[i] = stream(stub, pb, prompts[i], new, barrier)
                except Exception as e:  # noqa: BLE001 - reported below
                    results[i] = e

            workers = [threading.Thread(target=client, args=(i,)) for i in range(n)]
            for w in workers:
                w.start()
            mon = TreeCpuMonitor()
            barrier.wait()
            t_start = time.perf_counter()
            for w in workers:
                w.join()
            cpu = mon.stop()
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise RuntimeError(f"{len(failed)}/{n} served requests failed: {failed[0]!r}")
        out = {
            "settings": settings,
            "start_s": start_s,
            **decode_rate(results, t_start),
            "deltas_per_request": [len(r) for r in results],
            "cpu": cpu,
            "output_token_ids": [[t for _, toks in r for t in toks] for r in results],
        }
        out["e2e_tok_s"] = sum(len(x) for x in out["output_token_ids"]) / out["t_total_s"]
        return out
    except BaseException:
        fail_up(up, err_path, "served")
        raise
    finally:
        stop_up(up)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch

    ap = script_parser(__doc__)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker-threads", type=int, default=1, help="each served worker's threads")
    ap.add_argument("--compare", type=int, default=4, help="prompts whose tokens are compared")
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 requests, 16 new tokens")
    ap.add_argument("--no-served", action="store_true", help="skip `pdserve up` (and its engine)")
    ap.add_argument("--family", choices=list(FAMILIES), default="mixtral")
    add_out_arg(ap, "moe_decode.json")
    add_wait_idle_arg(ap, "each side")
    args = ap.parse_args(argv)
    if args.family != "mixtral" and args.out.endswith("moe_decode.json"):
        args.out = args.out.replace(
            "moe_decode.json", f"moe_decode_{args.family.replace('-', '_')}.json"
        )
    if args.quick:
        args.requests, args.new_tokens = 8, 16
    torch.set_num_threads(args.threads)
    report = run_header("benchmarks.engine.moe", argv)
    report["machine"] = machine_info(args.threads)
    n, p, m = args.requests, args.prompt_len, args.new_tokens
    report["setup"] = {
        "requests": n, "prompt_len": p, "new_tokens": m, "dtype": "float32",
        "threads": args.threads, "served": not args.no_served, "family": args.family,
    }  # fmt: skip
    idle = report["wait_idle"] = {}

    def wait(side: str) -> None:
        if args.wait_idle > 0:
            idle[side] = wait_for_idle_machine(args.wait_idle)

    with tempfile.TemporaryDirectory(prefix="moe-bench-") as model_dir:
        t = time.perf_counter()
        report["model"] = build_moe_model(model_dir, family=args.family)
        report["model"]["architecture"] = FAMILIES[args.family][1]
        report["model"]["build_s"] = time.perf_counter() - t
        prompts = vocab_prompts(SEED_DECODE, n, p)
        wait("engine")
        log(f"engine: {n} requests x {p} prompt tokens, {m} new, {args.threads} threads ...")
        report["engine"] = run_engine(model_dir, prompts, m)
        gc.collect()
        if not args.no_served:
            if args.worker_threads != args.threads:
                wait("engine_worker_threads")
                log(f"engine again at the workers' {args.worker_threads} thread(s) ...")
                torch.set_num_threads(args.worker_threads)
                report["engine_worker_threads"] = run_engine(model_dir, prompts, m)
                report["engine_worker_threads"]["threads"] = args.worker_threads
                torch.set_num_threads(args.threads)
                gc.collect()
            wait("served")
            log(f"served: `pdserve up --model DIR`, 1 prefill + 1 decode, {n} streams ...")
            report["served"] = run_served(
                model_dir, report["model"], prompts, m, args.worker_threads
            )
            got = report["served"]["output_token_ids"]
            report["served_tokens"] = {
                side: agreement(report[side]["output_token_ids"], got)
                for side in ("engine", "engine_worker_threads")
                if side in report
            }
        wait("hf")
        log(f"hf: {n} sequences batched in generate, {args.threads} threads ...")
        torch.set_num_threads(args.threads)
        report["hf"] = run_hf(model_dir, prompts, m, args.prefill_repeats)
    e, h = report["engine"], report["hf"]
    k = min(args.compare, n)
    report["tokens"] = compare(e["output_token_ids"][:k], h["output_token_ids"][:k])
    report["speedup_decode"] = e["decode_tok_s"] / h["decode_tok_s"]
    report["summary"] = summary = summarize(report)
    write_result(args.out, report)
    same = sum(r["identical"] for r in report["tokens"])
    sides = [x for x in ("engine", "engine_worker_threads", "served", "hf") if x in report]
    busy = {x: report[x]["cpu"].get("foreign_cores_avg") for x in sides}
    print(f"other processes' CPU use while measured (cores): {busy}")
    print(
        f"decode tok/s: engine {e['decode_tok_s']:.1f} (median step {e['median_step_s']:.4f} s), "
        f"HF {h['decode_tok_s']:.1f} (median step {h['median_step_s']:.4f} s, experts "
        f"{h['experts_implementation']}): {report['speedup_decode']:.2f}x; tokens identical "
        f"for {same}/{k} prompts"
    )
    if "served" in report:
        ag = summary["served_tokens_vs_engine"]
        line = (
            f"served (1P+1D, {args.worker_threads} thread(s) each): {summary['served_tok_s']:.1f} "
            f"tok/s = {summary['served_over_hf']:.2f}x HF; tokens identical to the engine's for "
            f"{ag['identical']}/{ag['of']} requests"
        )
        if "engine_worker_threads_tok_s" in summary:
            line += (
                f"; engine alone at {args.worker_threads} thread(s): "
                f"{summary['engine_worker_threads_tok_s']:.1f} tok/s"
            )
        print(line)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
