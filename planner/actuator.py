"""The one small interface through which a planner loop changes a deployment, and the function
that carries a decision out through it.

An Actuator is what the policy's decisions act on: it knows the local prefill bound in force,
sets a new one, and moves workers from one pool to the other. The running router implements it
over its live workers (router/planner_actuator.py); the simulator implements it over simulated
ones (tuning/sim_planner.py). `carry_out` is the only code that turns a Decision into calls on
an Actuator, so the live loop (planner/live.py) and the simulated one (planner/simulated.py)
act alike. A flip batch may end at once (the live router drains and switches before it returns)
or later (the simulator plays the drain as events): either way the actuator calls `done(now)`
once the batch is over, which ends the policy's flip and starts its cooldown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdserve.planner.policy import DECODE, PREFILL, TO_DECODE, TO_PREFILL, Decision, Planner


class Actuator(Protocol):
    @property
    def local_max(self) -> int:
        """The local prefill bound in force (prompt tokens; 0: never local)."""

    def set_local_max(self, bound: int) -> None:
        """Replace the local prefill bound."""

    def flip(self, source: str, count: int, done: Callable[[float], None]) -> None:
        """Move `count` workers of pool `source` ("prefill" or "decode") to the other pool, one
        after another, each drained first; call `done(now)` when the batch is over (or given
        up), from within this call or later."""


def carry_out(planner: Planner, decision: Decision, actuator: Actuator) -> bool:
    """Act on `decision`: the local prefill bound first (a flip to decode also stops local
    prefill), then the flips it asks for. True when a flip batch began."""
    bound = planner.next_local_max(decision.action, actuator.local_max)
    if bound != actuator.local_max:
        actuator.set_local_max(bound)
    if decision.action not in (TO_PREFILL, TO_DECODE):
        return False
    source = DECODE if decision.action == TO_PREFILL else PREFILL
    actuator.flip(source, decision.count, planner.flip_done)
    return True
