"""The one way a planner decision acts (planner/actuator.py carry_out), and the live loop
(planner/live.py) driving it over a stand-in deployment: the bound first, then the flips, and a
flip batch ends the policy's flip when the actuator says it is over."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry

from pdserve.planner.actuator import carry_out
from pdserve.planner.live import PlannerLoop
from pdserve.planner.policy import (
    LOCAL_LESS,
    LOCAL_MORE,
    NONE,
    TO_DECODE,
    TO_PREFILL,
    Decision,
    Planner,
    PlannerConfig,
    Signals,
)

CONFIG = PlannerConfig(ttft_s=1.0, tpot_s=0.1, sustain=1, cooldown_s=0, local_step=64)


class Recorder:
    """An actuator that records what it is asked, and ends a flip batch at once."""

    def __init__(self, local_max=0, now=7.0):
        self.local_max, self.now, self.calls = local_max, now, []

    def set_local_max(self, bound):
        self.calls.append(("bound", bound))
        self.local_max = bound

    def flip(self, source, count, done):
        self.calls.append(("flip", source, count))
        done(self.now)


def test_carry_out_sets_the_bound_before_flipping_and_flips_from_the_pool_given_up():
    planner = Planner(CONFIG)
    planner.flipping = True
    act = Recorder(local_max=128)
    assert carry_out(planner, Decision(TO_DECODE, "", 2), act)
    assert act.calls == [("bound", 0), ("flip", "prefill", 2)]
    assert not planner.flipping and planner._last_flip == 7.0  # done(now) ended the flip

    act = Recorder(local_max=128)
    assert carry_out(Planner(CONFIG), Decision(TO_PREFILL, "", 1), act)
    assert act.calls == [("flip", "decode", 1)]  # toward prefill, the bound stays


def test_carry_out_moves_only_the_bound_for_local_actions_and_nothing_for_none():
    for action, before, calls in [
        (LOCAL_MORE, 0, [("bound", 64)]),
        (LOCAL_LESS, 128, [("bound", 0)]),
        (LOCAL_LESS, 0, []),
        (NONE, 128, []),
    ]:
        act = Recorder(local_max=before)
        assert not carry_out(Planner(CONFIG), Decision(action, ""), act)
        assert act.calls == calls, action


class Deployment(Recorder):
    """A live deployment stand-in: fixed signals, TTFT pressed while TPOT has room."""

    def signals(self, window_s, interval_s):
        return Signals(self.now, 1, 3, 2.0, 0.02, 0, 0.0, 0.2, self.local_max)


def test_the_live_loop_counts_every_decision_and_acts_through_its_deployment():
    registry = CollectorRegistry()
    deployment = Deployment()
    loop = PlannerLoop(dataclasses.replace(CONFIG, sustain=2), deployment, registry, "m")
    loop.step()
    assert deployment.calls == [] and loop.last[1].action == NONE  # 1 of 2 in a row
    loop.step()
    assert deployment.calls == [("flip", "decode", 1)]
    assert loop.last[1].action == TO_PREFILL and not loop.planner.flipping

    def count(action):
        labels = {"model_name": "m", "action": action}
        return registry.get_sample_value("pdserve:planner_decisions_total", labels)

    assert (count(NONE), count(TO_PREFILL), count(TO_DECODE)) == (1.0, 1.0, 0.0)
