"""The planner's policy (planner/policy.py): when it flips, prefills locally or waits."""

from __future__ import annotations

import pytest

from helpers.planner import sig
from pdserve.planner.policy import (
    LOCAL_LESS,
    LOCAL_MORE,
    NONE,
    TO_DECODE,
    TO_PREFILL,
    Planner,
    PlannerConfig,
)
from pdserve.router.recent import prefill_speed

CONFIG = PlannerConfig(ttft_s=1.0, tpot_s=0.1, sustain=2, cooldown_s=30, max_flips_per_min=2)


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
    # pressed from 1 - margin / 2 = 0.9 x SLO on, with room under 1 - margin = 0.8 x SLO
    assert p.decide(sig(0, ttft=0.85, tpot=0.05)).action == NONE  # inside the margin
    assert p.decide(sig(1, ttft=1.5, tpot=0.085)).action == NONE  # TPOT has too little room
    for t in (2, 3):
        assert p.decide(sig(t, ttft=1.5, tpot=0.05)).action == TO_PREFILL
        p.flip_done(t)
    blocked = p.decide(sig(4, ttft=1.5, tpot=0.05))
    assert blocked.action == NONE and "2 flips in the last minute" in blocked.reason
    assert p.decide(sig(62.5, ttft=1.5, tpot=0.05)).action == TO_PREFILL


def test_no_worker_to_spare_means_local_prefill_and_tpot_pressure_takes_it_back():
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0))
    assert p.decide(sig(0, ttft=3.0, tpot=0.02, d=1)).action == LOCAL_MORE
    assert p.next_local_max(LOCAL_MORE, 0) == 64
    # TPOT pressed: a prefill worker to spare flips, and the flip ends local prefill too
    assert p.decide(sig(1, ttft=0.5, tpot=0.2, p=2, local=64)).action == TO_DECODE
    assert p.next_local_max(TO_DECODE, 64) == 0
    p.flip_done(1)
    # no prefill worker to spare: local prefill goes, all of it at once
    assert p.decide(sig(2, ttft=0.5, tpot=0.2, p=1, local=128)).action == LOCAL_LESS
    assert p.next_local_max(LOCAL_LESS, 128) == 0
    d = p.decide(sig(3, ttft=0.5, tpot=0.2, p=1, local=0))  # the last prefill worker
    assert d.action == NONE and "no prefill worker to spare" in d.reason


def test_local_prefill_grows_only_onto_an_idle_decode_pool_and_stops_when_tpot_has_no_room():
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0))
    # room is under 0.8 x SLO; local prefill grows only under half of that
    assert p.decide(sig(0, ttft=2.0, tpot=0.035, d=1, local=64)).action == LOCAL_MORE
    assert p.decide(sig(1, ttft=2.0, tpot=0.05, d=1, local=128)).action == NONE
    # TPOT past its room (0.85 x, not yet pressed): what runs locally stops
    d = p.decide(sig(2, ttft=2.0, tpot=0.085, d=1, local=128))
    assert d.action == LOCAL_LESS and "no room" in d.reason
    assert p.decide(sig(3, ttft=0.5, tpot=0.085, d=1, local=0)).action == NONE


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


def test_a_flip_batch_is_sized_by_the_prefill_demand():
    cfg = dict(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0, prefill_use=0.8)
    p = Planner(PlannerConfig(**cfg, max_flips_per_min=4))
    # 9000 prompt tokens/s arriving, 1000 queued over a 15 s window, 2000 tokens/s a worker at
    # 0.8 use: ceil(9066.7 / 1600) = 6 prefill workers; 2 serve, 5 decode: 4 flip (the bound)
    d = p.decide(sig(0, ttft=2.0, tpot=0.02, p=2, d=5, queued=1000, speed=2000.0, rate=9000.0))
    assert (d.action, d.count) == (TO_PREFILL, 4) and "demand needs 6P" in d.reason
    assert p.prefill_need(sig(0, p=2, d=5, queued=1000, speed=2000.0, rate=9000.0)) == 6
    p.flip_done(0)
    # the rate bound counts every flip of a batch
    assert "4 flips in the last minute" in p.decide(sig(1, ttft=0.5, tpot=0.2, p=6, d=1)).reason
    # never a pool's last worker: 3 decode workers give at most 2
    q = Planner(PlannerConfig(**cfg, max_flips_per_min=9))
    d = q.decide(sig(0, ttft=2.0, tpot=0.02, p=1, d=3, speed=1000.0, rate=9000.0))
    assert (d.action, d.count) == (TO_PREFILL, 2)
    # TPOT pressed with 6 prefill workers where the demand needs 2: 4 go to decode at once
    q.flip_done(0)
    d = q.decide(sig(1, ttft=0.1, tpot=0.2, p=6, d=2, speed=1000.0, rate=1200.0))
    assert (d.action, d.count) == (TO_DECODE, 4) and "demand needs 2P" in d.reason
    # unknown demand (no rate yet): one flip
    q.flip_done(1)
    assert q.decide(sig(2, ttft=0.1, tpot=0.2, p=6, d=2, speed=1000.0)).count == 1


def test_the_demand_estimate_holds_a_flip_that_would_starve_the_other_pool():
    cfg = dict(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0, max_flips_per_min=9)
    p = Planner(PlannerConfig(**cfg, prefill_use=0.8))
    # TPOT pressed, but the prefill demand needs all 3 prefill workers: no flip
    d = p.decide(sig(0, ttft=0.1, tpot=0.2, p=3, d=2, speed=1000.0, rate=2000.0))
    assert d.action == NONE and "the prefill demand needs 3P" in d.reason
    # ... and with local prefill on, that stops instead
    d = p.decide(sig(1, ttft=0.1, tpot=0.2, p=3, d=2, speed=1000.0, rate=2000.0, local=64))
    assert d.action == LOCAL_LESS
    # TTFT pressed while 3 prefill workers cover the demand (a backlog, or decode waits): none
    d = p.decide(sig(2, ttft=2.0, tpot=0.02, p=3, d=2, speed=1000.0, rate=1000.0))
    assert d.action == NONE and "3P cover the prefill demand" in d.reason


def test_a_long_wait_for_decode_kv_presses_the_decode_pool_not_the_prefill_pool():
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0))
    # TTFT is 5 x its SLO only because requests wait for decode KV (the longest for 2 s); the
    # prefill queue is empty: without the wait this would prefill locally, with it it flips
    quiet = dict(ttft=5.0, tpot=0.03, p=3, d=1, speed=1000.0)
    assert Planner(p.config).decide(sig(0, **quiet)).action == LOCAL_MORE
    d = p.decide(sig(0, wait=2.0, **quiet))
    assert d.action == TO_DECODE, d.reason
    assert p.pressures(sig(0, wait=2.0, **quiet))[0] == 0.0  # the prefill queue's share
    # a short wait (0.5 s of a 1 s SLO) is a full pool's normal turnover: nothing
    assert Planner(p.config).decide(sig(0, ttft=0.5, tpot=0.05, p=3, d=1, wait=0.5)).action == NONE


def test_the_streams_pace_now_presses_the_decode_pool_before_finished_requests_show_it():
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0))
    # finished requests' TPOT p90 still 0.05 s, but tokens now come 0.15 s apart
    assert p.pressures(sig(0, ttft=0.2, tpot=0.05, p=2, d=1, itl=0.15))[1] == pytest.approx(1.5)
    assert p.decide(sig(0, ttft=0.2, tpot=0.05, p=2, d=1, itl=0.15)).action == TO_DECODE
    # a calm pace never lowers what the finished requests say
    assert p.pressures(sig(1, ttft=0.2, tpot=0.2, p=2, d=1, itl=0.01))[1] == pytest.approx(2.0)


def test_both_sides_pressed_the_prefill_demand_decides_when_it_is_clear():
    """TTFT also holds the wait for a full decode pool, so a decode shortage presses both sides.
    Then the prefill demand (in workers' worth at prefill_use 0.95) decides, only when clear
    (the workers left cover it with the margin to spare, or it passes the pool by the margin)
    and only toward the more pressed side."""
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0))
    both = dict(ttft=1.5, tpot=0.2, p=2, d=2, speed=1000.0)
    assert "no clear prefill demand" in p.decide(sig(0, **both)).reason  # no estimate
    assert p.decide(sig(1, **both, rate=1400.0)).action == NONE  # 1.47 workers' worth: unclear
    d = p.decide(sig(2, **both, rate=500.0))  # 0.53: one worker covers it
    assert d.action == TO_DECODE and "prefill needs 1P" in d.reason
    p.flip_done(2)
    # 2.42: more than 2 by the margin, but TPOT (2 x) is the more pressed: no flip to prefill
    assert p.decide(sig(3, **both, rate=2300.0)).action == NONE
    # TTFT the more pressed (2.5 x), but 1 decode worker left would carry 4 x: no flip either
    d = p.decide(sig(3, **dict(both, ttft=2.5), rate=2300.0))
    assert d.action == NONE and "one decode worker fewer would be more pressed" in d.reason
    # of 4 decode workers, the 3 left would carry 2.67 x, under TTFT's 3 x: one goes
    d = p.decide(sig(3, **dict(both, ttft=3.0, d=4), rate=2300.0))
    assert d.action == TO_PREFILL and d.count == 1
    p.flip_done(3)
    # unclear, with local prefill on: it stops, as TPOT is over its SLO
    assert p.decide(sig(4, **both, rate=1400.0, local=128)).action == LOCAL_LESS


def test_prefill_speed_is_a_workers_tokens_over_the_time_it_computed():
    s = 1_000_000_000  # ns
    # ten 100-token prompts batched into one 1-s step: the worker computes 1000 tokens/s, though
    # each prompt alone saw 100
    batch = [("p0", 5 * s, 6 * s, 100)] * 10
    assert prefill_speed(batch) == pytest.approx(1000.0)
    # overlapping and separate spans on one worker: busy 2.5 s (5-6.5 and 6-7 merged, 9-9.5 apart)
    spans = [
        ("p0", 5 * s, int(6.5 * s), 600),
        ("p0", 6 * s, 7 * s, 400),
        ("p0", 9 * s, int(9.5 * s), 500),
    ]
    assert prefill_speed(spans) == pytest.approx(1500 / 2.5)
    # two workers computing at once count apart: each 1000 tokens in 1 s
    both = [("p0", 5 * s, 6 * s, 1000), ("p1", 5 * s, 6 * s, 1000)]
    assert prefill_speed(both) == pytest.approx(1000.0)
    assert prefill_speed([]) == 0.0


def test_a_spare_prefill_worker_goes_to_decode_before_tpot_is_pressed():
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0))
    # TTFT 0.3 x, TPOT 0.6 x (past half its 0.8 room), demand 500 / (1000 x 0.95) = 0.53
    # workers: the one prefill worker left covers it at 0.8 of its capacity
    spare = dict(ttft=0.3, tpot=0.06, p=2, d=1, speed=1000.0, rate=500.0)
    d = p.decide(sig(0, **spare))
    assert (d.action, d.count) == (TO_DECODE, 1) and "to spare" in d.reason
    p.flip_done(0)
    # one worker at a time, even with more to spare
    d = Planner(p.config).decide(sig(0, **dict(spare, p=4)))
    assert (d.action, d.count) == (TO_DECODE, 1)
    for other in (
        dict(spare, rate=900.0),  # 0.95 workers' worth: none to spare with the margin
        dict(spare, ttft=0.5),  # TTFT past half its room
        dict(spare, tpot=0.03),  # TPOT under half its room
        dict(spare, p=1),  # the last prefill worker
        dict(spare, rate=0.0),  # no demand estimate
    ):
        assert Planner(p.config).decide(sig(0, **other)).action == NONE, other


def test_a_batch_back_the_other_way_soon_after_moves_half_as_many():
    # 14P:2D, the demand reads 9P: 5 go to decode; on 9P:7D it reads 13P (a queue built while
    # the flip drained): back by 2, not 4, then by 1, so the splits between are tried
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=30, prefill_use=1))
    d = p.decide(sig(0, ttft=0.1, tpot=0.2, p=14, d=2, speed=1000.0, rate=9000.0))
    assert (d.action, d.count) == (TO_DECODE, 5)
    p.flip_done(5)
    d = p.decide(sig(40, ttft=3.0, tpot=0.05, p=9, d=7, speed=1000.0, rate=13000.0))
    assert (d.action, d.count) == (TO_PREFILL, 2) and "after a batch of 5" in d.reason
    p.flip_done(45)
    d = p.decide(sig(80, ttft=0.1, tpot=0.2, p=11, d=5, speed=1000.0, rate=9000.0))
    assert (d.action, d.count) == (TO_DECODE, 1) and "after a batch of 2" in d.reason
    p.flip_done(85)
    # the same way again is not held back, and neither is a reversal long after the last batch
    d = p.decide(sig(120, ttft=0.1, tpot=0.2, p=10, d=6, speed=1000.0, rate=7000.0))
    assert (d.action, d.count) == (TO_DECODE, 3)
    p.flip_done(125)
    d = p.decide(sig(300, ttft=3.0, tpot=0.05, p=7, d=9, speed=1000.0, rate=11000.0))
    assert (d.action, d.count) == (TO_PREFILL, 4)


def test_no_decode_worker_goes_to_prefill_when_the_decode_pool_left_would_be_more_pressed():
    """TPOT pressure scales by the decode workers left (the same streams on fewer workers); a
    flip toward prefill must leave that under the TTFT pressure it relieves."""
    p = Planner(PlannerConfig(ttft_s=1, tpot_s=0.1, sustain=1, cooldown_s=0, max_flips_per_min=9))
    # live, long answers on 1P:2D: TTFT 1.13 x, TPOT 1.01 x, the demand reading 2P
    d = p.decide(sig(0, ttft=1.13, tpot=0.101, p=1, d=2, speed=1000.0, rate=1500.0))
    assert d.action == NONE and "one decode worker fewer would be more pressed" in d.reason
    # TTFT pressed while TPOT has room (0.7 x), but 1 decode worker would carry 1.4 x
    d = p.decide(sig(1, ttft=1.0, tpot=0.07, p=1, d=2))
    assert d.action == NONE and "one decode worker fewer would be more pressed" in d.reason
    assert p.decide(sig(2, ttft=1.5, tpot=0.07, p=1, d=2)).action == TO_PREFILL  # 1.4 < 1.5
    p.flip_done(2)
    # a batch stops where the decode workers left would pass TTFT's pressure: the demand asks
    # for 6P on 1P:5D (4 could go), but 1 or 2 left would carry 3.5 x or 1.75 x, over 1.5 x
    d = p.decide(sig(3, ttft=1.5, tpot=0.07, p=1, d=5, speed=1000.0, rate=5500.0))
    assert (d.action, d.count) == (TO_PREFILL, 2), d.reason
