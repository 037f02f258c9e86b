"""The HF transformers side of benchmarks/engine_bench.py, run in its own process (`--side hf`):
static-batch `model.generate` decode throughput (prefill timed separately) and the time of one
forward over a fresh 512-token prompt. See engine_bench.py's docstring for the measurements."""

from __future__ import annotations

import time

from benchmarks import bench_common as bc


def run_hf(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from pdserve.engine.loader import resolve_model

    res = bc.side_result("hf", args.threads)
    t0 = time.perf_counter()
    model_dir = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    res["load_s"] = time.perf_counter() - t0
    res["model_dir"] = str(model_dir)
    res["memory_after_load"] = bc.memory_snapshot()
    gc = model.generation_config
    pad = (
        gc.pad_token_id
        if gc.pad_token_id is not None
        else (gc.eos_token_id[0] if isinstance(gc.eos_token_id, (list, tuple)) else gc.eos_token_id)
    )
    N, P, M = args.num_requests, args.prompt_len, args.new_tokens

    class StepClock:
        """A logits processor that only timestamps: generate calls it once per step, so the gaps
        between calls are HF's decode step times (robust to bursts of VM slowness, unlike the
        wall time of the whole generate)."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(ids: torch.Tensor, new: int, clock=None) -> tuple[torch.Tensor, float]:
        from transformers import LogitsProcessorList

        t = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
            logits_processor=LogitsProcessorList([clock] if clock else []),
        )
        return out, time.perf_counter() - t

    def warmup():
        ids = torch.tensor(bc.random_prompts(bc.SEED_WARMUP, 2, 16))
        _, t = generate(ids, 4)
        with torch.inference_mode():
            model(ids)
        return {"s": t}

    def decode():
        ids = torch.tensor(bc.random_prompts(bc.SEED_DECODE, N, P))
        prefill = []
        for _ in range(args.prefill_repeats):
            _, t = generate(ids, 1)
            prefill.append(t)
        clock = StepClock()
        out, total = generate(ids, M, clock)
        steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
        new = out[:, P:]
        assert new.shape == (N, M), f"HF produced {tuple(new.shape)} new tokens, wanted {(N, M)}"
        t_prefill = bc.median(prefill)
        return {
            "t_prefill_s": t_prefill,
            "t_prefill_runs_s": prefill,
            "t_total_s": total,
            "decode_tok_s": N * (M - 1) / (total - t_prefill),
            "e2e_tok_s": N * M / total,
            "step_durations_s": steps,
            "median_step_s": bc.median(steps),
            "decode_tok_s_median_step": N / bc.median(steps),
            "output_token_ids": new.tolist(),
        }

    def one_stream():
        """One sequence alone: P prompt tokens, then M new; decode tok/s over the tokens after the
        first, from the per-step timestamps."""
        ids = torch.tensor(bc.random_prompts(bc.SEED_ONE_STREAM, 1, P))
        runs = []
        for _ in range(2):  # the first run warms this shape
            clock = StepClock()
            generate(ids, M, clock)
            runs.append((M - 1) / (clock.times[-1] - clock.times[0]))
        return {"decode_tok_s": runs[-1], "runs_tok_s": runs}

    def ttft512():
        ids = torch.tensor(bc.random_prompts(bc.SEED_TTFT, 1, args.ttft_len))
        times, times_keep1 = [], []
        with torch.inference_mode():
            model(ids)  # warm-up
            for _ in range(args.repeats):
                t = time.perf_counter()
                model(ids)
                times.append(time.perf_counter() - t)
            # informational: HF without the lm_head over all 512 positions
            model(ids, logits_to_keep=1)
            for _ in range(args.repeats):
                t = time.perf_counter()
                model(ids, logits_to_keep=1)
                times_keep1.append(time.perf_counter() - t)
        return {
            "runs_s": times,
            "best_s": min(times),
            "median_s": bc.median(times),
            "logits_to_keep1_runs_s": times_keep1,
            "logits_to_keep1_median_s": bc.median(times_keep1),
        }

    bc.section(res, "warmup", warmup)
    bc.section(res, "decode", decode)
    bc.section(res, "one_stream", one_stream)
    bc.section(res, "ttft512", ttft512)
    res["memory_peak"] = bc.memory_snapshot()
    return res


def one_stream_tok_s(
    model_name: str, threads: int, prompt_len: int, new_tokens: int
) -> list[float]:
    """HF float32 decoding one sequence: tok/s after the first token, for 2 runs (the first warms)."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from pdserve.engine.loader import resolve_model

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model(model_name)), dtype=torch.float32
    ).eval()
    ids = torch.tensor(bc.random_prompts(bc.SEED_ONE_STREAM, 1, prompt_len))
    runs = []
    for _ in range(2):
        times: list[float] = []

        def clock(input_ids, scores):
            times.append(time.perf_counter())
            return scores

        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,  # one sequence: nothing is padded
            logits_processor=LogitsProcessorList([clock]),
        )
        runs.append((new_tokens - 1) / (times[-1] - times[0]))
    return runs
