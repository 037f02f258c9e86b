"""The router's console line: what the cluster is doing, every few seconds, at INFO.

vLLM prints a line every few seconds (throughput, running and waiting requests, KV use); a
disaggregated deployment has two pools whose figures mean different things, so ConsoleStats
writes one line for the router (prompt and generation tokens per second over the interval,
requests in flight and waiting for decode KV, finished and failed) and one per pool (workers up
and down, running, waiting and reserved requests, prompt tokens queued, KV cache use, the prefix
cache's hit share of the tokens looked up, KV hand-off bytes per second). It reads only what the
router already holds (the pool's last WorkerStats, the router's own Prometheus counters): no RPC.
Lines stop while the cluster is idle (one line says so) and start again with the next request.

Lifecycle: the Router starts one after its pool and metrics when its interval
(`observability.stats_interval_s`, 0: none) is set, as a daemon thread that wakes each interval;
`stop` ends it with the router. `lines` (one interval's lines from the figures since the last
call) is the whole computation, so a test drives it with no thread and a fake clock.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

_ROUTER_COUNTERS = (  # what the router line's rates and totals come from (router/metrics.py)
    ("prompt", "vllm:prompt_tokens_total"),
    ("generation", "vllm:generation_tokens_total"),
)
_GAUGES = (
    ("inflight", "pdserve:router_requests_inflight"),
    ("decode_queue", "pdserve:router_decode_queue_waiting"),
)
# per-pool counters read from each worker's last WorkerStats, turned into rates or shares
_WORKER_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "kv_transfer_bytes")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class ConsoleStats:
    def __init__(self, pool, registry, model_name: str, interval_s: float, clock=time.monotonic):
        self.pool, self.registry, self.model = pool, registry, model_name
        self.interval_s = interval_s
        self.clock = clock
        self._last_t = clock()
        self._last: dict = {}  # counter name -> value at the last call (router and per worker)
        self._idle_said = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the figures ----------------------------------------------------------------------------
    def _sample(self, name: str, labels: dict | None = None) -> float:
        value = self.registry.get_sample_value(name, {"model_name": self.model, **(labels or {})})
        return value or 0.0

    def _finished(self) -> tuple[float, float]:
        """(requests that ended with a finish, requests that ended with an error) since start."""
        done = failed = 0.0
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name == "vllm:request_success_total":
                    if s.labels.get("finished_reason") in ("abort", "error"):
                        failed += s.value
                    else:
                        done += s.value
        return done, failed

    def lines(self) -> list[str]:
        """This interval's lines (empty while idle, after one line that says so)."""
        now = self.clock()
        dt = max(now - self._last_t, 1e-9)
        self._last_t = now
        cur = {key: self._sample(name) for key, name in _ROUTER_COUNTERS}
        cur["finished"], cur["failed"] = self._finished()
        gauges = {key: self._sample(name) for key, name in _GAUGES}
        pools: dict[str, list] = {}
        for role, name, stats, down, state in self.pool.snapshot():
            pools.setdefault(role, []).append((name, stats, down, state))
            for field in _WORKER_COUNTERS:
                if stats is not None:
                    cur[(name, field)] = float(getattr(stats, field))
        delta = {k: v - self._last.get(k, 0.0) for k, v in cur.items()}
        # a restarted worker's counters start over: its drop is not negative work
        delta = {k: max(0.0, v) for k, v in delta.items()}
        self._last = cur
        busy = any(
            stats is not None and (stats.num_running or stats.num_waiting or stats.num_reserved)
            for members in pools.values()
            for _, stats, _, _ in members
        )
        active = (
            busy
            or gauges["inflight"] > 0
            or any(delta[k] for k in ("prompt", "generation", "finished", "failed"))
        )
        if not active:
            if self._idle_said:
                return []
            self._idle_said = True
            return ["router: idle (no request in flight)"]
        self._idle_said = False
        out = [
            f"router: prompt {delta['prompt'] / dt:,.1f} tok/s, generation "
            f"{delta['generation'] / dt:,.1f} tok/s over {dt:.0f} s; "
            f"{gauges['inflight']:.0f} in flight, {gauges['decode_queue']:.0f} waiting for decode "
            f"KV; {delta['finished']:.0f} finished, {delta['failed']:.0f} failed or aborted"
        ]
        for role in sorted(pools):
            out.append(self._pool_line(role, pools[role], delta, dt))
        return out

    @staticmethod
    def _pool_line(role: str, members: list, delta: dict, dt: float) -> str:
        up = sum(1 for _, _, down, _ in members if not down)
        states = [state for _, _, down, state in members if not down and state != "serving"]
        running = waiting = reserved = queued = used = total = 0
        queries = hits = moved = 0.0
        for name, stats, down, _ in members:
            if stats is None or down:
                continue
            running += stats.num_running
            waiting += stats.num_waiting
            reserved += stats.num_reserved
            queued += stats.queued_prompt_tokens
            used += stats.num_total_blocks - stats.num_free_blocks
            total += stats.num_total_blocks
            queries += delta.get((name, "prefix_cache_queries"), 0.0)
            hits += delta.get((name, "prefix_cache_hits"), 0.0)
            moved += delta.get((name, "kv_transfer_bytes"), 0.0)
        parts = [
            f"{up} of {len(members)} workers up"
            + (f" ({', '.join(sorted(states))})" if states else ""),
            f"running {running}, waiting {waiting}"
            + (f", reserved {reserved}" if role == "decode" else ""),
            f"{queued:,} prompt tokens queued",
            f"KV {100 * used / total:.1f}% used" if total else "KV n/a",
            f"prefix hits {100 * hits / queries:.1f}% of {queries:,.0f} tokens"
            if queries
            else "no prefix lookups",
            f"KV {'pushed' if role == 'prefill' else 'received'} {_mb(moved / dt)}/s",
        ]
        return f"{role} pool: " + "; ".join(parts)

    # ---- the thread -----------------------------------------------------------------------------
    def start(self) -> ConsoleStats:
        self._thread = threading.Thread(target=self._run, name="pdserve-console", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                for line in self.lines():
                    log.info("%s", line)
            except Exception:  # a console bug must never stop the router
                log.exception("console stats line failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
