"""The planner's policy (router/planner.py): when it flips, prefills locally or waits."""

from __future__ import annotations

import pytest

from pdserve.router.planner import (
    LOCAL_LESS,
    LOCAL_MORE,
    NONE,
    TO_DECODE,
    TO_PREFILL,
    Planner,
    PlannerConfig,
    Signals,
)

CONFIG = PlannerConfig(ttft_s=1.0, tpot_s=0.1, sustain=2, cooldown_s=30, max_flips_per_min=2)


def sig(now, ttft=None, tpot=None, p=1, d=2, kv=0.2, local=0, queued=0, speed=0.0):
    return Signals(now, p, d, ttft, tpot, queued, speed, kv, local)


def actions(planner, signals):
    return [planner.decide(s).action for s in signals]


def test_a_pressed_side_must_hold_for_sustain_decisions_then_flips_once():
    p = Planner(CONFIG)
    assert actions(p, [sig(0, ttft=2.0, tpot=0.05), sig(5, ttft=2.0, tpot=0.05)]) == [
        NONE,
        TO_PREFILL,
    ]
    # under way: nothing more until flip_done; then the cooldown
    assert actions(p, [sig(10, ttft=2.0, tpot=0.05)] * 3) == [NONE] * 3
    p.flip_done(12)
    assert p.decide(sig(20, ttft=2.0, tpot=0.05)).reason.endswith("1P:2D)")
    assert "cooldown" in p.decide(sig(25, ttft=2.0, tpot=0.05)).reason
    assert p.decide(sig(45, ttft=2.0, tpot=0.05)).action == TO_PREFILL


def test_hysteresis_and_the_flip_rate_bound():
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0, max_flips_per_min=2))
    assert p.decide(sig(0, ttft=1.1, tpot=0.05)).action == NONE  # inside the margin
    assert p.decide(sig(1, ttft=1.5, tpot=0.085)).action == NONE  # TPOT has too little room
    for t in (2, 3):
        assert p.decide(sig(t, ttft=1.5, tpot=0.05)).action == TO_PREFILL
        p.flip_done(t)
    blocked = p.decide(sig(4, ttft=1.5, tpot=0.05))
    assert blocked.action == NONE and "2 flips in the last minute" in blocked.reason
    assert p.decide(sig(62.5, ttft=1.5, tpot=0.05)).action == TO_PREFILL


def test_no_worker_to_spare_means_local_prefill_and_tpot_pressure_takes_it_back_first():
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0))
    assert p.decide(sig(0, ttft=3.0, tpot=0.02, d=1)).action == LOCAL_MORE
    assert p.next_local_max(LOCAL_MORE, 0) == 64
    assert p.decide(sig(1, ttft=0.5, tpot=0.2, p=2, local=64)).action == LOCAL_LESS
    assert p.next_local_max(LOCAL_LESS, 64) == 0
    assert p.decide(sig(2, ttft=0.5, tpot=0.2, p=2, local=0)).action == TO_DECODE
    assert p.decide(sig(3, ttft=0.5, tpot=0.2, p=1, local=0)).action == NONE  # last prefill


def test_kv_use_counts_as_tpot_pressure_and_queued_tokens_as_ttft_before_any_sample():
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0))
    assert p.decide(sig(0, ttft=0.3, tpot=0.05, p=2, kv=0.99)).action == NONE  # TPOT has room
    assert p.decide(sig(0, ttft=0.3, tpot=0.09, p=2, kv=0.99)).action == TO_DECODE
    p.flip_done(0)
    # no TTFT sample yet: 3000 queued tokens at 1000 tokens/s on one worker is 3 x the SLO
    assert p.decide(sig(1, queued=3000, speed=1000.0, tpot=0.01)).action == TO_PREFILL


def test_bad_config():
    with pytest.raises(ValueError, match="ttft_s"):
        PlannerConfig(ttft_s=0, tpot_s=0.1)
    with pytest.raises(ValueError, match="margin"):
        PlannerConfig(ttft_s=1, tpot_s=0.1, margin=1.5)
