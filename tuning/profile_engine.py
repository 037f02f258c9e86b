"""The engine-step half of `pdserve profile`: for one TP degree, an engine in this process timed
on whole-prompt prefill steps and on decode steps of B sequences, and the latency models fitted to
those samples (tuning/perf_model.py); `log`, the progress line every part of the command
writes to stderr."""

from __future__ import annotations

import random
import statistics
import sys
import time

from pdserve.tuning.perf_model import decode_features, fit_nonnegative, prefill_features


def log(msg: str) -> None:
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    low = 1000 if vocab > 2000 else 0
    return [rng.randrange(low, vocab) for _ in range(n)]


def _measure_prefill(engine, grid, reps: int, rng) -> list[dict]:
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    vocab = engine.model_config.vocab_size
    samples = []
    for k, lens in enumerate(grid):
        runs = []
        for rep in range(reps):
            rids = [f"p{k}-{rep}-{i}" for i in range(len(lens))]
            for rid, n in zip(rids, lens):
                engine.add_request(rid, _prompt(rng, n, vocab), params)
            t0 = time.perf_counter()
            engine.step()
            runs.append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
        samples.append(
            {
                "seq_lens": lens,
                "num_tokens": sum(lens),
                "latency_s": statistics.median(runs),
                "runs_s": runs,
            }
        )
        log(
            f"prefill {'+'.join(map(str, lens)) if len(set(lens)) > 1 else f'{len(lens)}x{lens[0]}'}: "
            f"{samples[-1]['latency_s'] * 1e3:.1f} ms"
        )
    return samples


def _measure_decode(engine, batches, contexts, steps: int, rng) -> list[dict]:
    from pdserve.engine import SamplingParams

    vocab = engine.model_config.vocab_size
    capacity = engine.block_manager.num_blocks * engine.config.block_size
    samples = []
    for ctx in contexts:
        for batch in batches:
            if batch * (ctx + steps + 2) > 0.9 * capacity or batch > engine.config.max_num_seqs:
                continue
            params = SamplingParams(max_tokens=steps + 3, ignore_eos=True, temperature=0.0)
            rids = [f"d{ctx}-{batch}-{i}" for i in range(batch)]
            for rid in rids:
                engine.reserve(rid, _prompt(rng, ctx, vocab), params)
                engine.commit(rid, [1000 % vocab])
            engine.step()  # the first step after the commits: allocations, not steady state
            runs = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                runs.append(time.perf_counter() - t0)
            for rid in rids:
                engine.abort(rid)
            while engine.has_unfinished_requests():
                engine.step()
            # the timed steps saw contexts ctx+1 .. ctx+steps; the middle one stands for them
            samples.append(
                {
                    "batch_size": batch,
                    "context_tokens": ctx + 1 + steps // 2,
                    "latency_s": statistics.median(runs),
                    "runs_s": runs,
                }
            )
            log(f"decode B={batch} ctx={ctx}: {samples[-1]['latency_s'] * 1e3:.1f} ms")
    return samples


def profile_tp(model: str, tp: int, grids: dict, args) -> tuple[dict, dict]:
    """(the tp entry, what the engine says about the model and its KV)."""
    import torch

    from pdserve.engine import LLM

    torch.set_num_threads(args.threads_per_rank)
    max_prefill = max(sum(lens) for lens in grids["prefill"])
    t0 = time.perf_counter()
    llm = LLM(
        model,
        tensor_parallel_size=tp,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=max(max_prefill, 2048),
        max_num_seqs=max(grids["batches"]) + 8,
        enable_prefix_caching=False,
    )
    torch.set_num_threads(args.threads_per_rank)  # in case engine construction touched it
    log(f"tp={tp}: engine loaded in {time.perf_counter() - t0:.1f} s")
    try:
        engine = llm.engine
        rng = random.Random(tp)
        _measure_prefill(engine, [[64], [16] * 2], 1, rng)  # warm-up
        _measure_decode(engine, (4,), (32,), 2, rng)
        prefill = _measure_prefill(engine, grids["prefill"], grids["prefill_reps"], rng)
        decode = _measure_decode(
            engine, grids["batches"], grids["contexts"], grids["decode_steps"], rng
        )
        mc, cfg = engine.model_config, engine.config
        info = {
            "id": engine.model_id,
            "name": model,
            "num_layers": mc.num_layers,
            "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "hidden_size": mc.hidden_size,
            "dtype": cfg.dtype,
            "device": cfg.device,
            "kv_bytes_per_token": mc.kv_bytes_per_token(cfg.torch_dtype),
            "block_size": cfg.block_size,
        }
        capacity = engine.block_manager.num_blocks * cfg.block_size
    finally:
        llm.shutdown()
    pf = fit_nonnegative(
        [prefill_features(s["seq_lens"]) for s in prefill], [s["latency_s"] for s in prefill]
    )
    df = fit_nonnegative(
        [decode_features(s["batch_size"], s["context_tokens"]) for s in decode],
        [s["latency_s"] for s in decode],
    )
    log(
        f"tp={tp}: prefill fit {pf['coef']} (rms rel error {pf['fit']['rms_rel_error']:.1%}), "
        f"decode fit {df['coef']} (rms rel error {df['fit']['rms_rel_error']:.1%})"
    )
    entry = {
        "prefill": {**pf, "samples": prefill},
        "decode": {**df, "samples": decode},
        "kv_capacity_tokens": capacity,
        "threads_per_rank": args.threads_per_rank,
    }
    return entry, info
