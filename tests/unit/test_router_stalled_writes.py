"""A Generate call whose client stops reading, and one whose client is gone before its legs
start, with fakes and no sockets: a write the client has not taken by the call's deadline lets
go of the call (its generator closed, its end-of-call callbacks run) and ends it
DEADLINE_EXCEEDED, a write after the deadline is not sent, and a client that cancels during a
write still ends the call as a cancel (router/grpc_loop.py); an event queued behind others on a leg is
a copy, not a part of the worker's Streams message, which it would keep alive whole
(router/decode_streams.py); a leg is never started for a call whose client already left
(router/legs.py). The same through a real router: tests/integration/test_router_gone_and_stalled_clients.py."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from helpers.decode_streams import Stub, event, wait_for
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router import stepping
from pdserve.router.decode_streams import DecodeStreams
from pdserve.router.grpc_loop import BridgeContext, drive
from pdserve.router.legs import Inflight, Legs
from pdserve.router.service import ServiceOptions


class StalledContext:
    """A grpc.aio context whose client takes the first `taken` writes, then stops reading: the
    next write waits until `resume()` (as a grpc.aio write waits for the client)."""

    def __init__(self, taken: int = 0):
        self.written, self.aborted, self.taken = [], None, taken
        self.reading: asyncio.Future | None = None  # the write that waits

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self):
        return ()

    async def write(self, message):
        if len(self.written) >= self.taken:
            self.reading = asyncio.get_running_loop().create_future()
            await self.reading  # flow control: the client takes nothing
        self.written.append(message)

    def resume(self):
        self.taken = 1 << 30
        self.reading.set_result(None)

    async def send_initial_metadata(self, metadata):
        pass

    async def abort(self, code, details=""):
        self.aborted = (code, details)
        raise RuntimeError("aborted")  # as grpc.aio's abort raises


def responses(closed: list, pause=None, count: int = 1000):
    """A call's generator: `count` responses (each followed by `pause`, if any); `closed` gets
    True when it is closed before its end (its finally blocks let go of its legs)."""
    try:
        for i in range(count):
            yield f"r{i}"
            if pause is not None:
                yield pause
    except GeneratorExit:
        closed.append(True)
        raise


def run(coro_fn):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


async def until(cond, what: str):
    """A guard against a hang, not a timing: without the fix the condition never comes."""
    for _ in range(20000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(what)


def test_a_write_still_waiting_for_the_client_at_the_deadline_lets_go_of_the_call():
    """The write cannot be cancelled: the call lets go of its generator (its admission slot,
    its legs) and runs its end-of-call callbacks while the write waits, then ends
    DEADLINE_EXCEEDED once the client reads."""
    closed, ended = [], []

    async def main():
        context = StalledContext(taken=0)
        bridge = BridgeContext(context)
        bridge.deadline = time.monotonic()  # (passed already: the first write waits past it)
        assert bridge.add_callback(lambda: ended.append(True))  # the call's _on_rpc_end
        with ThreadPoolExecutor(1) as executor:
            task = asyncio.ensure_future(drive(responses(closed), bridge, context, executor))
            await until(lambda: closed and ended, "a stalled write kept the call past its deadline")
            assert not task.done() and context.written == []  # the write still waits
            context.resume()
            with pytest.raises(RuntimeError, match="aborted"):
                await task
        return context

    context = run(main)
    assert context.written == ["r0"]  # taken late, and nothing after it
    code, details = context.aborted
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline_ms" in details
    assert closed == [True] and ended == [True]


def test_a_write_after_the_deadline_is_not_sent_and_ends_the_call():
    closed = []

    async def main():
        context = StalledContext(taken=1 << 30)
        bridge = BridgeContext(context)
        bridge.deadline = time.monotonic()
        with ThreadPoolExecutor(1) as executor:
            # each response is followed by a step on the pool: the loop runs the timer between
            with pytest.raises(RuntimeError, match="aborted"):
                await drive(responses(closed, stepping.OFF_LOOP), bridge, context, executor)
        return context

    context = run(main)
    assert context.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert context.written[0] == "r0" and closed == [True]


def test_a_client_that_cancels_during_a_guarded_write_ends_the_call_cancelled():
    closed = []

    async def main():
        context = StalledContext(taken=2)
        bridge = BridgeContext(context)
        bridge.deadline = time.monotonic() + 3600
        with ThreadPoolExecutor(1) as executor:
            task = asyncio.ensure_future(drive(responses(closed), bridge, context, executor))
            await until(lambda: context.reading is not None, "the third write never came")
            task.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await task
        return context

    context = run(main)
    assert context.written == ["r0", "r1"] and context.aborted is None
    assert closed == [True]


def test_an_event_queued_behind_others_is_not_part_of_the_streams_message():
    """Each Streams message carries the events of every leg on the worker; a leg whose reader
    stopped would keep every message it queued an event of alive, whole, if the queued event
    were the message's own sub-message. A change to the messages after they were delivered
    shows which events are their own: only the first, queued when nothing waited."""
    stub = Stub()
    streams = DecodeStreams(stub, "d0")
    stalled, other = streams.open("a", None), streams.open("b", None)
    sent = [
        worker_pb2.StreamsResponse(
            requests=[
                worker_pb2.RequestEvents(request_id="a", events=[event([i])]),
                worker_pb2.RequestEvents(request_id="b", events=[event([100 + i])]),
            ]
        )
        for i in (1, 2, 3)
    ]
    for message in sent:
        stub.calls[0].responses.put(message)
    wait_for(lambda: stalled._queue.qsize() == 3 and other._queue.qsize() == 3, "all queued")
    for message in sent[1:]:
        for entry in message.requests:
            entry.events[0].token_ids[0] = 999
    assert list(next(stalled).token_ids) == [1, 2, 3]  # read joined
    assert list(next(other).token_ids) == [101, 102, 103]


class Untouchable:
    """A worker pool that nothing may use (but Legs' own hook, at its making)."""

    def on_drop(self, callback):
        pass

    def __getattr__(self, name):
        raise AssertionError(f"the pool's {name} was used for a call whose client left")


def test_no_leg_starts_for_a_call_whose_client_already_left():
    legs = Legs(Untouchable(), executor=None, options=ServiceOptions("m", 256, 256, "float32"))
    try:
        call = Inflight("r1")
        call.cancelled = True
        started = legs.start(
            call, [1, 2, 3], pdserve_pb2.SamplingParams(), time.monotonic() + 60, 0
        )
        assert started is None and call.leg is None
    finally:
        legs.close()
