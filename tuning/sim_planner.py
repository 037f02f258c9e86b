"""The planner in the simulator: a disaggregated placement whose prefill:decode split and local
prefill bound move while a trace plays, decided by the same policy code a running router uses
(planner/policy.py), so that a policy can be judged on any trace, at any scale, before it is
deployed.

    sim = PlannerSimulator(profile, placement, PlannerConfig(ttft_s=1.0, tpot_s=0.05))
    result = sim.run(requests, ttft_s=1.0, tpot_s=0.05)   # a PlannerSimResult
    result.attainment(1.0, 0.05), result.flips, result.decisions

Without a PlannerConfig it is the static simulator, step for step (the tests check). What the
planner path models (signals, drains, moves at the drain bound, switches, local prefill), as
the live router does it: docs/architecture.md, "The planner in the simulator". Goodput over a
shift trace with its phases kept: tuning/shift_goodput.py.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import deque

from pdserve.planner.local_prefill import LocalPrefill
from pdserve.planner.policy import (
    LOCAL_LESS,
    LOCAL_MORE,
    NONE,
    TO_DECODE,
    TO_PREFILL,
    Planner,
    PlannerConfig,
    Signals,
    p90,
)
from pdserve.tuning.perf_model import Profile
from pdserve.tuning.sim_worker import Seq, Worker, least_used
from pdserve.tuning.simulator import INF, FlipRecord, Placement, PlannerSimResult, RequestResult

_ARRIVE, _STEP_DONE, _COMMIT, _TICK, _BOUND, _SWITCH = range(6)
PREFILL, DECODE = "prefill", "decode"
SERVING, DRAINING, SWITCHING = "serving", "draining", "switching"
DRAIN_S = 5.0  # router.flip_drain_s's default
SWITCH_DELAY_S = 0.05


class _Req:
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


class PlannerSimulator:
    """A disaggregated placement with the planner in the loop; planner None: the Simulator's."""

    def __init__(
        self,
        profile: Profile,
        placement: Placement,
        planner: PlannerConfig | None = None,
        *,
        local_prefill: LocalPrefill | None = None,
        drain_s: float = DRAIN_S,
        switch_delay_s: float = SWITCH_DELAY_S,
        fast: bool = True,
        seed: int | None = None,
        planner_cls: type = Planner,
    ):
        """planner_cls: the policy's class (Planner, or a variant of it to try in simulation)."""
        if placement.colocated:
            raise ValueError("the planner moves workers between a prefill and a decode pool")
        for pool in (placement.prefill, placement.decode):
            if pool.tp not in profile.tp:
                raise ValueError(f"the profile has no tp={pool.tp} (it has {profile.tp_degrees})")
        if not drain_s >= 0 or not switch_delay_s >= 0:
            raise ValueError("drain_s and switch_delay_s must be >= 0")
        self.profile, self.placement, self.config = profile, placement, planner
        self.local_prefill = local_prefill or LocalPrefill(0)
        self.drain_s, self.switch_delay_s = drain_s, switch_delay_s
        self.fast, self.seed = fast, seed
        self.planner_cls = planner_cls
        self.backend = placement.backend or profile.best_backend()
        if self.backend not in profile.transfer:
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
        max_steps: int = 20_000_000,
    ) -> PlannerSimResult:
        """As Simulator.run with phase "both"."""
        prof, pl, cfg = self.profile, self.placement, self.config
        bs = prof.block_size
        specs = {PREFILL: pl.prefill, DECODE: pl.decode}

        def make_worker(role: str, tp: int, slot: int) -> Worker:
            spec = specs[role]
            model = prof.step_model(tp, role)
            capacity = spec.kv_capacity_tokens if spec.tp == tp else None
            capacity = capacity or model.kv_capacity_tokens
            limits = (spec.max_num_batched_tokens, spec.max_num_seqs)
            w = Worker(model, bs, capacity, *limits, role == PREFILL, self.fast)
            w.role, w.tp, w.slot, w.state = role, tp, slot, SERVING
            w.pending = {}  # reservations on it whose commit has not come yet (a dict: ordered)
            w.bound_passed = w.move_pending = False
            w.flip = None
            return w

        prefill = [make_worker(PREFILL, pl.prefill.tp, i) for i in range(pl.prefill.replicas)]
        n_p = len(prefill)
        decode = [make_worker(DECODE, pl.decode.tp, n_p + i) for i in range(pl.decode.replicas)]
        serving = {PREFILL: list(prefill), DECODE: list(decode)}
        rng = random.Random(self.seed) if self.seed is not None else None

        def draw_speed(w: Worker) -> None:
            if rng is not None and w.model.speed_traces:
                trace = w.model.speed_traces[rng.randrange(len(w.model.speed_traces))]
                w.speed = (trace, rng.randrange(len(trace)))

        for w in prefill + decode:
            draw_speed(w)
        transfer = prof.transfer[self.backend]
        kv_bytes, num_layers = prof.kv_bytes_per_token, prof.num_layers
        reqs = [_Req(r.arrival_s, r.prompt_len, r.output_len) for r in requests]
        hops = prefill[0].model.first_token_latency_s
        events = [(r.arrival + hops, i, _ARRIVE, i) for i, r in enumerate(reqs)]
        heapq.heapify(events)
        counter = len(events)
        held: deque[_Req] = deque()
        rr, missed, num_steps, stopped = [0, 0], 0, 0, False
        out = PlannerSimResult([])
        planner = self.planner_cls(cfg) if cfg is not None else None
        policy = self.local_prefill
        retired_preemptions = 0  # of the workers a flip replaced
        ttft_window: deque = deque()  # (first token at, ttft)
        arrived: deque = deque()  # (arrival, prompt tokens) of legs for the prefill pool
        gaps: deque = deque()  # (step end, step time) of decode steps with streams
        batch: list = [None, 0]  # a flip batch: the role flips take from, flips still to begin
        tpot_window: deque = deque()  # (done at, tpot)

        def push(t: float, kind: int, obj) -> None:
            nonlocal counter
            heapq.heappush(events, (t, counter, kind, obj))
            counter += 1

        if planner is not None:
            push(cfg.interval_s, _TICK, None)

        def pick(workers, key, which):
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

        def start_step(w: Worker, now: float) -> None:
            nonlocal num_steps
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
            if w.is_prefill:
                if f_prefill and any(d.busy for d in decode):
                    dur *= 1.0 + f_prefill
            elif f_decode and any(p.busy for p in prefill):
                dur *= 1.0 + f_decode
            w.busy = True
            w.step_start = now
            num_steps += 1
            push(now + dur, _STEP_DONE, w)

        def note_first(r: _Req, now: float) -> None:
            nonlocal missed
            r.first_at = now
            if planner is not None:
                ttft_window.append((now, now - r.arrival))
            if now - r.arrival > ttft_s:
                r.missed = True
                missed += 1

        def note_done(r: _Req, now: float) -> None:
            nonlocal missed
            r.done_at = now
            if planner is not None and r.output > 1:
                tpot_window.append((now, (now - r.first_at) / (r.output - 1)))
            if not r.missed and r.output > 1 and (now - r.first_at) / (r.output - 1) > tpot_s:
                r.missed = True
                missed += 1

        # ---- the router ---------------------------------------------------------------------
        def choose_local(r: _Req) -> bool:
            if not policy.enabled:
                return False
            backlog = min(w.queued_tokens for w in serving[PREFILL]) + r.leg_prompt
            return policy.choose(
                r.leg_prompt, backlog, min(w.router_tokens for w in serving[DECODE])
            )

        def dispatch(now: float) -> None:
            while held:
                r = held[0]
                need = (r.leg_prompt + bs - 1) // bs
                if r.local:
                    # the fewest prompt tokens charged, the next one when full
                    d = pick(
                        serving[DECODE],
                        lambda w: (w.free - w.pending_blocks >= need, -w.router_tokens, w.free),
                        0,
                    )
                    if d.free - d.pending_blocks < need:
                        return
                    held.popleft()
                    r.dest, r.reserved = d, 0
                    r.charged = r.leg_prompt
                    d.router_tokens += r.leg_prompt
                    out.num_local += 1
                    d.enqueue(Seq(r, r.leg_prompt, 0, 0, False))
                    if not d.busy:
                        start_step(d, now)
                    continue
                d = pick(serving[DECODE], least_used, 0)
                if d.free < need:
                    return
                d.free -= need
                d.pending[r] = None
                r.dest, r.reserved = d, need
                held.popleft()
                if d.busy:
                    d.calls.append((to_prefill, r))  # Reserve runs between decode steps
                else:
                    to_prefill(r, now)

        def to_prefill(r: _Req, now: float) -> None:
            p = pick(serving[PREFILL], lambda w: -w.queued_tokens, 1)
            p.enqueue(Seq(r, r.leg_prompt, 0, 0, True))
            if not p.busy:
                start_step(p, now)

        def commit(r: _Req, now: float) -> None:
            d = r.dest
            del d.pending[r]
            if d.bound_passed:  # its worker is flipping away: the leg moves
                resume(r, now)
                drained_yet(d, now)
                return
            r.num_out += 1
            if r.num_out == 1:
                note_first(r, now)
            if r.num_out >= r.output:
                d.free += r.reserved
                note_done(r, now)
                if held:
                    dispatch(now)
                if d.state == DRAINING:
                    drained_yet(d, now)
            else:
                d.join(Seq(r, r.leg_prompt + 1, r.leg_prompt, r.reserved, False))
                if not d.busy:
                    start_step(d, now)

        def resume(r: _Req, now: float) -> None:
            """A leg moved off a flipping decode worker: prompt + tokens so far, as a new leg."""
            r.moved += 1
            r.leg_prompt = r.prompt + r.num_out
            r.dest, r.reserved, r.charged = None, 0, 0
            r.local = choose_local(r)
            held.append(r)
            dispatch(now)

        # ---- flips --------------------------------------------------------------------------
        def least_loaded(role: str) -> Worker:
            def load(w):
                n = len(w.running) + len(w.waiting) + len(w.joining) + len(w.pending)
                return (n, w.router_tokens if role == DECODE else w.queued_tokens)

            return min(serving[role], key=load)

        def begin_flip(role: str, now: float) -> None:
            w = least_loaded(role)
            w.state = DRAINING
            serving[role].remove(w)
            w.flip = FlipRecord(w.slot, role, PREFILL if role == DECODE else DECODE, now)
            out.flips.append(w.flip)
            push(now + self.drain_s, _BOUND, w)
            drained_yet(w, now)

        def holds_nothing(w: Worker) -> bool:
            return not (w.busy or w.running or w.waiting or w.joining or w.calls or w.pending)

        def drained_yet(w: Worker, now: float) -> None:
            if w.state != DRAINING or not holds_nothing(w):
                return
            w.state = SWITCHING
            at = max(now, w.link_free)  # a prefill worker's last KV is on its way
            w.flip.drained_s = at
            push(at + self.switch_delay_s, _SWITCH, w)

        def move_out(w: Worker, now: float) -> None:
            """The drain bound: what `w` still holds goes elsewhere (never while it steps)."""
            w.move_pending = False
            if w.lazy:
                w._leave_fast_path()
            seqs = w.running + list(w.waiting) + w.joining
            w.running, w.joining = [], []
            w.waiting.clear()
            w.queued_tokens = w.pending_blocks = 0
            for seq in seqs:
                r = seq.req
                if w.is_prefill:
                    w.flip.moved_prompts += 1
                    to_prefill(r, now)
                else:
                    w.flip.moved_streams += 1
                    if r.charged:
                        w.router_tokens -= r.charged
                        r.charged = 0
                    resume(r, now)
            for r in list(w.pending):  # prompts still prefilling for it: reserved elsewhere
                need = r.reserved
                d = pick(serving[DECODE], least_used, 0)
                if d.free >= need:
                    del w.pending[r]
                    d.free -= need
                    d.pending[r] = None
                    r.dest = d
                # else its KV lands here and the leg resumes from there (commit)
            drained_yet(w, now)

        def switch(w: Worker, now: float) -> None:
            nonlocal retired_preemptions
            retired_preemptions += w.num_preemptions
            role = w.flip.to_role
            (prefill if w.is_prefill else decode).remove(w)
            nw = make_worker(role, w.tp, w.slot)
            draw_speed(nw)
            (prefill if role == PREFILL else decode).append(nw)
            serving[role].append(nw)
            w.flip.done_s = now
            if batch[1] > 0 and len(serving[batch[0]]) > 1:  # the batch's next flip
                batch[1] -= 1
                begin_flip(batch[0], now)
            else:
                planner.flip_done(now)
                push(now + cfg.interval_s, _TICK, None)
            if held:
                dispatch(now)

        def tick(now: float) -> None:
            nonlocal policy
            for window in (ttft_window, tpot_window, arrived, gaps):
                while window and window[0][0] <= now - cfg.window_s:
                    window.popleft()
            pace = sorted(g for t, g in gaps if t > now - cfg.interval_s)  # decode steps' pace
            sp, sd = serving[PREFILL], serving[DECODE]
            speeds = [w.budget / w.model.prefill_time(w.budget, w.budget**2) for w in sp]
            s = Signals(
                now=now,
                prefill_workers=len(sp),
                decode_workers=len(sd),
                ttft_p90_s=p90([x for _, x in ttft_window]),
                tpot_p90_s=p90([x for _, x in tpot_window]),
                prefill_queued_tokens=sum(w.queued_tokens for w in sp),
                prefill_tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
                decode_kv_use=sum(1 - w.free / w.num_blocks for w in sd) / len(sd) if sd else 0.0,
                local_max=policy.max_prompt_tokens,
                decode_wait_s=max((now - r.arrival for r in held if not r.local), default=0.0),
                itl_p50_s=pace[len(pace) // 2] if pace else None,
                prompt_tokens_per_s=sum(n for _, n in arrived)
                / max(min(cfg.window_s, now), cfg.interval_s),
            )
            d = planner.decide(s)
            ttft_p, tpot_p = planner.pressures(s)
            out.timeline.append((now, len(sp), len(sd), s.local_max, ttft_p, tpot_p, d.action))
            if d.action != NONE:
                out.decisions.append((now, d.action, d.reason))
            if d.action in (LOCAL_MORE, LOCAL_LESS, TO_DECODE):
                bound = planner.next_local_max(d.action, policy.max_prompt_tokens)
                policy = dataclasses.replace(policy, max_prompt_tokens=bound)
            if d.action in (TO_PREFILL, TO_DECODE):
                batch[:] = [DECODE if d.action == TO_PREFILL else PREFILL, d.count - 1]
                begin_flip(batch[0], now)
            elif events:  # no tick keeps an ended run going
                push(now + cfg.interval_s, _TICK, None)

        # ---- the event loop -----------------------------------------------------------------
        first: list[_Req] = []
        done: list[_Req] = []
        prefilled: list[_Req] = []
        while events and not stopped:
            now, _, kind, obj = heapq.heappop(events)
            if kind == _ARRIVE:
                r = reqs[obj]
                if policy.enabled:
                    r.local = choose_local(r)
                if planner is not None and not r.local:
                    arrived.append((now, r.leg_prompt))
                held.append(r)
                dispatch(now)
            elif kind == _COMMIT:
                r = obj
                if r.dest.busy:
                    r.dest.calls.append((commit, r))  # runs between the decode worker's steps
                else:
                    commit(r, now)
            elif kind == _STEP_DONE:
                w = obj
                for xs in (first, done, prefilled):
                    xs.clear()
                step_tokens = w.complete(first, done, prefilled)
                for r in first:
                    note_first(r, now)
                if not w.is_prefill and w.step_has_prompt and w.plan:
                    for seq, start, n in w.plan:  # local prompts computed: their charge ends
                        r = seq.req
                        if r.charged and start + n >= r.leg_prompt:
                            w.router_tokens -= r.charged
                            r.charged = 0
                for r in done:
                    note_done(r, now)
                if planner is not None and not w.is_prefill and w.running:
                    gaps.append((now, now - w.step_start))  # its streams' gap between tokens
                if w.is_prefill and step_tokens:
                    dur = now - w.step_start
                    x_total = step_tokens * kv_bytes / transfer.bandwidth_bytes_per_s
                    begin = max(w.step_start + dur / num_layers, w.link_free)
                    sent = max(begin + x_total, now + x_total / num_layers)
                    w.link_free = sent
                    for r in prefilled:
                        push(sent + transfer.latency_s, _COMMIT, r)
                if done and held:
                    dispatch(now)
                if w.calls:
                    calls, w.calls = w.calls, []
                    for call, r in calls:
                        call(r, now)
                if w.move_pending:
                    w.busy = False
                    move_out(w, now)
                else:
                    start_step(w, now)
                if w.state == DRAINING:
                    drained_yet(w, now)
            elif kind == _TICK:
                tick(now)
            elif kind == _BOUND:
                w = obj
                if w.state == DRAINING:
                    w.bound_passed = True
                    if w.busy:
                        w.move_pending = True  # after the step in flight
                    else:
                        move_out(w, now)
            else:
                switch(obj, now)
            if (max_missed is not None and missed > max_missed) or num_steps >= max_steps:
                stopped = True
        for r in reqs:
            ttft = r.first_at - r.arrival
            e2e = r.done_at - r.arrival
            tpot = INF if e2e == INF else (e2e - ttft) / (r.output - 1) if r.output > 1 else 0.0
            out.requests.append(RequestResult(ttft, tpot, e2e))
        out.stopped_early = stopped
        out.num_steps = num_steps
        out.num_preemptions = retired_preemptions + sum(w.num_preemptions for w in prefill + decode)
        return out
