"""Slow is not dead, and hung is caught (issue #47, must-shows a and d): a real deployment of the
embedded SmolLM2 (`deploy.launcher.up()`, as `pdserve up` runs it), greedy streams of fixed
prompts, each part first run clean for the tokens every stream must have.

  a  1P+1D, --streams (16) concurrent streams that keep arriving, and two busy processes hogging
     both cores for --hog-s (60 s) while they run: no worker may be marked down or dead (the
     router's pool sampled every 50 ms, its `is down`/`is dead` warnings counted, and its
     pdserve:worker_deaths_total), no stream may fail, and every stream must be token-identical
     to the clean run. Reports the streams' durations clean and beside the hogs and how much of
     the streams' time the hogs overlapped.
  d  1P+2D, the same streams; the hang hook (PDSERVE_TEST_ENGINE_HANG_FILE, engine/
     engine_loop.py) stops the engine thread of the decode worker with the most streams while
     its server still answers, for --hang-s (30 s). Per stream in flight at the hang: the gap
     until its next token (the must-show: under 10 s), and whether it stayed token-identical; when
     the router declared the worker dead, and that it served again after the hook let go.

  python -m benchmarks.robustness.busy_hogs              # both parts, about 6 minutes on 2 cores
  python -m benchmarks.robustness.busy_hogs --part d --hang-s 20

Writes benchmarks/results/busy_hogs.json.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.bench_common import add_out_arg, log, random_prompts, run_and_write, script_parser
from benchmarks.chaos_harness import (
    Child,
    deployment,
    example_config,
    jobs_for,
    kv_state,
    pct,
    run_streams,
    stream_counts,
    wait_kv_free,
)
from benchmarks.robustness.chaos_hangs import timed_loop

HOG = "import time, sys\nend = time.monotonic() + float(sys.argv[1])\n"
HOG += "while time.monotonic() < end:\n    pass\n"


class PoolWatch:
    """Samples the router's pool every 50 ms, and counts its pool's down/dead warnings."""

    def __init__(self, pool):
        self.pool = pool
        self.samples = 0
        self.bad: list[tuple] = []  # (seconds since start, worker, down, dead)
        self.warnings: list[str] = []
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._handler = logging.Handler(logging.WARNING)
        self._handler.emit = lambda record: self.warnings.append(record.getMessage())
        logging.getLogger("pdserve.router.pool").addHandler(self._handler)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.05):
            self.samples += 1
            for w in self.pool.members():
                if w.down or w.dead:
                    t = round(time.monotonic() - self._t0, 2)
                    self.bad.append((t, self.pool.name(w), w.down, w.dead))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        logging.getLogger("pdserve.router.pool").removeHandler(self._handler)
        return {
            "samples": self.samples,
            "samples_with_a_worker_down_or_dead": len(self.bad),
            "first_bad_samples": self.bad[:10],
            "down_or_dead_warnings": [m for m in self.warnings if "is down" in m or "is dead" in m],
            "deaths": dict(self.pool.deaths),
        }


def clean_run(address: str, jobs: list[dict], concurrency: int) -> list[list[int]]:
    """Every job once, nothing disturbed: the tokens each stream must have."""
    rows = Child(run_streams, address, jobs, concurrency).result()
    if any(r["error"] for r in rows):
        raise RuntimeError(f"the clean run failed: {[r['error'] for r in rows][:3]}")
    return [r["tokens"] for r in sorted(rows, key=lambda r: r["i"])]


def resumed_after(row: dict, t: float) -> float:
    """Seconds from `t` to the token that ended `row`'s longest wait between tokens after `t`
    (inf: no token came after `t`)."""
    after = [e for e in row["events"] if e > t]
    if not after:
        return float("inf")
    ends = list(zip([t] + after, after))
    _, end = max(ends, key=lambda pair: pair[1] - pair[0])
    return end - t


def durations(rows: list[dict]) -> dict:
    took = [r["end"] - r["start"] for r in rows if not r["error"]]
    return {"p50": round(pct(took, 50), 2), "max": round(max(took, default=0.0), 2)}


def part_a(args) -> dict:
    prompts = random_prompts(4700, args.streams, args.prompt_len)
    jobs = jobs_for(prompts, args.max_tokens)
    config = example_config(prefill=1, decode=1, prefix_caching=False)
    with deployment(config, source="bench/busy_hogs") as (cluster, _):
        address, pool = cluster.router_address, cluster.router.pool
        t = time.monotonic()
        want = clean_run(address, jobs, args.streams)
        clean_s = time.monotonic() - t
        loop = Child(timed_loop, address, jobs, args.streams, stop=Child.ctx.Event())
        time.sleep(clean_s + 2)  # a round of the loop before the hogs, for its durations
        watch = PoolWatch(pool)
        t_hog = time.monotonic()
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(args.hog_s)]) for _ in range(2)]
        log(f"a: two busy processes for {args.hog_s:.0f} s beside {args.streams} streams")
        for hog in hogs:
            hog.wait(args.hog_s + 60)
        t_end = time.monotonic()
        rows = loop.result()
        health = watch.stop()
        free, waited, _ = wait_kv_free(cluster, timeout_s=30)
    changed, counts = stream_counts(rows, want)
    before = [r for r in rows if r["end"] <= t_hog]
    beside = [r for r in rows if r["start"] < t_end and r["end"] > t_hog]
    stream_s = sum(r["end"] - r["start"] for r in beside)
    overlap_s = sum(min(r["end"], t_end) - max(r["start"], t_hog) for r in beside)
    out = {
        "workers": "1P+1D",
        "streams_concurrent": args.streams,
        "prompt_tokens": args.prompt_len,
        "max_tokens": args.max_tokens,
        "hog_s": round(t_end - t_hog, 1),
        **counts,
        "streams_beside_the_hogs": len(beside),
        "hog_overlap_of_their_stream_time": round(overlap_s / stream_s, 3) if stream_s else None,
        "stream_s_clean": durations(before),
        "stream_s_beside_the_hogs": durations(beside),
        "health": health,
        "kv_all_free": free,
        "kv_free_waited_s": round(waited, 2),
    }
    log(
        f"a: {counts['errors']} errors, {counts['token_identical']}/{counts['streams']} identical, "
        f"{len(changed)} changed; {health['samples_with_a_worker_down_or_dead']} of "
        f"{health['samples']} samples with a worker down or dead; deaths {health['deaths']}"
    )
    return out


def part_d(args) -> dict:
    hang = os.path.join(tempfile.mkdtemp(prefix="pdhang"), "hang")
    os.environ["PDSERVE_TEST_ENGINE_HANG_FILE"] = hang  # the workers inherit it through Ray
    prompts = random_prompts(4701, args.streams, args.prompt_len)
    jobs = jobs_for(prompts, args.max_tokens)
    config = example_config(prefill=1, decode=2, prefix_caching=False)
    try:
        with deployment(config, source="bench/busy_hogs") as (cluster, _):
            address, pool = cluster.router_address, cluster.router.pool
            want = clean_run(address, jobs, args.streams)
            run = Child(timed_loop, address, jobs, args.streams, stop=Child.ctx.Event())
            time.sleep(args.warm_s)
            state = kv_state(cluster)
            victim = max(
                (r for r in cluster.replicas if r.role == "decode" and r.address),
                key=lambda r: state[r.name]["running"],
            )
            flag = f"{hang}.{victim.name}-engine"
            watch = PoolWatch(pool)
            open(flag, "w").close()
            t_stop = time.monotonic()
            log(f"d: hung the engine of {victim.name} ({state[victim.name]}) for {args.hang_s} s")
            dead_s = None
            while time.monotonic() - t_stop < args.hang_s:
                w = next((w for w in pool.decode if w.address == victim.address), None)
                if dead_s is None and w is not None and w.dead:
                    dead_s = round(time.monotonic() - t_stop, 2)
                time.sleep(0.05)
            os.unlink(flag)
            t_cont = time.monotonic()
            alive_s = None
            while time.monotonic() - t_cont < 20 and alive_s is None:
                w = next((w for w in pool.decode if w.address == victim.address), None)
                if w is not None and not w.dead and not w.down:
                    alive_s = round(time.monotonic() - t_cont, 2)
                time.sleep(0.05)
            rows = run.result()
            health = watch.stop()
            free, waited, _ = wait_kv_free(cluster, timeout_s=30)
    finally:
        os.environ.pop("PDSERVE_TEST_ENGINE_HANG_FILE", None)
    changed, counts = stream_counts(rows, want)
    in_flight = [r for r in rows if r["start"] < t_stop < r["end"] and r["events"]]
    every = sorted(resumed_after(r, t_stop) for r in in_flight)
    resumes = [g for g in every if g != float("inf")]
    stalled = [r for r in in_flight if resumed_after(r, t_stop) >= 1.0]
    out = {
        "workers": "1P+2D",
        "streams_concurrent": args.streams,
        "hung": victim.name,
        "hang_s": args.hang_s,
        "victim_at_hang": state[victim.name],
        "declared_dead_after_s": dead_s,
        "up_again_after_release_s": alive_s,
        **counts,
        "changed_streams": len(changed),
        "in_flight_at_hang": len(in_flight),
        # streams that waited 1 s or more after the hang (those on the hung worker), and where
        # they finished
        "stalled_by_the_hang": len(stalled),
        "they_finished_on": sorted({r.get("decode_worker") for r in stalled}),
        # per stream in flight: seconds from the hang to the token that ended its longest wait
        # after it (the turn under way at the hang still delivers; the hang stops the next)
        "resumed_after_hang_s": {
            "max": round(max(resumes, default=0.0), 2),
            "p50": round(pct(resumes, 50), 2),
            "over_10s": sum(g >= 10.0 for g in resumes),
            "all": [round(g, 2) for g in resumes],
            # in flight at the hang but no token after it: every token had come (the checks
            # above say whether it was the right one), only the finish was to come
            "no_token_after_hang": len(every) - len(resumes),
        },
        "health": health,
        "kv_all_free": free,
        "kv_free_waited_s": round(waited, 2),
    }
    log(
        f"d: {counts['errors']} errors, {counts['token_identical']}/{counts['streams']} identical; "
        f"dead after {dead_s} s; every stream resumed within "
        f"{out['resumed_after_hang_s']['max']} s of the hang ({len(stalled)} had waited)"
    )
    return out


def run(args) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    out = {"model": "SmolLM2-135M-Instruct (embedded GGUF), deploy/examples/local-cpu.yaml"}
    if args.part in ("a", "all"):
        out["a"] = part_a(args)
    if args.part in ("d", "all"):
        out["d"] = part_d(args)
    return out


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--part", choices=("a", "d", "all"), default="all")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    p.add_argument("--hog-s", type=float, default=60.0, help="a: how long the hogs run")
    p.add_argument("--hang-s", type=float, default=30.0, help="d: how long the engine hangs")
    p.add_argument("--warm-s", type=float, default=6.0, help="d: streams before the hang")
    add_out_arg(p, "busy_hogs.json")
    args = p.parse_args(argv)
    return run_and_write("benchmarks.robustness.busy_hogs", argv, args.out, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
