"""The router's admission: at most `max_inflight` Generate calls run at once; past that a call
waits in a bounded queue instead of being refused at once (vLLM queues the same way).

    admission = Admission(max_inflight=64, max_queued=1024, max_wait_s=60.0)
    ticket = admission.enter(priority)  # raises QueueFull when max_queued calls already wait
    outcome = admission.wait(ticket, deadline)   # ADMITTED, TIMED_OUT, DEADLINE or CANCELLED
    ...                               # ADMITTED: run the call, then
    admission.leave()                 # its slot goes to the queue's head, else is freed

A call is admitted at once while a slot is free and nobody waits; otherwise it queues, and a
slot that frees goes straight to the queue's head. The queue is in priority order (vLLM's: the
lower value first), first come first served within equal values: with every priority 0 (the
router's fcfs policy) no later arrival overtakes an earlier one. A batch's call (`background`:
a line of the Batch API, router/openai/batches_api.py) queues behind every waiting interactive
call whatever their priorities, so a batch never takes a slot an interactive call waits for; a
batch's call admitted at once (a slot free, nobody waiting) runs to its end. A queued call
leaves the queue when it has waited `max_wait_s` (TIMED_OUT: the service answers UNAVAILABLE, an
HTTP 503 with Retry-After), when its own deadline passes first (DEADLINE), or when its client
goes away (`cancel`, from gRPC's end-of-call callback: it only sets an event, never waits).
`max_queued` bounds the waiting calls (QueueFull: RESOURCE_EXHAUSTED, an HTTP 429 with
Retry-After). PDServeServicer (router/service.py) owns one for the router's lifetime; the HTTP
front reaches it through the router's own gRPC API, so both fronts share it. Every admission's
wait is reported to `on_admit` (the router's pdserve:router_admission_wait_seconds histogram).

`pause` closes the gate for every call (router/pause.py, the HTTP front's /pause): a new call
queues even where a slot is free, a freed slot goes to nobody, and `idle` says when the last
admitted call has left; `resume` hands the free slots to the queue's head. Time spent paused does
not count towards a queued call's max_wait_s (a pause loses no request by itself), while its own
deadline, its client leaving and max_queued still apply.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

ADMITTED, TIMED_OUT, DEADLINE, CANCELLED = "admitted", "timed_out", "deadline", "cancelled"
# the gRPC metadata key that marks a call as a batch's (its value: the batch's id): the HTTP front
# sets it on a batch's lines; a client that sends it itself only puts its own calls at the back
BATCH_METADATA_KEY = "pdserve-batch"


class QueueFull(Exception):
    """max_queued calls already wait."""


class Ticket:
    """One call's place: granted at once, or queued until `wait` says how it ended."""

    __slots__ = ("granted", "cancelled", "event", "since", "counted_from", "order")

    def __init__(self, since: float, granted: bool, priority: int = 0, background: bool = False):
        self.granted, self.cancelled, self.since = granted, False, since
        # where its max_wait_s runs from: `since`, moved on by the time it spent paused
        self.counted_from = since
        self.order = (background, priority)  # its place in the queue: the lower first
        self.event = threading.Event()


class Admission:
    def __init__(
        self,
        max_inflight: int,
        max_queued: int,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_admit: Callable[[float], None] = lambda wait_s: None,
    ):
        if max_inflight < 1 or max_queued < 0 or not max_wait_s > 0:
            raise ValueError(
                f"Admission needs max_inflight >= 1, max_queued >= 0 and max_wait_s > 0; got "
                f"{max_inflight}, {max_queued}, {max_wait_s}"
            )
        self.max_inflight, self.max_queued, self.max_wait_s = max_inflight, max_queued, max_wait_s
        self._clock, self._on_admit = clock, on_admit
        self._lock = threading.Lock()
        self._running = 0
        self._queue: deque[Ticket] = deque()
        self._paused_since: float | None = None  # when `pause` closed the gate; None: open

    def running(self) -> int:
        with self._lock:
            return self._running

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def enter(self, priority: int = 0, background: bool = False) -> Ticket:
        """The call's ticket: granted when a slot is free and nobody waits, else queued behind
        every waiting call of its priority or a lower value (an interactive call ahead of every
        `background` one); raises QueueFull when max_queued calls already wait."""
        now = self._clock()
        with self._lock:
            if self._running < self.max_inflight and not self._queue and not self.is_paused:
                self._running += 1
                ticket = Ticket(now, granted=True)
            elif len(self._queue) >= self.max_queued:
                raise QueueFull(
                    f"the router is at max_inflight={self.max_inflight} with max_queued="
                    f"{self.max_queued} requests already waiting"
                )
            else:
                ticket = Ticket(now, granted=False, priority=priority, background=background)
                i = len(self._queue)
                while i > 0 and self._queue[i - 1].order > ticket.order:
                    i -= 1
                self._queue.insert(i, ticket)
        if ticket.granted:
            self._on_admit(0.0)
        return ticket

    def wait(self, ticket: Ticket, deadline: float | None = None) -> str:
        """Blocks the calling (gRPC handler) thread until the ticket is granted (ADMITTED: the
        caller must `leave` once the call ends), it waited max_wait_s (TIMED_OUT), `deadline`
        (on the admission clock) passed first (DEADLINE), or `cancel` ran (CANCELLED)."""
        while True:
            with self._lock:
                # cleared before the flags are read: a grant, a cancel or a resume that sets it
                # after this point wakes the wait below
                ticket.event.clear()
                if ticket.granted and not ticket.cancelled:
                    break
                if ticket.granted:  # granted and cancelled at once: hand the slot on
                    self._release_locked()
                    return CANCELLED
                if ticket.cancelled:
                    self._drop_locked(ticket)
                    return CANCELLED
                # paused: only the call's own deadline ends its wait
                limit = None if self.is_paused else ticket.counted_from + self.max_wait_s
                until = deadline if limit is None else limit
                if deadline is not None:
                    until = min(until, deadline)
                left = None if until is None else until - self._clock()
                if left is not None and left <= 0:
                    self._drop_locked(ticket)
                    return DEADLINE if limit is None or until < limit else TIMED_OUT
            ticket.event.wait(left)
        self._on_admit(max(0.0, self._clock() - ticket.since))
        return ADMITTED

    def cancel(self, ticket: Ticket) -> None:
        """The call's client went away while it waited: its `wait` returns CANCELLED. Never
        blocks past a short lock (gRPC's callback thread calls it)."""
        ticket.cancelled = True
        ticket.event.set()

    def leave(self) -> None:
        """An admitted call ended: its slot goes to the queue's head, else is freed."""
        with self._lock:
            self._release_locked()

    # ---- pause (router/pause.py) ----------------------------------------------------------------
    @property
    def is_paused(self) -> bool:
        return self._paused_since is not None

    def pause(self) -> None:
        """Closes the gate: no call is admitted until `resume`; those admitted run on."""
        with self._lock:
            if self._paused_since is None:
                self._paused_since = self._clock()

    def resume(self) -> None:
        """Opens the gate: each queued call's wait so far loses the time it spent paused, and
        the free slots go to the queue's head, in order."""
        with self._lock:
            if self._paused_since is None:
                return
            now, since = self._clock(), self._paused_since
            self._paused_since = None
            for ticket in self._queue:
                ticket.counted_from += now - max(since, ticket.counted_from)
                ticket.event.set()  # its wait takes up its max_wait_s bound again
            while self._running < self.max_inflight and self._grant_head_locked():
                self._running += 1

    def idle(self) -> bool:
        """No admitted call is running."""
        with self._lock:
            return self._running == 0

    def _grant_head_locked(self) -> bool:
        """The queue's first live ticket granted; False when none waits."""
        while self._queue:
            head = self._queue.popleft()
            if head.cancelled:
                continue
            head.granted = True
            head.event.set()
            return True
        return False

    def _release_locked(self) -> None:
        if self._paused_since is None and self._grant_head_locked():
            return  # the slot passes on: _running stays
        self._running -= 1

    def _drop_locked(self, ticket: Ticket) -> None:
        try:
            self._queue.remove(ticket)
        except ValueError:
            pass
