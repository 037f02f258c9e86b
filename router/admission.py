"""The router's admission: at most `max_inflight` Generate and Embed calls run at once; past that a
call waits in a bounded queue instead of being refused at once (vLLM queues the same way), and
the queue shares the slots fairly between tenants.

    admission = Admission(max_inflight=64, max_queued=1024, max_wait_s=60.0)
    ticket = admission.enter(priority, flow=("tenant", "sub"))  # QueueFull: no room
    outcome = admission.wait(ticket, deadline)   # ADMITTED, TIMED_OUT, DEADLINE, CANCELLED, SHED
    ...                               # ADMITTED: run the call, then
    admission.leave(ticket)           # its slot goes to the next call the queue picks

A call is admitted at once while a slot is free and nobody waits; otherwise it queues, and a freed
slot goes straight to a waiting call. Which one: first the best class, (background, priority):
a lower priority value first (vLLM's), and a batch's call (`background`: a line of the Batch API,
router/openai/batches_api.py) behind every interactive one whatever the priorities. Within a class
the slot goes to a tenant, then to one of its flows, then to that flow's oldest call. A call's
`flow` is (tenant, sub-flow): the router's servicer names the tenant by the client's API key and
the sub-flow by the `x-gateway-inference-fairness-id` header (router/service.py `flow_of`), so a
gateway in front with one key can still share between its own users, and one key cannot take a
larger share by naming more sub-flows. The tenant picked is the one running the fewest admitted
calls, ties to the one granted longest ago; the same rule then picks among its sub-flows. So a
tenant that sends a thousand requests at once holds no more slots than a tenant that sends one,
once both wait: each backlogged tenant converges on an equal share of max_inflight, and a tenant
with nothing running is served next. With one tenant and one flow (no keys, no header) the queue
is first come, first served within a class, as before.

The workers' queues past the admission (the router's decode queue, both engines) know nothing of
tenants: each granted call gets a start tag for them (`Ticket.tag`, sent as the workers'
share_tag; they order by priority, then tag: protos/convert.py engine_priority), the later of the
virtual time (the lowest tag among the calls running) and its unit's next tag, a unit being the
tenant, or without keys the flow (start-time fair queuing). One unit's tags rise in admission
order, first come, first served within it; a unit that joins while another holds many slots
starts at the lowest tag running, ahead of everything the other has queued on the workers. A
unit with nothing running or waiting is forgotten and starts afresh when it comes back.

A queued call leaves when it has waited `max_wait_s` (TIMED_OUT: the service answers
UNAVAILABLE, an HTTP 503 with Retry-After), when its own deadline passes first (DEADLINE), or
when its client goes away (`cancel`, from gRPC's end-of-call callback: it only sets an event,
never waits). `max_queued` bounds the waiting calls: an arrival that finds the queue full takes
the place of the newest call of the tenant with the most waiting calls (SHED, answered as a full
queue: RESOURCE_EXHAUSTED, an HTTP 429 with Retry-After) when that tenant has at least two more
waiting than the arrival's own and the shed call is placed no better (between the sub-flows of
the arrival's tenant when that tenant is the one with the most); else the arrival itself is
refused (QueueFull). So one tenant's flood cannot keep the others out of the queue either.
PDServeServicer (router/service.py) owns one for the router's lifetime; the HTTP front reaches
it through the router's own gRPC API, so both fronts share it. Every admission's wait is
reported to `on_admit` (the router's pdserve:router_admission_wait_seconds histogram).

`pause` closes the gate for every call (router/pause.py, the HTTP front's /pause): a new call
queues even where a slot is free, a freed slot goes to nobody, and `idle` says when the last
admitted call has left; `resume` hands the free slots to the queue as leaving calls would. Time
spent paused does not count towards a queued call's max_wait_s (a pause loses no request by
itself), while its own deadline, its client leaving and max_queued still apply.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

ADMITTED, TIMED_OUT, DEADLINE, CANCELLED, SHED = (
    "admitted",
    "timed_out",
    "deadline",
    "cancelled",
    "shed",
)
# the gRPC metadata key that marks a call as a batch's (its value: the batch's id): the HTTP front
# sets it on a batch's lines; a client that sends it itself only puts its own calls at the back
BATCH_METADATA_KEY = "pdserve-batch"
# the header (HTTP) and metadata key (gRPC) that names a call's flow within its tenant: the Gateway
# API Inference Extension's name, which llm-d's gateway and its clients send
FAIRNESS_ID_KEY = "x-gateway-inference-fairness-id"
MAX_FAIRNESS_ID_CHARS = 128
DEFAULT_FLOW = ("", "")  # no key and no header: every such call is one flow


class QueueFull(Exception):
    """max_queued calls already wait, and none gives way to this one."""


class Ticket:
    """One call's place: granted at once, or queued until `wait` says how it ended."""

    __slots__ = (
        "granted",
        "cancelled",
        "shed",
        "event",
        "since",
        "counted_from",
        "order",
        "flow",
        "tag",
    )

    def __init__(
        self,
        since: float,
        granted: bool,
        priority: int = 0,
        background: bool = False,
        flow: tuple[str, str] = DEFAULT_FLOW,
    ):
        self.granted, self.cancelled, self.shed, self.since = granted, False, False, since
        # where its max_wait_s runs from: `since`, moved on by the time it spent paused
        self.counted_from = since
        self.order = (background, priority)  # its class: the lower first
        self.flow = flow
        self.tag = 0  # its start tag in its unit's fair share, set when granted
        self.event = threading.Event()


class _Share:
    """What the queue knows of one tenant or one flow: its admitted calls running, its calls
    waiting, and when it was last granted a slot (a grant count; -1: never)."""

    __slots__ = ("running", "waiting", "last")

    def __init__(self):
        self.running, self.waiting, self.last = 0, 0, -1

    def rank(self) -> tuple[int, int]:
        return self.running, self.last


class Admission:
    def __init__(
        self,
        max_inflight: int,
        max_queued: int,
        max_wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_admit: Callable[[float], None] = lambda wait_s: None,
        on_shed: Callable[[], None] = lambda: None,
    ):
        if max_inflight < 1 or max_queued < 0 or not max_wait_s > 0:
            raise ValueError(
                f"Admission needs max_inflight >= 1, max_queued >= 0 and max_wait_s > 0; got "
                f"{max_inflight}, {max_queued}, {max_wait_s}"
            )
        self.max_inflight, self.max_queued, self.max_wait_s = max_inflight, max_queued, max_wait_s
        self._clock, self._on_admit, self._on_shed = clock, on_admit, on_shed
        self._lock = threading.Lock()
        self._running = 0
        self._queued = 0
        # class (background, priority) -> tenant -> sub-flow -> its waiting tickets, oldest first
        self._waiting: dict[tuple, dict[str, dict[str, deque[Ticket]]]] = {}
        # tenant -> its share; (tenant, sub-flow) -> the flow's: kept while it runs or waits
        self._tenants: dict[str, _Share] = {}
        self._flows: dict[tuple[str, str], _Share] = {}
        self._grants = 0
        # start tags (the module docstring): each unit's next one, and the tags of the calls
        # running (tag -> how many), whose lowest is the virtual time a new unit starts at
        self._next_tag: dict[str, int] = {}
        self._running_tags: dict[int, int] = {}
        self._virtual = 0
        self._paused_since: float | None = None  # when `pause` closed the gate; None: open

    def running(self) -> int:
        with self._lock:
            return self._running

    def queued(self) -> int:
        with self._lock:
            return self._queued

    def tenants_waiting(self) -> int:
        """The tenants with at least one call in the queue."""
        with self._lock:
            return sum(1 for s in self._tenants.values() if s.waiting)

    def enter(
        self, priority: int = 0, background: bool = False, flow: tuple[str, str] = DEFAULT_FLOW
    ) -> Ticket:
        """The call's ticket: granted when a slot is free and nobody waits, else queued in its
        class and flow (the module docstring says which waiting call a freed slot goes to);
        raises QueueFull when max_queued calls already wait and none gives way (SHED)."""
        now = self._clock()
        shed = None
        with self._lock:
            if self._running < self.max_inflight and not self._queued and not self.is_paused:
                ticket = Ticket(now, granted=True, flow=flow)
                self._running += 1
                self._count_grant_locked(ticket)
            else:
                ticket = Ticket(
                    now, granted=False, priority=priority, background=background, flow=flow
                )
                if self._queued >= self.max_queued:
                    shed = self._shed_for_locked(ticket)
                    if shed is None:
                        raise QueueFull(
                            f"the router is at max_inflight={self.max_inflight} with "
                            f"max_queued={self.max_queued} requests already waiting"
                        )
                self._push_locked(ticket)
        if shed is not None:
            self._on_shed()
        if ticket.granted:
            self._on_admit(0.0)
        return ticket

    def wait(self, ticket: Ticket, deadline: float | None = None) -> str:
        """Blocks the calling (gRPC handler) thread until the ticket is granted (ADMITTED: the
        caller must `leave` once the call ends), it waited max_wait_s (TIMED_OUT), `deadline`
        (on the admission clock) passed first (DEADLINE), `cancel` ran (CANCELLED), or a later
        arrival took its place in a full queue (SHED)."""
        while True:
            with self._lock:
                # cleared before the flags are read: a grant, a cancel or a resume that sets it
                # after this point wakes the wait below
                ticket.event.clear()
                if ticket.granted and not ticket.cancelled:
                    break
                if ticket.granted:  # granted and cancelled at once: hand the slot on
                    self._release_locked(ticket)
                    return CANCELLED
                if ticket.shed:
                    return SHED
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

    def leave(self, ticket: Ticket) -> None:
        """An admitted call ended: its slot goes to the call the queue picks, else is freed."""
        with self._lock:
            self._release_locked(ticket)

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
        the free slots go to waiting calls as freed slots do."""
        with self._lock:
            if self._paused_since is None:
                return
            now, since = self._clock(), self._paused_since
            self._paused_since = None
            for ticket in self._tickets_locked():
                ticket.counted_from += now - max(since, ticket.counted_from)
                ticket.event.set()  # its wait takes up its max_wait_s bound again
            while self._running < self.max_inflight and self._grant_next_locked():
                pass

    def idle(self) -> bool:
        """No admitted call is running."""
        with self._lock:
            return self._running == 0

    # ---- the queue (under the lock) -------------------------------------------------------------
    def _tickets_locked(self):
        for tenants in self._waiting.values():
            for subs in tenants.values():
                for fifo in subs.values():
                    yield from fifo

    def _shares_locked(self, flow: tuple[str, str]) -> tuple[_Share, _Share]:
        tenant = self._tenants.get(flow[0])
        if tenant is None:
            tenant = self._tenants[flow[0]] = _Share()
        share = self._flows.get(flow)
        if share is None:
            share = self._flows[flow] = _Share()
        return tenant, share

    def _forget_locked(self, flow: tuple[str, str]) -> None:
        """Drops the tenant's and the flow's records once nothing of theirs runs or waits."""
        share = self._flows.get(flow)
        if share is not None and not share.running and not share.waiting:
            del self._flows[flow]
            if not flow[0]:  # the flow is its own unit: it starts afresh when it comes back
                self._next_tag.pop(flow[1], None)
        tenant = self._tenants.get(flow[0])
        if tenant is not None and not tenant.running and not tenant.waiting:
            del self._tenants[flow[0]]
            self._next_tag.pop(flow[0], None)

    def _count_grant_locked(self, ticket: Ticket) -> None:
        """A granted ticket counted running, in its tenant's and flow's shares, with its start
        tag: the later of the virtual time and its unit's next tag."""
        self._grants += 1
        for share in self._shares_locked(ticket.flow):
            share.running += 1
            share.last = self._grants
        if self._running_tags:
            self._virtual = max(self._virtual, min(self._running_tags))
        unit = _unit(ticket.flow)
        ticket.tag = max(self._virtual, self._next_tag.get(unit, 0))
        self._next_tag[unit] = ticket.tag + 1
        self._running_tags[ticket.tag] = self._running_tags.get(ticket.tag, 0) + 1

    def _push_locked(self, ticket: Ticket) -> None:
        tenant, sub = ticket.flow
        tenants = self._waiting.setdefault(ticket.order, {})
        tenants.setdefault(tenant, {}).setdefault(sub, deque()).append(ticket)
        for share in self._shares_locked(ticket.flow):
            share.waiting += 1
        self._queued += 1

    def _unlink_locked(self, ticket: Ticket, fifo: deque[Ticket] | None = None) -> None:
        """Takes the ticket's count out of the queue's; `fifo`: its flow's, already without it."""
        tenant, sub = ticket.flow
        tenants = self._waiting[ticket.order]
        if fifo is None:
            fifo = tenants[tenant][sub]
            fifo.remove(ticket)
        if not fifo:
            del tenants[tenant][sub]
            if not tenants[tenant]:
                del tenants[tenant]
                if not tenants:
                    del self._waiting[ticket.order]
        for share in self._shares_locked(ticket.flow):
            share.waiting -= 1
        self._queued -= 1

    def _grant_next_locked(self) -> bool:
        """The waiting call the queue picks, granted (and counted running); False when none
        waits. The best class; in it the tenant, then its sub-flow, with the fewest running
        (ties: granted longest ago); that flow's oldest call."""
        while self._waiting:
            tenants = self._waiting[min(self._waiting)]
            tenant = min(tenants, key=lambda t: self._tenants[t].rank())
            subs = tenants[tenant]
            sub = min(subs, key=lambda s: self._flows[(tenant, s)].rank())
            fifo = subs[sub]
            ticket = fifo.popleft()
            self._unlink_locked(ticket, fifo)
            if ticket.cancelled:
                self._forget_locked(ticket.flow)
                continue
            ticket.granted = True
            self._running += 1
            self._count_grant_locked(ticket)
            ticket.event.set()
            return True
        return False

    def _shed_for_locked(self, arrival: Ticket) -> Ticket | None:
        """A full queue: the newest call of the tenant with the most waiting, taken out (SHED)
        to make room for `arrival`, when that tenant has at least two more waiting than the
        arrival's and the call is placed no better than the arrival; the same between the
        flows of the arrival's own tenant when it is the one with the most; else None."""
        if not self._queued:
            return None
        tenant = arrival.flow[0]
        heavy = max(self._tenants, key=lambda t: self._tenants[t].waiting)
        own = self._tenants.get(tenant)
        if heavy != tenant and self._tenants[heavy].waiting >= (own.waiting if own else 0) + 2:
            flow = max(
                (f for f in self._flows if f[0] == heavy), key=lambda f: self._flows[f].waiting
            )
        elif heavy == tenant:
            flow = max(
                (f for f in self._flows if f[0] == tenant), key=lambda f: self._flows[f].waiting
            )
            mine = self._flows.get(arrival.flow)
            if (
                flow == arrival.flow
                or self._flows[flow].waiting < (mine.waiting if mine else 0) + 2
            ):
                return None
        else:
            return None
        order = max(
            o for o, tenants in self._waiting.items() if flow[1] in tenants.get(flow[0], ())
        )
        if order < arrival.order:
            return None
        fifo = self._waiting[order][flow[0]][flow[1]]
        victim = fifo.pop()
        self._unlink_locked(victim, fifo)
        self._forget_locked(victim.flow)
        victim.shed = True
        victim.event.set()
        return victim

    def _release_locked(self, ticket: Ticket) -> None:
        self._running -= 1
        left = self._running_tags[ticket.tag] - 1
        if left:
            self._running_tags[ticket.tag] = left
        else:
            del self._running_tags[ticket.tag]
        for share in self._shares_locked(ticket.flow):
            share.running -= 1
        self._forget_locked(ticket.flow)
        if self._paused_since is None:
            self._grant_next_locked()

    def _drop_locked(self, ticket: Ticket) -> None:
        try:
            self._unlink_locked(ticket)
        except (KeyError, ValueError):
            return  # already out of the queue
        self._forget_locked(ticket.flow)


def _unit(flow: tuple[str, str]) -> str:
    """Whose start tags a call's are: its tenant's (an API key), or without one its flow's."""
    return flow[0] or flow[1]
