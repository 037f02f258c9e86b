"""One stream beside busy processes (issue #48, must-show b): how much of its quiet speed a greedy
decode stream keeps when two plain Python busy loops share the machine's cores with it.

For each mode, the embedded SmolLM2 is built once in this process (torch's threads as the engine
would have them: every core), then one greedy stream of --tokens new tokens on a short chat prompt
is timed --runs times on the quiet machine, then --runs times with --hogs busy loops running
(`python -c "while True: pass"`, started before and killed after). A run's speed is its new
tokens over its wall time (the prompt is 20 tokens: its prefill is under 2% of a run). Each mode
is measured twice: with the engine's thread fitting (engine/threads.py: torch's thread count
follows the cores free now) and without it (the count it started with, the engine before the
fitting), so the gain is measured on the same machine in the same minutes. Reports the median
tok/s of each, the ratio busy/quiet, the threads the fitting ended on, and this process's CPU
use beside the hogs (cores; a fair share of two cores among three busy processes is ~0.67).

With the fitting, the stream is also timed quiet on one thread, which gives the most the busy
runs could reach: the share ceiling, the CPU the busy runs got (cores) times the one-thread
quiet speed, over the quiet speed; and the efficiency, the busy runs' tokens per CPU-second over
the one-thread quiet speed (1.0: each CPU-second the scheduler gave did as much as one alone).

  python -m benchmarks.engine.contention                 # float32 without speculation, default mode
  python -m benchmarks.engine.contention --modes float32 --runs 2

Modes: float32 (dtype float32, speculation off) and default (every "auto": what `pdserve up`
serves). Needs a quiet machine apart from its own busy loops: it waits for one (--wait-idle).
Writes benchmarks/results/contention.json.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from benchmarks.bench_common import (
    add_out_arg,
    add_wait_idle_arg,
    log,
    run_and_write,
    script_parser,
    wait_for_idle_machine,
)

MODES = {
    "float32": dict(dtype="float32", speculative_config=None),
    "default": {},
}
PROMPT = [{"role": "user", "content": "Tell me about the history of Paris in a few paragraphs."}]


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _start_hogs(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]


def _stop(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
        h.wait()


def _stream(llm, ids: list[int], tokens: int) -> tuple[float, float]:
    """(tok/s of one greedy stream of `tokens` new tokens, this process's cores while it ran)."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0, c0 = time.perf_counter(), _own_cpu_s()
    out = llm.generate([ids], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == tokens
    return tokens / wall, (_own_cpu_s() - c0) / wall


def _one_thread(llm, ids, args) -> list[float]:
    """Quiet tok/s on one torch thread (the fitting's count beside busy processes)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _stream(llm, ids, 16)
        return [_stream(llm, ids, args.tokens)[0] for _ in range(args.runs)]
    finally:
        torch.set_num_threads(before)


def _ceiling(res: dict, one: list[float]) -> dict:
    """The share ceiling and the busy runs' efficiency (module docstring) from `res`'s runs."""
    one_med = statistics.median(one)
    cores = statistics.median(res["busy_own_cores"])
    per_cpu_s = statistics.median(t / c for t, c in zip(res["busy_tok_s"], res["busy_own_cores"]))
    return {
        "one_thread_quiet_tok_s": [round(x, 1) for x in one],
        "share_ceiling": round(cores * one_med / res["quiet_median"], 3),
        "busy_efficiency": round(per_cpu_s / one_med, 3),
    }


def _measure(llm, ids, args, fitting: bool) -> dict:
    runner = llm.engine.runner
    fit = runner.thread_fit
    if not fitting:
        runner.thread_fit = None
    try:
        _stream(llm, ids, 16)  # warm
        quiet = [_stream(llm, ids, args.tokens)[0] for _ in range(args.runs)]
        runner.thread_fit = None  # (the one-thread runs, with the fitting, are not the fitting's)
        one = _one_thread(llm, ids, args) if fitting else None
        runner.thread_fit = fit if fitting else None
        hogs = _start_hogs(args.hogs)
        try:
            time.sleep(1.0)  # the loops are running, and the fitting has seen them
            _stream(llm, ids, 16)
            busy = [_stream(llm, ids, args.tokens) for _ in range(args.runs)]
        finally:
            _stop(hogs)
        threads_busy = fit.threads if (fitting and fit is not None) else None
    finally:
        runner.thread_fit = fit
        if fit is not None:
            fit.restore()
        time.sleep(1.0)
    q, b = statistics.median(quiet), statistics.median(x[0] for x in busy)
    res = {
        "quiet_tok_s": [round(x, 1) for x in quiet],
        "busy_tok_s": [round(x[0], 1) for x in busy],
        "busy_own_cores": [round(x[1], 2) for x in busy],
        "quiet_median": round(q, 1),
        "busy_median": round(b, 1),
        "busy_over_quiet": round(b / q, 3),
        "threads_at_the_end_of_the_busy_runs": threads_busy,
    }
    return res | (_ceiling(res, one) if one else {})


def run(args) -> dict:
    import torch

    from pdserve.engine import LLM

    out = {
        "hogs": args.hogs,
        "tokens": args.tokens,
        "runs": args.runs,
        "threads_at_start": torch.get_num_threads(),
    }
    for mode in args.modes:
        if args.wait_idle:
            out.setdefault("waited_for_idle", {})[mode] = wait_for_idle_machine(args.wait_idle)
        llm = LLM("smollm2", **MODES[mode])
        ids = list(
            llm.get_tokenizer().apply_chat_template(
                PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        res = {"mode_note": llm.engine.mode_note}
        for fitting in (True, False):
            key = "fitting" if fitting else "no_fitting"
            res[key] = _measure(llm, ids, args, fitting)
            log(f"{mode} {key}: {res[key]}")
        out[mode] = res
        llm.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    ap.add_argument("--runs", type=int, default=3, help="streams per condition")
    ap.add_argument("--hogs", type=int, default=2, help="busy loops beside the stream")
    add_wait_idle_arg(ap, "each mode")
    add_out_arg(ap, "contention.json")
    args = ap.parse_args(argv)
    return run_and_write("benchmarks.engine.contention", argv, args.out, lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
