"""Which thread builds the engine matters to its speed on CPU (see engine/engine_loop.py).

    python bench/engine_thread_bench.py [--threads 2] [--prompts 8] [--prompt-len 512]

Three modes, each in its own fresh process, SmolLM2, one 512-token prompt at a time (prefill
only, max_tokens 1), a warm-up prompt first:
  main             built and stepped on the main thread (what a script using LLM does)
  other-thread     built on the main thread, stepped on another (what the workers did before
                   EngineLoop.build)
  built-on-thread  built and stepped on one non-main thread (EngineLoop.build)
Prints each mode's per-prompt times and median, in ms.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("main", "other-thread", "built-on-thread")


def run_mode(mode: str, threads: int, num_prompts: int, prompt_len: int) -> None:
    sys.path.insert(0, REPO_ROOT)
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams
    torch.set_num_threads(threads)
    rng = random.Random(1)
    times: list[float] = []
    box: dict = {}

    def build():
        box["engine"] = LLMEngine(EngineConfig(model="smollm2", kv_cache_memory=256 << 20,
                                               max_model_len=2048, max_num_batched_tokens=2048))

    def step_all():
        engine = box["engine"]
        for i in range(num_prompts + 1):
            engine.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)],
                               SamplingParams(temperature=0.0, max_tokens=1))
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            if i:   # the first is the warm-up
                times.append(time.perf_counter() - t0)

    if mode == "main":
        build()
        step_all()
    else:
        if mode == "other-thread":
            build()
        target = step_all if mode == "other-thread" else (lambda: (build(), step_all()))
        t = threading.Thread(target=target)
        t.start()
        t.join()
    print(f"{mode}: {[round(x * 1000) for x in times]} median {statistics.median(times) * 1000:.0f} ms",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)   # the child's
    args = ap.parse_args()
    if args.mode:
        run_mode(args.mode, args.threads, args.prompts, args.prompt_len)
        return 0
    env = {**os.environ, "PDSERVE_NO_PROGRESS": "1"}
    for mode in MODES:
        subprocess.run([sys.executable, __file__, "--mode", mode, "--threads", str(args.threads),
                        "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len)],
                       check=True, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
