"""Placement search: the deployment of N devices with the highest goodput (in total, or per device:
the objective) for a workload and an SLO, predicted by the simulator from a hardware profile.
Goodput is DistServe's: the highest request rate at which at least `attainment` of the requests
meet both the TTFT and the TPOT SLO.

    pdserve tune --profile P --workload azure_conv --scale 0.2 --max-prompt 1024 \
        --slo ttft=1s,tpot=100ms,attainment=0.9 --devices 8 [--colocated] [--out best.yaml]

`pdserve tune` (tuning/tune_cmd.py) creates one Search per run and calls `run`, which returns the
ranked candidates; nothing outlives the run. `enumerate_placements` says which layouts are
candidates (TP x PP for the prefill pool, as DistServe searches each phase's parallelism; TP only
for decode and colocated pools), and Search how they are sized and checked. A device is a GPU
when the profile says gpu, else a CPU core.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field, replace

from pdserve.tuning.perf_model import Profile
from pdserve.tuning.simulator import Placement, PoolSpec, Simulator
from pdserve.tuning.slo import SLO, TuneError
from pdserve.tuning.workload import RequestSpec, retime

BISECT_RATIO = 1.05  # stop when the failing rate is within 5% of the passing one
PRUNE_SLACK = 1.25  # the capacity estimate may be this much too pessimistic


# the ranking: "total" goodput of the placement (for a fixed budget of devices: a layout that uses
# them all and serves more beats one that leaves one idle), or goodput "per-device" (the cheapest
# layout per request/s, fewer devices on a tie)
OBJECTIVES = ("total", "per-device")


def sample_requests(requests: list[RequestSpec], n: int, seed: int = 0) -> list[RequestSpec]:
    """n of the requests, chosen evenly at random over the whole trace, in their order."""
    if len(requests) <= n:
        return list(requests)
    keep = sorted(random.Random(seed).sample(range(len(requests)), n))
    return [requests[i] for i in keep]


# ---- candidates ---------------------------------------------------------------------------------
def pp_degrees(profile: Profile, tp: int, num_devices: int) -> list[int]:
    """The stage counts a prefill worker of `tp` ranks a stage may take: 1, 2, 4, ... while
    every stage keeps a layer and tp x pp devices are there."""
    out, pp = [], 1
    while pp <= profile.num_layers and tp * pp <= num_devices:
        out.append(pp)
        pp *= 2
    return out


def pp_dominated(profile: Profile, tp: int, pp: int, min_kv_tokens: int = 1) -> bool:
    """Whether a prefill worker of tp x pp (pp > 1) can never beat pp workers of tp in one stage
    on the same devices: those hold at least min_kv_tokens of KV each, and the stages take turns
    (no micro-batching), so the pipelined worker computes the same layers at the same TP degree
    with hand-offs added, while pp one-stage workers serve pp prompts at a time."""
    return pp > 1 and profile.kv_capacity(tp, 1) >= max(1, min_kv_tokens)


def enumerate_placements(
    profile: Profile,
    num_devices: int,
    *,
    colocated: bool = False,
    tp_degrees: list[int] | None = None,
    backend: str | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
    pipeline: bool = True,
    min_kv_tokens: int = 1,
) -> list[Placement]:
    """Every prefill/decode split with as many decode replicas as the rest of the devices allow
    (so every n:m ratio per pair of worker shapes), and with colocated, N // tp workers per
    degree. A prefill worker's shape is tp x pp (pipeline: pp in pp_degrees, except where
    pp_dominated says one stage of that tp, holding min_kv_tokens, always does as well); decode
    and colocated workers run one stage. A shape whose weights leave no room for KV
    (Profile.kv_capacity 0) is no candidate."""
    tps = [t for t in (tp_degrees or profile.tp_degrees) if t in profile.tp]
    pool = lambda n, t, pp=1: PoolSpec(n, t, max_num_batched_tokens, max_num_seqs, pp=pp)  # noqa: E731
    prefill_shapes = [
        (t, pp)
        for t in tps
        for pp in (pp_degrees(profile, t, num_devices) if pipeline else [1])
        if profile.kv_capacity(t, pp) > 0 and not pp_dominated(profile, t, pp, min_kv_tokens)
    ]
    decode_tps = [t for t in tps if profile.kv_capacity(t) > 0]
    out = []
    for tp_p, pp_p in prefill_shapes:
        for tp_d in decode_tps:
            for n_p in range(1, num_devices // (tp_p * pp_p) + 1):
                n_d = (num_devices - n_p * tp_p * pp_p) // tp_d
                if n_d >= 1:
                    out.append(Placement(pool(n_p, tp_p, pp_p), pool(n_d, tp_d), backend))
    if colocated:
        for t in decode_tps:
            if num_devices // t >= 1:
                out.append(Placement(None, pool(num_devices // t, t)))
    return out


def instance_capacity(
    kind: str, pool: PoolSpec, profile: Profile, requests: list[RequestSpec], slo: SLO
) -> float:
    """Requests/s one worker could sustain at best (no queueing): prefill work per request, and
    the decode batch that the TPOT SLO and the KV capacity allow. Brackets the bisections."""
    # the serving-path model of this kind, when profiled, placed on the profile's nodes
    m = profile.placed_step_model(pool.tp, pool.pp, kind)
    mean_out = statistics.fmean(max(0, r.output_len - 1) for r in requests) or 1e-9
    ctx = statistics.fmean(r.prompt_len + r.output_len / 2 for r in requests)
    held = statistics.fmean(r.prompt_len + r.output_len for r in requests)
    a, b, c = m.prefill
    prefill_s = statistics.fmean(
        a * r.prompt_len / pool.max_num_batched_tokens + b * r.prompt_len + c * r.prompt_len**2
        for r in requests
    )
    if kind == "prefill":
        return 1.0 / prefill_s
    a, b, c = m.decode
    batch = min(
        (pool.kv_capacity_tokens or m.kv_capacity_tokens) / held,
        (slo.tpot_s - a) / (b + c * ctx) if slo.tpot_s > a else 0.0,
    )
    if batch < 1:
        return 0.0
    step = a + b * batch + c * batch * ctx
    if kind == "decode":
        return batch / (step * mean_out)
    return 1.0 / (prefill_s + mean_out * step / batch)


# ---- search -------------------------------------------------------------------------------------
@dataclass
class Candidate:
    placement: Placement
    estimate: float = 0.0  # req/s from the per-instance goodputs (DistServe's sizing)
    goodput: float | None = None  # req/s from simulating the deployment (None: not simulated)
    # estimate | simulated | "simulated (at least)" (passed at max_rate) | unverified (its unit is
    # too big to simulate in steady state) | dropped (could not beat the best) | no-rate
    status: str = "estimate"
    trials: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment)
    ttft_p90_s: float | None = None  # at the goodput rate
    tpot_p90_s: float | None = None
    horizon_s: float | None = None  # simulated seconds of arrivals at the goodput rate
    seeded: list[float] | None = (
        None  # goodputs with the profile's step noise, one per seed (band())
    )

    @property
    def score(self) -> float:
        """The goodput this candidate is ranked by: simulated when it was, else the estimate."""
        return self.estimate if self.goodput is None else self.goodput

    @property
    def per_device(self) -> float:
        return self.score / self.placement.num_devices


@dataclass
class Instance:
    """One worker of one kind alone: its goodput (req/s) and the trials that found it."""

    kind: str
    tp: int
    goodput: float
    trials: list[tuple[float, float]]
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    num_requests: int
    capped: bool = False  # passed at the highest rate simulated: at least this
    pp: int = 1  # pipeline stages (prefill only)


def _p90(values: list[float]) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(math.ceil(0.9 * len(xs))) - 1)]


class Search:
    """Per-instance goodputs first, by bisection on the rate (one prefill worker with an ideal
    decode side, one decode worker fed by an ideal prefill, one colocated worker: DistServe's
    algorithm), which size every placement at once: min(n_prefill x prefill goodput, n_decode x
    decode goodput), or n x colocated goodput. Then the best placements by that estimate are
    simulated whole (on their smallest repeating unit: 4P+6D as 2P+3D at half the rate), best
    first, until the best simulated one beats every estimate left (or `verify_top` were simulated
    and time is up). A colocated estimate is final unless the profile's
    serving.interference.colocated_while_busy says colocated workers slow each other.

    A simulation at rate r needs about r x horizon_s requests, or a short burst would pass that
    steady traffic fails; so the sample grows with the rate, up to max_requests (one worker) and
    max_verify_requests (a whole unit), and no rate is tried above what that many can show. To
    save time, samples and re-timed workloads are cached (re-timing with the same seed scales the
    arrival gaps exactly with 1/rate), and a simulation stops as soon as too many requests missed
    the SLO."""

    def __init__(
        self,
        profile: Profile,
        workload: list[RequestSpec],
        slo: SLO,
        *,
        num_requests: int = 300,
        max_requests: int = 6000,
        max_verify_requests: int = 20000,
        burstiness: float = 1.0,
        seed: int = 0,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 128,
        backend: str | None = None,
        objective: str = "per-device",
    ):
        if objective not in OBJECTIVES:
            raise TuneError(f"--objective {objective!r}: one of {', '.join(OBJECTIVES)}")
        self.objective = objective
        self.profile, self.workload, self.slo = profile, workload, slo
        self.num_requests, self.max_requests = num_requests, max(max_requests, num_requests)
        self.max_verify_requests = max(max_verify_requests, self.max_requests)
        self.burstiness, self.seed, self.backend = burstiness, seed, backend
        self.pool_args = (max_num_batched_tokens, max_num_seqs)
        self.base = sample_requests(workload, num_requests, seed)
        mean_out = statistics.fmean(r.output_len for r in self.base)
        # arrivals must last long enough for overload to show: queues behind the TTFT SLO, and
        # decode batches that build up over a request's lifetime
        self.horizon_s = max(10 * slo.ttft_s, 1.5 * mean_out * slo.tpot_s)
        # above this rate even max_requests arrive within less than the horizon: a burst the
        # pools absorb says nothing of steady state, so no simulation runs above it
        self.max_rate = self.max_requests / self.horizon_s
        self.last_capped = False
        self._sized: dict[int, list[RequestSpec]] = {}
        self._timed: dict[tuple[int, float], list[RequestSpec]] = {}
        self.instances: dict[tuple[str, int, int], Instance] = {}  # (kind, tp, pp)
        self.num_sims = 0
        self.timed_out = False

    def _requests(self, rate: float, cap: int) -> list[RequestSpec]:
        """The sample to simulate at about `rate`: enough requests to span the horizon."""
        n = self.num_requests
        while n < rate * self.horizon_s and n < cap:
            n = math.ceil(n * 1.5)  # a coarse ladder: fewer distinct samples, more cache hits
        n = min(n, cap, len(self.workload))
        if n not in self._sized:
            self._sized[n] = sample_requests(self.workload, n, self.seed)
        return self._sized[n]

    def _timed_at(self, reqs: list[RequestSpec], rate: float) -> list[RequestSpec]:
        key = (len(reqs), rate)
        if key not in self._timed:
            self._timed[key] = retime(reqs, rate, self.burstiness, self.seed)
        return self._timed[key]

    def _bisect(
        self,
        sim: Simulator,
        start: float,
        cap: int,
        *,
        phase: str = "both",
        give_up_below: float = 0.0,
    ):
        """Highest passing rate (0 if none) and the lowest failing one (None if none), with the
        trials, the passing run's p90 TTFT/TPOT and its number of requests. In the decode phase
        TTFT is the wait for KV blocks on a decode worker (prefill is ideal)."""
        slo = self.slo
        tpot = slo.tpot_s if phase != "prefill" else math.inf
        state = {
            "good": 0.0,
            "bad": None,
            "trials": [],
            "p90": (None, None),
            "n": 0,
            "capped": False,
        }

        def trial(rate: float) -> bool:
            reqs = self._requests(rate, cap)
            max_missed = int(math.floor((1 - slo.attainment) * len(reqs) + 1e-9))
            res = sim.run(
                self._timed_at(reqs, rate),
                max_missed=max_missed,
                ttft_s=slo.ttft_s,
                tpot_s=tpot,
                phase=phase,
            )
            self.num_sims += 1
            att = res.attainment(slo.ttft_s, tpot)
            state["trials"].append((rate, att))
            ok = att >= slo.attainment - 1e-12
            if ok and rate > state["good"]:
                state["good"], state["n"] = rate, len(reqs)
                state["p90"] = (
                    _p90([r.ttft_s for r in res.requests]),
                    _p90([r.tpot_s for r in res.requests]),
                )
            elif not ok and (state["bad"] is None or rate < state["bad"]):
                state["bad"] = rate
            return ok

        top = cap / self.horizon_s
        rate = min(max(start, 1e-6), top)
        if trial(rate):
            for _ in range(8):
                if rate >= top:
                    state["capped"] = True
                    break
                rate = min(rate * 1.5, top)
                if not trial(rate):
                    break
        else:
            for _ in range(14):
                if rate <= give_up_below:  # failed at or below the best so far: cannot beat it
                    break
                # never below give_up_below, but that rate itself is tried: a goodput between it
                # and the failed rate must not be stepped over (it would beat the best so far)
                rate = max(rate / 1.5, give_up_below)
                if trial(rate):
                    break
        while (
            state["good"] > 0
            and state["bad"] is not None
            and state["bad"] / state["good"] > BISECT_RATIO
        ):
            if state["bad"] < give_up_below:
                break
            trial(math.sqrt(state["good"] * state["bad"]))
        self.last_capped = state["capped"]
        return state["good"], state["trials"], state["p90"], state["n"]

    def instance(self, kind: str, tp: int, pp: int = 1) -> Instance:
        key = (kind, tp, pp)
        if key not in self.instances:
            pool = PoolSpec(1, tp, *self.pool_args, pp=pp)
            if kind == "colocated":
                placement, phase = Placement(None, pool), "both"
            elif kind == "prefill":
                placement, phase = Placement(pool, pool, self.backend), "prefill"
            else:
                placement, phase = Placement(pool, pool, self.backend), "decode"
            if pp > 1:  # the ideal other side of a pipelined prefill worker: one stage
                placement = replace(placement, decode=replace(pool, pp=1))
            est = instance_capacity(kind, pool, self.profile, self.base, self.slo)
            if est <= 0:
                self.instances[key] = Instance(kind, tp, 0.0, [], None, None, 0, pp=pp)
            else:
                good, trials, (ttft, tpot), n = self._bisect(
                    Simulator(self.profile, placement), est * 0.7, self.max_requests, phase=phase
                )
                self.instances[key] = Instance(
                    kind, tp, good, trials, ttft, tpot, n, self.last_capped, pp
                )
        return self.instances[key]

    def estimate(self, cand: Candidate) -> None:
        pl = cand.placement
        if pl.colocated:
            inst = self.instance("colocated", pl.decode.tp)
            n = pl.decode.replicas
            if n > 1 and self.profile.interference.get("colocated_while_busy"):
                # workers that slow each other down are no n copies of one: simulated whole
                cand.estimate = n * inst.goodput
                if cand.estimate <= 0:
                    cand.status = "no-rate"
                return
            cand.estimate = cand.goodput = n * inst.goodput
            cand.trials = [(r * n, a) for r, a in inst.trials]
            cand.ttft_p90_s, cand.tpot_p90_s = inst.ttft_p90_s, inst.tpot_p90_s
            cand.status = (
                "no-rate"
                if inst.goodput <= 0
                else "simulated (at least)"
                if inst.capped
                else "simulated"
            )
            if inst.goodput > 0:
                cand.horizon_s = inst.num_requests / inst.goodput
            return
        p = self.instance("prefill", pl.prefill.tp, pl.prefill.pp)
        d = self.instance("decode", pl.decode.tp)
        cand.estimate = min(pl.prefill.replicas * p.goodput, pl.decode.replicas * d.goodput)
        if cand.estimate <= 0:
            cand.status = "no-rate"

    def value(self, cand: Candidate) -> float:
        """What the ranking maximizes (self.objective)."""
        return cand.score if self.objective == "total" else cand.per_device

    def simulate(self, cand: Candidate, best: float) -> None:
        """The whole deployment, on its smallest repeating unit, bisected around the estimate;
        `best`: the best value (self.value) so far, below which it may give up."""
        pl = cand.placement
        g, unit = self._unit(pl)
        if cand.estimate / g > self.max_verify_requests / self.horizon_s:
            cand.status = "unverified"  # its unit is too big to reach steady state: see max_rate
            return
        total = best if self.objective == "total" else best * pl.num_devices
        give_up = total / g
        good, trials, (ttft, tpot), n = self._bisect(
            Simulator(self.profile, unit),
            cand.estimate / g,
            self.max_verify_requests,
            give_up_below=give_up,
        )
        cand.trials = [(r * g, a) for r, a in trials]
        cand.goodput = good * g
        cand.ttft_p90_s, cand.tpot_p90_s = ttft, tpot
        if good <= 0:
            cand.status = "no-rate" if give_up <= 0 else "dropped"
            return
        cand.horizon_s = n / good
        cand.status = "simulated (at least)" if self.last_capped else "simulated"

    def _unit(self, pl: Placement) -> tuple[int, Placement]:
        """(g, the smallest repeating unit): pl is g copies of it."""
        if pl.colocated:  # simulated whole only when its workers slow each other (estimate)
            if self.profile.interference.get("colocated_while_busy"):
                return 1, pl
            return pl.decode.replicas, Placement(None, replace(pl.decode, replicas=1))
        g = math.gcd(pl.prefill.replicas, pl.decode.replicas)
        return g, Placement(
            replace(pl.prefill, replicas=pl.prefill.replicas // g),
            replace(pl.decode, replicas=pl.decode.replicas // g),
            pl.backend,
        )

    def band(self, cand: Candidate, seeds: int) -> None:
        """cand.seeded: its goodput bisected again with the profile's step-time variation
        (step_noise, prompt_step_noise, step_speed), once per seed 0..seeds-1. The ranking stays
        on the unseeded goodput: a machine at its mean speed."""
        g, unit = self._unit(cand.placement)
        cand.seeded = []
        for k in range(seeds):
            good, *_ = self._bisect(
                Simulator(self.profile, unit, seed=k), cand.score / g, self.max_verify_requests
            )
            cand.seeded.append(good * g)

    def evaluate(self, placement: Placement) -> Candidate:
        """One placement alone: its estimate, then its whole-deployment goodput."""
        cand = Candidate(placement)
        self.estimate(cand)
        if cand.status == "estimate":
            self.simulate(cand, 0.0)
        return cand

    def run(
        self,
        placements: list[Placement],
        *,
        verify_top: int = 3,
        deadline_s: float | None = 45.0,
        prune: bool = True,
    ) -> list[Candidate]:
        """The candidates, best first. prune=False: none is dropped early; each one simulated
        is bisected in full (for a goodput band around every finalist)."""
        t0 = time.monotonic()
        cands = [Candidate(p) for p in placements]
        for cand in cands:
            self.estimate(cand)
        order = lambda c: (-self.value(c), c.placement.num_devices, c.placement.label())  # noqa: E731
        num_simulated = 0
        while True:
            live = sorted((c for c in cands if c.status not in ("no-rate", "dropped")), key=order)
            pending = [c for c in live if c.status == "estimate"]
            if not pending:
                break
            top_is_simulated = live[0].status != "estimate"
            if top_is_simulated and num_simulated >= verify_top:
                break
            if deadline_s is not None and time.monotonic() - t0 > deadline_s:
                self.timed_out = True
                break
            # while the top is an estimate, a candidate that cannot beat the best simulated one is
            # dropped early; the extra ones simulated for the table are bisected in full
            best = max(
                (self.value(c) for c in live if c.status.startswith("simulated")), default=0.0
            )
            self.simulate(pending[0], 0.0 if top_is_simulated or not prune else best)
            num_simulated += 1
        cands.sort(key=lambda c: (c.status in ("no-rate", "dropped"),) + order(c))
        return cands
