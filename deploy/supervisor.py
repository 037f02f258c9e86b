"""Self-healing: the Supervisor thread notices a worker replica whose actor died and relaunches it
in the same placement group with the same worker_id, so it registers with the router again. Deaths
soon after a start back off, and a replica that keeps dying that way is given up on
(RestartPolicy), one log line each."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup

log = logging.getLogger("pdserve.deploy.launcher")


def role_of(key: str) -> str:
    """The worker kind a pool runs: colocated workers are decode workers that also prefill."""
    return "prefill" if key == "prefill" else "decode"


def ray_error_reason(e: BaseException) -> str:
    """The original exception's type and message inside a Ray error, without Ray's traceback."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        if isinstance(e, RayTaskError) and not isinstance(cause, RayError):
            return f"{type(cause).__name__}: {cause}"
        return ray_error_reason(cause)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


@dataclass
class Replica:
    key: str  # its pool under `pools`: prefill, decode or colocated
    index: int
    pg: PlacementGroup
    actor: object = None
    address: str | None = None
    spawn: Callable[[], object] | None = field(default=None, repr=False)  # a new actor in pg
    info: dict | None = field(default=None, repr=False)  # WorkerActor.info() of its first start
    # its actor was asked to start (stop() then has a worker to stop; before, only imports ran)
    asked_to_start: bool = False
    # the Supervisor's bookkeeping
    start_ref: object = field(default=None, repr=False)
    ping_ref: object = field(default=None, repr=False)
    serving_since: float | None = None
    quick_deaths: int = 0
    retry_at: float = 0.0
    given_up: bool = False

    @property
    def role(self) -> str:
        return role_of(self.key)

    @property
    def name(self) -> str:
        return f"{self.key}-{self.index}"


@dataclass(frozen=True)
class RestartPolicy:
    """How dead workers are replaced. A death before a replica served `stable_s` seconds (or
    before it started serving) is quick: the n-th quick death in a row waits backoff_s x 2^(n-1),
    at most max_backoff_s, before the relaunch, and the max_quick_deaths-th gives the replica up
    (a crash loop: a broken node, a model that no longer fits). Other deaths wait backoff_s."""

    poll_s: float = 1.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0
    max_quick_deaths: int = 3


class Supervisor:
    """A thread that notices dead replicas and relaunches them. It never blocks on an actor: a
    starting or busy actor's ping simply stays pending (busy is not dead)."""

    def __init__(self, replicas: list[Replica], policy: RestartPolicy, registry_address: str):
        self.replicas = replicas
        self.policy = policy
        self.registry_address = registry_address  # the router a relaunched worker joins
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pdserve-supervisor")

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self.policy.poll_s):
            try:
                for r in self.replicas:
                    if not self._stop.is_set():
                        self.check(r)
                failing = False
            except Exception:  # e.g. Ray itself went away; said once, tried again next poll
                if not failing:
                    log.exception(
                        "checking the workers failed; retrying every %.0fs", self.policy.poll_s
                    )
                failing = True

    def check(self, r: Replica) -> None:
        if r.given_up:
            return
        if r.actor is None:
            if time.monotonic() >= r.retry_at:
                try:  # same placement group, worker config, worker_id and actor name
                    r.actor = r.spawn()
                except ValueError as e:  # the dead actor's name is freed a moment after it died
                    if "already taken" not in str(e):
                        raise
                    r.retry_at = time.monotonic() + self.policy.poll_s
                    return
                r.start_ref = r.actor.start.remote(self.registry_address)
                r.asked_to_start = True
            return
        ref = r.start_ref if r.start_ref is not None else r.ping_ref
        if ref is None:
            r.ping_ref = r.actor.ping.remote()
            return
        if not ray.wait([ref], timeout=0)[0]:
            return
        starting, r.start_ref, r.ping_ref = r.start_ref is not None, None, None
        try:
            result = ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            self._died(r, ray_error_reason(e), starting)
            return
        if starting:
            (r.address, mode), r.serving_since = result, time.monotonic()
            log.warning("worker %s replaced: serving on %s; %s", r.name, r.address, mode)

    def _died(self, r: Replica, reason: str, starting: bool) -> None:
        p = self.policy
        quick = (
            starting or r.serving_since is None or time.monotonic() - r.serving_since < p.stable_s
        )
        r.quick_deaths = r.quick_deaths + 1 if quick else 0
        try:
            ray.kill(r.actor)  # a start that raised leaves a live actor holding the bundle
        except Exception:  # already gone
            pass
        r.actor, r.address, r.serving_since = None, None, None
        what = "failed to start" if starting else "died"
        if r.quick_deaths >= p.max_quick_deaths:
            r.given_up = True
            log.error(
                "worker %s %s (%s); giving up on it: %d deaths in a row within %.0fs of "
                "starting. The rest of the deployment keeps serving; fix the cause and "
                "restart pdserve up to bring it back",
                r.name,
                what,
                reason,
                r.quick_deaths,
                p.stable_s,
            )
            return
        delay = min(p.backoff_s * 2 ** max(r.quick_deaths - 1, 0), p.max_backoff_s)
        r.retry_at = time.monotonic() + delay
        log.error("worker %s %s (%s); replacing it in %.0fs", r.name, what, reason, delay)
