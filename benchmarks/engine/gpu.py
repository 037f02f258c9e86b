"""The engine on a CUDA GPU against HF transformers on the same GPU, and against the HBM floor.

    python -m benchmarks.engine.gpu --out gpu.json                       # every section
    python -m benchmarks.engine.gpu --sections ceilings,floor8b --out x.json
    python -m benchmarks.engine.gpu --gguf PATH --sections smollm2 ...   # SmolLM2 from a GGUF
    python -m benchmarks.engine.gpu --model-dir .gpu/smollm2 --sections smollm2 ...  # random weights

Sections (each writes its results into the JSON as it finishes; an error is recorded and the next
section still runs):
- ceilings: a 2 GiB device-to-device copy (bytes read + written per second) and an 8192^3 bf16
  matrix product, the two ceilings the timings are read against.
- floor8b: a Llama-3-8B-shaped model with random weights (load_format="dummy"), batch-1 decode
  time per token with CUDA graphs (decode bursts on and off) and without, against weight bytes /
  measured copy bandwidth; a batch-1 graph replay's device time alone (CUDA events); and a
  torch.profiler count of kernels per step, their summed device time and the top 10 by time.
- smollm2: the embedded SmolLM2-135M-Instruct in bf16 (and float32): greedy tokens against HF
  transformers on the same GPU (exact matches; a divergence counts as a near tie when HF's own
  logits at that step put the two tokens within NEAR_TIE of each other); decode tok/s at 1, 32
  and 256 concurrent streams and TTFT at 512 and 2048 prompt tokens, ours (graphs on and off)
  against HF `generate`; and the batch-1 numbers of floor8b against its floor. With --model-dir
  (config and tokenizer only) the weights are random, seed 0, and the result says so.
Needs CUDA; the results go to BENCHMARKS.md ("The engine on a GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback

import torch

from benchmarks.bench_common import write_result

os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
DEVICE = (
    "cuda"  # --device cpu runs the same code on CPU at small sizes (a smoke test of the script)
)
NEAR_TIE = 0.25  # logit gap (HF's bf16 logits) under which two greedy choices count as a tie
NEW_TOKENS = 64  # greedy continuation length of the equality check
DECODE_LEN = 128  # prompt and output length of the decode throughput runs
CONCURRENCY = [1, 32, 256]
QUICK = False  # --quick: the smollm2 section's bf16 half only, no eager runs
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


PROMPTS = [
    "The capital of France is",
    "La tour Eiffel a été construite en",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a GPU.",
    "List three uses of a hash map.",
    "Disaggregated serving splits the prompt phase and the token generation phase of a large "
    "language model onto different machines, because the first is limited by compute and the "
    "second by memory bandwidth.",
]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def sync_time(fn, reps: int = 1) -> float:
    """Seconds per call of fn, after one warm-up call, between device synchronizations."""
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def ceilings() -> dict:
    n, k = (1 << 30, 8192) if DEVICE == "cuda" else (1 << 24, 512)  # bf16: 2 GiB copied
    a = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    b = torch.empty_like(a)
    copy_s = sync_time(lambda: b.copy_(a), reps=20)

    m = torch.randn(k, k, dtype=torch.bfloat16, device=DEVICE)
    mm_s = sync_time(lambda: m @ m, reps=10)
    return {
        "copy_bytes": 2 * 2 * n,
        "copy_GBps_read_plus_write": round(4 * n / copy_s / 1e9, 1),
        f"matmul_bf16_{k}_TFLOPs": round(2 * k**3 / mm_s / 1e12, 1),
    }


def weight_bytes(model: torch.nn.Module, tied: bool) -> int:
    """Bytes one decode step must read: every parameter except the input embedding (one row is
    read), unless the LM head reuses it."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def runner_for(model_dir: str, graphs: bool, dummy: bool, max_len: int = 4096):
    from transformers import AutoConfig

    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.precision import start_runner

    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    config = EngineConfig(
        model=model_dir,
        device=DEVICE,
        dtype="bfloat16",
        kv_cache_memory=2 << 30 if DEVICE == "cuda" else 256 << 20,
        max_model_len=max_len,
        max_num_seqs=256,
        cuda_graphs=graphs,
        load_format="dummy" if dummy else "auto",
    ).resolve(mc)
    return start_runner(config, mc, model_dir), mc


def batch1_ms(runner, prompt_len: int = 128, steps: int = 64, burst: bool = False) -> float:
    """Milliseconds per token of one sequence's decode through ModelRunner.execute (the engine's
    step but the scheduler: inputs, forward, greedy sampling on the GPU, the token back on the
    host); with `burst`, decode bursts allowed (engine/decode_burst.py), so most steps hand out
    tokens run ahead. The mean over the steps after the first 8, so bursts count whole."""
    from pdserve.engine.model_runner import ModelInput, SeqInput
    from pdserve.engine.sampler import SamplingRow
    from pdserve.engine.sampling_params import SamplingParams

    bs = runner.block_size
    blocks = list(range(-(-(prompt_len + steps + 8) // bs)))
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    ids = torch.randint(0, 1000, (prompt_len,)).tolist()
    row = SamplingRow(params, ids, [], None)
    if runner.bursts is not None:
        runner.bursts.allowed = burst
    tok = runner.execute(ModelInput([SeqInput(ids, 0, blocks, True)], []), [row], [0]).token_ids
    pos, token = prompt_len, tok[0]
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        tok = runner.execute(
            ModelInput([SeqInput([token], pos, blocks, True)], []), [row], [0]
        ).token_ids
        times.append(time.perf_counter() - t)  # (the token's .tolist() synchronized already)
        pos, token = pos + 1, tok[0]
    if runner.bursts is not None:
        runner.bursts.allowed = False
        runner.bursts.clear()
    return statistics.mean(times[8:]) * 1e3


def replay_ms(runner, reps: int = 20) -> dict:
    """A batch-1 decode graph's replay alone, timed by CUDA events on the device: the graph
    batch1_ms recorded last (its static inputs as that step left them)."""
    graphs = runner.graphs
    keys = [k for k in (graphs.recorded if graphs else []) if k[0] == 1]
    if DEVICE != "cuda" or not keys:
        return {"skipped": "no batch-1 graph (CUDA only)"}
    key = keys[-1]
    graph = graphs._graphs[key][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return {"bucket": list(key), "ms": round(start.elapsed_time(end) / reps, 4)}


def kernel_profile(runner, steps: int = 8) -> dict:
    """torch.profiler over `steps` batch-1 decode steps: kernels per step, their summed device
    time per step, and the 10 kernels with the most device time (where the step goes). Off
    CUDA, the CPU operators stand in for kernels."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = DEVICE == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    batch1_ms(runner, steps=10)  # warm: the graphs recorded, outside the profile
    with profile(activities=activities) as prof:
        batch1_ms(runner, steps=steps + 8)
        sync()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        on_device = "cuda" in str(getattr(e, "device_type", "")).lower()
        if on_cuda != on_device:
            continue
        us = e.time_range.elapsed_us()  # (a kernel's own time; an operator's with its children)
        t = totals.setdefault(e.name, [0, 0.0])
        t[0], t[1] = t[0] + 1, t[1] + float(us or 0.0)
    n = steps + 9  # the profiled run's prefill and decode steps
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:10]
    return {
        "kernels_per_step": round(sum(c for c, _ in totals.values()) / n, 1),
        "device_ms_per_step": round(sum(us for _, us in totals.values()) / n / 1e3, 4),
        "top10": [
            {
                "name": name[:120],
                "calls_per_step": round(c / n, 2),
                "ms_per_step": round(us / n / 1e3, 4),
            }
            for name, (c, us) in top
        ],
        "note": "kernels of the prefill step are included, spread over the steps",
    }


def batch1_entries(runner, out: dict, name: str) -> None:
    """The batch-1 numbers of one runner into out[name]: time per token (with and without
    bursts when it has graphs), the replay's device time and the kernel profile. Each part
    records its own error, so one failing part keeps the others."""
    entry = out.setdefault(name, {})
    parts = {"ms_per_token": lambda: round(batch1_ms(runner), 3)}
    if runner.graphs is not None:
        parts["ms_per_token_bursts"] = lambda: round(batch1_ms(runner, burst=True), 3)
        parts["replay"] = lambda: replay_ms(runner)
    parts["profile"] = lambda: kernel_profile(runner)
    for part, fn in parts.items():
        try:
            entry[part] = fn()
        except Exception:
            entry[part] = {"error": traceback.format_exc()[-2000:]}


def floor_entry(runner, tied: bool, copy_GBps: float) -> dict:
    nbytes = weight_bytes(runner.model, tied)
    floor_ms = nbytes / (copy_GBps * 1e9) * 1e3
    return {"weight_bytes": nbytes, "floor_ms": round(floor_ms, 4)}


def floor8b(copy_GBps: float) -> dict:
    from transformers import LlamaConfig

    out = {}
    shape = LLAMA3_8B if DEVICE == "cuda" else {**LLAMA3_8B, "num_hidden_layers": 1}
    with tempfile.TemporaryDirectory() as d:
        LlamaConfig(**shape).save_pretrained(d)
        for graphs in (True, False):
            runner, _ = runner_for(d, graphs, dummy=True)
            name = "graphs" if graphs else "eager"
            out[name] = floor_entry(runner, False, copy_GBps)
            batch1_entries(runner, out, name)
            over_floor(out[name])
            del runner
            empty_cache()
    return out


def over_floor(entry: dict) -> None:
    """Each batch-1 time of `entry` as a multiple of its floor."""
    for key in ("ms_per_token", "ms_per_token_bursts"):
        if isinstance(entry.get(key), float):
            entry[key.replace("ms_per_token", "over_floor")] = round(
                entry[key] / entry["floor_ms"], 2
            )


# ---- SmolLM2 ------------------------------------------------------------------------------------
def smollm2_dir(gguf: str | None) -> str:
    from pdserve.engine.loader.resolve import resolve_model

    return str(resolve_model(gguf or "smollm2"))


def random_weights_dir(config_dir: str, into: str) -> str:
    """A checkpoint in `into`: the model of config_dir's config.json with random weights (seed
    0, float32 safetensors) and config_dir's tokenizer files, for HF and the engine alike."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(into, safe_serialization=True)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(into)
    del model
    return into


def prompts_for(tok) -> list[list[int]]:
    """PROMPTS as chat turns and as plain text: 16 prompts."""
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    return [tok.encode(t, add_special_tokens=False) for t in chats + PROMPTS]


def hf_greedy_logits(hf, ids: list[int], n: int):
    """HF's greedy continuation and the logits at each step (its own KV cache, batch 1)."""
    x = torch.tensor([ids], device=DEVICE)
    past, out, logits = None, [], []
    with torch.inference_mode():
        for _ in range(n):
            step = hf(x if past is None else x[:, -1:], past_key_values=past, use_cache=True)
            past = step.past_key_values
            row = step.logits[0, -1].float()
            logits.append(row)
            out.append(int(row.argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]], device=DEVICE)], dim=1)
    return out, logits


def equality(model_dir: str, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine import LLM, SamplingParams

    tdtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompts_for(tok)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).to(DEVICE).eval()
    llm = LLM(model_dir, device=DEVICE, dtype=dtype, kv_cache_memory=1 << 30, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    exact, ties, diverged = 0, [], []
    for ids, mine in zip(prompts, ours):
        ref, logits = hf_greedy_logits(hf, ids, NEW_TOKENS)
        if mine == ref:
            exact += 1
            continue
        d = next(i for i, (a, b) in enumerate(zip(mine, ref)) if a != b)
        gap = float(logits[d][ref[d]] - logits[d][mine[d]])
        (ties if gap <= NEAR_TIE else diverged).append({"at": d, "gap": round(gap, 4)})
    recorded = list(llm.engine.runner.graphs.recorded) if llm.engine.runner.graphs else []
    del llm, hf
    empty_cache()
    return {
        "prompts": len(prompts),
        "new_tokens": NEW_TOKENS,
        "exact": exact,
        "near_ties": ties,
        "diverged": diverged,
        "graphs_recorded": [list(k) for k in recorded],
    }


def ours_decode(model_dir: str, concurrency: int, graphs: bool) -> dict:
    """Decode tokens/s at `concurrency` streams of DECODE_LEN-token prompts and answers: the
    second of two rounds on one engine, so the decode graphs of every shape the round reaches
    (and the Triton kernels' compiles) are made in the first; that round's figures are kept as
    `first_round`, what the first requests after a start pay."""
    from pdserve.engine import LLM

    llm = LLM(
        model_dir,
        device=DEVICE,
        dtype="bfloat16",
        kv_cache_memory=4 << 30,
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        cuda_graphs=graphs,
    )
    first = _decode_round(llm.engine, concurrency, seed=1)  # other prompts: no prefix hits
    result = _decode_round(llm.engine, concurrency, seed=0) | {"first_round": first}
    del llm
    empty_cache()
    return result


def _decode_round(engine, concurrency: int, seed: int) -> dict:
    from pdserve.engine import RequestOutputKind, SamplingParams

    # as a decode worker runs its requests: outputs carry what is new, the router makes the text
    params = SamplingParams(
        temperature=0,
        max_tokens=DECODE_LEN,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )
    gen = torch.Generator().manual_seed(seed)
    for i in range(concurrency):
        ids = torch.randint(100, 40000, (DECODE_LEN,), generator=gen).tolist()
        engine.add_request(f"s{seed}-{i}", ids, params)
    # tokens so far per request; the clock starts once every prompt has its first token
    lens: dict[str, int] = {}
    t0, base = None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            lens[o.request_id] = lens.get(o.request_id, 0) + len(o.outputs[0].token_ids)
        if t0 is None and len(lens) == concurrency:
            sync()
            t0, base = time.perf_counter(), sum(lens.values())
    elapsed = time.perf_counter() - t0
    tokens = sum(lens.values()) - base
    return {
        "tok_s": round(tokens / elapsed, 1),
        "ms_per_step": round(elapsed * 1e3 * concurrency / tokens, 3),
    }


def hf_decode(hf, concurrency: int) -> dict:
    """HF generate on `concurrency` prompts of DECODE_LEN tokens: decode tok/s is the output
    tokens after the first over (time of DECODE_LEN new tokens - time of 1)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(100, 40000, (concurrency, DECODE_LEN), generator=gen).to(DEVICE)
    mask = torch.ones_like(x)

    def run(n):
        with torch.inference_mode():
            hf.generate(
                input_ids=x,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )

    one = sync_time(lambda: run(1))
    full = sync_time(lambda: run(DECODE_LEN))
    elapsed = full - one
    return {
        "tok_s": round(concurrency * (DECODE_LEN - 1) / elapsed, 1),
        "ms_per_step": round(elapsed * 1e3 / (DECODE_LEN - 1), 3),
    }


def ours_ttft(model_dir: str, length: int, reps: int = 5) -> float:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(
        model_dir,
        device=DEVICE,
        dtype="bfloat16",
        kv_cache_memory=2 << 30,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    times = []
    for i in range(reps + 1):
        ids = torch.randint(100, 40000, (length,), generator=gen).tolist()
        t = time.perf_counter()
        llm.engine.add_request(f"t{i}", ids, params)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        times.append(time.perf_counter() - t)
    del llm
    empty_cache()
    return round(statistics.median(times[1:]) * 1e3, 3)


def hf_ttft(hf, length: int, reps: int = 5) -> float:
    x = torch.randint(100, 40000, (1, length)).to(DEVICE)

    def run():
        with torch.inference_mode():
            int(hf(x).logits[0, -1].argmax())

    run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 3)


def smollm2(gguf: str | None, copy_GBps: float, out: dict, model_dir: str | None = None) -> None:
    """Fills `out` section by section (what finished stays when a later part fails). With
    model_dir (SmolLM2's config.json and tokenizer only), the model has random weights."""
    if model_dir is None:
        smollm2_parts(smollm2_dir(gguf), copy_GBps, out)
        return
    with tempfile.TemporaryDirectory() as d:
        out["weights"] = f"random (seed 0) from {model_dir}/config.json: not SmolLM2's own"
        smollm2_parts(random_weights_dir(model_dir, d), copy_GBps, out)


def smollm2_parts(model_dir: str, copy_GBps: float, out: dict) -> None:
    from transformers import AutoModelForCausalLM

    out["model_dir"] = model_dir
    for dtype in ("bfloat16", "float32")[: 1 if QUICK else 2]:
        out[f"greedy_vs_hf_{dtype}"] = equality(model_dir, dtype)
    for graphs in (True, False)[: 1 if QUICK else 2]:
        runner, mc = runner_for(model_dir, graphs, dummy=False)
        name = "batch1_floor" if graphs else "batch1_eager"
        out[name] = floor_entry(runner, mc.tie_word_embeddings, copy_GBps)
        batch1_entries(runner, out, name)
        over_floor(out[name])
        del runner
        empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    out["ttft_ms"] = {}
    for length in (512, 2048):
        out["ttft_ms"][length] = {
            "ours": ours_ttft(model_dir, length),
            "hf": hf_ttft(hf, length),
        }
    out["decode"] = {}
    for c in CONCURRENCY:
        out["decode"][c] = {"ours_graphs": ours_decode(model_dir, c, True)}
        if not QUICK:
            out["decode"][c]["ours_eager"] = ours_decode(model_dir, c, False)
        out["decode"][c]["hf_generate"] = hf_decode(hf, c)


def environment() -> dict:
    import transformers

    if DEVICE != "cuda":
        from pdserve.engine.cpu import cpu_features

        return {"device": cpu_features().describe(), "torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    try:
        import flash_attn  # noqa: F401

        fa = flash_attn.__version__
    except ImportError:
        fa = None
    return {
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "memory_GiB": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "flash_attn": fa,
        "sdpa_flash": torch.backends.cuda.flash_sdp_enabled(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": os.environ.get("PDSERVE_COMMIT", ""),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="ceilings,floor8b,smollm2")
    ap.add_argument("--gguf", default=None, help="SmolLM2's GGUF (default: the embedded one)")
    ap.add_argument(
        "--model-dir",
        default=None,
        help="SmolLM2's config.json and tokenizer only: the smollm2 section runs it with "
        "random weights (seed 0), the same for HF and the engine",
    )
    ap.add_argument("--quick", action="store_true", help="smollm2: bf16 only, no eager runs")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", default="1,32,256")
    args = ap.parse_args(argv)
    global DEVICE, CONCURRENCY, NEW_TOKENS, QUICK
    QUICK = args.quick
    DEVICE, CONCURRENCY = args.device, [int(c) for c in args.concurrency.split(",")]
    if DEVICE == "cpu":  # the smoke test's sizes
        NEW_TOKENS = 8
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs CUDA")
    result: dict = {"environment": environment()}
    copy_GBps = None

    def save():
        write_result(args.out, result, "benchmarks.engine.gpu", argv)

    for name in args.sections.split(","):
        t = time.perf_counter()
        try:
            if name == "ceilings":
                result[name] = ceilings()
                copy_GBps = result[name]["copy_GBps_read_plus_write"]
            else:
                copy_GBps = copy_GBps or ceilings()["copy_GBps_read_plus_write"]
                if name == "floor8b":
                    result[name] = floor8b(copy_GBps)
                else:
                    result[name] = {}
                    smollm2(args.gguf, copy_GBps, result[name], args.model_dir)
        except Exception:
            result.setdefault(name, {})["error"] = traceback.format_exc()
        result[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(name, json.dumps(result[name], default=str)[:3000], flush=True)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
