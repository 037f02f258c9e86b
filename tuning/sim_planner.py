"""The planner in the simulator: a disaggregated placement whose prefill:decode split and local
prefill bound move while a trace plays, decided by the same policy code a running router uses
(planner/policy.py, ticked by planner/simulated.py), so that a policy can be judged on any trace,
at any scale, before it is deployed.

    sim = PlannerSimulator(profile, placement, PlannerConfig(ttft_s=1.0, tpot_s=0.05))
    result = sim.run(requests, ttft_s=1.0, tpot_s=0.05)   # a PlannerSimResult
    result.attainment(1.0, 0.05), result.flips, result.decisions

PlannerSimulator extends the static Simulator's event loop (tuning/simulator.py) with what the
planner adds: its ticks, the drain bound and the switch of a flipping worker, local prefill per
request, and the signals it reports to the planner's loop. It is the simulated Actuator the
policy acts through. Without a PlannerConfig it is the static simulator, step for step (the tests
check). What the planner path models (signals, drains, moves at the drain bound, switches, local
prefill), as the live router does it: docs/architecture.md, "The planner in the simulator".
Goodput over a shift trace with its phases kept: tuning/shift_goodput.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.planner.local_prefill import LocalPrefill
from pdserve.planner.policy import TO_DECODE, TO_PREFILL, Planner, PlannerConfig
from pdserve.planner.simulated import PoolState, SimulatedLoop
from pdserve.tuning.perf_model import Profile
from pdserve.tuning.sim_worker import Seq, Worker, least_used
from pdserve.tuning.simulator import (
    DECODE,
    INF,
    PREFILL,
    Placement,
    Req,
    SimResult,
    Simulator,
)

_TICK, _BOUND, _SWITCH = 3, 4, 5  # after the static simulator's events
SERVING, DRAINING, SWITCHING = "serving", "draining", "switching"
DRAIN_S = 5.0  # router.flip_drain_s's default
SWITCH_DELAY_S = 0.05


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


class PlannerSimulator(Simulator):
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
        if planner is not None and placement.prefill.pp > 1:
            raise ValueError(
                "the planner flips one-stage workers only: a prefill worker in pipeline stages "
                "never flips roles (deploy/config/schema.py Pool.pp)"
            )
        if not drain_s >= 0 or not switch_delay_s >= 0:
            raise ValueError("drain_s and switch_delay_s must be >= 0")
        super().__init__(profile, placement, fast, seed=seed)
        self.config = planner
        self.local_prefill = local_prefill or LocalPrefill(0)
        self.drain_s, self.switch_delay_s = drain_s, switch_delay_s
        self.planner_cls = planner_cls

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
        return super().run(
            requests, max_missed=max_missed, ttft_s=ttft_s, tpot_s=tpot_s, max_steps=max_steps
        )

    # ---- a run's state ---------------------------------------------------------------------
    def _start(self, requests) -> None:
        self.out = PlannerSimResult([])
        self.policy = self.local_prefill
        self.retired_preemptions = 0  # of the workers a flip replaced
        self.batch: list = [None, 0]  # a flip batch: the role flips take from, flips still to begin
        self._flip_done: Callable[[float], None] | None = None  # the batch's, until it ends
        super()._start(requests)
        for slot, w in enumerate(self.prefill + self.decode):
            w.slot = slot
        self.serving = {PREFILL: list(self.prefill), DECODE: list(self.decode)}
        cfg = self.config
        self.loop = SimulatedLoop(cfg, self.planner_cls) if cfg is not None else None
        if self.loop is not None:
            self._push(cfg.interval_s, _TICK, None)

    def _make_worker(self, role: str, tp: int) -> Worker:
        w = super()._make_worker(role, tp)
        w.slot, w.state = None, SERVING  # the slot: _start, or the worker it replaces
        w.pending = {}  # reservations on it whose commit has not come yet (a dict: ordered)
        w.bound_passed = w.move_pending = False
        w.flip = None
        return w

    def _serving(self, role: str) -> list[Worker]:
        return self.serving[role]

    def _result(self, stopped: bool) -> PlannerSimResult:
        out = self.out
        out.requests = self._request_results()
        out.stopped_early = stopped
        out.num_steps = self.num_steps
        out.num_preemptions = self.retired_preemptions + self._num_preemptions()
        if self.loop is not None:
            out.timeline, out.decisions = self.loop.timeline, self.loop.decisions
        return out

    # ---- events ----------------------------------------------------------------------------
    def _handlers(self) -> dict:
        handlers = super()._handlers()
        handlers.update({_TICK: self._on_tick, _BOUND: self._on_bound, _SWITCH: self._switch})
        return handlers

    def _on_arrive(self, now: float, i: int) -> None:
        r = self.reqs[i]
        if self.policy.enabled:
            r.local = self._choose_local(r)
        if self.loop is not None and not r.local:
            self.loop.prompt_arrived(now, r.leg_prompt)
        super()._on_arrive(now, i)

    def _note_first(self, r: Req, now: float) -> None:
        if self.loop is not None:
            self.loop.first_token(now, now - r.arrival)
        super()._note_first(r, now)

    def _note_done(self, r: Req, now: float) -> None:
        if self.loop is not None and r.output > 1:
            self.loop.finished(now, (now - r.first_at) / (r.output - 1))
        super()._note_done(r, now)

    def _stepped(self, w: Worker, now: float) -> None:
        if not w.is_prefill and w.step_has_prompt and w.plan:
            for seq, start, n in w.plan:  # local prompts computed: their charge ends
                r = seq.req
                if r.charged and start + n >= r.leg_prompt:
                    w.router_tokens -= r.charged
                    r.charged = 0
        if self.loop is not None and not w.is_prefill and w.running:
            self.loop.decode_step(now, now - w.step_start)  # its streams' gap between tokens

    def _next_step(self, w: Worker, now: float) -> None:
        if w.move_pending:
            w.busy = False
            self._move_out(w, now)
        else:
            self._start_step(w, now)
        if w.state == DRAINING:
            self._drained_yet(w, now)

    def _on_tick(self, now: float, _) -> None:
        sp, sd = self.serving[PREFILL], self.serving[DECODE]
        speeds = [w.budget / w.model.prefill_time(w.budget, w.budget**2) for w in sp]
        pools = PoolState(
            prefill_workers=len(sp),
            decode_workers=len(sd),
            prefill_queued_tokens=sum(w.queued_tokens for w in sp),
            prefill_tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
            decode_kv_use=sum(1 - w.free / w.num_blocks for w in sd) / len(sd) if sd else 0.0,
            decode_wait_s=max((now - r.arrival for r in self.held if not r.local), default=0.0),
        )
        self._now = now
        d = self.loop.tick(now, pools, self)
        # a flip batch ticks again when it ends (_switch); no tick keeps an ended run going
        if d.action not in (TO_PREFILL, TO_DECODE) and self.events:
            self._push(now + self.config.interval_s, _TICK, None)

    def _on_bound(self, now: float, w: Worker) -> None:
        if w.state == DRAINING:
            w.bound_passed = True
            if w.busy:
                w.move_pending = True  # after the step in flight
            else:
                self._move_out(w, now)

    # ---- the actuator the planner acts through ------------------------------------------------
    @property
    def local_max(self) -> int:
        return self.policy.max_prompt_tokens

    def set_local_max(self, bound: int) -> None:
        self.policy = dataclasses.replace(self.policy, max_prompt_tokens=bound)

    def flip(self, source: str, count: int, done: Callable[[float], None]) -> None:
        """A batch of `count` flips out of `source`, one after another (each begins when the
        last switched); done when the last switched."""
        self.batch[:] = [source, count - 1]
        self._flip_done = done
        self._begin_flip(source, self._now)

    # ---- the router ------------------------------------------------------------------------
    def _choose_local(self, r: Req) -> bool:
        if not self.policy.enabled:
            return False
        backlog = min(w.queued_tokens for w in self.serving[PREFILL]) + r.leg_prompt
        return self.policy.choose(
            r.leg_prompt, backlog, min(w.router_tokens for w in self.serving[DECODE])
        )

    def _dispatch_one(self, r: Req, now: float) -> bool:
        if r.local:
            return self._dispatch_local(r, now)
        if not super()._dispatch_one(r, now):
            return False
        r.dest.pending[r] = None
        return True

    def _dispatch_local(self, r: Req, now: float) -> bool:
        """A leg its decode worker prefills: the fewest prompt tokens charged, the next one when
        full."""
        need = (r.leg_prompt + self.profile.block_size - 1) // self.profile.block_size
        d = self._pick(
            self.serving[DECODE],
            lambda w: (w.free - w.pending_blocks >= need, -w.router_tokens, w.free),
            0,
        )
        if d.free - d.pending_blocks < need:
            return False
        self.held.popleft()
        r.dest, r.reserved = d, 0
        r.charged = r.leg_prompt
        d.router_tokens += r.leg_prompt
        self.out.num_local += 1
        d.enqueue(Seq(r, r.leg_prompt, 0, 0, False))
        if not d.busy:
            self._start_step(d, now)
        return True

    def _commit(self, r: Req, now: float) -> None:
        d = r.dest
        del d.pending[r]
        if d.bound_passed:  # its worker is flipping away: the leg moves
            self._resume(r, now)
            self._drained_yet(d, now)
            return
        super()._commit(r, now)
        if r.num_out >= r.output and d.state == DRAINING:
            self._drained_yet(d, now)

    def _resume(self, r: Req, now: float) -> None:
        """A leg moved off a flipping decode worker: prompt + tokens so far, as a new leg."""
        r.moved += 1
        r.leg_prompt = r.prompt + r.num_out
        r.dest, r.reserved, r.charged = None, 0, 0
        r.local = self._choose_local(r)
        self.held.append(r)
        self._dispatch(now)

    # ---- flips -------------------------------------------------------------------------------
    def _least_loaded(self, role: str) -> Worker:
        def load(w):
            n = len(w.running) + len(w.waiting) + len(w.joining) + len(w.pending)
            return (n, w.router_tokens if role == DECODE else w.queued_tokens)

        return min(self.serving[role], key=load)

    def _begin_flip(self, role: str, now: float) -> None:
        w = self._least_loaded(role)
        w.state = DRAINING
        self.serving[role].remove(w)
        w.flip = FlipRecord(w.slot, role, PREFILL if role == DECODE else DECODE, now)
        self.out.flips.append(w.flip)
        self._push(now + self.drain_s, _BOUND, w)
        self._drained_yet(w, now)

    def _drained_yet(self, w: Worker, now: float) -> None:
        if w.state != DRAINING or _holds_something(w):
            return
        w.state = SWITCHING
        at = max(now, w.link_free)  # a prefill worker's last KV is on its way
        w.flip.drained_s = at
        self._push(at + self.switch_delay_s, _SWITCH, w)

    def _move_out(self, w: Worker, now: float) -> None:
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
                self._to_prefill(r, now)
            else:
                w.flip.moved_streams += 1
                if r.charged:
                    w.router_tokens -= r.charged
                    r.charged = 0
                self._resume(r, now)
        for r in list(w.pending):  # prompts still prefilling for it: reserved elsewhere
            need = r.reserved
            d = self._pick(self.serving[DECODE], least_used, 0)
            if d.free >= need:
                del w.pending[r]
                d.free -= need
                d.pending[r] = None
                r.dest = d
            # else its KV lands here and the leg resumes from there (commit)
        self._drained_yet(w, now)

    def _switch(self, now: float, w: Worker) -> None:
        """A drained worker comes back in its new role (a new worker in its slot)."""
        self.retired_preemptions += w.num_preemptions
        role = w.flip.to_role
        (self.prefill if w.is_prefill else self.decode).remove(w)
        nw = self._make_worker(role, w.tp)
        nw.slot = w.slot
        self._draw_speed(nw)
        (self.prefill if role == PREFILL else self.decode).append(nw)
        self.serving[role].append(nw)
        w.flip.done_s = now
        source, left = self.batch
        if left > 0 and len(self.serving[source]) > 1:  # the batch's next flip
            self.batch[1] -= 1
            self._begin_flip(source, now)
        else:
            done, self._flip_done = self._flip_done, None
            done(now)
            self._push(now + self.config.interval_s, _TICK, None)
        if self.held:
            self._dispatch(now)


def _holds_something(w: Worker) -> bool:
    return bool(w.busy or w.running or w.waiting or w.joining or w.calls or w.pending)
