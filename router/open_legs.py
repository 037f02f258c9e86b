"""The legs that have a call open on each worker, so that a worker the pool drops takes its calls
with it: OpenLegs.

A worker that stops answering (a stopped or hung process, a partitioned host) ends none of the
gRPC calls open on it: they just wait. When the pool drops a worker (router/pool.py: its
heartbeats stopped, or a Stats failed while it is marked down), `dropped` marks each leg
streaming from it lost, with the reason, and cancels that stream; the call (router/call.py's
decode_died) takes that as the decode worker's death, resumes on another decode worker and sends
the lost leg's Abort from the abort threads. A prefill pending on it is cancelled the same way and
retried once on another prefill worker (router/legs.py). Failed Stats are a weaker sign than
stopped heartbeats (a busy worker answers late): a leg that got a token event after the failed
Stats was sent keeps its stream, until a later failed Stats finds it silent too. A Reserve in
flight on it is cancelled as well, and the next decode worker is tried. A cancelled call
delivers nothing more, so a worker back from a stop cannot send into a stream that moved on. The
cancels run on the abort threads: the pool's health thread never waits on a call.
"""

from __future__ import annotations

import threading


class OpenLegs:
    """Which legs have a call open on which worker of `pool`; `run_later(fn)` runs fn on the
    router's abort threads."""

    def __init__(self, pool, run_later):
        self.pool = pool
        self._run_later = run_later
        self._lock = threading.Lock()
        self._open: dict[object, set] = {}  # pool worker -> legs with a call open on it
        if pool is not None:  # None: a Legs without workers (unit tests)
            pool.on_drop(self.dropped)

    def add(self, worker, leg) -> None:
        """`leg` has a call open on `worker` (its decode stream, or its prefill) until remove();
        a worker the pool already dropped loses the leg at once."""
        with self._lock:
            self._open.setdefault(worker, set()).add(leg)
        if not self.pool.is_member(worker):
            self.dropped(
                worker, f"{worker.role} worker {self.pool.name(worker)} left the pool", None
            )

    def remove(self, worker, leg) -> None:
        with self._lock:
            legs = self._open.get(worker)
            if legs is not None:
                legs.discard(leg)
                if not legs:
                    del self._open[worker]

    def count(self, worker) -> int:
        """How many legs have a call open on `worker`."""
        with self._lock:
            return len(self._open.get(worker, ()))

    def dropped(self, worker, why: str, silent_since: float | None, moved: bool = False) -> list:
        """The pool dropped `worker` (on its health thread; the module docstring): each call open
        on it and silent since `silent_since` (None: every call) is cancelled from the abort
        threads, its leg marked lost first so that the cancel reads as a death. moved: not a
        death but a role flip's move (router/flips.py), which costs the call no resume. Returns
        the legs it let go of."""
        with self._lock:
            legs = self._open.get(worker, set())
            lost = [
                leg for leg in legs if silent_since is None or heard(leg, worker) < silent_since
            ]
            legs.difference_update(lost)
            if not legs:
                self._open.pop(worker, None)
        for leg in lost:
            if leg.reserving is worker and leg.reserve_call is not None:
                self._run_later(leg.reserve_call.cancel)
            if leg.decode is worker and leg.stream_call is not None:
                leg.lost_why, leg.moved = why, moved
                leg.decode_lost = True  # before the cancel: decode_died reads it
                self._run_later(leg.stream_call.cancel)
            if leg.prefill is worker and leg.prefill_call is not None:
                leg.prefill_lost = why
                self._run_later(leg.prefill_call.cancel)
        return lost


def heard(leg, worker) -> float:
    """When `worker` was last heard of on `leg`'s call (time.monotonic()): the decode stream's
    last event (or its opening), the prefill's dispatch; a Reserve in flight, never (it is
    short: one the worker has not answered by a failed Stats is lost)."""
    if leg.reserving is worker:
        return 0.0
    return leg.heard if leg.decode is worker else leg.prefill_sent
