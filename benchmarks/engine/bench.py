"""Engine benchmark: pdserve's LLMEngine vs HF transformers, same model, same prompts, same CPU.

    python -m benchmarks.engine.bench            # full run (both sides, ~5 min on 2 cores)
    python -m benchmarks.engine.bench --quick    # smoke run: 8 requests, 32 new tokens

The default mode runs `--side hf` and then `--side pdserve` as separate subprocesses (so each
side's peak RSS is its own, and neither warms the other's caches), collects one JSON line from
each, prints a markdown table and writes the combined results to --out. Prompts are deterministic
random token ids, so every length is exact and both sides see identical inputs. It measures the
decode throughput of N concurrent requests, the TTFT of a fresh 512-token prompt, the TTFT of a
cached 512-token prefix plus 32 fresh tokens, and each side's peak RSS; benchmarks/README.md says
how each side times them. bench_report.py renders the report, run_hf and run_pdserve below are the two sides (llamacpp.py
the third, for --modes), and bench_common.py holds what they share.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from benchmarks import bench_common as bc
from benchmarks.bench_common import (
    REPO_ROOT,
    SEED_COLD,
    SEED_DECODE,
    SEED_ONE_STREAM,
    SEED_PREFIX,
    SEED_SUFFIX,
    SEED_TTFT,
    SEED_WARMUP,
    add_wait_idle_arg,
    count_new_tokens,
    log,
    median,
    memory_snapshot,
    random_prompts,
    script_parser,
    section,
    side_result,
    wait_for_idle_machine,
    write_result,
)
from benchmarks.engine.bench_report import (
    combine,
    modes_summary,
    render,
    render_modes,
)


class StepClock:
    """A logits processor that only timestamps: generate calls it once per step, so the gaps
    between calls are HF's decode step times (robust to bursts of VM slowness, unlike the
    wall time of the whole generate)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class HFSide:
    """The HF transformers side (`--side hf`): the model loaded in float32, then one method per
    measured section, each returning its section of the result."""

    def __init__(self, args):
        import torch

        torch.set_num_threads(args.threads)
        from transformers import AutoModelForCausalLM

        from pdserve.engine.loader import resolve_model

        self.args = args
        self.res = bc.side_result("hf", args.threads)
        t0 = time.perf_counter()
        model_dir = resolve_model(args.model)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32
        ).eval()
        self.res["load_s"] = time.perf_counter() - t0
        self.res["model_dir"] = str(model_dir)
        self.res["memory_after_load"] = bc.memory_snapshot()
        gc = self.model.generation_config
        self.pad = (
            gc.pad_token_id
            if gc.pad_token_id is not None
            else (
                gc.eos_token_id[0]
                if isinstance(gc.eos_token_id, (list, tuple))
                else gc.eos_token_id
            )
        )

    def generate(self, ids, new: int, clock=None):
        """(model.generate's output, its seconds) for exactly `new` greedy tokens per row."""
        import torch
        from transformers import LogitsProcessorList

        t = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=self.pad,
            logits_processor=LogitsProcessorList([clock] if clock else []),
        )
        return out, time.perf_counter() - t

    def warmup(self):
        import torch

        ids = torch.tensor(bc.random_prompts(bc.SEED_WARMUP, 2, 16))
        _, t = self.generate(ids, 4)
        with torch.inference_mode():
            self.model(ids)
        return {"s": t}

    def decode(self):
        import torch

        N, P, M = self.args.num_requests, self.args.prompt_len, self.args.new_tokens
        ids = torch.tensor(bc.random_prompts(bc.SEED_DECODE, N, P))
        prefill = []
        for _ in range(self.args.prefill_repeats):
            _, t = self.generate(ids, 1)
            prefill.append(t)
        clock = StepClock()
        out, total = self.generate(ids, M, clock)
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

    def one_stream(self):
        """One sequence alone: P prompt tokens, then M new; decode tok/s over the tokens after the
        first, from the per-step timestamps."""
        import torch

        P, M = self.args.prompt_len, self.args.new_tokens
        ids = torch.tensor(bc.random_prompts(bc.SEED_ONE_STREAM, 1, P))
        runs = []
        for _ in range(2):  # the first run warms this shape
            clock = StepClock()
            self.generate(ids, M, clock)
            runs.append((M - 1) / (clock.times[-1] - clock.times[0]))
        return {"decode_tok_s": runs[-1], "runs_tok_s": runs}

    def ttft512(self):
        import torch

        model, repeats = self.model, self.args.repeats
        ids = torch.tensor(bc.random_prompts(bc.SEED_TTFT, 1, self.args.ttft_len))
        times, times_keep1 = [], []
        with torch.inference_mode():
            model(ids)  # warm-up
            for _ in range(repeats):
                t = time.perf_counter()
                model(ids)
                times.append(time.perf_counter() - t)
            # informational: HF without the lm_head over all 512 positions
            model(ids, logits_to_keep=1)
            for _ in range(repeats):
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

    def run(self) -> dict:
        for name in ("warmup", "decode", "one_stream", "ttft512"):
            bc.section(self.res, name, getattr(self, name))
        self.res["memory_peak"] = bc.memory_snapshot()
        return self.res


def run_hf(args) -> dict:
    return HFSide(args).run()


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


class PdserveSide:
    """The pdserve side (`--side pdserve`): the engine built as the serving mode asks, then one
    method per measured section, each returning its section of the result."""

    def __init__(self, args):
        import torch

        torch.set_num_threads(args.threads)
        from pdserve.engine import LLM

        self.args = args
        self.res = side_result("pdserve", args.threads)
        t0 = time.perf_counter()
        quant = None if args.quantization == "none" else args.quantization
        self.llm = LLM(
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
        self.res["load_s"] = time.perf_counter() - t0
        torch.set_num_threads(args.threads)  # in case engine construction touched it
        self.eng = eng = self.llm.engine
        self.res["mode"] = {
            "dtype": eng.config.dtype,
            "quantization": eng.config.quantization,
            "note": eng.mode_note,
        }
        kv = eng.kv_cache
        self.res["kv_cache"] = {
            "bytes": kv.numel() * kv.element_size(),
            "num_blocks": eng.block_manager.num_blocks,
            "block_size": eng.config.block_size,
            "shape": list(kv.shape),
            "dtype": str(kv.dtype),
            "kv_cache_memory_config": eng.config.kv_cache_memory,
            "max_model_len": eng.config.max_model_len,
            "max_num_batched_tokens": eng.config.max_num_batched_tokens,
        }
        self.res["memory_after_load"] = memory_snapshot()
        self.counter = iter(range(10**9))

    @staticmethod
    def greedy(max_tokens: int):
        from pdserve.engine import SamplingParams

        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        """add_request -> first output token, for one request run alone; (seconds, cached tokens)."""
        eng = self.eng
        rid = f"ttft-{next(self.counter)}"
        t = time.perf_counter()
        eng.add_request(rid, prompt, self.greedy(1))
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

    def warmup(self):
        t = time.perf_counter()
        self.llm.generate(random_prompts(SEED_WARMUP, 2, 16), self.greedy(4), use_tqdm=False)
        return {"s": time.perf_counter() - t}

    def decode_steps(self, rids: list[str], prompts: list[list[int]], M: int):
        """Runs the requests together; (their final outputs, the start, and per step: its end
        relative to the start, its duration, the tokens it produced, whether every request then
        had its first token)."""
        eng, N = self.eng, len(rids)
        num_out = dict.fromkeys(rids, 0)
        final: dict = {}
        steps = []
        params = self.greedy(M)
        t_start = time.perf_counter()
        for rid, p in zip(rids, prompts):
            eng.add_request(rid, p, params)
        t_prev = time.perf_counter()
        while len(final) < N:
            outs = eng.step()
            t_now = time.perf_counter()
            produced = count_new_tokens(outs, num_out, final)
            steps.append(
                (t_now - t_start, t_now - t_prev, produced, all(v > 0 for v in num_out.values()))
            )
            t_prev = t_now
            if not outs and not eng.has_unfinished_requests() and len(final) < N:
                raise RuntimeError("engine went idle before all decode requests finished")
        return final, t_start, steps

    def decode(self):
        N, P, M = self.args.num_requests, self.args.prompt_len, self.args.new_tokens
        rids = [f"decode-{i}" for i in range(N)]
        final, t_start, steps = self.decode_steps(rids, random_prompts(SEED_DECODE, N, P), M)
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
            "num_preemptions": self.eng.scheduler.num_preemptions,
            "step_durations_s": [round(s[1], 6) for s in steps],
            "step_tokens": [s[2] for s in steps],
            "output_token_ids": outputs,
        }

    def one_stream(self):
        """One request alone: P prompt tokens, then M new; decode tok/s over the tokens after
        the first, from the step timestamps."""
        P, M = self.args.prompt_len, self.args.new_tokens
        prompt = random_prompts(SEED_ONE_STREAM, 1, P)[0]
        params, runs = self.greedy(M), []
        for i in range(2):  # the first run warms this shape
            self.eng.add_request(f"one-{i}", prompt, params)
            times = []
            while self.eng.has_unfinished_requests():
                self.eng.step()
                times.append(time.perf_counter())
            runs.append((M - 1) / (times[-1] - times[0]))
        return {"decode_tok_s": runs[-1], "runs_tok_s": runs}

    def ttft512(self):
        n = self.args.ttft_len
        self.ttft(random_prompts(SEED_TTFT + 99, 1, n)[0])  # warm-up, its own prompt
        runs, cached = [], []
        for i in range(self.args.repeats):
            t, c = self.ttft(random_prompts(SEED_TTFT + i, 1, n)[0])
            runs.append(t)
            cached.append(c)
        return {
            "runs_s": runs,
            "best_s": min(runs),
            "median_s": median(runs),
            "num_cached_tokens": cached,
        }

    def prefix(self):
        L, S = self.args.prefix_len, self.args.suffix_len
        cold, cold_cached = [], []
        for i in range(self.args.repeats):
            t, c = self.ttft(random_prompts(SEED_COLD + i, 1, L + S)[0])
            cold.append(t)
            cold_cached.append(c)
        shared = random_prompts(SEED_PREFIX, 1, L)[0]
        warm_t, warm_c = self.ttft(shared + random_prompts(SEED_SUFFIX + 99, 1, S)[0])
        hot, hot_cached = [], []
        for i in range(self.args.repeats):
            t, c = self.ttft(shared + random_prompts(SEED_SUFFIX + i, 1, S)[0])
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

    def run(self) -> dict:
        for name in ("warmup", "decode", "one_stream", "ttft512", "prefix"):
            section(self.res, name, getattr(self, name))
        self.res["memory_peak"] = memory_snapshot()
        self.res["block_manager"] = {
            "num_free_blocks": self.eng.block_manager.num_free_blocks,
            "num_blocks": self.eng.block_manager.num_blocks,
        }
        self.llm.shutdown()
        return self.res


def run_pdserve(args) -> dict:
    return PdserveSide(args).run()


RESULT_PREFIX = "@@ENGINE_BENCH_RESULT "
DEFAULT_OUT = os.path.join("benchmarks", "results", "engine_bench.json")


# ---- orchestration ----------------------------------------------------------------------------
def side_argv(args, side: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "benchmarks.engine.bench",
        "--side",
        side,
        "--num-requests",
        str(args.num_requests),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--ttft-len",
        str(args.ttft_len),
        "--prefix-len",
        str(args.prefix_len),
        "--suffix-len",
        str(args.suffix_len),
        "--repeats",
        str(args.repeats),
        "--prefill-repeats",
        str(args.prefill_repeats),
        "--threads",
        str(args.threads),
        "--model",
        args.model,
    ]
    if args.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", str(args.kv_cache_memory)]
    return argv + [
        "--dtype",
        args.dtype,
        "--quantization",
        args.quantization,
        "--kv-cache-dtype",
        args.kv_cache_dtype,
    ]


def run_side_subprocess(args, side: str) -> dict:
    argv = side_argv(args, side)
    idle = wait_for_idle_machine(args.wait_idle) if args.wait_idle > 0 else None
    env = dict(
        os.environ,
        PDSERVE_NO_PROGRESS="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    log(f"running {side}: {shlex.join(argv)}")
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
        elif line.strip():
            print(line, file=sys.stderr)
    if result is None:
        result = {"side": side, "error": f"subprocess exited {proc.returncode} without a result"}
    result["subprocess"] = {
        "argv": argv,
        "returncode": proc.returncode,
        "wall_s": wall,
        "wait_idle": idle,
    }
    log(f"{side} finished in {wall:.1f} s (rc={proc.returncode})")
    return result


# --modes name -> (--dtype, --quantization, --kv-cache-dtype) of the pdserve side
MODES = {
    "float32": ("float32", "none", "auto"),
    "bfloat16": ("bfloat16", "none", "auto"),
    "int8": ("float32", "int8", "auto"),
    "int8-kvbf16": ("float32", "int8", "bfloat16"),  # int8 weights, a bf16 KV cache
    "int4": ("float32", "int4", "auto"),
    "bf16": ("float32", "bf16", "auto"),  # bf16 decoder linears, a screened int8 head
    "bf16-kvbf16": ("float32", "bf16", "bfloat16"),
    "auto": ("auto", "none", "auto"),
}


def parse_args(argv=None):
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument(
        "--side",
        choices=["both", "hf", "pdserve", "llamacpp"],
        default="both",
        help="hf / pdserve / llamacpp: run one side in this process and print one JSON "
        "line; both (default): run each side in its own subprocess and report",
    )
    ap.add_argument("--dtype", default="float32", help="pdserve side: the engine's dtype")
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "int4", "bf16", "auto"],
        help="pdserve side: the engine's quantization",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="pdserve side: the KV cache's dtype (auto: the activations')",
    )
    ap.add_argument(
        "--modes",
        default="float32",
        help="comma-separated pdserve modes to run against the one HF run, each in its "
        "own process: float32, bfloat16, int8, int8-kvbf16, int4, bf16, bf16-kvbf16, auto "
        "(dtype auto); more than "
        "float32 adds the modes table and llama.cpp's one stream",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 32 new tokens")
    ap.add_argument("--out", default=None, help=f"JSON results path (default {DEFAULT_OUT})")
    ap.add_argument(
        "--num-requests", type=int, default=None, help="concurrent requests (32; quick 8)"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--new-tokens", type=int, default=None, help="new tokens per request (128; quick 32)"
    )
    ap.add_argument("--ttft-len", type=int, default=512)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each TTFT measurement")
    ap.add_argument(
        "--prefill-repeats",
        type=int,
        default=2,
        help="HF prefill-only generate runs (median is subtracted)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="pdserve KV bytes (default: the engine default, 1 GiB on CPU)",
    )
    add_wait_idle_arg(ap, "each side")
    args = ap.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 32
    if args.new_tokens is None:
        args.new_tokens = 32 if args.quick else 128
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode-only throughput needs a decode step)")
    for name in (
        "num_requests",
        "prompt_len",
        "ttft_len",
        "prefix_len",
        "suffix_len",
        "repeats",
        "prefill_repeats",
        "threads",
    ):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side != "both":
        if args.side == "llamacpp":
            from benchmarks.engine.llamacpp import run_llamacpp

            res = run_llamacpp(args)
        else:
            res = run_hf(args) if args.side == "hf" else run_pdserve(args)
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return 0
    command = shlex.join(["python", "-m", "benchmarks.engine.bench", *sys.argv[1:]])
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: each of {sorted(MODES)}")
    hf = run_side_subprocess(args, "hf")
    runs = {}
    for m in modes:
        args.dtype, args.quantization, args.kv_cache_dtype = MODES[m]
        runs[m] = run_side_subprocess(args, "pdserve")
    pd = runs[modes[0]]
    report = combine(args, hf, pd, command)
    report["config"]["dtype"] = modes[0]
    table = render(report)
    if len(modes) > 1:
        from benchmarks.engine.llamacpp import LLAMA_CPP_VERSION  # noqa: F401 (import check)

        lc = run_side_subprocess(args, "llamacpp")
        report["modes"] = modes_summary(hf, runs, lc)
        report["llamacpp"] = lc
        table += "\n\n" + render_modes(report["modes"], args)
    report["table_markdown"] = table
    out = args.out or os.path.join(REPO_ROOT, DEFAULT_OUT)
    write_result(out, report, "benchmarks.engine.bench", argv)
    print(table)
    print(f"\nresults written to {out}")
    failed = [k for k in ("decode", "ttft512", "prefix") if report["summary"][k]["pass"] is None]
    return 1 if failed or hf.get("error") or pd.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
