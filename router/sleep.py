"""Sleep mode across the cluster: every worker's engine gives its memory back while a
reinforcement-learning trainer shares the machines between rollouts, and takes it again, as
vLLM's sleep mode does for one engine (the HTTP front's /sleep, /wake_up and /is_sleeping:
router/openai/sleep.py). A trainer does sleep(level=2), trains, wake_up(["weights"]), updates the
weights (router/weights.py: an engine takes an update while asleep), then wake_up(["kv_cache"]).

    level 0   scheduling pauses: requests are taken and held, nothing is freed
    level 1   the KV cache is dropped and the weights are offloaded to host memory
    level 2   the KV cache and the weights are dropped (loaded again when they wake)

A sleep holds every new request at the router (router/pause.py `hold`: held, never refused, and
a client's /resume cannot open the gate while the cluster sleeps), lets the running requests end
(mode "abort") or finish ("wait"), and once none runs, for levels 1-2, tells every live worker of
both pools Sleep (worker_common/sleep.py) at once. A sleep is all or nothing: if one worker
refuses, the others are put back as they were, and the cluster stays as it was (were one of them
not put back, the cluster sleeps, held, until a /wake_up wakes every worker). A wake tells
every live worker WakeUp with the tags named ("scheduling", level 0's, is the router's own); a
worker that fails leaves its tags asleep in the cluster's state, and once no tag sleeps the hold
ends. A second sleep at a deeper level (1 -> 2) goes deeper; at the same or a shallower one it
answers the state. One sleep or wake at a time. A worker that joins, or comes back from a
restart, while the whole cluster sleeps at level 1 or 2 is put to sleep at that level from its
reports, as router/weights.py catches a worker up (router/catch_up.py): it would otherwise hold
the memory the sleep gave back (not in a partly woken state, whose mix no single Sleep gives).
Off unless the deployment sets `router.sleep_mode`. One RouterSleep per router; `sleep` and `wake_up` block their caller (the
HTTP front runs them on a thread); the state reads are thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import grpc

from pdserve.protos.limits import SLEEP_TAGS, SLEEP_TIMEOUT_S
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.catch_up import CatchUps

log = logging.getLogger(__name__)

LEVELS = (0, 1, 2)
SCHEDULING = "scheduling"  # level 0's tag: the router's hold, which no worker sees
TAGS = (*SLEEP_TAGS, SCHEDULING)  # "weights", "kv_cache", "scheduling"
MAX_TAGS = 8  # names in one wake_up (each is one of TAGS; repeats are taken once)
_CALL_TIMEOUT_S = SLEEP_TIMEOUT_S + 30  # a worker's own bound, and its answer's way back


class SleepError(Exception):
    """`status`: the HTTP status (400 a field, 404 off, 409 a state, 503 no worker or a worker's
    failure, 504 requests still ran, 500 the workers were left apart); `param`: the field."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RouterSleep:
    def __init__(self, pool, pause, enabled: bool = False):
        """pool: the router's WorkerPool; pause: its RouterPause, whose hold keeps the requests
        back while the cluster sleeps."""
        self.pool, self.pause, self.enabled = pool, pause, enabled
        self._lock = threading.Lock()  # the state below
        self._busy = threading.Lock()  # one sleep or wake at a time
        self.level = 0  # the level the cluster sleeps at (0 also when awake: see is_sleeping)
        self._asleep: set[str] = set()  # of TAGS
        self._catch_ups = CatchUps("router-sleep-catch-up")
        self.catch_ups = 0  # workers put to sleep from their reports
        if enabled and hasattr(pool, "on_report"):
            pool.on_report(self.on_report)

    # ---- checks ---------------------------------------------------------------------------------
    def check_enabled(self) -> None:
        if not self.enabled:
            raise SleepError(404, "sleep mode is off here: the deployment needs router.sleep_mode")

    @staticmethod
    def check_level(raw: object) -> int:
        """The level from a query value ("1"), or a 400 naming `level`."""
        try:
            level = int(str(raw))
        except ValueError:
            level = -1
        if level not in LEVELS:
            raise SleepError(400, f"level must be 0, 1 or 2; got {str(raw)[:40]!r}", "level")
        return level

    @staticmethod
    def check_tags(tags: list[str] | None) -> list[str] | None:
        """The tags to wake (None: every one), or a 400 naming `tags`."""
        if not tags:
            return None
        if len(tags) > MAX_TAGS:
            raise SleepError(400, f"at most {MAX_TAGS} tags; got {len(tags)}", "tags")
        for tag in tags:
            if tag not in TAGS:
                raise SleepError(400, f"tag {tag[:40]!r} is not one of {', '.join(TAGS)}", "tags")
        return [t for t in TAGS if t in tags]

    # ---- the state ------------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(t for t in TAGS if t in self._asleep)

    def _set(self, level: int, asleep: set[str]) -> None:
        with self._lock:
            self.level = level if asleep else 0
            self._asleep = set(asleep)

    @contextlib.contextmanager
    def _operation(self):
        if not self._busy.acquire(blocking=False):
            raise SleepError(409, "another sleep or wake is under way; retry when it ends")
        try:
            yield
        finally:
            self._busy.release()

    # ---- sleep ----------------------------------------------------------------------------------
    def sleep(self, level: int, mode: str, drain: Callable[[], bool]) -> int:
        """The cluster sleeps at `level` (the module's docstring): returns the level it sleeps at
        now. `drain()` blocks until no admitted request runs, False past its bound (then 504 and
        nothing changed). Raises SleepError."""
        self.check_enabled()
        with self._operation():
            before, asleep = self.level, set(self.asleep_tags)
            if asleep and level <= before:
                return before  # as deep already: vLLM's engine does nothing either
            if asleep and asleep != _tags_of(before):
                raise SleepError(
                    409,
                    f"the cluster is partly awake ({', '.join(sorted(set(TAGS) - asleep))} "
                    "woken): wake it up fully before a deeper sleep",
                )
            took = not asleep  # the hold this sleep takes (a deeper one has it already)
            if took:
                self.pause.hold(mode)
            try:
                if not drain():
                    raise SleepError(
                        504,
                        f"{self.pause.running()} request(s) still ran; nothing changed "
                        "(mode=abort ends them)",
                    )
                if level >= 1:
                    self._sleep_workers(level, before)
            except SleepError as e:
                if e.status == 500:  # workers asleep that could not be woken: the cluster
                    self._set(level, set(_tags_of(level)))  # sleeps, held, until /wake_up
                elif took:
                    self.pause.release()
                raise
            except BaseException:
                if took:
                    self.pause.release()
                raise
            self._set(level, set(_tags_of(level)))
            log.info("the cluster sleeps at level %d", level)
            return level

    def _sleep_workers(self, level: int, before: int) -> None:
        """Sleep on every live worker at once; if one fails, those that slept go back to the
        level they were at (`before`) and SleepError says why."""
        workers = live_workers(self.pool)
        if not workers:
            raise SleepError(503, "no live worker to put to sleep")
        _, failed = call_all(workers, "Sleep", worker_pb2.SleepRequest(level=level))
        if not failed:
            return
        slept = [w for w in workers if id(w) not in {id(f) for f, _ in failed}]
        stuck = [w for w in slept if not self._restore(w, before)]
        worker, error = failed[0]
        why = f"worker {self.pool.name(worker)}: {error.code().name}: {error.details()}"
        log.warning("sleep at level %d failed: %s", level, why)
        if stuck:
            names = ", ".join(self.pool.name(w) for w in stuck)
            raise SleepError(
                500,
                f"{why}; the workers that slept could not be put back ({names}): POST /wake_up "
                "wakes every worker",
            )
        raise SleepError(http_status(error), f"{why}; every worker is as it was before")

    def _restore(self, worker, before: int) -> bool:
        """A worker that slept at the new level goes back to `before` (0: awake): whether it
        did."""
        try:
            worker.stub.WakeUp(worker_pb2.WakeUpRequest(), timeout=_CALL_TIMEOUT_S)
            if before >= 1:
                worker.stub.Sleep(worker_pb2.SleepRequest(level=before), timeout=_CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning(
                "worker %s could not be put back: %s %s",
                self.pool.name(worker),
                e.code().name,
                e.details(),
            )
            return False
        return True

    # ---- a worker that joins while the cluster sleeps ---------------------------------------------
    def _catch_up_level(self) -> int:
        """The level a worker reporting now should sleep at: 0 unless the whole cluster sleeps
        at level 1 or 2 (every tag asleep)."""
        with self._lock:
            return self.level if self.level >= 1 and self._asleep == set(TAGS) else 0

    def on_report(self, worker, stats) -> None:
        """A WorkerPool report listener (returns at once): starts a catch-up thread for a worker
        awake, or asleep at a shallower level, while the cluster sleeps."""
        level = self._catch_up_level()
        if level and stats.sleep_level < level and not self._busy.locked():
            self._catch_ups.start(worker, self._catch_up)

    def _catch_up(self, worker) -> None:
        with self._busy:  # after a sleep or wake under way: the state it leaves is what counts
            level = self._catch_up_level()
            if not level or not self.pool.is_member(worker):
                return
            try:
                worker.stub.Sleep(worker_pb2.SleepRequest(level=level), timeout=_CALL_TIMEOUT_S)
            except grpc.RpcError as e:
                self._catch_ups.failed(worker)
                log.warning(
                    "sleep catch-up of worker %s failed: %s %s",
                    self.pool.name(worker),
                    e.code().name,
                    e.details(),
                )
                return
        self._catch_ups.succeeded(worker)
        self.catch_ups += 1
        log.info(
            "worker %s joined a sleeping cluster: asleep at level %d", self.pool.name(worker), level
        )

    # ---- wake -----------------------------------------------------------------------------------
    def wake_up(self, tags: list[str] | None) -> bool:
        """Wakes `tags` (None: every one) on every live worker; returns whether the cluster is
        fully awake (then the requests held run). Raises SleepError naming a worker that failed;
        its tags stay asleep in the state."""
        self.check_enabled()
        with self._operation():
            asleep = set(self.asleep_tags)
            if not asleep:
                return True
            woken = asleep if tags is None else asleep & set(tags)
            engine_tags = [t for t in SLEEP_TAGS if t in woken]
            if engine_tags:
                workers = live_workers(self.pool)
                if not workers:
                    raise SleepError(503, "no live worker to wake up")
                _, failed = call_all(workers, "WakeUp", worker_pb2.WakeUpRequest(tags=engine_tags))
                if failed:
                    worker, error = failed[0]
                    why = f"worker {self.pool.name(worker)}: {error.code().name}: {error.details()}"
                    log.warning("wake up of %s failed: %s", ", ".join(engine_tags), why)
                    raise SleepError(
                        http_status(error), f"{why}; {', '.join(engine_tags)} still asleep"
                    )
            left = asleep - set(engine_tags)
            if not left & set(SLEEP_TAGS):
                left = set()  # scheduling wakes with the last of the memory (vLLM's rule)
            self._set(self.level, left)
            if not left:
                self.pause.release()
                log.info("the cluster is awake")
            return not left


def _tags_of(level: int) -> set[str]:
    """What sleeps at `level`."""
    return {SCHEDULING} if level == 0 else set(TAGS)


def call_all(workers, method: str, request, timeout: float = _CALL_TIMEOUT_S) -> tuple[list, list]:
    """`method` on every worker at once: ([(worker, reply)] of those that answered,
    [(worker, grpc.RpcError)] of those that failed); router/cache_reset.py's too."""
    pending = [(w, getattr(w.stub, method).future(request, timeout=timeout)) for w in workers]
    answered, failed = [], []
    for worker, future in pending:
        try:
            answered.append((worker, future.result()))
        except grpc.RpcError as e:
            failed.append((worker, e))
    return answered, failed


def http_status(error) -> int:
    """The HTTP status of a worker's failure."""
    code = error.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return 409
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return 400
    return 503


def live_workers(pool) -> list:
    """Every member but the dead ones."""
    return [w for w in pool.members() if not getattr(w, "dead", "")]
