"""The planner in a running router: PlannerLoop asks the policy (planner/policy.py) every
`interval_s` and carries out what it decides through the router's actuator.

The Router starts one when the deployment's YAML enables the planner (`planner:`; off by default,
the static split stays) and stops it first when it stops. The router side (a LiveDeployment,
router/planner_actuator.py) reads the live signals from what the router already has, with no
RPC, and acts on its workers: a flip goes through the same Flips an operator's `pdserve ctl flip`
uses, a local prefill change replaces the Legs' LocalPrefill bound. This loop owns the thread,
the decision counter pdserve:planner_decisions_total{action} and the log: every decision that
acts is logged at INFO with its reason (the others at DEBUG). A step never raises into the
thread: the planner must never take the router down.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from prometheus_client import Counter

from pdserve.planner.actuator import Actuator, carry_out
from pdserve.planner.policy import ACTIONS, NONE, Planner, PlannerConfig, Signals

log = logging.getLogger(__name__)


class LiveDeployment(Actuator, Protocol):
    def signals(self, window_s: float, interval_s: float) -> Signals:
        """The live signals now, over the last window_s (rates over at least interval_s)."""


class PlannerLoop:
    """`config`'s policy over `deployment` (the module docstring)."""

    def __init__(
        self, config: PlannerConfig, deployment: LiveDeployment, registry=None, model_name=""
    ):
        self.planner = Planner(config)
        self.config = config
        self.deployment = deployment
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-planner", daemon=True)
        self._decisions = Counter(
            "pdserve:planner_decisions",
            "The planner's decisions, by action (none included).",
            ["model_name", "action"],
            registry=registry,
        )
        for action in ACTIONS:
            self._decisions.labels(model_name, action)
        self._model = model_name
        self.last: tuple[Signals, object] | None = None  # the last (signals, decision)

    def start(self) -> PlannerLoop:
        self._thread.start()
        log.info("planner on: %s", self.config)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.step()
            except Exception:  # the planner must never take the router down
                log.exception("planner step failed")

    def signals(self) -> Signals:
        return self.deployment.signals(self.config.window_s, self.config.interval_s)

    def step(self) -> None:
        """One decision, carried out before it returns (a flip included)."""
        s = self.signals()
        d = self.planner.decide(s)
        self.last = (s, d)
        self._decisions.labels(self._model, d.action).inc()
        if d.action == NONE:
            log.debug("planner: nothing to do: %s", d.reason)
            return
        log.info("planner: %s: %s", d.action, d.reason)
        carry_out(self.planner, d, self.deployment)
