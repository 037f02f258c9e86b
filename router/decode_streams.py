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
aborts the request. The call's reader thread hands each leg its events through the leg's queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from pdserve.protos.pdserve.v1 import worker_pb2

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


class LegStream:
    """One leg's token events, read from its worker's Streams call."""

    def __init__(self, conn: _Call, request_id: str, deadline: float | None):
        self._conn, self.request_id, self._deadline = conn, request_id, deadline
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False

    def __iter__(self):
        return self

    def __next__(self) -> worker_pb2.TokenEvent:
        while not self._done:
            wait = 1.0
            if self._deadline is not None:
                wait = self._deadline - time.monotonic()
                if wait <= 0:
                    self._stop(
                        LegStreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                    )
            try:
                item = self._queue.get(timeout=min(wait, 1.0))
            except queue.Empty:
                continue
            if item is _END:
                self._done = True
                break
            if isinstance(item, LegStreamError):
                self._stop(item)
            return item
        raise StopIteration

    def cancel(self) -> None:
        """Stops the leg's stream: the reader's next read fails CANCELLED, and the worker
        aborts the request (detached, unless its last event is in)."""
        self._queue.put(LegStreamError(grpc.StatusCode.CANCELLED, "Locally cancelled"))
        self._conn.leave(self.request_id, detach=True)

    def _stop(self, error: LegStreamError):
        self._done = True
        self._conn.leave(self.request_id, detach=True)
        raise error

    def deliver(self, item) -> None:
        """A TokenEvent, _END or a LegStreamError, from the call's reader thread."""
        self._queue.put(item)


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
                for entry in response.requests:
                    self._deliver(entry)
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            error = LegStreamError(code, details or "")
        finally:
            self.outbox.put(None)
            for leg in self.owner.drop(self):
                leg.deliver(error)

    def _deliver(self, entry: worker_pb2.RequestEvents) -> None:
        with self.owner.lock:
            leg = self.legs.get(entry.request_id)
        if leg is None:
            return  # left already
        for event in entry.events:
            leg.deliver(event)
        if entry.error_code:
            code = _CODES.get(entry.error_code, grpc.StatusCode.UNKNOWN)
            leg.deliver(LegStreamError(code, entry.error))
        elif entry.end:
            leg.deliver(_END)
        if entry.end or entry.error_code:  # the worker holds nothing more of it
            self.leave(entry.request_id, detach=False)

    def leave(self, request_id: str, detach: bool) -> None:
        self.owner.leave(self, request_id, detach)


class DecodeStreams:
    """The Streams call to one decode worker (`stub`), shared by the legs there."""

    def __init__(self, stub, name: str):
        self.stub, self.name = stub, name
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
