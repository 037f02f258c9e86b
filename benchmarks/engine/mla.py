"""Multi-head latent attention against multi-head attention of the same size: KV bytes, the
prefill -> decode hand-off and decode steps (engine/layers/mla.py).

  python -m benchmarks.engine.mla            # ~6 min on 2 cores
  python -m benchmarks.engine.mla --quick    # smoke run: shorter contexts

Two random-weight models of the same width, written once into the pdserve cache (bench-models/),
with SmolLM2's tokenizer:
- "mla": DeepSeek-V2-Lite's attention (hidden 2048, 16 heads, kv_lora_rank 512, rope 64 / nope 128
  / v 128 dims a head, no query compression), 4 layers, every MLP dense (intermediate 5632);
- "mha": a Llama of the same hidden size, 16 heads of 128 with 16 key/value heads, the same MLPs.
Both run in float32 with a float32 KV cache (no quantization, no speculation, no prefix cache),
torch at --threads threads, in this process, one model after the other.

(1) KV: bytes a token of context holds (every layer), and what an MLA engine that caches the
expanded per-head keys and values (192 + 128 a head, as transformers' reference did before its
latent cache) would hold.
(2) Decode: B requests of C prompt tokens added at once, stepped to the end (16 new tokens
each); the median time of the steps after every request has its first token, for B in (1, 8).
(3) Hand-off: a PrefillWorker and a DecodeWorker of the model in this process, KV backend grpc:
Reserve, then Prefill of a C-token prompt (three times, fresh prompts); bytes sent, the prefill's
time and the transfer's tail after it (timings of the Prefill reply), median.

Writes benchmarks/results/mla.json (--out): the header (command, date, commit, CPU), the shapes,
each model's numbers and the summary ratios.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from benchmarks.bench_common import (
    add_out_arg,
    log,
    median,
    random_prompts,
    run_and_write,
    script_parser,
)

HIDDEN, HEADS, INTER, LAYERS = 2048, 16, 5632, 4
MLA_SHAPE = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    intermediate_size=INTER,
    num_hidden_layers=LAYERS,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    first_k_dense_replace=LAYERS,  # every MLP dense: the attention is what differs
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=1408,
    max_position_embeddings=4096,
)
MHA_SHAPE = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    head_dim=128,
    intermediate_size=INTER,
    num_hidden_layers=LAYERS,
    max_position_embeddings=4096,
)
NEW_TOKENS = 16
SEED = 7


def bench_model(name: str, model_type: str, shape: dict) -> str:
    """A random model of `shape` with SmolLM2's tokenizer, written once into the pdserve cache
    as bench-models/NAME; its folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.engine.loader import resolve_model
    from pdserve.engine.loader.resolve import default_cache_dir

    out = default_cache_dir() / "bench-models" / name
    if (out / "config.json").exists():
        return str(out)
    tok_dir = Path(resolve_model("smollm2"))
    vocab = AutoConfig.from_pretrained(tok_dir).vocab_size
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab, bos_token_id=1, eos_token_id=2, **shape
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return str(out)


ENGINE = dict(
    dtype="float32",
    quantization=None,
    kv_cache_dtype="float32",
    speculative_config=None,
    enable_prefix_caching=False,
    kv_cache_memory=3 << 30,
)


def decode_steps(model_dir: str, batch: int, context: int) -> dict:
    """(2): the median decode step of `batch` requests of `context` prompt tokens."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, max_model_len=context + NEW_TOKENS + 1, **ENGINE)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        for i, p in enumerate(random_prompts(SEED + batch, batch, context)):
            engine.add_request(f"r{i}", p, params)
        started, steps = set(), []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if len(started) == batch:
                steps.append(dt)
            started |= {o.request_id for o in outs if o.outputs and o.outputs[0].token_ids}
        return {
            "batch": batch,
            "context": context,
            "steps": len(steps),
            "step_ms": median(steps) * 1e3,
        }
    finally:
        llm.shutdown()


def hand_off(
    model_dir: str,
    context: int,
    runs: int = 3,
    backend: str = "grpc",
    prompts=None,
    tps: tuple[int, int] = (1, 1),
) -> dict:
    """(3): Reserve -> Prefill through a prefill and a decode worker (the `backend` KV backend),
    of `runs` + 1 prompts of `context` tokens (random ones, or `prompts`: the first warms);
    `tps`: the prefill and decode workers' tensor-parallel sizes."""
    import grpc

    from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
    from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
    from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc

    engine = dict(ENGINE, max_model_len=context + NEW_TOKENS + 1, kv_cache_memory=1 << 30)
    decode = DecodeWorker(
        DecodeWorkerConfig(
            model=model_dir,
            worker_id="d0",
            engine_kwargs=dict(engine, tensor_parallel_size=tps[1]),
            kv_backend=backend,
            lease_ms=60_000,
        )
    ).start()
    prefill = PrefillWorker(
        PrefillWorkerConfig(
            model=model_dir,
            worker_id="p0",
            engine_kwargs=dict(engine, tensor_parallel_size=tps[0]),
        )
    ).start()
    channels = [grpc.insecure_channel(w.address) for w in (decode, prefill)]
    d, p = (
        worker_pb2_grpc.DecodeWorkerStub(channels[0]),
        worker_pb2_grpc.PrefillWorkerStub(channels[1]),
    )
    sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    try:
        for i, prompt in enumerate(prompts or random_prompts(SEED + 100, runs + 1, context)):
            rid = f"h{i}"
            res = d.Reserve(
                worker_pb2.ReserveRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling
                ),
                timeout=300,
            )
            reply = p.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling, reservation=res
                ),
                timeout=300,
            )
            list(d.Stream(worker_pb2.StreamRequest(request_id=rid), timeout=300))
            t = reply.timings
            if i:  # the first warms both workers
                rows.append(
                    {
                        "bytes_sent": reply.bytes_sent,
                        "prefill_ms": (t.prefill_end_unix_ns - t.prefill_start_unix_ns) / 1e6,
                        "tail_ms": (t.transfer_end_unix_ns - t.prefill_end_unix_ns) / 1e6,
                    }
                )
    finally:
        for ch in channels:
            ch.close()
        prefill.stop()
        decode.stop()
    return {
        "context": context,
        "runs": rows,
        "bytes_sent": rows[0]["bytes_sent"],
        "prefill_ms": median([r["prefill_ms"] for r in rows]),
        "tail_ms": median([r["tail_ms"] for r in rows]),
    }


def measure(name: str, model_dir: str, contexts: tuple[int, int]) -> dict:
    import torch
    from transformers import AutoConfig

    from pdserve.engine.config import ModelConfig

    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    out = {"kv_bytes_per_token": mc.kv_bytes_per_token(torch.float32)}
    long_ctx, batch_ctx = contexts
    out["decode"] = []
    for batch, ctx in ((1, long_ctx), (8, batch_ctx)):
        log(f"{name}: decode, {batch} x {ctx} tokens")
        out["decode"].append(decode_steps(model_dir, batch, ctx))
    log(f"{name}: hand-off of {long_ctx} tokens")
    out["hand_off"] = hand_off(model_dir, long_ctx)
    return out


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="contexts of 256 and 128 tokens")
    ap.add_argument("--threads", type=int, default=2)
    add_out_arg(ap, "mla.json")
    args = ap.parse_args(argv)

    def run() -> dict:
        import torch

        torch.set_num_threads(args.threads)
        contexts = (256, 128) if args.quick else (2048, 1024)
        models = {
            "mla": measure("mla", bench_model("mla-v2lite-4l", "deepseek_v2", MLA_SHAPE), contexts),
            "mha": measure("mha", bench_model("mha-2048-4l", "llama", MHA_SHAPE), contexts),
        }
        expanded = LAYERS * HEADS * (MLA_SHAPE["qk_nope_head_dim"] + 64 + 128) * 4
        mla, mha = models["mla"], models["mha"]
        summary = {
            "kv_bytes_per_token": {
                "mla": mla["kv_bytes_per_token"],
                "mha": mha["kv_bytes_per_token"],
                "mla_expanded": expanded,
            },
            "kv_ratio_mha_over_mla": mha["kv_bytes_per_token"] / mla["kv_bytes_per_token"],
            "hand_off_bytes_ratio": mha["hand_off"]["bytes_sent"] / mla["hand_off"]["bytes_sent"],
            "decode_step_ms": {
                f"{d['batch']}x{d['context']}": {"mla": d["step_ms"], "mha": e["step_ms"]}
                for d, e in zip(mla["decode"], mha["decode"])
            },
            "hand_off_ms": {
                k: {"prefill": m["hand_off"]["prefill_ms"], "tail": m["hand_off"]["tail_ms"]}
                for k, m in models.items()
            },
        }
        return {
            "threads": args.threads,
            "shapes": {"mla": MLA_SHAPE, "mha": MHA_SHAPE},
            "models": models,
            "summary": summary,
        }

    return run_and_write("benchmarks.engine.mla", argv, args.out, run)


if __name__ == "__main__":
    sys.exit(main())
