"""The engine on a CUDA GPU against HF transformers on the same GPU, and against the HBM floor.

    python -m benchmarks.engine.gpu --out gpu.json                       # every section
    python -m benchmarks.engine.gpu --sections ceilings,floor8b --out x.json
    python -m benchmarks.engine.gpu --gguf PATH --sections smollm2 ...   # SmolLM2 from a GGUF

Sections (each writes its results into the JSON as it finishes; an error is recorded and the next
section still runs):
- ceilings: a 2 GiB device-to-device copy (bytes read + written per second) and an 8192^3 bf16
  matrix product, the two ceilings the timings are read against.
- floor8b: a Llama-3-8B-shaped model with random weights (load_format="dummy"), batch-1 decode
  time per token with and without CUDA graphs, against weight bytes / measured copy bandwidth.
- smollm2: the embedded SmolLM2-135M-Instruct in bf16 (and float32): greedy tokens against HF
  transformers on the same GPU (exact matches; a divergence counts as a near tie when HF's own
  logits at that step put the two tokens within NEAR_TIE of each other); decode tok/s at 1, 32
  and 256 concurrent streams and TTFT at 512 and 2048 prompt tokens, ours (graphs on and off)
  against HF `generate`; and batch-1 time per token against the floor.
Needs CUDA; the results go to BENCHMARKS.md ("The engine on a GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def batch1_ms(runner, prompt_len: int = 128, steps: int = 64) -> float:
    """Milliseconds per decode step of one sequence, through ModelRunner.execute (the engine's
    step: inputs, forward, greedy sampling on the GPU, the token back on the host)."""
    from pdserve.engine.model_runner import ModelInput, SeqInput
    from pdserve.engine.sampler import SamplingRow
    from pdserve.engine.sampling_params import SamplingParams

    bs = runner.block_size
    blocks = list(range(-(-(prompt_len + steps + 8) // bs)))
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    ids = torch.randint(0, 1000, (prompt_len,)).tolist()
    row = SamplingRow(params, ids, [], None)
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
    return statistics.median(times[4:]) * 1e3


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
            ms = batch1_ms(runner)
            entry = floor_entry(runner, False, copy_GBps)
            entry.update(ms_per_token=round(ms, 3), over_floor=round(ms / entry["floor_ms"], 2))
            out["graphs" if graphs else "eager"] = entry
            del runner
            empty_cache()
    return out


# ---- SmolLM2 ------------------------------------------------------------------------------------
def smollm2_dir(gguf: str | None, config_dir: str | None = None) -> str:
    """SmolLM2 as a model folder: from its GGUF, or (config_dir: its config and tokenizer
    alone, for a machine the GGUF cannot travel to) with random weights of its shape, drawn
    once with a fixed seed and saved, so HF and the engine load the same ones."""
    if config_dir is None:
        from pdserve.engine.loader.resolve import resolve_model

        return str(resolve_model(gguf or "smollm2"))
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tempfile.mkdtemp(prefix="smollm2-random-")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_dir)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in os.listdir(config_dir):
        if not os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(config_dir, name), out)
    return out


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
    from pdserve.engine import LLM, SamplingParams

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
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=DECODE_LEN, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(concurrency):
        ids = torch.randint(100, 40000, (DECODE_LEN,), generator=gen).tolist()
        engine.add_request(f"r{i}", ids, params)
    # tokens so far per request; the clock starts once every prompt has its first token
    lens: dict[str, int] = {}
    t0, base = None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            lens[o.request_id] = len(o.outputs[0].token_ids)
        if t0 is None and len(lens) == concurrency:
            sync()
            t0, base = time.perf_counter(), sum(lens.values())
    elapsed = time.perf_counter() - t0
    tokens = sum(lens.values()) - base
    del llm
    empty_cache()
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


def smollm2(args, copy_GBps: float, out: dict) -> None:
    """Fills `out` section by section (what finished stays when a later part fails)."""
    from transformers import AutoModelForCausalLM

    model_dir = out["model_dir"] = smollm2_dir(args.gguf, args.model_dir)
    out["weights"] = "random, SmolLM2's shape" if args.model_dir else "the GGUF's"
    for dtype in ("bfloat16", "float32")[: 1 if args.quick else 2]:
        out[f"greedy_vs_hf_{dtype}"] = equality(model_dir, dtype)
    runner, mc = runner_for(model_dir, True, dummy=False)
    entry = floor_entry(runner, mc.tie_word_embeddings, copy_GBps)
    ms = batch1_ms(runner)
    entry.update(ms_per_token=round(ms, 3), over_floor=round(ms / entry["floor_ms"], 2))
    out["batch1_floor"] = entry
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
        if not args.quick:
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
        "--model-dir", default=None, help="SmolLM2's config and tokenizer: random weights"
    )
    ap.add_argument("--quick", action="store_true", help="smollm2: bf16 only, no eager runs")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", default="1,32,256")
    args = ap.parse_args(argv)
    global DEVICE, CONCURRENCY, NEW_TOKENS
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
                    smollm2(args, copy_GBps, result[name])
        except Exception:
            result.setdefault(name, {})["error"] = traceback.format_exc()
        result[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(name, json.dumps(result[name], default=str)[:3000], flush=True)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
