"""A discrete-event simulator of a pdserve deployment, for the tuner: the router, the prefill
queues, the KV transfer and continuous-batching decode (or colocated workers), driven by
RequestSpecs and a hardware profile (tuning/perf_model.py).

    result = simulate(requests, profile, Placement(prefill=PoolSpec(2, 1), decode=PoolSpec(1, 2)))
    result.attainment(ttft_s=0.5, tpot_s=0.05)        # fraction meeting both SLOs

The tuner (tuning/tuner.py) and the SLO experiments create one Simulator per placement and call
`run` once per workload and rate. A run builds its workers (tuning/sim_worker.py: the engine
scheduler's policy over token counts), plays every event to the end, one method per kind of event
(an arrival, a commit on a decode worker, a step's end), and returns a SimResult. The state of a
run lives on the Simulator until the next run replaces it; nothing touches the disk, and without
a seed the same inputs always give the same answer. What the simulation models, and what it
leaves out, is in the Simulator docstring. The placement here is static; tuning/sim_planner.py
extends this event loop with the planner (planner/simulated.py) moving workers between the pools
as a trace plays (`simulate(..., planner=PlannerConfig(...))`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

from pdserve.tuning.perf_model import Profile
from pdserve.tuning.sim_worker import Seq, Worker, least_used

_ARRIVE, _STEP_DONE, _COMMIT = 0, 1, 2  # the static simulator's events (sim_planner adds more)
PREFILL, DECODE = "prefill", "decode"
INF = math.inf
ROUTER_STATS_S = 0.5  # router.server.RouterConfig.stats_interval_s


@dataclass(frozen=True)
class PoolSpec:
    replicas: int
    tp: int = 1
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    kv_capacity_tokens: int | None = None  # per replica; None: the profile's for this tp and pp
    # pipeline stages of each replica, tp ranks each (prefill pools only: a decode step in stages
    # pays every stage per token, and the deployment refuses it)
    pp: int = 1

    @property
    def devices(self) -> int:
        """Devices of one replica: tp ranks in each of pp stages."""
        return self.tp * self.pp

    def shape(self) -> str:
        return f"tp{self.tp}" + (f" pp{self.pp}" if self.pp > 1 else "")


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
        return sum(p.replicas * p.devices for p in pools)

    def label(self) -> str:
        if self.prefill is None:
            return f"colocated {self.decode.replicas}x {self.decode.shape()}"
        p, d = self.prefill, self.decode
        return f"{p.replicas}P {p.shape()} + {d.replicas}D {d.shape()}"


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


class Req:
    """One request as a run sees it; a planner run also moves its legs (sim_planner)."""

    __slots__ = tuple(
        "arrival prompt output dest reserved first_at done_at num_out missed leg_prompt local "
        "charged moved".split()
    )

    def __init__(self, arrival: float, prompt: int, output: int):
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.dest, self.reserved = None, 0
        self.first_at = self.done_at = INF
        self.num_out, self.missed = 0, False
        self.leg_prompt = prompt  # this leg's prompt: the prompt, plus the tokens before a move
        self.local, self.moved = False, 0
        self.charged = 0  # prompt tokens charged to its decode worker until its local prefill ends


class Simulator:
    """One placement under one profile; `run` simulates a workload on it.

    Modelled, as the real components behave:
    * Router, disaggregated: a request reserves its prompt's blocks on the decode worker with the
      fewest blocks in use (then the most free), then goes to the prefill worker with the fewest
      queued prompt tokens (ties rotate). With no room on any decode worker it waits in arrival
      order, where the real router answers RESOURCE_EXHAUSTED and the client retries. A decode
      worker takes the Reserve and the commit between its steps.
    * Router, colocated: the worker with the fewest prompt tokens charged to it, then the most free
      blocks as the router saw them at its last Stats sweep (`router_stats_s`; 0: an exact view).
    * Workers: the engine scheduler's policy (tuning/sim_worker.py), with step times from the
      profile's model for the pool's TP degree and worker kind (serving-path models where given),
      placed on the profile's nodes (Profile.placed_step_model): a TP group that spans nodes pays
      its all-reduces over the inter-node link, and a prefill worker in pipeline stages runs them
      one after another (no micro-batching) with the activation hand-offs between them, and
      holds the KV of tp x pp ranks (Profile.kv_capacity).
    * KV transfer: layer by layer behind the prefill compute, one link per prefill worker, then
      the backend's per-message latency. A worker in stages pushes its first stage's layers as
      they finish and the later stages' once the step is done, as the engine does.
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
            if not 1 <= pool.pp <= profile.num_layers:
                raise ValueError(
                    f"pp={pool.pp}: a worker has 1 to {profile.num_layers} stages (the model's "
                    f"layers)"
                )
        if placement.decode.pp != 1:
            raise ValueError(
                "decode and colocated pools run in one stage (pp=1): a decode step in stages "
                "pays every stage per token"
            )
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
        if self.placement.colocated and phase != "both":
            raise ValueError("a colocated placement has no separate prefill or decode phase")
        self.phase, self.ttft_s, self.tpot_s = phase, ttft_s, tpot_s
        self._start(requests)
        handlers = self._handlers()
        events, pop = self.events, heapq.heappop
        stopped = False
        while events and not stopped:
            now, _, kind, obj = pop(events)
            handlers[kind](now, obj)
            if (max_missed is not None and self.missed > max_missed) or self.num_steps >= max_steps:
                stopped = True
        return self._result(stopped)

    # ---- a run's state ---------------------------------------------------------------------
    def _start(self, requests) -> None:
        """A run's workers, requests and first events."""
        prof, pl = self.profile, self.placement
        self.decode = [self._make_worker(DECODE, pl.decode.tp) for _ in range(pl.decode.replicas)]
        self.prefill = (
            []
            if pl.colocated
            else [self._make_worker(PREFILL, pl.prefill.tp) for _ in range(pl.prefill.replicas)]
        )
        self.rng = random.Random(self.seed) if self.seed is not None else None
        for w in self.prefill + self.decode:
            self._draw_speed(w)
        self.transfer = None if pl.colocated else prof.transfer[self.backend]
        self.reqs = [Req(r.arrival_s, r.prompt_len, r.output_len) for r in requests]
        # serving profiles: a request's trip outside the steps (the router, its RPCs to the
        # workers) delays when it reaches a worker; its TTFT still counts from its arrival
        hops = (
            self.decode[0] if pl.colocated or not self.prefill else self.prefill[0]
        ).model.first_token_latency_s
        self.events = [(r.arrival + hops, i, _ARRIVE, i) for i, r in enumerate(self.reqs)]
        heapq.heapify(self.events)
        self.counter = len(self.events)
        self.held: deque[Req] = deque()  # disaggregated: waiting for decode blocks
        self.next_sweep = 0.0
        self.rr = [0, 0]
        self.missed = self.num_steps = 0
        self.f_decode = prof.interference.get("decode_while_prefill", 0.0)
        self.f_prefill = prof.interference.get("prefill_while_decode", 0.0)
        self.f_colocated = prof.interference.get("colocated_while_busy", 0.0)
        self._first: list[Req] = []
        self._done: list[Req] = []
        self._prefilled: list[Req] = []

    def _serving(self, role: str) -> list[Worker]:
        """The workers of `role` the router may pick (all of them: the placement is static)."""
        return self.prefill if role == PREFILL else self.decode

    def _make_worker(self, role: str, tp: int) -> Worker:
        pl = self.placement
        spec = pl.prefill if role == PREFILL else pl.decode
        pp = spec.pp if spec.tp == tp else 1  # a worker flipped in from the other pool: 1 stage
        model = self.profile.placed_step_model(tp, pp, "colocated" if pl.colocated else role)
        capacity = spec.kv_capacity_tokens if spec.tp == tp else None
        limits = (spec.max_num_batched_tokens, spec.max_num_seqs)
        w = Worker(
            model,
            self.profile.block_size,
            capacity or model.kv_capacity_tokens,
            *limits,
            role == PREFILL,
            self.fast,
        )
        w.role, w.tp, w.pp = role, tp, pp
        return w

    def _draw_speed(self, w: Worker) -> None:
        """A seeded run: each worker replays a speed trace from a random window."""
        if self.rng is not None and w.model.speed_traces:
            trace = w.model.speed_traces[self.rng.randrange(len(w.model.speed_traces))]
            w.speed = (trace, self.rng.randrange(len(trace)))

    def _result(self, stopped: bool) -> SimResult:
        return SimResult(self._request_results(), stopped, self.num_steps, self._num_preemptions())

    def _num_preemptions(self) -> int:
        return sum(w.num_preemptions for w in self.decode + self.prefill)

    def _request_results(self) -> list[RequestResult]:
        results = []
        for r in self.reqs:
            ttft = r.first_at - r.arrival
            e2e = r.done_at - r.arrival
            if r.output > 1:
                tpot = (e2e - ttft) / (r.output - 1) if e2e < INF else INF
            else:
                tpot = 0.0 if e2e < INF else INF
            results.append(RequestResult(ttft, tpot, e2e))
        return results

    # ---- events ----------------------------------------------------------------------------
    def _handlers(self) -> dict:
        return {_ARRIVE: self._on_arrive, _COMMIT: self._on_commit, _STEP_DONE: self._on_step_done}

    def _push(self, t: float, kind: int, obj) -> None:
        heapq.heappush(self.events, (t, self.counter, kind, obj))
        self.counter += 1

    def _on_arrive(self, now: float, i: int) -> None:
        r = self.reqs[i]
        if not self.placement.colocated:
            self.held.append(r)
            self._dispatch(now)
            return
        bs, decode, stats_s = self.profile.block_size, self.decode, self.router_stats_s
        if stats_s > 0:
            if now >= self.next_sweep:  # the router's view: free blocks at its last sweep
                for d in decode:
                    d.router_view = d.free
                self.next_sweep = (math.floor(now / stats_s) + 1) * stats_s
            w = self._pick(decode, lambda w: (-w.router_tokens, w.router_view), 0)
            w.router_view -= (r.prompt + bs - 1) // bs  # charged until the next sweep
        else:
            w = self._pick(decode, lambda w: (-w.router_tokens, w.free - w.pending_blocks), 0)
        w.router_tokens += r.prompt  # until its first token
        w.enqueue(Seq(r, r.prompt, 0, 0, False))
        if not w.busy:
            self._start_step(w, now)

    def _on_commit(self, now: float, r: Req) -> None:
        if self.phase != "prefill" and r.dest.busy:
            r.dest.calls.append((self._commit, r))  # runs between the decode worker's steps
        else:
            self._commit(r, now)

    def _on_step_done(self, now: float, w: Worker) -> None:
        first, done, prefilled = self._first, self._done, self._prefilled
        first.clear()
        done.clear()
        prefilled.clear()
        step_tokens = w.complete(first, done, prefilled)
        for r in first:
            self._note_first(r, now)
            if self.placement.colocated:
                w.router_tokens -= r.prompt
        for r in done:
            self._note_done(r, now)
        self._stepped(w, now)
        if w.is_prefill and step_tokens:
            self._send_kv(w, now, step_tokens, prefilled)
        if done and self.held:
            self._dispatch(now)
        if w.calls:  # Reserve and commit calls that waited for this step, in order
            calls, w.calls = w.calls, []
            for call, r in calls:
                call(r, now)
        self._next_step(w, now)

    def _stepped(self, w: Worker, now: float) -> None:
        """A step's requests are noted; what a subclass observes of the step comes here."""

    def _next_step(self, w: Worker, now: float) -> None:
        self._start_step(w, now)

    # ---- the router and the workers ----------------------------------------------------------
    def _pick(self, workers, key, which):
        """The best by key; ties go to the next in rotation, as the router's pickers do."""
        n = len(workers)
        start = self.rr[which] % n
        self.rr[which] += 1
        best, best_key = None, None
        for k in range(n):
            w = workers[(start + k) % n]
            kv = key(w)
            if best is None or kv > best_key:
                best, best_key = w, kv
        return best

    def _start_step(self, w: Worker, now: float) -> None:
        dur = w.schedule()
        if not w.has_plan:
            w.busy = False
            return
        # A seeded run multiplies each step by one value drawn from the kind's step_noise
        # (prompt_step_noise for steps with prompt tokens), and by the worker's speed trace at
        # this time, so that a slow spell lasts as long as it did during calibration.
        if self.rng is not None:
            noise = (w.step_has_prompt and w.model.prompt_step_noise) or w.model.step_noise
            if noise:
                dur *= noise[self.rng.randrange(len(noise))]
        if w.speed is not None:
            trace, first = w.speed
            dur *= trace[(first + int(now / w.model.speed_window_s)) % len(trace)]
        dur *= self._interference(w)
        w.busy = True
        w.step_start = now
        self.num_steps += 1
        self._push(now + dur, _STEP_DONE, w)

    def _interference(self, w: Worker) -> float:
        """Another worker busy on the same host when this step starts: it runs slower."""
        if w.is_prefill:
            if self.f_prefill and any(d.busy for d in self.decode):
                return 1.0 + self.f_prefill
        elif self.placement.colocated:
            if self.f_colocated and any(o.busy for o in self.decode if o is not w):
                return 1.0 + self.f_colocated
        elif self.f_decode and any(p.busy for p in self.prefill):
            return 1.0 + self.f_decode
        return 1.0

    def _note_first(self, r: Req, now: float) -> None:
        r.first_at = now
        if now - r.arrival > self.ttft_s:
            r.missed = True
            self.missed += 1

    def _note_done(self, r: Req, now: float) -> None:
        r.done_at = now
        if not r.missed and r.output > 1 and (now - r.first_at) / (r.output - 1) > self.tpot_s:
            r.missed = True
            self.missed += 1

    def _dispatch(self, now: float) -> None:
        """The held requests, in arrival order, while the first of them finds room."""
        held = self.held
        while held and self._dispatch_one(held[0], now):
            pass

    def _dispatch_one(self, r: Req, now: float) -> bool:
        """The first held request: reserve its blocks on a decode worker and send it to prefill
        (phase "prefill": no reservation; "decode": its commit at once). False: no room."""
        if self.phase != "prefill":
            need = (r.leg_prompt + self.profile.block_size - 1) // self.profile.block_size
            d = self._pick(self._serving(DECODE), least_used, 0)
            if d.free < need:
                return False
            d.free -= need
            r.dest, r.reserved = d, need
        self.held.popleft()
        if self.phase == "decode":
            self._push(now, _COMMIT, r)
        elif self.phase == "both" and r.dest.busy:
            r.dest.calls.append((self._to_prefill, r))  # Reserve runs between decode steps
        else:
            self._to_prefill(r, now)
        return True

    def _to_prefill(self, r: Req, now: float) -> None:
        p = self._pick(self._serving(PREFILL), lambda w: -w.queued_tokens, 1)
        p.enqueue(Seq(r, r.leg_prompt, 0, 0, True))
        if not p.busy:
            self._start_step(p, now)

    def _commit(self, r: Req, now: float) -> None:
        """The leg's KV landed on its decode worker: its first token (of this leg), then it
        decodes there."""
        r.num_out += 1
        if r.num_out == 1:
            self._note_first(r, now)
        if self.phase == "prefill":
            self._note_done(r, now)
        elif r.num_out >= r.output:
            r.dest.free += r.reserved
            self._note_done(r, now)
            if self.held:
                self._dispatch(now)
        else:
            d = r.dest
            d.join(Seq(r, r.leg_prompt + 1, r.leg_prompt, r.reserved, False))
            if not d.busy:
                self._start_step(d, now)

    def _send_kv(self, w: Worker, now: float, step_tokens: int, prefilled: list[Req]) -> None:
        """The step's KV moves layer by layer behind its compute: it starts once the first layer
        is done (or when the link frees) at the backend's bandwidth and cannot end before the
        last layer's share has moved after the compute ends. Alone on the link, the time it adds
        after the compute is therefore max(x, L*x - (L-1)*c) for per-layer transfer x and
        per-layer compute c. A worker in pp stages pushes only its first stage's layers behind
        the compute; the later stages' wait for the step's end (prefill_worker/handoff.py)."""
        num_layers, transfer = self.profile.num_layers, self.transfer
        dur = now - w.step_start
        x_total = step_tokens * self.profile.kv_bytes_per_token / transfer.bandwidth_bytes_per_s
        begin = max(w.step_start + dur / num_layers, w.link_free)
        if w.pp > 1:
            first = self.profile.stage_layers(w.pp)[0] / num_layers  # the first stage's share
            sent = max(begin + x_total * first, now) + x_total * (1 - first)
        else:
            sent = max(begin + x_total, now + x_total / num_layers)
        w.link_free = sent
        for r in prefilled:
            self._push(sent + transfer.latency_s, _COMMIT, r)


def simulate(requests, profile: Profile, placement: Placement, planner=None, **kwargs) -> SimResult:
    """One run; with `planner` (a planner.policy.PlannerConfig), a disaggregated placement whose
    split the planner moves as the run goes (tuning/sim_planner.py)."""
    if planner is not None:
        from pdserve.tuning.sim_planner import PlannerSimulator

        return PlannerSimulator(profile, placement, planner).run(requests, **kwargs)
    return Simulator(profile, placement).run(requests, **kwargs)
