"""Named scenarios for the planner's policy (planner/policy.py): the situations, seen live and in
simulation, that shaped a rule of `decide`, each with the decision the rule now takes and, where
it helps, the decision without the condition that rule keys on."""

from __future__ import annotations

import pytest

from helpers.planner import sig as signals
from pdserve.planner.policy import (
    LOCAL_MORE,
    NONE,
    TO_DECODE,
    TO_PREFILL,
    Planner,
    PlannerConfig,
    Signals,
)

TTFT_S, TPOT_S = 1.0, 0.1
CONFIG = PlannerConfig(ttft_s=TTFT_S, tpot_s=TPOT_S, sustain=2, cooldown_s=30)
SPEED = 10_000.0  # prompt tokens one prefill worker computes per second
PER_WORKER = SPEED * CONFIG.prefill_use  # the prompt tokens per second one worker covers


def sig(now, p, d, ttft, tpot, *, kv=0.2, local=0, wait=0.0, demand=0.0, queued=0):
    """Signals at pressures `ttft` and `tpot` (x SLO) with `demand` prefill workers' worth of
    prompt tokens arriving (0: unknown)."""
    return signals(
        now,
        ttft * TTFT_S,
        tpot * TPOT_S,
        p=p,
        d=d,
        kv=kv,
        local=local,
        queued=queued,
        speed=SPEED,
        wait=wait,
        rate=demand * PER_WORKER,
    )


def held(signals: Signals, config: PlannerConfig = CONFIG, times: int = 2):
    """The decision after `times` decisions in a row on the same signals."""
    planner = Planner(config)
    decisions = [planner.decide(signals) for _ in range(times)]
    return decisions[-1]


def test_a_full_decode_worker_behind_seven_prefill_workers_takes_one_back():
    """7P:1D, the one decode worker full: requests wait for its KV blocks, and TTFT, which holds
    that wait, reads high. Read from TTFT alone it looked prefill-pressed (and no decode worker
    can go), so no worker ever came back; the wait for decode KV says the decode pool is short."""
    full = sig(0, 7, 1, ttft=3.0, tpot=0.5, wait=0.95 * TTFT_S)
    assert held(full).action == TO_DECODE
    assert held(sig(0, 7, 1, ttft=3.0, tpot=0.5)).action == NONE


def test_a_full_kv_pool_with_tpot_well_inside_its_slo_does_not_flip():
    """16 GPUs in simulation: a full decode KV pool with TPOT at 0.72 x SLO counted as TPOT
    pressure, flipped back and forth and cost goodput. KV use counts only once TPOT is past
    1 - margin."""
    planner = Planner(CONFIG)
    calm = sig(0, 8, 8, ttft=0.5, tpot=0.72, kv=0.95)
    assert planner.pressures(calm)[1] == pytest.approx(0.72)
    assert held(calm).action == NONE
    assert held(sig(0, 8, 8, ttft=0.5, tpot=0.85, kv=0.95)).action == TO_DECODE


def test_local_prefill_does_not_grow_onto_a_decode_pool_at_half_its_tpot():
    """Live, a local prefill bound raised while TPOT read 0.5-0.7 x SLO grew to 832 tokens and
    took TPOT to 2 x SLO: local prompts stall every stream of their worker. The bound grows only
    while TPOT is under half its room."""
    for tpot in (0.5, 0.6, 0.7):
        planner = Planner(CONFIG)
        decisions = [planner.decide(sig(5 * i, 1, 1, ttft=2.0, tpot=tpot)) for i in range(10)]
        assert {d.action for d in decisions} == {NONE}, tpot
    assert held(sig(0, 1, 1, ttft=2.0, tpot=0.3)).action == LOCAL_MORE


def test_long_answers_on_two_prefill_one_decode_flip_to_decode_with_both_sides_over():
    """Live, a shift to long answers on 2P:1D sat 14 s with TTFT and TPOT both over their SLOs
    (TTFT holds the wait for the full decode pool) before it flipped. The prefill demand, 1P,
    says decode is short while both are pressed."""
    d = held(sig(0, 2, 1, ttft=1.2, tpot=2.0, demand=0.5))
    assert (d.action, d.count) == (TO_DECODE, 1)
    assert "prefill needs 1P" in d.reason
    assert held(sig(0, 2, 1, ttft=1.2, tpot=2.0)).action == NONE  # no demand known: no verdict


def test_a_queue_behind_a_full_decode_pool_is_not_read_as_prefill_demand():
    """Live, a queue that built behind a full decode pool read as prefill demand and flipped a
    worker back to prefill with TPOT at 2.6 x SLO. Both pressed, a flip goes only toward the
    more pressed side."""
    backlog = 10 * CONFIG.window_s * PER_WORKER  # ten workers' worth over one window
    assert held(sig(0, 1, 3, ttft=2.0, tpot=2.6, queued=backlog, demand=1)).action == NONE
    assert held(sig(0, 1, 3, ttft=2.0, tpot=1.2, queued=backlog, demand=1)).action == TO_PREFILL


def test_a_spare_prefill_worker_goes_to_decode_while_tpot_has_room_left():
    """Live, a shift to long answers on 2P:1D held TPOT at 0.5-0.7 x SLO for 15 s while the one
    decode worker's batch grew, then crossed the SLO within 4 s; a flip only then came late for
    the streams that worker had taken. A prefill worker the demand leaves spare goes first."""
    d = held(sig(0, 2, 1, ttft=0.3, tpot=0.6, demand=0.5))
    assert (d.action, d.count) == (TO_DECODE, 1)
    assert held(sig(0, 2, 1, ttft=0.3, tpot=0.3, demand=0.5)).action == NONE


def test_sixteen_gpus_swinging_between_two_splits_try_the_one_between():
    """16 GPUs in simulation: the demand read 9P on 11P:5D and 11P on 9P:7D, and the planner
    swung between the two by 2 every 40 s, never trying the 10P:6D that served the phase. A
    batch back the other way within 3 cooldowns moves at most half as many."""
    config = PlannerConfig(ttft_s=TTFT_S, tpot_s=TPOT_S, sustain=1, cooldown_s=30)
    planner = Planner(config)
    out = planner.decide(sig(0, 11, 5, ttft=0.5, tpot=1.5, demand=8.5))
    assert (out.action, out.count) == (TO_DECODE, 2)
    planner.flip_done(5)
    back = planner.decide(sig(45, 9, 7, ttft=2.0, tpot=0.5, demand=10.5))
    assert (back.action, back.count) == (TO_PREFILL, 1)
    assert "1 after a batch of 2 the other way" in back.reason
    fresh = Planner(config).decide(sig(45, 9, 7, ttft=2.0, tpot=0.5, demand=10.5))
    assert (fresh.action, fresh.count) == (TO_PREFILL, 2)


def test_long_answers_on_one_prefill_two_decode_keep_both_decode_workers():
    """Live, TTFT at 1.1-1.9 x SLO in a phase of long answers on 1P:2D read as a need for 2P;
    the flip took TPOT from 1.0-1.3 x to 1.8-2.0 x SLO and the phase's attainment from 92% to
    53-81%. No decode worker goes when the decode pool left would be more pressed than prefill
    is now."""
    d = held(sig(0, 1, 2, ttft=1.5, tpot=1.0, demand=2.0))
    assert d.action == NONE
    assert "one decode worker fewer would be more pressed" in d.reason
    assert held(sig(0, 1, 2, ttft=2.5, tpot=1.0, demand=2.0)).action == TO_PREFILL
