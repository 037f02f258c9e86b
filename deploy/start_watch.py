"""Starting the worker actors while `pdserve up` shows each worker's start as it happens.

`start_and_watch` calls start() on every replica it is given at once, those of every pool, with
the router's address for them to join: they load their models concurrently (each worker has cores
of its own where the machine has enough: launcher.core_plan, so one pool after another would only
lengthen the start). Until each has returned it polls every starting actor's `stages` (a
WorkerActor answers it on another thread while start() runs: deploy/workers.py) and logs the new
lines, one per stage, prefixed with the worker's id: the compiled kernels' build, the weights, the
precision probe, the KV capacity and the warm-up (worker_common/start_stages.py). A replica whose
start returned gets its address, serving_since and `info` (WorkerActor.info(): the row of
deploy/start_table.py) set; a start that fails, or a replica that has not started within the
deadline, raises DeployError naming its pool and replica, after the stages that did come are
logged. Holds no state between calls.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from pdserve.deploy.prechecks import DeployError
from pdserve.deploy.supervisor import Replica, ray_error_reason

log = logging.getLogger("pdserve.deploy.launcher")
POLL_S = 0.5  # how often the stages of a starting worker are asked for
INFO_TIMEOUT_S = 30.0


class StageFeed:
    """One starting actor's stage lines, asked for one call at a time (never more than one in
    flight), logged as they come."""

    def __init__(self, replica: Replica):
        self.replica = replica
        self.seen = 0
        self.ref = None

    def poll(self) -> None:
        """Logs what the last call brought, if it is back, and asks again; never waits."""
        if self.ref is not None:
            if not ray.wait([self.ref], timeout=0)[0]:
                return
            self._log(self.ref, 0)
        self.ref = self.replica.actor.stages.remote(self.seen)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Logs every line the actor has, waiting up to `timeout_s` (best effort: a dead actor
        has nothing more to say)."""
        if self.ref is not None:
            self._log(self.ref, timeout_s)
        self._log(self.replica.actor.stages.remote(self.seen), timeout_s)

    def _log(self, ref, timeout_s: float) -> None:
        self.ref = None
        try:
            stages = ray.get(ref, timeout=timeout_s)
        except (GetTimeoutError, RayActorError, RayTaskError):
            return
        for t, name, text in stages:
            log.info("%s: %6.1fs %s: %s", self.replica.name, t, name, text)
        self.seen += len(stages)


def start_and_watch(replicas: list[Replica], registry_address: str, start_timeout_s: float) -> None:
    """Starts `replicas` (actors created), each to join the router at `registry_address`, and
    returns once all serve; see the module docstring."""
    refs = {}
    for r in replicas:
        refs[r.actor.start.remote(registry_address)] = r
        r.asked_to_start = True
    feeds = {r.name: StageFeed(r) for r in replicas}
    deadline = time.monotonic() + start_timeout_s
    while refs:
        for r in refs.values():
            feeds[r.name].poll()
        left = deadline - time.monotonic()
        if left <= 0:
            r = next(iter(refs.values()))
            feeds[r.name].drain(1.0)
            raise DeployError(
                f"pools.{r.key}: replica {r.index} did not start within {start_timeout_s:.0f}s"
            )
        done, _ = ray.wait(list(refs), num_returns=1, timeout=min(POLL_S, left))
        for ref in done:
            r = refs.pop(ref)
            feeds[r.name].drain()
            try:
                r.address, mode = ray.get(ref)
            except (RayTaskError, RayActorError) as e:
                raise DeployError(
                    f"pools.{r.key}: replica {r.index} failed to start: {ray_error_reason(e)}"
                ) from None
            r.serving_since = time.monotonic()
            r.info = _info(r)
            log.info("%s serving on %s; %s", r.name, r.address, mode)


def _info(r: Replica) -> dict:
    """r's WorkerActor.info(), or what the driver knows when it cannot be read."""
    try:
        return ray.get(r.actor.info.remote(), timeout=INFO_TIMEOUT_S)
    except (GetTimeoutError, RayActorError, RayTaskError) as e:
        log.warning("%s: no start details (%s)", r.name, ray_error_reason(e))
        return {"worker_id": r.name, "role": r.role}
