"""How the router steps a Generate call on its event loop (router/stepping.py,
router/grpc_loop.py, the driven reads of router/decode_streams.py), with fakes and no sockets:
a leg's read never blocks in a driven step, a loop-side read stops before the leg's end or
failure, whose handling may block, the reader thread wakes a waiting driver, and drive() writes what the
generator yields, steps it where it asks, turns a refusal into the call's status, and closes it
off the loop when the client leaves."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from helpers.decode_streams import Stub, event, wait_for
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router import stepping
from pdserve.router.decode_streams import DecodeStreams
from pdserve.router.grpc_loop import BridgeContext, Refused, drive, run_blocking


def read(leg, loop_side: bool):
    """One driven read of `leg` (as drive() steps a call)."""

    def one():
        for item in leg:  # (its end: the generator returns, DONE)
            yield item
            return

    return stepping.step(one(), loop_side)


def responses(*events, end=False) -> worker_pb2.StreamsResponse:
    return worker_pb2.StreamsResponse(
        requests=[worker_pb2.RequestEvents(request_id="a", events=events, end=end)]
    )


def test_a_driven_read_waits_instead_of_blocking_and_the_loop_side_stops_before_the_end():
    stub = Stub()
    leg = DecodeStreams(stub, "d0").open("a", None)
    started = time.monotonic()
    pause = read(leg, loop_side=False)
    assert type(pause) is stepping.Wait and pause.stream is leg
    assert time.monotonic() - started < 0.5  # no blocking read (a blocking one waits 1 s)
    stub.calls[0].responses.put(
        responses(event([1]), event([2]), event([3], finish_reason="length"), end=True)
    )
    wait_for(lambda: leg._queue.qsize() == 4, "all queued")
    joined = read(leg, loop_side=True)  # the events join, the final one too
    assert list(joined.token_ids) == [1, 2, 3] and joined.finish_reason == "length"
    assert read(leg, loop_side=True) is stepping.OFF_LOOP  # the end: off the loop
    assert read(leg, loop_side=False) is stepping.DONE
    assert not stepping.driven() and not stepping.on_loop()  # only inside a step


def test_a_failure_or_a_passed_deadline_is_raised_off_the_loop_only():
    stub = Stub()
    leg = DecodeStreams(stub, "d0").open("a", time.monotonic() + 0.05)
    time.sleep(0.06)
    assert read(leg, loop_side=True) is stepping.OFF_LOOP
    with pytest.raises(grpc.RpcError) as late:
        read(leg, loop_side=False)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    other = DecodeStreams(Stub(), "d1").open("b", None)
    other.cancel()
    assert read(other, loop_side=True) is stepping.OFF_LOOP
    with pytest.raises(grpc.RpcError) as cancelled:
        read(other, loop_side=False)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED


def test_the_reader_thread_wakes_every_waiting_leg_of_a_message_in_one_hand_off():
    stub = Stub()
    streams = DecodeStreams(stub, "d0")
    legs = [streams.open(rid, None) for rid in ("a", "b", "c")]
    loop = asyncio.new_event_loop()
    handoffs = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: handoffs.append(a) or real(*a)
    try:

        async def wait_all():
            wakers = [leg.readable(asyncio.get_running_loop()) for leg in legs]
            assert all(w is not None for w in wakers)  # nothing queued yet
            stub.calls[0].responses.put(
                worker_pb2.StreamsResponse(
                    requests=[
                        worker_pb2.RequestEvents(request_id=rid, events=[event([7])])
                        for rid in ("a", "b", "c")
                    ]
                )
            )
            await asyncio.wait_for(asyncio.gather(*wakers), 5)

        loop.run_until_complete(wait_all())
    finally:
        loop.close()
    assert len(handoffs) == 1
    assert legs[0].readable(asyncio.new_event_loop()) is None  # queued already: no wait


class Context:
    """A grpc.aio ServicerContext's part that drive() uses."""

    def __init__(self):
        self.written, self.metadata, self.aborted = [], None, None

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self):
        return ()

    async def write(self, message):
        self.written.append(message)

    async def send_initial_metadata(self, metadata):
        assert not self.written
        self.metadata = metadata

    async def abort(self, code, details=""):
        self.aborted = (code, details)
        raise RuntimeError("aborted")


class Readable:
    """A stream whose readable() the test completes."""

    deadline = None

    def __init__(self):
        self.waker = None

    def readable(self, loop):
        self.waker = loop.create_future()
        return self.waker


def run(coro_fn):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn(loop))
    finally:
        loop.close()


def test_drive_steps_where_the_generator_asks_and_writes_what_it_yields():
    loop_thread, threads = [], []
    stream = Readable()

    def gen(bridge):
        threads.append(threading.current_thread())
        bridge.send_initial_metadata((("k", "v"),))
        yield "first"
        threads.append(threading.current_thread())
        yield stepping.Wait(stream)
        threads.append(threading.current_thread())  # after the wait: on the loop
        yield "second"
        threads.append(threading.current_thread())
        yield stepping.OFF_LOOP
        threads.append(threading.current_thread())
        yield "last"

    async def main(loop):
        loop_thread.append(threading.current_thread())
        context = Context()
        bridge = BridgeContext(context)
        ended = []
        assert bridge.add_callback(lambda: ended.append(True))
        task = asyncio.ensure_future(drive(gen(bridge), bridge, context, executor))
        while stream.waker is None:
            await asyncio.sleep(0.001)
        stream.waker.set_result(None)
        await task
        assert not bridge.add_callback(lambda: None)  # the RPC ended: gRPC's answer too
        return context, ended

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as executor:
        context, ended = run(main)
    assert context.written == ["first", "second", "last"]
    assert context.metadata == (("k", "v"),) and ended == [True]
    on_loop = [t is loop_thread[0] for t in threads]
    assert on_loop == [False, False, True, True, False]


def test_a_refusal_becomes_the_status_and_a_client_that_leaves_closes_the_generator_off_the_loop():
    closed_on = []

    def refused(bridge):
        bridge.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be positive")
        yield "never"

    def streaming(stream):
        try:
            yield "token"
            yield stepping.Wait(stream)
        finally:
            closed_on.append(threading.current_thread().name)

    async def main(loop):
        from concurrent.futures import ThreadPoolExecutor

        executor = ThreadPoolExecutor(1, thread_name_prefix="pool")
        context = Context()
        bridge = BridgeContext(context)
        with pytest.raises(RuntimeError):
            await drive(refused(bridge), bridge, context, executor)
        assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be positive")
        assert bridge.code() == grpc.StatusCode.INVALID_ARGUMENT
        context, stream = Context(), Readable()
        bridge = BridgeContext(context)
        left = []
        bridge.add_callback(lambda: left.append(True))
        task = asyncio.ensure_future(drive(streaming(stream), bridge, context, executor))
        while stream.waker is None:
            await asyncio.sleep(0.001)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert left == [True]
        executor.shutdown(wait=True)

    run(main)
    assert len(closed_on) == 1 and closed_on[0].startswith("pool")


def test_a_blocking_unary_body_runs_on_the_pool_and_its_refusal_becomes_the_status():
    async def main(loop):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as executor:
            ok = await run_blocking(
                lambda r, c: (r, threading.current_thread()), 3, Context(), executor
            )
            assert ok[0] == 3 and ok[1] is not threading.current_thread()
            context = Context()

            def refuse(request, bridge):
                bridge.abort(grpc.StatusCode.NOT_FOUND, "no such model")

            with pytest.raises(RuntimeError):
                await run_blocking(refuse, 1, context, executor)
            assert context.aborted == (grpc.StatusCode.NOT_FOUND, "no such model")

    run(main)
    with pytest.raises(Refused):
        BridgeContext(Context()).abort(grpc.StatusCode.INTERNAL, "x")


def test_a_blocking_drive_steps_every_step_on_the_pool_undriven():
    """The HTTP front's calls (router/service.py): each step on the pool, where a leg's read
    waits for its events instead of pausing."""
    seen = []

    def gen():
        for i in range(3):
            seen.append((threading.current_thread().name, stepping.driven(), stepping.on_loop()))
            yield f"r{i}"

    async def main(loop):
        from concurrent.futures import ThreadPoolExecutor

        context = Context()
        with ThreadPoolExecutor(1, thread_name_prefix="pool") as executor:
            await drive(gen(), BridgeContext(context), context, executor, blocking=True)
        return context.written

    assert run(main) == ["r0", "r1", "r2"]
    assert all(name.startswith("pool") and not d and not o for name, d, o in seen)
