"""Engine benchmark: pdserve's LLMEngine vs HF transformers, same model, same prompts, same CPU.

    python bench/engine_bench.py            # full run (both sides, ~5 min on 2 cores)
    python bench/engine_bench.py --quick    # smoke run: 8 requests, 32 new tokens

The default mode runs `--side hf` and then `--side pdserve` as separate subprocesses (so each
side's peak RSS is its own, and neither warms the other's caches), collects one JSON line from
each, prints a markdown table and writes the combined results to --out.

Prompts are deterministic random token ids (a fixed torch.Generator, ids in [100, 49000)), not
text, so every length is exact and both sides see identical inputs. Everything is fp32, greedy,
torch.set_num_threads(--threads) on both sides.

Measurements
  1. decode throughput, N concurrent requests of P prompt tokens, M new tokens, ignore_eos
       HF: static-batch model.generate (min_new_tokens=M); prefill timed separately with
           max_new_tokens=1; decode-only tok/s = N*(M-1) / (t_total - t_prefill)
       pdserve: all N requests added to llm.engine, step() until done, every step timestamped;
           decode-only tok/s = tokens produced in the steps after every request has its first
           token / wall time of those steps
       end-to-end tok/s = N*M / t_total on both sides
  2. TTFT of one fresh 512-token prompt: HF = one forward model(ids[1,512]);
     pdserve = add_request -> first output token (each repeat a different prompt)
  3. pdserve TTFT of <cached 512-token prefix> + 32 fresh tokens vs a cold 544-token prompt
  4. peak RSS of each side's process (ru_maxrss and /proc/self/status VmHWM), KV cache size
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

RESULT_PREFIX = "@@ENGINE_BENCH_RESULT "
DEFAULT_OUT = os.path.join("bench", "results", "engine_bench.json")
TOKEN_LO, TOKEN_HI = 100, 49000

# seeds of the prompt sets (disjoint, so no two sections share a prompt by construction)
SEED_DECODE = 1000
SEED_WARMUP = 2000
SEED_TTFT = 3000          # + repeat index
SEED_COLD = 4000          # + repeat index
SEED_PREFIX = 5000
SEED_SUFFIX = 6000        # + repeat index

TARGET_DECODE_RATIO = 2.5
TARGET_TTFT_RATIO = 1.0
TARGET_PREFIX_SPEEDUP = 5.0
CONTENTION_WARN_CORES = 0.1   # other processes' average CPU use that makes timings suspect


# ---- helpers (no torch import at module level: the parent process must stay small) ----------
def log(msg: str) -> None:
    print(f"[engine_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_prompts(seed: int, n: int, length: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(TOKEN_LO, TOKEN_HI, (n, length), generator=g).tolist()


def proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_snapshot() -> dict:
    import resource
    return {
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "vm_hwm_bytes": (proc_status_kb("VmHWM") or 0) * 1024,
        "vm_rss_bytes": (proc_status_kb("VmRSS") or 0) * 1024,
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(threads: int) -> dict:
    import torch
    import transformers
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_num_threads": torch.get_num_threads(),
        "threads_requested": threads,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def git_head() -> str | None:
    """Best effort, read from .git without running git."""
    try:
        git = os.path.join(REPO_ROOT, ".git")
        if os.path.isfile(git):   # a worktree: "gitdir: <path>"
            with open(git) as f:
                git = f.read().split(":", 1)[1].strip()
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        for base in (git, os.path.join(git, "..", "..")):   # worktrees keep refs in the common dir
            path = os.path.join(base, ref)
            if os.path.isfile(path):
                with open(path) as f:
                    return f.read().strip()
        return ref
    except Exception:
        return None


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine_busy_cpu_s() -> float | None:
    """CPU seconds all cpus spent busy since boot (/proc/stat), None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    busy = sum(fields[:8]) - idle                                     # guest is inside user
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMonitor:
    """How much CPU *other* processes used while we measured: the benchmark shares the machine."""

    def __init__(self):
        self.t, self.busy, self.own = time.perf_counter(), machine_busy_cpu_s(), self._own()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t
        own = self._own() - self.own
        busy = machine_busy_cpu_s()
        out = {"wall_s": wall, "own_cpu_s": own}
        if busy is not None and self.busy is not None:
            foreign = max(0.0, (busy - self.busy) - own)
            out.update(machine_busy_cpu_s=busy - self.busy, foreign_cpu_s=foreign,
                       foreign_cores_avg=foreign / wall if wall > 0 else None)
        return out


def section(results: dict, name: str, fn) -> None:
    """Run one measurement; a failure is recorded, the other sections still run."""
    t0 = time.perf_counter()
    mon = CpuMonitor()
    log(f"{results['side']}: {name} ...")
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - the report must say what broke
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        log(f"{results['side']}: {name} FAILED: {type(e).__name__}: {e}")
    cpu = mon.stop()
    results.setdefault("cpu_contention", {})[name] = cpu
    log(f"{results['side']}: {name} done in {time.perf_counter() - t0:.1f} s; other processes used "
        f"{fmt(cpu.get('foreign_cores_avg'), '.2f')} cores on average meanwhile")


# ---- HF side ----------------------------------------------------------------------------------
def run_hf(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from engine.loader import resolve_model

    res: dict = {"side": "hf", "machine": machine_info(args.threads), "memory_start": memory_snapshot()}
    t0 = time.perf_counter()
    model_dir = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    res["load_s"] = time.perf_counter() - t0
    res["model_dir"] = str(model_dir)
    res["memory_after_load"] = memory_snapshot()
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (
        gc.eos_token_id[0] if isinstance(gc.eos_token_id, (list, tuple)) else gc.eos_token_id)
    N, P, M = args.num_requests, args.prompt_len, args.new_tokens

    def generate(ids: torch.Tensor, new: int) -> tuple[torch.Tensor, float]:
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad)
        return out, time.perf_counter() - t

    def warmup():
        ids = torch.tensor(random_prompts(SEED_WARMUP, 2, 16))
        _, t = generate(ids, 4)
        with torch.inference_mode():
            model(ids)
        return {"s": t}

    def decode():
        ids = torch.tensor(random_prompts(SEED_DECODE, N, P))
        prefill = []
        for _ in range(args.prefill_repeats):
            _, t = generate(ids, 1)
            prefill.append(t)
        out, total = generate(ids, M)
        new = out[:, P:]
        assert new.shape == (N, M), f"HF produced {tuple(new.shape)} new tokens, wanted {(N, M)}"
        t_prefill = median(prefill)
        return {
            "t_prefill_s": t_prefill, "t_prefill_runs_s": prefill, "t_total_s": total,
            "decode_tok_s": N * (M - 1) / (total - t_prefill),
            "e2e_tok_s": N * M / total,
            "output_token_ids": new.tolist(),
        }

    def ttft512():
        ids = torch.tensor(random_prompts(SEED_TTFT, 1, args.ttft_len))
        times, times_keep1 = [], []
        with torch.inference_mode():
            model(ids)   # warm-up
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
        return {"runs_s": times, "best_s": min(times), "median_s": median(times),
                "logits_to_keep1_runs_s": times_keep1,
                "logits_to_keep1_median_s": median(times_keep1)}

    section(res, "warmup", warmup)
    section(res, "decode", decode)
    section(res, "ttft512", ttft512)
    res["memory_peak"] = memory_snapshot()
    return res


# ---- pdserve side -----------------------------------------------------------------------------
def run_pdserve(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams

    res: dict = {"side": "pdserve", "machine": machine_info(args.threads),
                 "memory_start": memory_snapshot()}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, kv_cache_memory=args.kv_cache_memory, block_size=16,
              enable_prefix_caching=True, max_num_batched_tokens=2048, max_num_seqs=128)
    res["load_s"] = time.perf_counter() - t0
    torch.set_num_threads(args.threads)   # in case engine construction touched it
    eng = llm.engine
    kv = eng.kv_cache
    res["kv_cache"] = {
        "bytes": kv.numel() * kv.element_size(), "num_blocks": eng.block_manager.num_blocks,
        "block_size": eng.config.block_size, "shape": list(kv.shape), "dtype": str(kv.dtype),
        "kv_cache_memory_config": eng.config.kv_cache_memory,
        "max_model_len": eng.config.max_model_len,
        "max_num_batched_tokens": eng.config.max_num_batched_tokens,
    }
    res["memory_after_load"] = memory_snapshot()
    N, P, M = args.num_requests, args.prompt_len, args.new_tokens
    counter = iter(range(10 ** 9))

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
        llm.generate(random_prompts(SEED_WARMUP, 2, 16),
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        return {"s": time.perf_counter() - t}

    def decode():
        prompts = random_prompts(SEED_DECODE, N, P)
        params = SamplingParams(temperature=0, max_tokens=M, ignore_eos=True)
        rids = [f"decode-{i}" for i in range(N)]
        num_out = dict.fromkeys(rids, 0)
        final: dict = {}
        steps = []   # (t_end relative to start, step duration, tokens produced, all_have_first)
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
            steps.append((t_now - t_start, t_now - t_prev, produced,
                          all(v > 0 for v in num_out.values())))
            t_prev = t_now
            if not outs and not eng.has_unfinished_requests() and len(final) < N:
                raise RuntimeError("engine went idle before all decode requests finished")
        total = time.perf_counter() - t_start
        # first step after which every request has its first token
        k = next(i for i, s in enumerate(steps) if s[3])
        t_first_all = steps[k][0]
        decode_tokens = sum(s[2] for s in steps[k + 1:])
        decode_time = steps[-1][0] - t_first_all
        outputs = [final[r].outputs[0].token_ids for r in rids]
        assert all(len(o) == M for o in outputs), "a request did not produce exactly new_tokens"
        return {
            "t_total_s": total, "t_all_first_token_s": t_first_all,
            "num_steps": len(steps), "num_prefill_phase_steps": k + 1,
            "decode_tokens": decode_tokens, "decode_time_s": decode_time,
            "decode_tok_s": decode_tokens / decode_time if decode_time > 0 else None,
            "e2e_tok_s": N * M / total,
            "num_cached_tokens": [final[r].num_cached_tokens for r in rids],
            "num_preemptions": eng.scheduler.num_preemptions,
            "step_durations_s": [round(s[1], 6) for s in steps],
            "step_tokens": [s[2] for s in steps],
            "output_token_ids": outputs,
        }

    def ttft512():
        ttft(random_prompts(SEED_TTFT + 99, 1, args.ttft_len)[0])   # warm-up, its own prompt
        runs, cached = [], []
        for i in range(args.repeats):
            t, c = ttft(random_prompts(SEED_TTFT + i, 1, args.ttft_len)[0])
            runs.append(t)
            cached.append(c)
        return {"runs_s": runs, "best_s": min(runs), "median_s": median(runs),
                "num_cached_tokens": cached}

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
            "prefix_len": L, "suffix_len": S,
            "cold_runs_s": cold, "cold_median_s": median(cold), "cold_num_cached_tokens": cold_cached,
            "cache_warm_s": warm_t, "cache_warm_num_cached_tokens": warm_c,
            "cached_runs_s": hot, "cached_median_s": median(hot),
            "cached_num_cached_tokens": hot_cached,
            "speedup": median(cold) / median(hot),
        }

    section(res, "warmup", warmup)
    section(res, "decode", decode)
    section(res, "ttft512", ttft512)
    section(res, "prefix", prefix)
    res["memory_peak"] = memory_snapshot()
    res["block_manager"] = {"num_free_blocks": eng.block_manager.num_free_blocks,
                            "num_blocks": eng.block_manager.num_blocks}
    llm.shutdown()
    return res


# ---- orchestration ----------------------------------------------------------------------------
def side_argv(args, side: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--side", side,
            "--num-requests", str(args.num_requests), "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens), "--ttft-len", str(args.ttft_len),
            "--prefix-len", str(args.prefix_len), "--suffix-len", str(args.suffix_len),
            "--repeats", str(args.repeats), "--prefill-repeats", str(args.prefill_repeats),
            "--threads", str(args.threads), "--model", args.model]
    if args.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", str(args.kv_cache_memory)]
    return argv


def wait_for_idle_machine(max_wait_s: float) -> dict:
    """Poll until other processes use < CONTENTION_WARN_CORES over a 3 s window (or give up)."""
    t0 = time.perf_counter()
    while True:
        mon = CpuMonitor()
        time.sleep(3)
        f = mon.stop().get("foreign_cores_avg")
        waited = time.perf_counter() - t0
        if f is None or f < CONTENTION_WARN_CORES or waited >= max_wait_s:
            if f is not None and f >= CONTENTION_WARN_CORES:
                log(f"machine still busy ({f:.2f} cores used by others) after {waited:.0f} s; going on")
            return {"waited_s": waited, "foreign_cores_avg_last_3s": f}
        log(f"waiting for an idle machine: others use {f:.2f} cores ({waited:.0f}/{max_wait_s:.0f} s)")


def run_side_subprocess(args, side: str) -> dict:
    argv = side_argv(args, side)
    idle = wait_for_idle_machine(args.wait_idle) if args.wait_idle > 0 else None
    env = dict(os.environ, PDSERVE_NO_PROGRESS="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TOKENIZERS_PARALLELISM="false")
    log(f"running {side}: {shlex.join(argv)}")
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
        elif line.strip():
            print(line, file=sys.stderr)
    if result is None:
        result = {"side": side, "error": f"subprocess exited {proc.returncode} without a result"}
    result["subprocess"] = {"argv": argv, "returncode": proc.returncode, "wall_s": wall,
                            "wait_idle": idle}
    log(f"{side} finished in {wall:.1f} s (rc={proc.returncode})")
    return result


def get(d: dict, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def agreement(a: list[list[int]] | None, b: list[list[int]] | None) -> dict | None:
    """How far pdserve's greedy outputs agree with HF's (same prompts)."""
    if not a or not b or len(a) != len(b):
        return None
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        prefixes.append(n)
    return {"identical_requests": sum(1 for x, y in zip(a, b) if x == y), "num_requests": len(a),
            "mean_common_prefix": sum(prefixes) / len(prefixes), "min_common_prefix": min(prefixes)}


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def fmt(x, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def combine(args, hf: dict, pd: dict, command: str) -> dict:
    N, P, M = args.num_requests, args.prompt_len, args.new_tokens
    hf_dec, pd_dec = get(hf, "decode", "decode_tok_s"), get(pd, "decode", "decode_tok_s")
    hf_e2e, pd_e2e = get(hf, "decode", "e2e_tok_s"), get(pd, "decode", "e2e_tok_s")
    hf_ttft, pd_ttft = get(hf, "ttft512", "median_s"), get(pd, "ttft512", "median_s")
    cold, hot = get(pd, "prefix", "cold_median_s"), get(pd, "prefix", "cached_median_s")
    ratio = lambda a, b: (a / b) if (a is not None and b) else None  # noqa: E731
    dec_ratio, e2e_ratio = ratio(pd_dec, hf_dec), ratio(pd_e2e, hf_e2e)
    ttft_ratio, speedup = ratio(pd_ttft, hf_ttft), ratio(cold, hot)
    summary = {
        "decode": {"hf_tok_s": hf_dec, "pdserve_tok_s": pd_dec, "ratio": dec_ratio,
                   "target": f">= {TARGET_DECODE_RATIO}x HF decode-only",
                   "pass": None if dec_ratio is None else dec_ratio >= TARGET_DECODE_RATIO},
        "e2e": {"hf_tok_s": hf_e2e, "pdserve_tok_s": pd_e2e, "ratio": e2e_ratio},
        "ttft512": {"hf_forward_median_s": hf_ttft, "hf_forward_best_s": get(hf, "ttft512", "best_s"),
                    "pdserve_median_s": pd_ttft, "pdserve_best_s": get(pd, "ttft512", "best_s"),
                    "ratio": ttft_ratio, "target": "pdserve median <= HF forward median",
                    "pass": None if ttft_ratio is None else ttft_ratio <= TARGET_TTFT_RATIO},
        "prefix": {"cold_median_s": cold, "cached_median_s": hot, "speedup": speedup,
                   "target": f">= {TARGET_PREFIX_SPEEDUP}x faster than cold",
                   "pass": None if speedup is None else speedup >= TARGET_PREFIX_SPEEDUP},
        "peak_rss": {"hf_bytes": get(hf, "memory_peak", "ru_maxrss_bytes"),
                     "pdserve_bytes": get(pd, "memory_peak", "ru_maxrss_bytes"),
                     "hf_vm_hwm_bytes": get(hf, "memory_peak", "vm_hwm_bytes"),
                     "pdserve_vm_hwm_bytes": get(pd, "memory_peak", "vm_hwm_bytes"),
                     "pdserve_kv_cache_bytes": get(pd, "kv_cache", "bytes"),
                     "pdserve_kv_cache_blocks": get(pd, "kv_cache", "num_blocks")},
        "output_agreement": agreement(get(hf, "decode", "output_token_ids"),
                                      get(pd, "decode", "output_token_ids")),
    }
    return {
        "command": command, "argv": sys.argv, "cwd": os.getcwd(), "git_head": git_head(),
        "quick": args.quick,
        "config": {"num_requests": N, "prompt_len": P, "new_tokens": M, "ttft_len": args.ttft_len,
                   "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                   "repeats": args.repeats, "prefill_repeats": args.prefill_repeats,
                   "threads": args.threads, "dtype": "float32", "greedy": True,
                   "model": args.model, "kv_cache_memory": args.kv_cache_memory,
                   "wait_idle_s": args.wait_idle,
                   "token_id_range": [TOKEN_LO, TOKEN_HI]},
        "machine": hf.get("machine") or pd.get("machine"),
        "summary": summary, "hf": hf, "pdserve": pd,
    }


def render(report: dict) -> str:
    c, s, m = report["config"], report["summary"], report["machine"] or {}
    hf, pd = report["hf"], report["pdserve"]
    N, P, M = c["num_requests"], c["prompt_len"], c["new_tokens"]
    mib = lambda b: None if b is None else b / 2 ** 20  # noqa: E731
    ms = lambda x: None if x is None else x * 1000  # noqa: E731
    lines = [
        f"## pdserve engine benchmark{' (QUICK smoke run)' if report['quick'] else ''}",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {m.get('cpu_model')} ({m.get('cpu_count')} cpus), torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}, threads {m.get('torch_num_threads')}, "
        f"python {m.get('python')}, {m.get('date_utc')}",
        f"- model {c['model']}, fp32, greedy; prompts = random token ids in "
        f"[{c['token_id_range'][0]}, {c['token_id_range'][1]})",
        "",
        "| metric | HF transformers | pdserve | pdserve/HF | target | result |",
        "|---|---|---|---|---|---|",
        f"| decode-only tok/s ({N} req x {P} prompt, {M} new) | {fmt(s['decode']['hf_tok_s'])} "
        f"| {fmt(s['decode']['pdserve_tok_s'])} | {fmt(s['decode']['ratio'], '.2f', 'x')} "
        f"| >= {TARGET_DECODE_RATIO}x | {verdict(s['decode']['pass'])} |",
        f"| end-to-end tok/s ({N}x{M} / total) | {fmt(s['e2e']['hf_tok_s'])} "
        f"| {fmt(s['e2e']['pdserve_tok_s'])} | {fmt(s['e2e']['ratio'], '.2f', 'x')} | (info) | - |",
        f"| TTFT, fresh {c['ttft_len']}-token prompt, median ms (HF: one forward) "
        f"| {fmt(ms(s['ttft512']['hf_forward_median_s']))} | {fmt(ms(s['ttft512']['pdserve_median_s']))} "
        f"| {fmt(s['ttft512']['ratio'], '.2f', 'x')} | <= 1.0x | {verdict(s['ttft512']['pass'])} |",
        f"| TTFT cold {c['prefix_len']}+{c['suffix_len']} tokens, median ms | - "
        f"| {fmt(ms(s['prefix']['cold_median_s']))} | - | - | - |",
        f"| TTFT cached {c['prefix_len']}-prefix + {c['suffix_len']} fresh, median ms | - "
        f"| {fmt(ms(s['prefix']['cached_median_s']))} | cold/cached = "
        f"{fmt(s['prefix']['speedup'], '.1f', 'x')} | >= {TARGET_PREFIX_SPEEDUP}x | "
        f"{verdict(s['prefix']['pass'])} |",
        f"| peak RSS MiB (ru_maxrss, own process) | {fmt(mib(s['peak_rss']['hf_bytes']), '.0f')} "
        f"| {fmt(mib(s['peak_rss']['pdserve_bytes']), '.0f')} "
        f"| {fmt((s['peak_rss']['pdserve_bytes'] or 0) / s['peak_rss']['hf_bytes'], '.2f', 'x') if s['peak_rss']['hf_bytes'] and s['peak_rss']['pdserve_bytes'] else 'n/a'} "
        f"| printed | INFO |",
        "",
        "Details:",
    ]
    hd, pdd = hf.get("decode", {}), pd.get("decode", {})
    if "t_total_s" in hd:
        lines.append(f"- HF decode: prefill {hd['t_prefill_s']:.2f} s (median of "
                     f"{[round(x, 2) for x in hd['t_prefill_runs_s']]}), generate total "
                     f"{hd['t_total_s']:.2f} s -> decode {hd['t_total_s'] - hd['t_prefill_s']:.2f} s "
                     f"for {N}x{M - 1} tokens")
    if "t_total_s" in pdd:
        lines.append(f"- pdserve decode: total {pdd['t_total_s']:.2f} s in {pdd['num_steps']} steps; "
                     f"all first tokens after {pdd['num_prefill_phase_steps']} steps / "
                     f"{pdd['t_all_first_token_s']:.2f} s; then {pdd['decode_tokens']} tokens in "
                     f"{pdd['decode_time_s']:.2f} s; prefix-cache hits "
                     f"{sum(pdd['num_cached_tokens'])} tokens; preemptions {pdd['num_preemptions']}")
    ht, pt = hf.get("ttft512", {}), pd.get("ttft512", {})
    if "runs_s" in ht:
        lines.append(f"- HF forward {c['ttft_len']} runs ms: {[round(x * 1000, 1) for x in ht['runs_s']]} "
                     f"(best {ht['best_s'] * 1000:.1f}); with logits_to_keep=1 (info): "
                     f"{[round(x * 1000, 1) for x in ht['logits_to_keep1_runs_s']]}")
    if "runs_s" in pt:
        lines.append(f"- pdserve TTFT {c['ttft_len']} runs ms: {[round(x * 1000, 1) for x in pt['runs_s']]} "
                     f"(best {pt['best_s'] * 1000:.1f}); cached tokens {pt['num_cached_tokens']}")
    pp = pd.get("prefix", {})
    if "cold_runs_s" in pp:
        lines.append(f"- prefix: cold runs ms {[round(x * 1000, 1) for x in pp['cold_runs_s']]} "
                     f"(cached tokens {pp['cold_num_cached_tokens']}); cached runs ms "
                     f"{[round(x * 1000, 1) for x in pp['cached_runs_s']]} "
                     f"(cached tokens {pp['cached_num_cached_tokens']})")
    kv = pd.get("kv_cache")
    if kv:
        lines.append(f"- pdserve KV cache: {kv['bytes']} bytes ({kv['bytes'] / 2 ** 20:.0f} MiB), "
                     f"{kv['num_blocks']} blocks x {kv['block_size']} tokens "
                     f"({kv['num_blocks'] * kv['block_size']} token slots), shape {kv['shape']}, "
                     f"kv_cache_memory={kv['kv_cache_memory_config']}")
    for side, r in (("HF", hf), ("pdserve", pd)):
        mp, ml = r.get("memory_peak") or {}, r.get("memory_after_load") or {}
        if mp:
            lines.append(f"- {side} memory: after load RSS {ml.get('vm_rss_bytes', 0) / 2 ** 20:.0f} MiB; "
                         f"peak ru_maxrss {mp['ru_maxrss_bytes'] / 2 ** 20:.0f} MiB, "
                         f"VmHWM {mp['vm_hwm_bytes'] / 2 ** 20:.0f} MiB; load {r.get('load_s', 0):.1f} s")
    contended = []
    for side, r in (("HF", hf), ("pdserve", pd)):
        for name, cpu in (r.get("cpu_contention") or {}).items():
            f = cpu.get("foreign_cores_avg")
            if name != "warmup" and f is not None:
                contended.append(f"{side} {name} {f:.2f}")
    if contended:
        worst = max(float(x.rsplit(" ", 1)[1]) for x in contended)
        lines.append(f"- CPU used by OTHER processes during each section (avg cores of "
                     f"{m.get('cpu_count')}): {', '.join(contended)}"
                     + (" -- WARNING: the machine was shared, timings are disturbed"
                        if worst >= CONTENTION_WARN_CORES else ""))
    ag = s.get("output_agreement")
    if ag:
        lines.append(f"- greedy output agreement pdserve vs HF: {ag['identical_requests']}/"
                     f"{ag['num_requests']} requests identical, mean common prefix "
                     f"{ag['mean_common_prefix']:.1f}/{M} tokens (min {ag['min_common_prefix']})")
    for side, r in (("HF", hf), ("pdserve", pd)):
        if r.get("error"):
            lines.append(f"- {side} ERROR: {r['error']}")
        for k, v in r.items():
            if isinstance(v, dict) and "error" in v:
                lines.append(f"- {side} {k} ERROR: {v['error']}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["both", "hf", "pdserve"], default="both",
                    help="hf / pdserve: run one side in this process and print one JSON line; "
                         "both (default): run each side in its own subprocess and report")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 32 new tokens")
    ap.add_argument("--out", default=None, help=f"JSON results path (default {DEFAULT_OUT})")
    ap.add_argument("--num-requests", type=int, default=None, help="concurrent requests (32; quick 8)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (128; quick 32)")
    ap.add_argument("--ttft-len", type=int, default=512)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each TTFT measurement")
    ap.add_argument("--prefill-repeats", type=int, default=2,
                    help="HF prefill-only generate runs (median is subtracted)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-cache-memory", type=int, default=None,
                    help="pdserve KV bytes (default: the engine default, 1 GiB on CPU)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each side, wait up to SECONDS for other processes to stop using "
                         "the CPU (the machine may be shared); 0 = do not wait")
    args = ap.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 32
    if args.new_tokens is None:
        args.new_tokens = 32 if args.quick else 128
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode-only throughput needs a decode step)")
    for name in ("num_requests", "prompt_len", "ttft_len", "prefix_len", "suffix_len", "repeats",
                 "prefill_repeats", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side != "both":
        res = run_hf(args) if args.side == "hf" else run_pdserve(args)
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return 0
    command = shlex.join(["python"] + [os.path.relpath(sys.argv[0], os.getcwd())] + sys.argv[1:])
    hf = run_side_subprocess(args, "hf")
    pd = run_side_subprocess(args, "pdserve")
    report = combine(args, hf, pd, command)
    table = render(report)
    report["table_markdown"] = table
    out = args.out or os.path.join(REPO_ROOT, DEFAULT_OUT)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(table)
    print(f"\nresults written to {out}")
    failed = [k for k in ("decode", "ttft512", "prefix") if report["summary"][k]["pass"] is None]
    return 1 if failed or hf.get("error") or pd.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
