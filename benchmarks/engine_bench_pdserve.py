"""The pdserve side of benchmarks/engine_bench.py, run in its own process (`--side pdserve`): decode
throughput with every engine step timestamped, TTFT of a fresh 512-token prompt, and TTFT with a
cached prefix vs a cold prompt. See engine_bench.py's docstring for the measurements."""

from __future__ import annotations

import time

from benchmarks.bench_common import (
    SEED_COLD,
    SEED_DECODE,
    SEED_ONE_STREAM,
    SEED_PREFIX,
    SEED_SUFFIX,
    SEED_TTFT,
    SEED_WARMUP,
    median,
    memory_snapshot,
    random_prompts,
    section,
    side_result,
)


def run_pdserve(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from pdserve.engine import LLM, SamplingParams

    res = side_result("pdserve", args.threads)
    t0 = time.perf_counter()
    quant = None if args.quantization == "none" else args.quantization
    llm = LLM(
        model=args.model,
        kv_cache_memory=args.kv_cache_memory,
        block_size=16,
        enable_prefix_caching=True,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
        dtype=args.dtype,
        quantization=quant,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    res["load_s"] = time.perf_counter() - t0
    torch.set_num_threads(args.threads)  # in case engine construction touched it
    eng = llm.engine
    res["mode"] = {
        "dtype": eng.config.dtype,
        "quantization": eng.config.quantization,
        "note": eng.mode_note,
    }
    kv = eng.kv_cache
    res["kv_cache"] = {
        "bytes": kv.numel() * kv.element_size(),
        "num_blocks": eng.block_manager.num_blocks,
        "block_size": eng.config.block_size,
        "shape": list(kv.shape),
        "dtype": str(kv.dtype),
        "kv_cache_memory_config": eng.config.kv_cache_memory,
        "max_model_len": eng.config.max_model_len,
        "max_num_batched_tokens": eng.config.max_num_batched_tokens,
    }
    res["memory_after_load"] = memory_snapshot()
    N, P, M = args.num_requests, args.prompt_len, args.new_tokens
    counter = iter(range(10**9))

    def ttft(prompt: list[int]) -> tuple[float, int]:
        """add_request -> first output token, for one request run alone; (seconds, cached tokens)."""
        rid = f"ttft-{next(counter)}"
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        t = time.perf_counter()
        eng.add_request(rid, prompt, params)
        first = None
        cached = None
        while True:
            outs = eng.step()
            for o in outs:
                if o.request_id == rid:
                    if first is None and o.outputs[0].token_ids:
                        first = time.perf_counter() - t
                        cached = o.num_cached_tokens
                    if o.finished:
                        assert first is not None
                        return first, cached
            if not eng.has_unfinished_requests():
                raise RuntimeError(f"{rid} finished without producing a token")

    def warmup():
        t = time.perf_counter()
        llm.generate(
            random_prompts(SEED_WARMUP, 2, 16),
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        return {"s": time.perf_counter() - t}

    def decode():
        prompts = random_prompts(SEED_DECODE, N, P)
        params = SamplingParams(temperature=0, max_tokens=M, ignore_eos=True)
        rids = [f"decode-{i}" for i in range(N)]
        num_out = dict.fromkeys(rids, 0)
        final: dict = {}
        steps = []  # (t_end relative to start, step duration, tokens produced, all_have_first)
        t_start = time.perf_counter()
        for rid, p in zip(rids, prompts):
            eng.add_request(rid, p, params)
        t_prev = time.perf_counter()
        while len(final) < N:
            outs = eng.step()
            t_now = time.perf_counter()
            produced = 0
            for o in outs:
                if o.request_id not in num_out:
                    continue
                n = len(o.outputs[0].token_ids)
                produced += n - num_out[o.request_id]
                num_out[o.request_id] = n
                if o.finished:
                    final[o.request_id] = o
            steps.append(
                (t_now - t_start, t_now - t_prev, produced, all(v > 0 for v in num_out.values()))
            )
            t_prev = t_now
            if not outs and not eng.has_unfinished_requests() and len(final) < N:
                raise RuntimeError("engine went idle before all decode requests finished")
        total = time.perf_counter() - t_start
        # first step after which every request has its first token
        k = next(i for i, s in enumerate(steps) if s[3])
        t_first_all = steps[k][0]
        decode_tokens = sum(s[2] for s in steps[k + 1 :])
        decode_time = steps[-1][0] - t_first_all
        full = sorted(s[1] for s in steps[k + 1 :] if s[2] == N)  # steps that decode every request
        median_step = full[len(full) // 2] if full else None
        outputs = [final[r].outputs[0].token_ids for r in rids]
        assert all(len(o) == M for o in outputs), "a request did not produce exactly new_tokens"
        return {
            "t_total_s": total,
            "t_all_first_token_s": t_first_all,
            "num_steps": len(steps),
            "num_prefill_phase_steps": k + 1,
            "decode_tokens": decode_tokens,
            "decode_time_s": decode_time,
            "decode_tok_s": decode_tokens / decode_time if decode_time > 0 else None,
            "e2e_tok_s": N * M / total,
            "median_step_s": median_step,
            "decode_tok_s_median_step": N / median_step if median_step else None,
            "num_cached_tokens": [final[r].num_cached_tokens for r in rids],
            "num_preemptions": eng.scheduler.num_preemptions,
            "step_durations_s": [round(s[1], 6) for s in steps],
            "step_tokens": [s[2] for s in steps],
            "output_token_ids": outputs,
        }

    def one_stream():
        """One request alone: P prompt tokens, then M new; decode tok/s over the tokens after
        the first, from the step timestamps."""
        prompt = random_prompts(SEED_ONE_STREAM, 1, P)[0]
        params = SamplingParams(temperature=0, max_tokens=M, ignore_eos=True)
        runs = []
        for i in range(2):  # the first run warms this shape
            eng.add_request(f"one-{i}", prompt, params)
            times = []
            while eng.has_unfinished_requests():
                eng.step()
                times.append(time.perf_counter())
            runs.append((M - 1) / (times[-1] - times[0]))
        return {"decode_tok_s": runs[-1], "runs_tok_s": runs}

    def ttft512():
        ttft(random_prompts(SEED_TTFT + 99, 1, args.ttft_len)[0])  # warm-up, its own prompt
        runs, cached = [], []
        for i in range(args.repeats):
            t, c = ttft(random_prompts(SEED_TTFT + i, 1, args.ttft_len)[0])
            runs.append(t)
            cached.append(c)
        return {
            "runs_s": runs,
            "best_s": min(runs),
            "median_s": median(runs),
            "num_cached_tokens": cached,
        }

    def prefix():
        L, S = args.prefix_len, args.suffix_len
        cold, cold_cached = [], []
        for i in range(args.repeats):
            t, c = ttft(random_prompts(SEED_COLD + i, 1, L + S)[0])
            cold.append(t)
            cold_cached.append(c)
        shared = random_prompts(SEED_PREFIX, 1, L)[0]
        warm_t, warm_c = ttft(shared + random_prompts(SEED_SUFFIX + 99, 1, S)[0])
        hot, hot_cached = [], []
        for i in range(args.repeats):
            t, c = ttft(shared + random_prompts(SEED_SUFFIX + i, 1, S)[0])
            hot.append(t)
            hot_cached.append(c)
        return {
            "prefix_len": L,
            "suffix_len": S,
            "cold_runs_s": cold,
            "cold_median_s": median(cold),
            "cold_num_cached_tokens": cold_cached,
            "cache_warm_s": warm_t,
            "cache_warm_num_cached_tokens": warm_c,
            "cached_runs_s": hot,
            "cached_median_s": median(hot),
            "cached_num_cached_tokens": hot_cached,
            "speedup": median(cold) / median(hot),
        }

    section(res, "warmup", warmup)
    section(res, "decode", decode)
    section(res, "one_stream", one_stream)
    section(res, "ttft512", ttft512)
    section(res, "prefix", prefix)
    res["memory_peak"] = memory_snapshot()
    res["block_manager"] = {
        "num_free_blocks": eng.block_manager.num_free_blocks,
        "num_blocks": eng.block_manager.num_blocks,
    }
    llm.shutdown()
    return res
