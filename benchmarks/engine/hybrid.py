"""Hybrid and state-space models on CPU: Qwen3.5 (Gated DeltaNet linear attention beside gated
full attention), Granite 4.0-H (Mamba2 beside attention without position encoding) and Falcon
Mamba (the first Mamba alone): decode and prefill throughput, engine vs HF transformers, and
what a sequence's state costs.

  python -m benchmarks.engine.hybrid                   # every family, ~5 min on 2 cores
  python -m benchmarks.engine.hybrid --family granite-4.0-h
  python -m benchmarks.engine.hybrid --quick           # smoke run: batches 1 and 4, 16 new tokens

The models: random weights (HF's own initialization, seed 0) of CPU size, FAMILIES below, each
hidden 1024 in 8 layers (in the hybrids, 3 and 7 attend in full; MLP 3584), vocab 32000 with a
word-level tokenizer (~0.5 GB float32 for the hybrids). Qwen3.5's linear layers have 16 key and 16 value heads of 128, its
attention 8 heads of 256 over 2 key/value heads with a quarter of each head rotated; Granite
4.0-H's Mamba2 layers 32 heads of 64 with a state of 128 and one B/C group, its attention 8 heads
of 128 over 2, a dense (shared) MLP, as Granite 4.0-H Micro; Falcon Mamba's 8 layers the first
Mamba's mixer alone (inner 2048, state 16, time-step rank 64: no attention, no MLP, no KV; its
hand-off over grpc only, shm having no pool to write into). Each is written once into the
pdserve cache (bench-models/). Both sides load it in float32 and decode greedily in this one
process, torch at --threads threads (engine first, then HF; transformers runs its own torch
fallbacks of the layers' CUDA kernels on CPU, as a user without them gets).

Per family:
(1) Decode, for each batch B: B requests of P prompt tokens at once, M new tokens each; the
engine's decode tok/s (tokens after every request has its first / their steps' time) and HF's
(`generate`, (M - 1) x B over its time less its prefill's), as benchmarks/engine/moe.py measures
them (its run_engine and run_hf), and whether the first --compare sequences agree.
(2) Prefill: one prompt of --prefill-len tokens, the time to its first token, median of three,
each side.
(3) State: bytes of one sequence's recurrent state, and the KV bytes a token holds (the full
layers only), as the engine sizes them; the hand-off moves both.
(4) Hand-off: a PrefillWorker and a DecodeWorker of the model in this process
(benchmarks/engine/mla.py hand_off), Reserve then Prefill of a --prefill-len prompt, three times
after one that warms, over grpc and over shm (the KV in place, the state on shm's control
channel), then over grpc from a prefill worker of two tensor-parallel ranks and to a decode
worker of two (the state joined from, or cut for, the ranks' parts): bytes sent, the prefill's
time and the transfer's tail after it, medians.
(5) A conversation's next turn: a --prefill-len prompt answered with 32 tokens, then the next
turn (that history, the answer and 32 new tokens) timed to its first token, with the prefix cache
on (its recurrent layers start from the state kept after the answer) and off, three
conversations each, medians; and the tokens the cache served.
(6) More conversations than kept states: 8 conversations' first turns (as in (5)) on an engine
whose kv_cache_memory holds 4 state slots and as much KV again (3,696 tokens of Qwen3.5's),
then each one's next turn timed to its first token, in the same order, with a host tier
(kv_host_tier_bytes 256 MiB: the states that lose their slots, and the blocks the cache evicts,
go there and come back) and without one; medians, the tokens the cache served, what the tier
stored and restored.
(7) A next turn through the prefill pool, with peer fetch and without: a prefill and a decode
worker in this process (grpc); turn 1 (a --prefill-len prompt) answered with 128 tokens, then
turn 2 (that history and 32 new tokens) prefilled by the same prefill worker, which holds turn
1's prompt (its state at the prompt's last block boundary) but not the answer: with a peer fetch
it pulls the blocks the decode worker holds and the state kept after them (where turn 1's decode
last passed a block boundary) and computes the rest, without one it computes the answer too.
The Prefill call's seconds (the fetch, the prefill and the hand-off), three conversations each,
medians; the tokens fetched and the bytes.

Writes benchmarks/results/hybrid.json (--out): the header (command, date, commit, CPU model and
ISA flags), and per family the shape, each side's numbers per batch, and the summary ratios.
"""

from __future__ import annotations

import shutil
import sys

from benchmarks.bench_common import add_out_arg, log, median, run_and_write, script_parser
from benchmarks.engine.mla import hand_off
from benchmarks.engine.moe import agreement, run_engine, run_hf, vocab_prompts

_COMMON = dict(
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,  # (vocab_prompts draws from moe.py's 32000)
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# family -> (HF model type, its shape over _COMMON, the cached model's folder)
FAMILIES = {
    "qwen3.5": (
        "qwen3_5_text",
        dict(
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
        ),  # (layer_types' default: every fourth layer full attention)
        "qwen3.5-cpu-8l",
    ),
    "granite-4.0-h": (
        "granitemoehybrid",
        dict(
            head_dim=128,
            layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
            mamba_n_heads=32,
            mamba_d_head=64,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_d_conv=4,
            num_local_experts=0,
            shared_intermediate_size=3584,
        ),
        "granite-4.0-h-cpu-8l",
    ),
    "falcon-mamba": (
        "falcon_mamba",
        dict(intermediate_size=2048, state_size=16, time_step_rank=64, conv_kernel=4),
        "falcon-mamba-cpu-8l",
    ),
}
PROMPT_LEN = 64


def bench_model(family: str) -> str:
    """The family's benchmark model (FAMILIES, seed 0) with a word-level tokenizer over its ids,
    written once into the pdserve cache; its folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from pdserve.engine.loader.resolve import default_cache_dir

    model_type, shape, folder = FAMILIES[family]
    out = default_cache_dir() / "bench-models" / folder
    if (out / "config.json").exists():
        return str(out)
    config = AutoConfig.for_model(
        model_type, bos_token_id=0, eos_token_id=1, pad_token_id=0, **{**_COMMON, **shape}
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    vocab = {f"t{i}": i for i in range(_COMMON["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1").save_pretrained(
        tmp
    )
    tmp.rename(out)
    return str(out)


def state_sizes(model_dir: str) -> dict:
    """(3): a sequence's recurrent state and a token's KV, in bytes, as the engine sizes them."""
    import torch
    from transformers import AutoConfig

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models import model_class
    from pdserve.engine.recurrent_state import RecurrentStates

    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    # (a family's own state_layouts, which read only the config)
    layouts = model_class(mc.architecture).state_layouts(type("M", (), {"config": mc})())
    shapes = [layout.shapes(1) for layout in layouts]
    state = RecurrentStates.bytes_for(shapes, 1)
    kv = mc.kv_bytes_per_token(torch.float32)
    return {
        "state_bytes_per_sequence": state,
        "kv_bytes_per_token": kv,
        "state_as_kv_tokens": state / kv if kv else None,
        "linear_layers": len(mc.recurrent_layers),
        "full_layers": mc.num_kv_layers,
    }


def decode(model_dir: str, batch: int, new: int, compare: int) -> dict:
    """(1) at one batch size."""
    prompts = vocab_prompts(100 + batch, batch, PROMPT_LEN)
    log(f"decode: engine, {batch} x {PROMPT_LEN} tokens, {new} new")
    engine = run_engine(model_dir, prompts, new)
    log(f"decode: HF, {batch} x {PROMPT_LEN} tokens, {new} new")
    hf = run_hf(model_dir, prompts, new, prefill_repeats=2)
    n = min(compare, batch)
    return {
        "batch": batch,
        "engine_tok_s": engine["decode_tok_s"],
        "engine_median_step_s": engine["median_step_s"],
        "hf_tok_s": hf["decode_tok_s"],
        "hf_median_step_s": hf["median_step_s"],
        "engine_over_hf": engine["decode_tok_s"] / hf["decode_tok_s"],
        "tokens": agreement(hf["output_token_ids"][:n], engine["output_token_ids"][:n]),
        "engine_cpu": engine["cpu"],
        "hf_cpu": hf["cpu"],
    }


def prefill(model_dir: str, length: int) -> dict:
    """(2): one prompt's time to its first token, median of three, each side."""
    prompts = [vocab_prompts(200 + i, 1, length) for i in range(3)]
    engine = [run_engine(model_dir, p, 2)["t_all_first_token_s"] for p in prompts]
    hf = run_hf(model_dir, prompts[0], 2, prefill_repeats=3)["t_prefill_runs_s"]
    e, h = median(engine), median(hf)
    return {
        "prompt_tokens": length,
        "engine_s": e,
        "engine_runs_s": engine,
        "hf_s": h,
        "hf_runs_s": hf,
        "engine_over_hf_speed": h / e,
    }


def next_turn(model_dir: str, length: int) -> dict:
    """(5): a conversation's second turn, its time to the first token with the cache on and off."""
    import time

    from pdserve.engine import LLM, SamplingParams

    answer = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = {}
    for caching in (True, False):
        llm = LLM(model_dir, dtype="float32", block_size=16, enable_prefix_caching=caching)
        try:
            llm.generate(vocab_prompts(SEED_WARM, 2, 16), answer, use_tqdm=False)
            times, served = [], []
            for i in range(3):
                first = vocab_prompts(400 + i, 1, length)[0]
                reply = llm.generate([first], answer, use_tqdm=False)[0].outputs[0].token_ids
                second = first + list(reply) + vocab_prompts(500 + i, 1, 32)[0]
                t = time.perf_counter()
                res = llm.generate([second], one, use_tqdm=False)[0]
                times.append(time.perf_counter() - t)
                served.append(res.num_cached_tokens)
        finally:
            llm.shutdown()
        key = "cache_on" if caching else "cache_off"
        out[key] = {"ttft_s": median(times), "runs_s": times, "cached_tokens": served}
    out["prompt_tokens"] = length + 64
    out["speedup"] = out["cache_off"]["ttft_s"] / out["cache_on"]["ttft_s"]
    return out


SEED_WARM = 900
TIER_SLOTS, TIER_SESSIONS, TIER_BYTES = 4, 8, 256 << 20


def past_the_slots(model_dir: str, length: int, state_bytes: int) -> dict:
    """(6): more conversations than the engine keeps states for, with the host tier and
    without."""
    import time

    from pdserve.engine import LLM, SamplingParams

    answer = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = {}
    for tier in (TIER_BYTES, 0):
        llm = LLM(
            model_dir,
            dtype="float32",
            block_size=16,
            max_model_len=1024,
            kv_cache_memory=2 * TIER_SLOTS * state_bytes + state_bytes // 2,
            kv_host_tier_bytes=tier,
        )
        try:
            assert llm.engine.scheduler.slots.num_slots == TIER_SLOTS
            llm.generate(vocab_prompts(SEED_WARM, 2, 16), answer, use_tqdm=False)
            runs, served, histories = [], [], []
            for i in range(TIER_SESSIONS):
                first = vocab_prompts(600 + i, 1, length)[0]
                reply = llm.generate([first], answer, use_tqdm=False)[0].outputs[0].token_ids
                histories.append(first + list(reply) + vocab_prompts(700 + i, 1, 32)[0])
            for second in histories:
                t = time.perf_counter()
                res = llm.generate([second], one, use_tqdm=False)[0]
                runs.append(time.perf_counter() - t)
                served.append(res.num_cached_tokens)
            bm = llm.engine.block_manager
            stats = bm.tier.stats() if bm.tier is not None else {}
            blocks = bm.num_blocks
        finally:
            llm.shutdown()
        key = "tier_on" if tier else "tier_off"
        out[key] = {
            "ttft_s": median(runs),
            "runs_s": runs,
            "cached_tokens": served,
            "kv_blocks": blocks,
            "tier": stats,
        }
    out["sessions"], out["slots"] = TIER_SESSIONS, TIER_SLOTS
    out["prompt_tokens"] = length + 64
    out["speedup"] = out["tier_off"]["ttft_s"] / out["tier_on"]["ttft_s"]
    return out


FETCH_ANSWER = 128


def peer_fetch_turn(model_dir: str, length: int) -> dict:
    """(7): a next turn through the prefill pool, with peer fetch and without."""
    import time

    import grpc

    from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
    from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
    from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc

    engine = dict(
        dtype="float32",
        speculative_config=None,
        block_size=16,
        max_model_len=2048,
        kv_cache_memory=1 << 30,
    )
    decode = DecodeWorker(
        DecodeWorkerConfig(model=model_dir, worker_id="d0", engine_kwargs=engine, lease_ms=60_000)
    ).start()
    prefill = PrefillWorker(
        PrefillWorkerConfig(model=model_dir, worker_id="p0", engine_kwargs=engine)
    ).start()
    channels = [grpc.insecure_channel(w.address) for w in (decode, prefill)]
    d = worker_pb2_grpc.DecodeWorkerStub(channels[0])
    p = worker_pb2_grpc.PrefillWorkerStub(channels[1])
    spec = worker_pb2.PeerFetch(
        address=decode.address, max_blocks=4096, max_bytes=1 << 30, timeout_ms=60_000
    )

    def turn(rid: str, prompt: list[int], max_tokens: int, fetch: bool):
        sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        res = d.Reserve(
            worker_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling),
            timeout=300,
        )
        request = worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, reservation=res
        )
        if fetch:
            request.peer_fetch.CopyFrom(spec)
        t = time.perf_counter()
        reply = p.Prefill(request, timeout=300)
        seconds = time.perf_counter() - t
        events = d.Stream(worker_pb2.StreamRequest(request_id=rid), timeout=300)
        return reply, seconds, [tok for event in events for tok in event.token_ids]

    rows: dict = {"fetch_on": [], "fetch_off": []}
    try:
        turn("warm", vocab_prompts(SEED_WARM, 1, 64)[0], 2, False)
        for i in range(3):
            for fetch in (True, False):
                first = vocab_prompts(800 + 2 * i + fetch, 1, length)[0]
                _, _, answer = turn(f"a{i}{fetch}", first, FETCH_ANSWER, False)
                second = first + answer + vocab_prompts(900 + 2 * i + fetch, 1, 32)[0]
                reply, seconds, _ = turn(f"b{i}{fetch}", second, 1, fetch)
                rows["fetch_on" if fetch else "fetch_off"].append(
                    {
                        "prefill_call_s": seconds,
                        "cached_tokens": reply.num_cached_tokens,
                        "fetched_tokens": reply.peer_fetched_tokens,
                        "fetch_bytes": reply.peer_fetch_bytes,
                        "fetch_s": reply.peer_fetch_seconds,
                        "skipped": reply.peer_fetch_skipped,
                    }
                )
    finally:
        for ch in channels:
            ch.close()
        prefill.stop()
        decode.stop()
    out = {
        key: {"prefill_call_s": median([r["prefill_call_s"] for r in runs]), "runs": runs}
        for key, runs in rows.items()
    }
    out["prompt_tokens"] = length + FETCH_ANSWER + 32
    out["speedup"] = out["fetch_off"]["prefill_call_s"] / out["fetch_on"]["prefill_call_s"]
    return out


def run_family(family: str, args) -> dict:
    """(1) to (7) for one family."""
    log(f"family {family}")
    model_dir = bench_model(family)
    batches, new = ((1, 4), 16) if args.quick else ((1, 8, 32), args.new_tokens)
    rows = [decode(model_dir, b, new, args.compare) for b in batches]
    length = 128 if args.quick else args.prefill_len
    log(f"prefill: {length} tokens")
    pre = prefill(model_dir, length)
    sizes = state_sizes(model_dir)
    transfers = {}
    # (a model with no KV layer hands its state off over grpc: shm has no pool to write into);
    # then over grpc from a prefill worker and to a decode worker of two ranks each, whose
    # first rank joins or cuts the ranks' parts of each state
    runs = [(b, (1, 1)) for b in (("grpc", "shm") if sizes["full_layers"] else ("grpc",))]
    for backend, tps in runs + [("grpc", (2, 1)), ("grpc", (1, 2))]:
        name = backend if tps == (1, 1) else f"{backend} prefill tp {tps[0]}, decode tp {tps[1]}"
        log(f"hand-off over {name}: {length} tokens")
        prompts = vocab_prompts(300, 4, length)
        transfers[name] = hand_off(model_dir, length, backend=backend, prompts=prompts, tps=tps)
    log(f"next turn: {length}-token history")
    turn = next_turn(model_dir, length)
    log(f"next turns past {TIER_SLOTS} slots: {TIER_SESSIONS} conversations, tier on and off")
    tiered = past_the_slots(model_dir, length, sizes["state_bytes_per_sequence"])
    log(f"next turn through the prefill pool: peer fetch on and off ({length}-token history)")
    fetched = peer_fetch_turn(model_dir, length)
    return {
        "shape": {**_COMMON, **FAMILIES[family][1]},
        "new_tokens": new,
        "decode": rows,
        "prefill": pre,
        "sizes": sizes,
        "hand_off": transfers,
        "next_turn": turn,
        "past_the_slots": tiered,
        "peer_fetch": fetched,
        "summary": {
            "decode_engine_over_hf": {r["batch"]: r["engine_over_hf"] for r in rows},
            "decode_engine_tok_s": {r["batch"]: r["engine_tok_s"] for r in rows},
            "prefill_engine_over_hf": pre["engine_over_hf_speed"],
            "state_as_kv_tokens": sizes["state_as_kv_tokens"],
            "hand_off_tail_ms": {b: t["tail_ms"] for b, t in transfers.items()},
            "next_turn_cache_speedup": turn["speedup"],
            "past_the_slots_tier_speedup": tiered["speedup"],
            "peer_fetch_turn_speedup": fetched["speedup"],
        },
    }


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, 16 new tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--compare", type=int, default=4, help="sequences whose tokens are compared")
    ap.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    add_out_arg(ap, "hybrid.json")
    args = ap.parse_args(argv)

    def run() -> dict:
        import torch

        torch.set_num_threads(args.threads)
        families = list(FAMILIES) if args.family == "all" else [args.family]
        results = {f: run_family(f, args) for f in families}
        return {
            "threads": args.threads,
            "prompt_len": PROMPT_LEN,
            "families": results,
            "summary": {f: r["summary"] for f, r in results.items()},
        }

    return run_and_write("benchmarks.engine.hybrid", argv, args.out, run)


if __name__ == "__main__":
    sys.exit(main())
