"""The router's reads of a decode worker's token events: one DecodeWorker.Streams call per
worker carries every leg's events there (decode_worker/streams.py), one message a decode step
rather than a message and a thread wake-up per leg.

`DecodeStreams.open(request_id, deadline)` attaches a leg's request to its worker's call (opened
when the first leg comes, closed when the last one leaves) and returns a `LegStream`: what
router/legs.py reads as it read a Stream call, an iterator of TokenEvents that ends after the
request's last one, with `cancel()`, and that fails with a `grpc.RpcError` whose code() and
details() are the worker's (the request could not be attached), DEADLINE_EXCEEDED (the leg's
deadline passed), CANCELLED (cancel()), or the call's own status when the call breaks (a worker
that died: UNAVAILABLE, which router/call.py answers with a resume elsewhere). A leg that stops
reading before its last event is detached, which the worker takes as its caller going away: it
aborts the request. Past its deadline a leg stays attached: the router aborts it, its prefill
worker first (router/legs.py `Legs.abort`), since a prefill step under way may still push KV
into the reservation that a detach would free. The call's reader thread hands each leg its
events through the leg's queue (an event queued behind others as a copy: `_copied`).
A read takes, as one event, the events already queued that continue the first one's sequence
(`_merged`): a leg whose reader fell behind catches up in one client response a sequence rather
than one a step, as the worker merges the outputs its stream has not sent yet. Nothing is held
back to merge. A read within a driven step (router/stepping.py) never blocks: with nothing
queued it returns a Wait, whose driver awaits `readable()` (the reader thread completes it, one
hand-off to the loop per Streams message however many legs it woke); on the event loop it
returns OFF_LOOP before the leg's end or failure.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time

import grpc

from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router import stepping

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_END = object()  # a leg's queue: its last event is in


class StatusError(grpc.RpcError):
    """An error with code() and details(), as a gRPC call's has them, that no call raised."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LegStreamError(StatusError):
    """A leg's stream failed: the worker's status for it, or its call's, its deadline, a cancel."""


def _per_token(event: worker_pb2.TokenEvent) -> tuple[int, int]:
    """How each of an event's per-token lists covers its tokens: 0 empty, 1 one per token, 2
    otherwise (a first token sampled elsewhere has no alternatives here)."""
    n = len(event.token_ids)
    lp, tp = len(event.logprobs), len(event.top_logprobs)
    return (0 if lp == 0 else 1 if lp == n else 2), (0 if tp == 0 else 1 if tp == n else 2)


def _continues(event: worker_pb2.TokenEvent, item: worker_pb2.TokenEvent) -> bool:
    """Whether `item`, the next event of `event`'s sequence, can join it: per-token lists that
    cover their tokens alike, so that joined they still line up with the joined tokens."""
    shape = _per_token(event)
    return 2 not in shape and shape == _per_token(item)


class LegStream:
    """One leg's token events, read from its worker's Streams call."""

    def __init__(self, conn: _Call, request_id: str, deadline: float | None):
        self._conn, self.request_id, self._deadline = conn, request_id, deadline
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque = collections.deque()  # taken, not yet read
        self._done = False
        self._waker: asyncio.Future | None = None  # a driver's readable(), until woken

    def __iter__(self):
        return self

    @property
    def deadline(self) -> float | None:
        """time.monotonic() when the leg's deadline passes (the event loop's clock too)."""
        return self._deadline

    def __next__(self) -> worker_pb2.TokenEvent:
        """The next event (joined with what continues it). In a driven step (router/stepping.py)
        it never blocks: a Wait when nothing is queued; on the event loop, OFF_LOOP before
        anything but a token event (the end, a failure), whose handling may block."""
        driven = stepping.driven()
        loop_side = driven and stepping.on_loop()
        while not self._done:
            wait = 1.0
            if self._deadline is not None:
                wait = self._deadline - time.monotonic()
                if wait <= 0:
                    if loop_side:
                        return stepping.OFF_LOOP
                    self._stop(
                        LegStreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                        detach=False,  # (the module docstring)
                    )
            if self._pending:
                item = self._pending.popleft()
            else:
                try:
                    item = (
                        self._queue.get_nowait()
                        if driven
                        else self._queue.get(timeout=min(wait, 1.0))
                    )
                except queue.Empty:
                    if driven:
                        return stepping.Wait(self)
                    continue
            if loop_side and not isinstance(item, worker_pb2.TokenEvent):
                self._pending.appendleft(item)
                return stepping.OFF_LOOP
            if item is _END:
                self._done = True
                break
            if isinstance(item, LegStreamError):
                self._stop(item)
            return self._merged(item)
        raise StopIteration

    def readable(self, loop) -> asyncio.Future | None:
        """A future of `loop` that the reader thread completes when an item is queued; None when
        one is queued already."""
        waker = loop.create_future()
        self._waker = waker
        if self._pending or not self._queue.empty():
            self._waker = None
            return None
        return waker

    def _merged(self, event: worker_pb2.TokenEvent) -> worker_pb2.TokenEvent:
        """`event` and the queued events of its sequence that continue it, as one event (their
        tokens, logprobs and alternatives in order; the last one's finish and timings). Another
        sequence's events stay queued in their order; the first of this sequence's that cannot
        join it, and the leg's end or failure, stop the joining."""
        pending = self._pending
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        i = joined = 0
        while i < len(pending) and not event.HasField("finish_reason"):
            item = pending[i]
            if not isinstance(item, worker_pb2.TokenEvent):
                break  # the end, or a failure: nothing of the leg comes after it
            if item.index != event.index:
                i += 1
            elif _continues(event, item):
                event.MergeFrom(item)  # repeated fields append; the later event's others win
                del pending[i]
                joined += 1
            else:
                break
        on_joined = self._conn.owner.on_joined
        if joined and on_joined is not None:
            on_joined(joined)
        return event

    def cancel(self) -> None:
        """Stops the leg's stream: the reader's next read fails CANCELLED, and the worker
        aborts the request (detached, unless its last event is in)."""
        self.deliver(LegStreamError(grpc.StatusCode.CANCELLED, "Locally cancelled"))
        self._conn.leave(self.request_id, detach=True)

    def _stop(self, error: LegStreamError, detach: bool = True):
        self._done = True
        if detach:
            self._conn.leave(self.request_id, detach=True)
        raise error

    def behind(self) -> bool:
        """Whether events are queued that the leg's reader has not read yet (from the reader
        thread: a snapshot)."""
        return bool(self._pending) or not self._queue.empty()

    def deliver(self, item, wakers: list | None = None) -> None:
        """A TokenEvent, _END or a LegStreamError, from the call's reader thread. A driver
        waiting in readable() is woken, or its future added to `wakers` for wake() to wake."""
        self._queue.put(item)
        waker, self._waker = self._waker, None
        if waker is not None:
            if wakers is None:
                wake([waker])
            else:
                wakers.append(waker)


def _copied(event: worker_pb2.TokenEvent) -> worker_pb2.TokenEvent:
    """`event` out of the Streams message it came in. A queued sub-message keeps its whole
    message alive (upb: the message's arena), every other leg's events in it included, so a leg
    whose reader stopped (a client that stops reading) would hold the worker's whole stream
    traffic for as long as it queues. An event queued behind others is copied (about half a
    microsecond); one for a reader that keeps up is read before long, and is not."""
    copy = worker_pb2.TokenEvent()
    copy.CopyFrom(event)
    return copy


def _set_all(wakers: list) -> None:
    for waker in wakers:
        if not waker.done():
            waker.set_result(None)


def wake(wakers: list) -> None:
    """Completes the readable() futures `wakers` on their loop: one hand-off a loop, from any
    thread."""
    by_loop: dict = {}
    for waker in wakers:
        by_loop.setdefault(waker.get_loop(), []).append(waker)
    for loop, some in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, some)
        except RuntimeError:  # the loop is closed: the server stopped, nobody waits
            pass


class _Call:
    """One Streams call to a worker and the legs it carries."""

    def __init__(self, owner: DecodeStreams):
        self.owner = owner
        self.legs: dict[str, LegStream] = {}
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.call = owner.stub.Streams(self._requests())
        threading.Thread(
            target=self._read, name=f"decode-streams-{owner.name}", daemon=True
        ).start()

    def _requests(self):
        while True:
            request = self.outbox.get()
            if request is None:
                return
            yield request

    def _read(self) -> None:
        error = LegStreamError(grpc.StatusCode.UNAVAILABLE, "the decode worker closed the call")
        try:
            for response in self.call:
                wakers: list = []
                for entry in response.requests:
                    self._deliver(entry, wakers)
                if wakers:
                    wake(wakers)
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            error = LegStreamError(code, details or "")
        finally:
            self.outbox.put(None)
            for leg in self.owner.drop(self):
                leg.deliver(error)

    def _deliver(self, entry: worker_pb2.RequestEvents, wakers: list) -> None:
        with self.owner.lock:
            leg = self.legs.get(entry.request_id)
        if leg is None:
            return  # left already
        for event in entry.events:
            if leg.behind():
                event = _copied(event)
            leg.deliver(event, wakers)
        if entry.error_code:
            code = _CODES.get(entry.error_code, grpc.StatusCode.UNKNOWN)
            leg.deliver(LegStreamError(code, entry.error), wakers)
        elif entry.end:
            leg.deliver(_END, wakers)
        if entry.end or entry.error_code:  # the worker holds nothing more of it
            self.leave(entry.request_id, detach=False)

    def leave(self, request_id: str, detach: bool) -> None:
        self.owner.leave(self, request_id, detach)


class DecodeStreams:
    """The Streams call to one decode worker (`stub`), shared by the legs there."""

    def __init__(self, stub, name: str, on_joined=None):
        """on_joined(n): n events were read joined to the one before them (router/metrics.py)."""
        self.stub, self.name, self.on_joined = stub, name, on_joined
        self.lock = threading.Lock()
        self._call: _Call | None = None

    def open(self, request_id: str, deadline: float | None) -> LegStream:
        """The leg's stream; its request attached to the worker's call (opened if none)."""
        with self.lock:
            if self._call is None:
                self._call = _Call(self)
            call = self._call
            leg = LegStream(call, request_id, deadline)
            call.legs[request_id] = leg
            call.outbox.put(worker_pb2.StreamsRequest(attach=[request_id]))
        return leg

    def leave(self, call: _Call, request_id: str, detach: bool) -> None:
        """A leg stops reading (detach: before its last event: the worker aborts it); the
        call closes when it carries no leg."""
        with self.lock:
            if call.legs.pop(request_id, None) is None:
                return
            if detach:
                call.outbox.put(worker_pb2.StreamsRequest(detach=[request_id]))
            if call.legs:
                return
            if self._call is call:
                self._call = None
        call.outbox.put(None)  # the worker ends the call once it has sent what it holds

    def drop(self, call: _Call) -> list[LegStream]:
        """The call ended: its legs, which it no longer carries."""
        with self.lock:
            if self._call is call:
                self._call = None
            legs, call.legs = list(call.legs.values()), {}
        return legs
