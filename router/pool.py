"""The router's view of its workers: channels, stubs, health, cached load, membership, and who
gets the next request.

The router creates one WorkerPool as it starts and keeps it until it stops. A background thread
refreshes every worker's Stats every `stats_ttl_s`, and requests never wait on a Stats call:
they read what the last sweep left. Decode picks prefer the fewest KV blocks in use (a Reserve
raises the cached count at once, so a burst between refreshes spreads out); prefill picks prefer
the worker that finishes the prompt soonest, counting the prefix it probably caches
(router/affinity.py). Ties go round-robin. `down_after` failed Stats in a row mark a worker down
and the pickers skip it, unless every worker of its role is down (then they try them all: a
wrong guess costs one failed RPC, refusing costs the request). Workers from the config are
static; workers that Register (router/registry.py) drop out when their heartbeats stop for
`ttl_s`. A worker dropped either way is passed to every `on_drop` listener with the reason
(router/open_legs.py ends the calls still open on it): once when its heartbeats stop, after each
failed Stats while it is down, with the time that Stats was sent, and while its Stats say its
engine has been stuck for `stall_after_s` (a hung GPU or deadlock: the server answers, the
engine computes nothing), with the time it stopped.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import grpc

from pdserve.protos import keepalive
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity
from pdserve.router.affinity import PrefixAffinity, prefix_hashes

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 << 20  # long prompts' token id lists
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# gRPC's default reconnect backoff grows to 120 s: a worker back after a long outage would stay
# "down" that long after it answers again. Keepalive (protos/keepalive.py): a worker that stops
# answering fails every call open on its channel UNAVAILABLE within about 20 s, so its streams
# resume elsewhere even where the pool has not dropped it.
WORKER_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    *keepalive.CLIENT_OPTIONS,
]
ROLES = ("prefill", "decode")
_STUBS = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub}


class NoWorker(Exception):
    """No worker of `role` to send a request to."""

    def __init__(self, role: str):
        super().__init__(
            f"no {role} worker is registered with the router: start one (or wait "
            f"for one to register), then retry"
        )
        self.role = role


@dataclass(eq=False)  # identity: two workers may share an address across a re-registration
class _Worker:
    role: str
    address: str
    channel: grpc.Channel
    stub: object
    worker_id: str = ""
    static: bool = True
    expires_at: float = float("inf")  # registered workers: the heartbeat deadline
    num_free_blocks: int = -1  # -1: unknown or unreachable, ranks last
    num_used_blocks: int = 0  # the decode worker's KV in use: its load (decode_order)
    num_inflight: int = 0  # prefills this router has running there
    queued_tokens: int = 0  # their prompt tokens not expected in that worker's cache
    num_failures: int = 0  # Stats failures in a row
    down: bool = False
    # "serving", or a role flip's "draining" | "switching" (router/flips.py): no new work then
    state: str = "serving"
    stats: object = None  # the last WorkerStats (a sweep's or a heartbeat's): router/metrics.py


class WorkerPool:
    def __init__(
        self,
        prefill_addresses=(),
        decode_addresses=(),
        stats_ttl_s: float = 0.5,
        stats_timeout_s: float = 1.0,
        down_after: int = 2,
        security: ClusterSecurity = INSECURE,
        stall_after_s: float = 30.0,
    ):
        if down_after < 1:
            raise ValueError(f"down_after must be >= 1, got {down_after}")
        if stall_after_s <= 0:
            raise ValueError(f"stall_after_s must be > 0, got {stall_after_s}")
        self.stall_after_s = stall_after_s
        self.stats_ttl_s = stats_ttl_s
        self.stats_timeout_s = stats_timeout_s
        self.down_after = down_after
        self.security = security
        self._workers = {
            "prefill": [self._connect("prefill", a) for a in prefill_addresses],
            "decode": [self._connect("decode", a) for a in decode_addresses],
        }
        self._registered: dict[str, _Worker] = {}  # worker_id -> worker, for heartbeats
        self._affinity = PrefixAffinity()
        self._lock = threading.Lock()
        self.prefill_tokens_started = 0  # of the legs started for the prefill pool, ever
        self._rr = {role: itertools.count() for role in ROLES}
        self._stop = threading.Event()
        self._drop_listeners: list = []  # (worker, why, silent_since): on the health thread
        self._report_listeners: list = []  # (worker, stats): router/reconcile.py
        self.num_sweeps = 0
        self._thread = threading.Thread(target=self._run, name="router-health", daemon=True)

    def _connect(self, role: str, address: str, **fields) -> _Worker:
        channel = self.security.channel(address, WORKER_CHANNEL_OPTIONS)
        return _Worker(role, address, channel, _STUBS[role](channel), **fields)

    def start(self) -> WorkerPool:
        self._thread.start()
        return self

    def num_workers(self, role: str) -> int:
        with self._lock:
            return len(self._workers[role])

    @property
    def prefill(self) -> list[_Worker]:
        with self._lock:
            return list(self._workers["prefill"])

    @property
    def decode(self) -> list[_Worker]:
        with self._lock:
            return list(self._workers["decode"])

    # ---- picking --------------------------------------------------------------------------------
    def decode_order(self, exclude=(), charge_tokens: int | None = None) -> list[_Worker]:
        """Decode workers other than `exclude`, the preferred one first; the rest are fallbacks
        for a full pool. Raises NoWorker when there is none.

        Preferred: the fewest KV blocks in use, which is the work of its decode steps (the
        sequences and the context they attend over); then the most free blocks. A full worker
        or one whose Stats are unknown ranks last. In use, not free: the workers' caches differ
        in size (a worker flipped from the prefill pool keeps that pool's smaller cache), and
        ranking by free blocks kept the bigger cache's worker that many blocks busier, its TPOT
        over the SLO while the other idled. With charge_tokens (colocated workers, which prefill
        too): the fewest prompt tokens charged to it first, and the first is charged
        `charge_tokens` before the lock is let go, so that concurrent arrivals see each other
        (the caller moves the charge with charge_queued when it settles elsewhere, and releases
        it at the first token). Blocks alone are read every health sweep and a colocated Reserve
        holds no blocks yet: a burst went to one worker."""
        with self._lock:
            workers = self._candidates("decode", exclude)
            start = next(self._rr["decode"]) % len(workers)
            rotated = workers[start:] + workers[:start]

            def load(w: _Worker) -> tuple:
                room = 0 if w.num_free_blocks > 0 else 1 if w.num_free_blocks == 0 else 2
                return room, w.num_used_blocks, -w.num_free_blocks

            if charge_tokens is None:  # stable sorts: ties keep the rotation
                return sorted(rotated, key=load)
            ordered = sorted(rotated, key=lambda w: (w.queued_tokens, *load(w)))
            ordered[0].queued_tokens += charge_tokens
            return ordered

    def note_started(self, prompt_tokens: int) -> None:
        """A leg for the prefill pool started (router/legs.py): the planner's prefill demand."""
        with self._lock:
            self.prefill_tokens_started += prompt_tokens

    def charge_queued(self, worker: _Worker, num_tokens: int) -> None:
        """Count `num_tokens` (negative: release them) against a worker's queued prompt tokens."""
        with self._lock:
            worker.queued_tokens += num_tokens

    def note_reserved(self, worker: _Worker, num_blocks: int) -> None:
        with self._lock:
            if worker.num_free_blocks >= 0:
                worker.num_free_blocks = max(0, worker.num_free_blocks - num_blocks)
                worker.num_used_blocks += num_blocks

    def pick_prefill(
        self, prompt: list[int] = (), exclude: _Worker | None = None
    ) -> tuple[_Worker, int]:
        """The prefill worker other than `exclude` (or `exclude` when it is the only one) that
        finishes `prompt` soonest, and the tokens charged to it until end_prefill(worker, charge).
        Raises NoWorker when there is none. A worker's work before this prompt is done, in
        tokens: the prompt tokens this router has in flight there, plus this prompt's tokens that
        it probably does not hold in its prefix cache, so a shared prefix goes back to the worker
        that has it unless that worker is busier than the cache hit saves."""
        hashes = prefix_hashes(list(prompt))
        with self._lock:
            try:
                workers = self._candidates("prefill", (exclude,))
            except NoWorker:
                if exclude is None or exclude not in self._workers["prefill"]:
                    raise
                workers = [exclude]
            start = next(self._rr["prefill"]) % len(workers)
            rotated = workers[start:] + workers[:start]
            matched = self._affinity.matched_tokens(hashes)
            charges = {id(w): len(prompt) - matched.get(w, 0) for w in rotated}
            worker = min(rotated, key=lambda w: (w.queued_tokens + charges[id(w)], w.num_inflight))
            charge = charges[id(worker)]
            worker.num_inflight += 1
            worker.queued_tokens += charge
            self._affinity.record(hashes, worker)
            return worker, charge

    def prefill_backlog(self, prompt: list[int]) -> int | None:
        """The prompt tokens the least loaded prefill worker would compute before `prompt`'s
        first token, this prompt's uncached ones included (as pick_prefill counts, without
        charging); None when no prefill worker serves (planner/local_prefill.py)."""
        hashes = prefix_hashes(list(prompt))
        with self._lock:
            try:
                workers = self._candidates("prefill", ())
            except NoWorker:
                return None
            matched = self._affinity.matched_tokens(hashes)
            return min(w.queued_tokens + len(prompt) - matched.get(w, 0) for w in workers)

    def queued_tokens(self, role: str) -> int:
        """The prompt tokens this router has in flight on the serving workers of `role`."""
        with self._lock:
            return sum(w.queued_tokens for w in self._workers[role] if w.state == "serving")

    def decode_backlog(self) -> int:
        """The prompt tokens the least loaded decode worker is prefilling itself."""
        with self._lock:
            try:
                return min(w.queued_tokens for w in self._candidates("decode", ()))
            except NoWorker:
                return 0

    def end_prefill(self, worker: _Worker, charge: int = 0) -> None:
        with self._lock:
            worker.num_inflight -= 1
            worker.queued_tokens -= charge

    def _candidates(self, role: str, exclude) -> list[_Worker]:
        workers = [w for w in self._workers[role] if w not in exclude and w.state == "serving"]
        if not workers:
            raise NoWorker(role)
        return [w for w in workers if not w.down] or workers

    def is_member(self, worker: _Worker) -> bool:
        """False once `worker` left the pool (its heartbeats stopped, or it re-registered)."""
        with self._lock:
            return worker in self._workers[worker.role]

    def on_drop(self, listener) -> None:
        """Calls `listener(worker, why, silent_since)` when a worker's heartbeats stop
        (silent_since None: it left the pool) and after each Stats it fails while marked down
        (silent_since: time.monotonic() when that Stats was sent, unanswered since). It runs on
        the health thread and must return at once (no worker calls)."""
        self._drop_listeners.append(listener)

    def on_report(self, listener) -> None:
        """Calls `listener(worker, stats)` after a heartbeat's or a health sweep's WorkerStats of
        `worker` are stored (router/reconcile.py compares the role and state they report). It
        runs on the health thread or a Registry handler thread and must return at once."""
        self._report_listeners.append(listener)

    def _reported(self, worker: _Worker, stats) -> None:
        for listener in list(self._report_listeners):
            try:
                listener(worker, stats)
            except Exception:  # one listener's bug must not stop the health sweeps
                log.exception("report listener failed for %s", self.name(worker))

    def _dropped(self, worker: _Worker, why: str, silent_since: float | None = None) -> None:
        for listener in list(self._drop_listeners):
            try:
                listener(worker, why, silent_since)
            except Exception:  # one listener's bug must not stop the health sweeps
                log.exception("drop listener failed for %s", self.name(worker))

    def name(self, worker: _Worker) -> str:
        return worker.worker_id or worker.address

    def snapshot(self) -> list[tuple[str, str, object, bool, str]]:
        """(role, name, last WorkerStats or None, down, state) of every member, without waiting
        on any worker: what the last health sweep or heartbeat left (the metrics read it per
        scrape)."""
        with self._lock:
            workers = self._workers["prefill"] + self._workers["decode"]
            return [(w.role, self.name(w), w.stats, w.down, w.state) for w in workers]

    def members(self) -> list[_Worker]:
        with self._lock:
            return self._workers["prefill"] + self._workers["decode"]

    def registered(self, worker_id: str) -> _Worker | None:
        """The member that registered as `worker_id`, or the static one it names by address."""
        with self._lock:
            worker = self._registered.get(worker_id)
            if worker is not None:
                return worker
            return next(
                (w for role in ROLES for w in self._workers[role] if w.address == worker_id), None
            )

    def begin_drain(self, worker: _Worker) -> str | None:
        """Marks `worker` draining (no new work: the pickers skip it) unless that would leave its
        role with no worker that is up and serving; then says why not, and changes nothing."""
        with self._lock:
            if worker not in self._workers[worker.role]:
                return f"{worker.role} worker {self.name(worker)} left the pool"
            others = [
                w
                for w in self._workers[worker.role]
                if w is not worker and w.state == "serving" and not w.down
            ]
            if not others:
                return (
                    f"it is the last {worker.role} worker that is up and serving: flipping it "
                    f"would leave the {worker.role} pool empty"
                )
            worker.state = "draining"
        return None

    def set_state(self, worker: _Worker, state: str) -> None:
        with self._lock:
            worker.state = state

    # ---- membership -----------------------------------------------------------------------------
    def register(self, role: str, worker_id: str, address: str, ttl_s: float) -> _Worker:
        """Adds a worker, or refreshes it; a new address or role replaces the old entry."""
        with self._lock:
            old = self._registered.get(worker_id)
            if old is not None and not old.static and (old.role, old.address) == (role, address):
                old.expires_at = time.monotonic() + ttl_s
                return old
            if old is not None and not old.static:
                # not closed here: streams still on its channel end on their own, and gRPC frees
                # the channel with its last reference
                self._workers[old.role].remove(old)
                del self._registered[worker_id]
                self._affinity.forget(old)
            static = next(
                (w for w in self._workers[role] if w.static and w.address == address), None
            )
            if static is not None:  # already configured: learn its id, never expire it
                static.worker_id = worker_id
                self._registered[worker_id] = static
                return static
            worker = self._connect(
                role,
                address,
                worker_id=worker_id,
                static=False,
                expires_at=time.monotonic() + ttl_s,
            )
            self._workers[role].append(worker)
            self._registered[worker_id] = worker
        log.info(
            "%s worker %s registered at %s%s",
            role,
            worker_id,
            address,
            f" (was {old.role} at {old.address})" if old is not None and not old.static else "",
        )
        return worker

    def heartbeat(self, worker_id: str, ttl_s: float, stats=None) -> bool:
        """False when `worker_id` is not a member (never registered, or dropped out)."""
        with self._lock:
            worker = self._registered.get(worker_id)
            if worker is None:
                return False
            if not worker.static:
                worker.expires_at = time.monotonic() + ttl_s
            if stats is not None and stats.worker_id:
                worker.stats = stats
            if stats is not None and worker.role == "decode" and not worker.down:
                _note_blocks(worker, stats)
        if stats is not None and stats.worker_id:
            self._reported(worker, stats)
        if stats is not None:
            self._check_stall(worker, stats)
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [w for w in self._registered.values() if not w.static and now > w.expires_at]
            for worker in late:
                self._workers[worker.role].remove(worker)
                del self._registered[worker.worker_id]
                self._affinity.forget(worker)
        for worker in late:
            log.warning(
                "%s worker %s at %s dropped out: no heartbeat",
                worker.role,
                worker.worker_id,
                worker.address,
            )
            self._dropped(worker, f"{worker.role} worker {worker.worker_id} missed its heartbeats")

    # ---- health ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._expire()
                self.sweep()
            except Exception:  # a dead health thread would freeze every worker's state
                log.exception("worker health sweep failed")
            self._stop.wait(self.stats_ttl_s)

    def sweep(self) -> None:
        """One health check of every worker (the thread runs one every stats_ttl_s). Stats go out
        to all at once, so a hung worker costs each sweep stats_timeout_s, not that times the
        number of workers. One successful Stats brings a worker marked down back."""
        with self._lock:
            workers = self._workers["prefill"] + self._workers["decode"]
        sent = time.monotonic()
        calls = [
            (w, w.stub.Stats.future(worker_pb2.StatsRequest(), timeout=self.stats_timeout_s))
            for w in workers
        ]
        for worker, call in calls:
            try:
                self._note_stats(worker, call.result())
            except grpc.RpcError as e:
                self._note_failure(worker, e, sent)
        with self._lock:  # the affinity view holds no more than the prefill caches can
            self._affinity.fit_to_tokens(
                sum(
                    w.stats.num_total_blocks * w.stats.block_size
                    for w in self._workers["prefill"]
                    if w.stats
                )
            )
        self.num_sweeps += 1

    def _note_stats(self, worker: _Worker, stats) -> None:
        if self._check_stall(worker, stats):
            return
        with self._lock:
            came_back = worker.down
            worker.num_failures, worker.down = 0, False
            _note_blocks(worker, stats)
            worker.worker_id = worker.worker_id or stats.worker_id
            worker.stats = stats
        self._reported(worker, stats)
        if came_back:
            log.info("%s worker %s is back up", worker.role, self.name(worker))

    def _check_stall(self, worker: _Worker, stats) -> bool:
        """True when `stats` says the worker's engine has been stuck in one turn for stall_after_s
        or more: it answers, but computes nothing. It is marked down (no new requests), and
        its calls silent since the turn began are dropped, as for a worker that stopped."""
        stalled_s = stats.engine_stalled_ms / 1000
        if stalled_s < self.stall_after_s:
            return False
        with self._lock:
            went_down, worker.down = not worker.down, True
            worker.num_free_blocks = -1
            worker.stats = stats
        why = f"{worker.role} worker {self.name(worker)} is hung: its engine made no progress for "
        why += f"{stalled_s:.0f} s (stall_after_s={self.stall_after_s:g})"
        if went_down:
            log.warning("%s", why)
        self._dropped(worker, why, time.monotonic() - stalled_s)
        return True

    def _note_failure(self, worker: _Worker, error: grpc.RpcError, sent: float) -> None:
        with self._lock:
            worker.num_failures += 1
            worker.num_free_blocks = -1
            went_down = not worker.down and worker.num_failures >= self.down_after
            worker.down = worker.down or went_down
        if went_down:
            log.warning(
                "%s worker %s is down: %d Stats calls failed in a row (last: %s %s)",
                worker.role,
                self.name(worker),
                worker.num_failures,
                error.code(),
                error.details(),
            )
        if worker.down:
            self._dropped(
                worker,
                f"{worker.role} worker {self.name(worker)} is down: {worker.num_failures} "
                f"Stats calls failed in a row",
                sent,
            )

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.stats_timeout_s + 1)
        with self._lock:
            workers = self._workers["prefill"] + self._workers["decode"]
        for worker in workers:
            worker.channel.close()


def _note_blocks(worker: _Worker, stats) -> None:
    """A worker's KV blocks from its Stats (under the pool's lock)."""
    worker.num_free_blocks = stats.num_free_blocks
    worker.num_used_blocks = max(0, stats.num_total_blocks - stats.num_free_blocks)
