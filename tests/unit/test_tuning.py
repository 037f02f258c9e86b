"""The SLO tuner's pieces without a model: the latency-model fit, the simulator against closed-form
answers on hand-made profiles, the placement search and the --slo parser (`pdserve tune` itself,
the YAML it writes and its argument errors: test_tuning_cli.py)."""

from __future__ import annotations

import math

import pytest

from helpers.tuning import DERIVED, make_profile, one
from pdserve.tuning.perf_model import (
    ProfileError,
    fit_nonnegative,
    load_profile,
    prefill_features,
    profile_from_dict,
)
from pdserve.tuning.simulator import Placement, PoolSpec, Simulator, simulate
from pdserve.tuning.slo import SLO, TuneError, latency_slos, parse_slo, parse_slo_items
from pdserve.tuning.tuner import Search, enumerate_placements
from pdserve.tuning.workload import retime, synthetic


# ---- fitting ------------------------------------------------------------------------------------
def test_fit_recovers_known_coefficients():
    lens = [[16], [64], [256], [1024], [2048], [256] * 4, [64] * 16]
    feats = [prefill_features(x) for x in lens]
    truth = (0.004, 2.5e-5, 3e-9)
    lat = [truth[0] + truth[1] * f[1] + truth[2] * f[2] for f in feats]
    fit = fit_nonnegative(feats, lat)
    assert fit["coef"] == pytest.approx(truth, rel=1e-6)
    assert fit["fit"]["max_rel_error"] < 1e-9


def test_fit_never_returns_a_negative_coefficient():
    # a latency that falls with attention pairs would fit c < 0 unconstrained
    feats = [[1.0, 100.0, 0.0], [1.0, 100.0, 10000.0], [1.0, 200.0, 0.0], [1.0, 200.0, 40000.0]]
    fit = fit_nonnegative(feats, [0.2, 0.15, 0.4, 0.3])
    assert min(fit["coef"]) >= 0
    assert fit["fit"]["max_rel_error"] > 0.05  # and it says the fit is poor


# ---- simulator: closed forms --------------------------------------------------------------------
def test_one_request_disaggregated_closed_form():
    """TTFT = prefill step (a + b*prompt) + the transfer left after compute + the backend's
    latency: alone on a fast enough link only the last layer's share is exposed (x = bytes/L/bw);
    the first token is streamed at the commit. Then output-1 decode steps, each a + b*1 + c*ctx
    with ctx = the tokens the step attends to (prompt + k for the k-th decode step)."""
    prof = make_profile(decode=(0.02, 0.001, 1e-5))
    res = simulate([one(100, 10)], prof, Placement(PoolSpec(1), PoolSpec(1)))
    (r,) = res.requests
    prefill = 0.01 + 0.001 * 100  # 0.11 s, per layer c = 0.011
    x = 100 * 1000 / 1e6 / 10  # 0.01 s per layer < c: only x is exposed
    assert r.ttft_s == pytest.approx(prefill + x + 0.001)
    decode = sum(0.02 + 0.001 + 1e-5 * (100 + k) for k in range(1, 10))
    assert r.e2e_s == pytest.approx(prefill + x + 0.001 + decode)
    assert r.tpot_s == pytest.approx(decode / 9)


def test_one_request_on_a_slow_link_exposes_the_transfer_minus_the_overlap():
    prof = make_profile(bandwidth=1e5)  # x = 0.1 s per layer > c = 0.011 s
    (r,) = simulate([one(100, 2)], prof, Placement(PoolSpec(1), PoolSpec(1))).requests
    exposed = 10 * 0.1 - 9 * 0.011  # L*x - (L-1)*c
    assert r.ttft_s == pytest.approx(0.11 + exposed + 0.001)


def test_one_request_colocated_has_no_transfer():
    (r,) = simulate([one(100, 10)], make_profile(), Placement(None, PoolSpec(1))).requests
    assert r.ttft_s == pytest.approx(0.11)
    assert r.e2e_s == pytest.approx(0.11 + 9 * 0.021)


def test_serving_models_replace_the_engine_model_per_worker_kind():
    """A profile's serving-path models (measured through a deployment) time the steps of their
    worker kind; kinds and coefficients not given fall back to the engine's."""
    data = make_profile(decode=(0.02, 0.001, 0.0), as_dict=True)
    data["serving"] = {
        "prefill": {"1": {"prefill": {"coef": [0.05, 0.001, 0.0]}}},
        "colocated": {"1": {"decode": {"coef": [0.03, 0.001, 0.0]}}},
    }
    prof = profile_from_dict(data)
    (r,) = simulate([one(100, 10)], prof, Placement(PoolSpec(1), PoolSpec(1))).requests
    x = 100 * 1000 / 1e6 / 10
    assert r.ttft_s == pytest.approx(0.05 + 0.1 + x + 0.001)  # serving prefill model
    assert r.tpot_s == pytest.approx(0.021)  # decode: engine's
    (r,) = simulate([one(100, 10)], prof, Placement(None, PoolSpec(1))).requests
    assert r.ttft_s == pytest.approx(0.11)  # colocated prefill: engine's
    assert r.tpot_s == pytest.approx(0.031)  # colocated decode: serving


def test_interference_stretches_a_decode_step_that_starts_while_prefill_computes():
    data = make_profile(as_dict=True)
    data["serving"] = {"interference": {"decode_while_prefill": 0.5}}
    plain, slowed = make_profile(), profile_from_dict(data)
    # alone, nothing overlaps: the same answer
    for prof in (plain, slowed):
        (r,) = simulate([one(100, 3)], prof, Placement(PoolSpec(1), PoolSpec(1))).requests
        assert r.tpot_s == pytest.approx(0.021)
    # a second prompt arrives while the first decodes: the decode steps that start during its
    # prefill take 1.5x as long
    reqs = [one(100, 20), one(1000, 2, at=0.15)]
    a = simulate(reqs, plain, Placement(PoolSpec(1), PoolSpec(1))).requests[0]
    b = simulate(reqs, slowed, Placement(PoolSpec(1), PoolSpec(1))).requests[0]
    assert b.tpot_s > a.tpot_s * 1.2
    with pytest.raises(ProfileError, match="interference"):
        data["serving"] = {"interference": {"decode_while_prefill": -1}}
        profile_from_dict(data)


def test_colocated_router_charges_each_prompt_to_its_worker_until_its_first_token():
    """As router/pool.py picks colocated workers: fewest charged prompt tokens first, so a burst
    within one Stats sweep alternates between the workers instead of piling onto the one that
    looked freest at the sweep; the view (stale or exact) only breaks ties."""
    # a long request holds blocks on one worker; at 0.6 s four prompts arrive within one sweep
    reqs = [one(200, 200)] + [one(100, 50, at=0.6 + 0.01 * i) for i in range(4)]
    pl = Placement(None, PoolSpec(2))
    for stats_s in (0.5, 0):
        burst = Simulator(make_profile(), pl, router_stats_s=stats_s).run(reqs).requests[1:]
        # 1st -> the idle worker (0.11 s); 2nd -> the other (waits out its running decode step);
        # 3rd and 4th (both charged alike now) -> one each, behind the prompt there. Piled onto
        # the idle worker, the last three waited 0.39-0.41 s.
        assert [r.ttft_s for r in burst] == pytest.approx([0.11, 0.231, 0.201, 0.211], abs=0.002)


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    pool = PoolSpec(1, max_num_batched_tokens=64)
    (r,) = simulate([one(100, 2)], make_profile(), Placement(None, pool)).requests
    # steps of 64 and 36 tokens; the second attends to 64 earlier tokens (c = 0 here)
    assert r.ttft_s == pytest.approx((0.01 + 0.064) + (0.01 + 0.036))


def test_a_full_decode_pool_holds_the_next_request_at_the_router():
    # 3 blocks of 16: one request (32 prompt + 16 decoded tokens) at a time
    prof = make_profile()
    pl = Placement(PoolSpec(1), PoolSpec(1, kv_capacity_tokens=48))
    first, second = simulate([one(32, 17), one(32, 17)], prof, pl).requests
    alone = simulate([one(32, 17)], prof, pl).requests[0]
    assert first == alone
    assert second.ttft_s == pytest.approx(alone.e2e_s + alone.ttft_s)


def test_decode_batches_every_running_sequence_and_late_commits_join_the_next_step():
    """With an ideal prefill (phase "decode") four requests commit at t=0; the first commit starts
    a step of one sequence at once, the other three commits wait for that step to end (the
    engine loop takes calls between steps), which is their first token, and join the next step:
    then every step decodes all running sequences (a + b*B: 0.03 s for B=1, 0.05 s for B=3, 0.06 s
    for B=4)."""
    prof = make_profile(decode=(0.02, 0.01, 0.0))
    res = Simulator(prof, Placement(PoolSpec(1), PoolSpec(1))).run(
        [one(16, 5) for _ in range(4)], phase="decode"
    )
    first, *rest = res.requests
    assert first.ttft_s == 0 and first.e2e_s == pytest.approx(0.03 + 3 * 0.06)
    for r in rest:
        # three steps with the first, one more without it (it has its 5 tokens)
        assert r.ttft_s == pytest.approx(0.03)
        assert r.e2e_s == pytest.approx(0.03 + 3 * 0.06 + 0.05)
        assert r.tpot_s == pytest.approx((0.26 - 0.03) / 4)


def test_simulation_is_deterministic():
    prof = load_profile(DERIVED)
    reqs = retime(
        [one(200 + 37 * i % 900, 5 + 13 * i % 200) for i in range(300)], rate=40.0, seed=3
    )
    pl = Placement(PoolSpec(2), PoolSpec(1, kv_capacity_tokens=40_000))
    a, b = simulate(reqs, prof, pl), simulate(reqs, prof, pl)
    assert a.requests == b.requests and a.num_steps == b.num_steps


def test_fast_decode_path_gives_the_same_answers_as_the_slow_one():
    prof = load_profile(DERIVED)
    reqs = retime(
        [one(100 + 53 * i % 1500, 1 + 29 * i % 300) for i in range(400)], rate=60.0, seed=1
    )
    for pl in (
        Placement(PoolSpec(3), PoolSpec(1, kv_capacity_tokens=60_000)),
        Placement(None, PoolSpec(2, kv_capacity_tokens=30_000)),
    ):
        fast = Simulator(prof, pl, fast=True).run(reqs)
        slow = Simulator(prof, pl, fast=False).run(reqs)
        assert fast.num_preemptions > 0  # the comparison covers preemption too
        assert fast.requests == slow.requests


def test_first_token_latency_delays_the_request_without_taking_step_time():
    """A serving profile's first_token_latency_s (the router's hops to the workers) is paid once
    per request, before it reaches a worker: its TTFT and E2E grow by it, its steps (and so the
    decodes sharing them, its TPOT) do not."""
    data = make_profile(as_dict=True)
    data["serving"] = {"colocated": {"1": {"first_token_latency_s": 0.05}}}
    slow = profile_from_dict(data)
    reqs = [one(100, 10), one(100, 10, at=0.001)]
    pl = Placement(None, PoolSpec(1))
    base = simulate(reqs, make_profile(), pl).requests
    late = simulate(reqs, slow, pl).requests
    assert [r.ttft_s for r in late] == pytest.approx([r.ttft_s + 0.05 for r in base])
    assert [r.e2e_s for r in late] == pytest.approx([r.e2e_s + 0.05 for r in base])
    assert [r.tpot_s for r in late] == pytest.approx([r.tpot_s for r in base])
    with pytest.raises(ProfileError, match="first_token_latency_s"):
        data["serving"]["colocated"]["1"]["first_token_latency_s"] = -1
        profile_from_dict(data)


def test_a_reserve_waits_for_the_decode_step_in_flight():
    """Disaggregated, the router's Reserve runs on the decode worker's loop between steps: a
    request that arrives while a decode step runs reaches the prefill worker when that step ends."""
    prof = make_profile(decode=(0.2, 0.0, 0.0))  # decode steps of 0.2 s
    pl = Placement(PoolSpec(1), PoolSpec(1))
    first, second = simulate([one(100, 5), one(100, 2, at=0.2)], prof, pl).requests
    alone = simulate([one(100, 2)], prof, pl).requests[0]
    # the first request commits at ~0.121 s and decodes from then on: its first decode step runs
    # until ~0.321 s, so the second's prefill starts there, not at 0.2 s; its commit then waits
    # for the decode step in flight at that time too (it ends at ~0.521 s)
    commit_1 = first.ttft_s
    assert second.ttft_s + 0.2 == pytest.approx(commit_1 + 2 * 0.2)
    assert alone.ttft_s == pytest.approx(commit_1)  # alone, neither call waits


def test_a_prompt_whose_last_chunk_is_one_token_gets_its_first_token():
    """Colocated, budget 64: a 64-token prompt admitted beside one decoding sequence gets 63
    tokens, then a last chunk of one token while everything else decodes. It is not decoding yet
    (the fast path once took it for a decode row and it never got a first token)."""
    pool = PoolSpec(1, max_num_batched_tokens=64)
    reqs = [one(8, 40), one(64, 5, at=0.05)]
    for fast in (True, False):
        first, second = (
            Simulator(make_profile(), Placement(None, pool), fast=fast).run(reqs).requests
        )
        assert math.isfinite(second.ttft_s) and math.isfinite(second.e2e_s)
        assert math.isfinite(first.e2e_s)


# ---- search -------------------------------------------------------------------------------------
def test_decode_bound_traffic_gains_from_decode_replicas():
    prof = make_profile(prefill=(0.001, 1e-5, 0.0), decode=(0.05, 0.01, 0.0))
    search = Search(prof, synthetic(300, 1.0, 32, 64), SLO(1.0, 0.3))
    one_d = search.evaluate(Placement(PoolSpec(1), PoolSpec(1))).goodput
    three_d = search.evaluate(Placement(PoolSpec(1), PoolSpec(3))).goodput
    assert one_d > 0 and three_d > 2 * one_d
    best = search.run(enumerate_placements(prof, 4))[0]
    assert best.placement.decode.replicas > best.placement.prefill.replicas


def test_prefill_heavy_traffic_prefers_prefill_replicas():
    prof = make_profile(prefill=(0.01, 1e-3, 0.0), decode=(0.01, 1e-4, 0.0))
    search = Search(prof, synthetic(300, 1.0, 1000, 2), SLO(5.0, 1.0))
    three_p = search.evaluate(Placement(PoolSpec(3), PoolSpec(1))).goodput
    one_p = search.evaluate(Placement(PoolSpec(1), PoolSpec(3))).goodput
    assert three_p > 2 * one_p > 0
    best = search.run(enumerate_placements(prof, 4))[0]
    assert best.placement.prefill.replicas > best.placement.decode.replicas


def test_colocated_workers_that_slow_each_other_are_simulated_whole():
    """Without interference, n colocated workers are n copies of one; with colocated_while_busy
    the candidate is simulated whole and its goodput falls below n x one worker's."""
    data = make_profile(prefill=(0.01, 1e-3, 0.0), decode=(0.02, 1e-3, 0.0), as_dict=True)
    workload, slo = synthetic(300, 1.0, 200, 20), SLO(2.0, 0.1)
    alone = Search(profile_from_dict(data), workload, slo).evaluate(Placement(None, PoolSpec(2)))
    one = Search(profile_from_dict(data), workload, slo).evaluate(Placement(None, PoolSpec(1)))
    assert alone.goodput == pytest.approx(2 * one.goodput) and alone.status == "simulated"
    data["serving"] = {"interference": {"colocated_while_busy": 0.5}}
    search = Search(profile_from_dict(data), workload, slo)
    slowed = search.evaluate(Placement(None, PoolSpec(2)))
    assert slowed.estimate == pytest.approx(alone.goodput)
    assert slowed.status == "simulated" and 0 < slowed.goodput < 0.9 * alone.goodput
    best = search.run([Placement(None, PoolSpec(2))])[0]
    assert best.goodput == pytest.approx(slowed.goodput, rel=0.06)


def test_pruning_never_drops_a_placement_that_would_beat_the_best():
    """Colocated ranks first by estimate and simulates to 3.06 req/s; 1P+1D's estimate (4.16) fails,
    and its goodput (~3.15) lies between the best so far and that failed rate. The search may give
    up below the best, but it must try the best's rate itself rather than step past it."""
    data = make_profile(prefill=(0.01, 1e-3, 0.0), decode=(0.02, 1e-3, 0.0), as_dict=True)
    data["serving"] = {
        "interference": {
            "colocated_while_busy": 0.5,
            "decode_while_prefill": 0.5,
            "prefill_while_decode": 0.5,
        }
    }
    prof = profile_from_dict(data)
    picks = []
    for prune in (True, False):
        search = Search(prof, synthetic(300, 1.0, 200, 20), SLO(2.0, 0.1))
        cands = search.run(enumerate_placements(prof, 2, colocated=True), verify_top=1, prune=prune)
        assert all(c.status == "simulated" for c in cands)
        picks.append(cands[0].placement.label())
    assert picks == ["1P tp1 + 1D tp1"] * 2


def test_enumeration_covers_ratios_and_tp_degrees():
    prof = make_profile(tps=(1, 3))
    labels = {p.label() for p in enumerate_placements(prof, 6, colocated=True)}
    assert {
        "1P tp1 + 5D tp1",
        "5P tp1 + 1D tp1",
        "1P tp3 + 3D tp1",
        "1P tp3 + 1D tp3",
        "colocated 6x tp1",
        "colocated 2x tp3",
    } <= labels
    assert all(p.num_devices <= 6 for p in enumerate_placements(prof, 6, colocated=True))


def test_parse_slo():
    assert parse_slo("ttft=200ms,tpot=0.05s,attainment=90%") == SLO(0.2, 0.05, 0.9)
    assert parse_slo("tpot=50ms, ttft=1s") == SLO(1.0, 0.05, 0.9)
    for bad in ("ttft=200,tpot=50ms", "ttft=200ms", "ttft=1s,tpot=1s,attainment=2", "foo=1s"):
        with pytest.raises(TuneError):
            parse_slo(bad)


def test_tune_and_bench_read_one_slo_grammar():
    """What either command accepted before, both read alike now; each takes what it uses."""
    for text in ("ttft=200ms,tpot=0.05s", "tpot=50ms, ttft=1s", " TTFT = 2s , tpot=1.5e3ms"):
        slo = parse_slo(text)
        assert latency_slos(text) == {"ttft": slo.ttft_s, "tpot": slo.tpot_s}
    assert parse_slo_items("e2e=1.5e3MS,attainment=90%") == {"e2e": 1.5, "attainment": 0.9}
    assert parse_slo("ttft=9ms,tpot=1e-1s").ttft_s == 0.009  # ms: a division, exact to the ulp
    with pytest.raises(TuneError, match="takes no e2e"):
        parse_slo("ttft=1s,tpot=50ms,e2e=10s")
    with pytest.raises(TuneError, match="--attainment"):
        latency_slos("ttft=1s,attainment=0.9")


@pytest.mark.parametrize("objective, winner", [("total", "8 devices"), ("per-device", "7 devices")])
def test_objective_chooses_total_or_per_device_goodput(objective, winner, monkeypatch):
    """For a fixed budget of 8: 8 devices serving 8.0 req/s beat 7 serving 7.7 (1.1 per device)
    in total, and lose per device."""
    prof = make_profile()
    seven, eight = Placement(PoolSpec(3), PoolSpec(4)), Placement(PoolSpec(4), PoolSpec(4))
    goodput = {seven.label(): 7.7, eight.label(): 8.0}

    def estimate(self, cand):
        cand.estimate = goodput[cand.placement.label()]

    def simulate(self, cand, best):
        cand.goodput, cand.status = cand.estimate, "simulated"

    monkeypatch.setattr(Search, "estimate", estimate)
    monkeypatch.setattr(Search, "simulate", simulate)
    search = Search(prof, synthetic(20, 1.0, 10, 5), SLO(1.0, 0.1), objective=objective)
    best = search.run([seven, eight])[0]
    assert f"{best.placement.num_devices} devices" == winner
