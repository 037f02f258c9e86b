"""A discrete-event simulator of a pdserve deployment: router, prefill queues, KV transfer and
decode continuous batching (or colocated workers), driven by RequestSpecs and a hardware profile.

    result = simulate(requests, profile, Placement(prefill=PoolSpec(2, 1), decode=PoolSpec(1, 2)))
    result.attainment(ttft_s=0.5, tpot_s=0.05)        # fraction meeting both SLOs

What it models (each worker runs a port of engine/scheduler.py at the level of token counts):
  * router, disaggregated: on arrival a request reserves KV blocks for its prompt on the decode
    worker with the most free blocks (ties rotate), then goes to the prefill worker with the least
    queued tokens (prompt tokens not yet computed; ties rotate). When no decode worker has room
    the router holds requests in arrival order until blocks free up (the real router answers
    RESOURCE_EXHAUSTED and the client retries: here that is waiting, not an error). The decode
    worker takes the Reserve, and later the commit of the prefilled KV (which streams the first
    token), on its engine loop between steps: while a decode step runs, both wait for its end.
  * router, colocated: the worker with the fewest prompt tokens charged to it, then the most free
    blocks as the router sees them (ties rotate), as router/pool.py picks: a request's prompt is
    charged to its worker from the pick to its first token, and its prompt's blocks are taken
    off the worker's free count until the router's next Stats sweep (every `router_stats_s`,
    0.5 s) reads the real count. router_stats_s=0: an exact view (free blocks less the blocks
    of queued prompts).
  * each worker, per step: running sequences first, in order, each up to its remaining tokens
    within the max_num_batched_tokens budget (chunked prefill); a sequence that needs a block
    when none is free preempts the most recently admitted ones (they lose their KV and are
    recomputed later); then waiting sequences are admitted FCFS while the budget lasts, fewer than
    max_num_seqs run and their whole prompt's blocks fit above a 1% watermark. Committed
    reservations join a decode worker's batch at its next step, without the max_num_seqs check,
    as in the engine; a preempted sequence on a decode worker is recomputed there (prompt and
    generated tokens, chunked), as the engine does. The worker itself is sim_worker.py.
  * step time from the profile's fitted models for the pool's TP degree (perf_model.py), so TP
    communication is whatever the profile measured; a step that finishes a prompt samples its
    next token at the step's end. Where the profile has serving-path models for the worker's kind
    (prefill, decode, colocated; measured through a deployment), those are used: they carry the
    costs of serving that a bare engine step lacks (KV pushes and receives, token streaming, RPCs
    between steps, the router's hops on an isolated request).
  * KV transfer: every chunk a prefill step computes is pushed layer by layer while the next
    layer computes. Per prefill worker one link: the step's bytes start moving once its first
    layer is done (or when the link frees) at the backend's bandwidth, and cannot end before the
    last layer's share has moved after compute ends. Alone on the link, the time the transfer
    adds after prefill compute is therefore max(x, L*x - (L-1)*c) for per-layer transfer x and
    per-layer compute c: only the last layer's share when the link keeps up. Then the backend's
    per-message latency, and the decode worker commits the request.
  * timings: TTFT = the commit on the decode worker (it streams the first token at once) or, when
    colocated, the end of the step that finishes the prompt, minus arrival; with a serving
    profile, a request reaches the router's pick first_token_latency_s (of the prefilling kind)
    after its arrival: the hops that an isolated request's TTFT pays outside the steps; E2E = the end of the
    step that samples the last token, minus arrival; TPOT = (E2E - TTFT) / (output_len - 1), 0 for
    one-token outputs. Requests that never finish get infinite TTFT and E2E.

What it does not model:
  * prefix caching (every prompt is computed in full; mooncake hash_ids are ignored);
  * stop tokens (every request produces exactly output_len tokens, as with ignore_eos);
  * the router's max_inflight limit and rejections, retries, lease expiry, failures, aborts;
  * network or CPU time of the router (tokenizing, detokenizing, gRPC hops) and the workers'
    serving threads, except as far as serving-path step models (above) fold them into step time:
    with an engine-only profile, none of it; the decode side's write of received KV into its cache
    is in the profiled bandwidth but takes no time from the decode worker's steps; transfers into one decode worker do not contend with each other (only
    the sender's link is shared); KV re-sharding between different prefill and decode TP sizes;
  * interference between workers that share a host (memory bandwidth, caches, cores), except the
    profile's serving.interference factors: a decode step that starts while a prefill worker is
    busy (or the other way round), or a colocated worker's step that starts while another
    colocated worker is busy, is stretched by that factor, judged at the step's start (all the
    workers of a placement are taken to share one host);
  * the router's stale view of free blocks when disaggregated (it reads Stats every 0.5 s and
    charges each reservation; here it knows exactly);
  * step-time noise, unless asked: with a seed, and a serving profile whose kind carries
    step_noise (measured step time / modelled, from the fit's residuals), each step's time is
    multiplied by one of those values drawn at random; without a seed the same inputs always give
    the same answer. A step with prompt tokens draws from prompt_step_noise where the kind has
    it. Where the kind also carries step_speed (the slow part of that ratio, per
    window of time, as it moved during calibration), each worker replays one of those traces from
    a random window, so a slow spell of the machine lasts as long as it did when measured, and
    step_noise is the fast part within a window.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

from pdserve.tuning.perf_model import Profile
from pdserve.tuning.sim_worker import Seq, Worker

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
                    d = pick(decode, lambda w: w.free, 0)
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
                    # the step's KV moves layer by layer behind its compute (see the docstring)
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


def simulate(requests, profile: Profile, placement: Placement, **kwargs) -> SimResult:
    return Simulator(profile, placement).run(requests, **kwargs)
