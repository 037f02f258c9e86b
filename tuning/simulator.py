"""A discrete-event simulator of a pdserve deployment, for the tuner: the router, the prefill
queues, the KV transfer and continuous-batching decode (or colocated workers), driven by
RequestSpecs and a hardware profile (tuning/perf_model.py).

    result = simulate(requests, profile, Placement(prefill=PoolSpec(2, 1), decode=PoolSpec(1, 2)))
    result.attainment(ttft_s=0.5, tpot_s=0.05)        # fraction meeting both SLOs

The tuner (tuning/tuner.py) and the SLO experiments create one Simulator per placement and call
`run` once per workload and rate. A run builds its workers (tuning/sim_worker.py: the engine
scheduler's policy over token counts), plays every event to the end, and returns a SimResult.
Nothing is kept between runs and nothing touches the disk; without a seed, the same inputs always
give the same answer. What the simulation models, and what it leaves out, is in the Simulator
docstring. The placement here is static; tuning/sim_planner.py runs the same model with the
planner (planner/policy.py) moving workers between the pools as a trace plays
(`simulate(..., planner=PlannerConfig(...))`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from pdserve.tuning.perf_model import Profile
from pdserve.tuning.sim_worker import Seq, Worker, least_used

_ARRIVE, _STEP_DONE, _COMMIT = 0, 1, 2
INF = math.inf
ROUTER_STATS_S = 0.5  # router.server.RouterConfig.stats_interval_s


@dataclass(frozen=True)
class PoolSpec:
    replicas: int
    tp: int = 1
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    kv_capacity_tokens: int | None = None  # per replica; None: the profile's for this tp


@dataclass(frozen=True)
class Placement:
    """prefill None: `decode` is a colocated pool whose workers prefill and decode together."""

    prefill: PoolSpec | None
    decode: PoolSpec
    backend: str | None = None  # None: the profile's fastest

    @property
    def colocated(self) -> bool:
        return self.prefill is None

    @property
    def num_devices(self) -> int:
        pools = [self.decode] if self.prefill is None else [self.prefill, self.decode]
        return sum(p.replicas * p.tp for p in pools)

    def label(self) -> str:
        if self.prefill is None:
            return f"colocated {self.decode.replicas}x tp{self.decode.tp}"
        p, d = self.prefill, self.decode
        return f"{p.replicas}P tp{p.tp} + {d.replicas}D tp{d.tp}"


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float
    tpot_s: float
    e2e_s: float


@dataclass
class SimResult:
    requests: list[RequestResult]
    stopped_early: bool = False  # gave up once too many requests had missed the SLO
    num_steps: int = 0
    num_preemptions: int = 0

    def attainment(self, ttft_s: float, tpot_s: float) -> float:
        if not self.requests:
            return 0.0
        good = sum(1 for r in self.requests if r.ttft_s <= ttft_s and r.tpot_s <= tpot_s)
        return good / len(self.requests)


@dataclass
class FlipRecord:
    worker: int  # the worker's slot (0.. in the starting placement's order: prefill, then decode)
    from_role: str
    to_role: str
    start_s: float
    drained_s: float | None = None
    done_s: float | None = None
    moved_streams: int = 0  # decode legs moved at the drain bound
    moved_prompts: int = 0  # prompts moved off a prefill worker at the drain bound


@dataclass
class PlannerSimResult(SimResult):
    flips: list[FlipRecord] = field(default_factory=list)
    decisions: list[tuple[float, str, str]] = field(default_factory=list)  # acting ones
    # one row per decision: (now, prefill workers, decode workers, local_max, ttft and tpot
    # pressure as the planner computed them, action)
    timeline: list[tuple] = field(default_factory=list)
    num_local: int = 0  # legs prefilled on their decode worker


class _Req:
    __slots__ = (
        "arrival",
        "prompt",
        "output",
        "dest",
        "reserved",
        "first_at",
        "done_at",
        "num_out",
        "missed",
    )

    def __init__(self, arrival: float, prompt: int, output: int):
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.dest = None
        self.reserved = 0
        self.first_at = self.done_at = INF
        self.num_out = 0
        self.missed = False


class Simulator:
    """One placement under one profile; `run` simulates a workload on it.

    Modelled, as the real components behave:
    * Router, disaggregated: a request reserves its prompt's blocks on the decode worker with the
      fewest blocks in use (then the most free), then goes to the prefill worker with the fewest
      queued prompt tokens (ties rotate). With no room on any decode worker it waits in arrival
      order, where the real router answers RESOURCE_EXHAUSTED and the client retries. A decode worker takes the Reserve
      and the commit between its steps.
    * Router, colocated: the worker with the fewest prompt tokens charged to it, then the most free
      blocks as the router saw them at its last Stats sweep (`router_stats_s`; 0: an exact view).
    * Workers: the engine scheduler's policy (tuning/sim_worker.py), with step times from the
      profile's model for the pool's TP degree and worker kind (serving-path models where given).
    * KV transfer: layer by layer behind the prefill compute, one link per prefill worker, then
      the backend's per-message latency.
    * Timings: TTFT ends at the commit on the decode worker (colocated: at the step that finishes
      the prompt). TPOT is (E2E - TTFT) / (output_len - 1), and 0 for one-token outputs. A request
      that never finishes gets an infinite TTFT and E2E.
    * Step times: the profile's interference factors stretch a step that starts while another
      worker on the host is busy; a seeded run also draws the profile's step noise and replays
      its speed traces.

    It does not model prefix caching, stop tokens (every request produces output_len tokens), the
    router's max_inflight, retries, lease expiry or failures, the CPU time of the router and of
    the workers' serving threads beyond what serving-path step models fold in, contention between
    transfers into one decode worker, KV re-sharding between TP sizes, interference beyond the
    profile's factors, or the disaggregated router's stale view of free blocks.
    """

    def __init__(
        self,
        profile: Profile,
        placement: Placement,
        fast: bool = True,
        router_stats_s: float = ROUTER_STATS_S,
        seed: int | None = None,
    ):
        self.profile, self.placement, self.fast = profile, placement, fast
        self.router_stats_s = router_stats_s
        self.seed = seed  # None: no step noise
        for pool in filter(None, (placement.prefill, placement.decode)):
            if pool.tp not in profile.tp:
                raise ValueError(f"the profile has no tp={pool.tp} (it has {profile.tp_degrees})")
        self.backend = placement.backend or profile.best_backend()
        if not placement.colocated and self.backend not in profile.transfer:
            raise ValueError(
                f"the profile has no KV transfer figures for backend {self.backend!r} "
                f"(it has {sorted(profile.transfer)})"
            )

    def run(
        self,
        requests,
        *,
        max_missed: int | None = None,
        ttft_s: float = INF,
        tpot_s: float = INF,
        phase: str = "both",
        max_steps: int = 20_000_000,
    ) -> SimResult:
        """requests: RequestSpecs. With max_missed, stops once more than that many requests missed
        ttft_s or tpot_s (the answer to "does it meet the SLO" is known by then).

        phase (disaggregated placements), for sizing one pool alone as DistServe does:
          "both"     the whole deployment
          "prefill"  decode is ideal: reservations always succeed, a commit ends the request
                     (TPOT 0), so only TTFT (queueing + prefill + exposed transfer) is simulated
          "decode"   prefill is ideal: a request commits on a decode worker as soon as one has
                     blocks for it, so TTFT is only that wait, and the decode pool (KV capacity,
                     batching, TPOT) is simulated
        """
        if phase not in ("both", "prefill", "decode"):
            raise ValueError(f"phase must be both, prefill or decode, got {phase!r}")
        prof, pl = self.profile, self.placement
        if pl.colocated and phase != "both":
            raise ValueError("a colocated placement has no separate prefill or decode phase")
        bs = prof.block_size

        def worker(pool: PoolSpec, is_prefill: bool) -> Worker:
            kind = "prefill" if is_prefill else "colocated" if pl.colocated else "decode"
            model = prof.step_model(pool.tp, kind)
            return Worker(
                model,
                bs,
                pool.kv_capacity_tokens or model.kv_capacity_tokens,
                pool.max_num_batched_tokens,
                pool.max_num_seqs,
                is_prefill,
                self.fast,
            )

        decode = [worker(pl.decode, False) for _ in range(pl.decode.replicas)]
        prefill = (
            [] if pl.colocated else [worker(pl.prefill, True) for _ in range(pl.prefill.replicas)]
        )
        rng = random.Random(self.seed) if self.seed is not None else None
        if rng is not None:
            for w in prefill + decode:  # each worker replays a speed trace from a random window
                if w.model.speed_traces:
                    trace = w.model.speed_traces[rng.randrange(len(w.model.speed_traces))]
                    w.speed = (trace, rng.randrange(len(trace)))
        transfer = None if pl.colocated else prof.transfer[self.backend]
        kv_bytes, num_layers = prof.kv_bytes_per_token, prof.num_layers
        reqs = [_Req(r.arrival_s, r.prompt_len, r.output_len) for r in requests]
        # serving profiles: a request's trip outside the steps (the router, its RPCs to the
        # workers) delays when it reaches a worker; its TTFT still counts from its arrival
        hops = (
            decode[0] if pl.colocated or not prefill else prefill[0]
        ).model.first_token_latency_s
        events = [(r.arrival + hops, i, _ARRIVE, i) for i, r in enumerate(reqs)]
        heapq.heapify(events)
        counter = len(events)
        held: deque[_Req] = deque()  # disaggregated: waiting for decode blocks
        stats_s, next_sweep = self.router_stats_s, 0.0
        rr = [0, 0]
        missed = 0
        num_steps = 0
        stopped = False

        def pick(workers, key, which):
            # the best by key; ties go to the next in rotation, as the router's pickers do
            n = len(workers)
            start = rr[which] % n
            rr[which] += 1
            best, best_key = None, None
            for k in range(n):
                w = workers[(start + k) % n]
                kv = key(w)
                if best is None or kv > best_key:
                    best, best_key = w, kv
            return best

        f_decode = prof.interference.get("decode_while_prefill", 0.0)
        f_prefill = prof.interference.get("prefill_while_decode", 0.0)
        f_colocated = prof.interference.get("colocated_while_busy", 0.0)

        def start_step(w: Worker, now: float) -> None:
            nonlocal counter, num_steps
            dur = w.schedule()
            if not w.has_plan:
                w.busy = False
                return
            # A seeded run multiplies each step by one value drawn from the kind's step_noise
            # (prompt_step_noise for steps with prompt tokens), and by the worker's speed trace
            # at this time, so that a slow spell lasts as long as it did during calibration.
            if rng is not None:
                noise = (w.step_has_prompt and w.model.prompt_step_noise) or w.model.step_noise
                if noise:
                    dur *= noise[rng.randrange(len(noise))]
            if w.speed is not None:
                trace, first = w.speed
                dur *= trace[(first + int(now / w.model.speed_window_s)) % len(trace)]
            # another worker busy on the same host when this step starts: it runs slower
            if w.is_prefill:
                if f_prefill and any(d.busy for d in decode):
                    dur *= 1.0 + f_prefill
            elif pl.colocated:
                if f_colocated and any(o.busy for o in decode if o is not w):
                    dur *= 1.0 + f_colocated
            elif f_decode and any(p.busy for p in prefill):
                dur *= 1.0 + f_decode
            w.busy = True
            w.step_start = now
            num_steps += 1
            heapq.heappush(events, (now + dur, counter, _STEP_DONE, w))
            counter += 1

        def note_first(r: _Req, now: float) -> None:
            nonlocal missed
            r.first_at = now
            if now - r.arrival > ttft_s:
                r.missed = True
                missed += 1

        def note_done(r: _Req, now: float) -> None:
            nonlocal missed
            r.done_at = now
            if not r.missed and r.output > 1 and (now - r.first_at) / (r.output - 1) > tpot_s:
                r.missed = True
                missed += 1

        def dispatch(now: float) -> None:
            nonlocal counter
            while held:
                r = held[0]
                if phase != "prefill":
                    need = (r.prompt + bs - 1) // bs
                    d = pick(decode, least_used, 0)
                    if d.free < need:
                        return
                    d.free -= need
                    r.dest, r.reserved = d, need
                held.popleft()
                if phase == "decode":
                    heapq.heappush(events, (now, counter, _COMMIT, r))
                    counter += 1
                elif phase == "both" and r.dest.busy:
                    r.dest.calls.append((to_prefill, r))  # Reserve runs between decode steps
                else:
                    to_prefill(r, now)

        def to_prefill(r: _Req, now: float) -> None:
            p = pick(prefill, lambda w: -w.queued_tokens, 1)
            p.enqueue(Seq(r, r.prompt, 0, 0, True))
            if not p.busy:
                start_step(p, now)

        def commit(r: _Req, now: float) -> None:
            note_first(r, now)
            r.num_out = 1
            if phase == "prefill":
                note_done(r, now)
            elif r.output <= 1:
                r.dest.free += r.reserved
                note_done(r, now)
                if held:
                    dispatch(now)
            else:
                d = r.dest
                d.join(Seq(r, r.prompt + 1, r.prompt, r.reserved, False))
                if not d.busy:
                    start_step(d, now)

        first: list[_Req] = []
        done: list[_Req] = []
        prefilled: list[_Req] = []
        while events and not stopped:
            now, _, kind, obj = heapq.heappop(events)
            if kind == _ARRIVE:
                r = reqs[obj]
                if pl.colocated:
                    if stats_s > 0:
                        if now >= next_sweep:  # the router's view: free blocks at its last sweep
                            for d in decode:
                                d.router_view = d.free
                            next_sweep = (math.floor(now / stats_s) + 1) * stats_s
                        w = pick(decode, lambda w: (-w.router_tokens, w.router_view), 0)
                        w.router_view -= (r.prompt + bs - 1) // bs  # charged until the next sweep
                    else:
                        w = pick(decode, lambda w: (-w.router_tokens, w.free - w.pending_blocks), 0)
                    w.router_tokens += r.prompt  # until its first token
                    w.enqueue(Seq(r, r.prompt, 0, 0, False))
                    if not w.busy:
                        start_step(w, now)
                else:
                    held.append(r)
                    dispatch(now)
            elif kind == _COMMIT:
                r = obj
                if phase != "prefill" and r.dest.busy:
                    r.dest.calls.append((commit, r))  # runs between the decode worker's steps
                else:
                    commit(r, now)
            else:
                w = obj
                first.clear()
                done.clear()
                prefilled.clear()
                step_tokens = w.complete(first, done, prefilled)
                for r in first:
                    note_first(r, now)
                    if pl.colocated:
                        w.router_tokens -= r.prompt
                for r in done:
                    note_done(r, now)
                if w.is_prefill and step_tokens:
                    # The step's KV moves layer by layer behind its compute: it starts once the
                    # first layer is done (or when the link frees) at the backend's bandwidth and
                    # cannot end before the last layer's share has moved after the compute ends.
                    # Alone on the link, the time it adds after the compute is therefore
                    # max(x, L*x - (L-1)*c) for per-layer transfer x and per-layer compute c.
                    dur = now - w.step_start
                    x_total = step_tokens * kv_bytes / transfer.bandwidth_bytes_per_s
                    begin = max(w.step_start + dur / num_layers, w.link_free)
                    sent = max(begin + x_total, now + x_total / num_layers)
                    w.link_free = sent
                    for r in prefilled:
                        heapq.heappush(events, (sent + transfer.latency_s, counter, _COMMIT, r))
                        counter += 1
                if done and held:
                    dispatch(now)
                if w.calls:  # Reserve and commit calls that waited for this step, in order
                    calls, w.calls = w.calls, []
                    for call, r in calls:
                        call(r, now)
                start_step(w, now)
            if (max_missed is not None and missed > max_missed) or num_steps >= max_steps:
                stopped = True
        results = []
        for r in reqs:
            ttft = r.first_at - r.arrival
            e2e = r.done_at - r.arrival
            if r.output > 1:
                tpot = (e2e - ttft) / (r.output - 1) if e2e < INF else INF
            else:
                tpot = 0.0 if e2e < INF else INF
            results.append(RequestResult(ttft, tpot, e2e))
        return SimResult(
            results, stopped, num_steps, sum(w.num_preemptions for w in decode + prefill)
        )


def simulate(requests, profile: Profile, placement: Placement, planner=None, **kwargs) -> SimResult:
    """One run; with `planner` (a router.planner.PlannerConfig), a disaggregated placement whose
    split the planner moves as the run goes (tuning/sim_planner.py)."""
    if planner is not None:
        from pdserve.tuning.sim_planner import PlannerSimulator

        return PlannerSimulator(profile, placement, planner).run(requests, **kwargs)
    return Simulator(profile, placement).run(requests, **kwargs)
