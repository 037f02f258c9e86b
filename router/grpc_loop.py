"""The router's gRPC server on an asyncio event loop, and the bridge its blocking handlers use.

A synchronous gRPC server hands every streamed message between threads: the handler's thread
wakes for each token, queues the message and waits for gRPC's polling thread to say it went out.
At hundreds of streams that hand-off, not the work, sets the router's pace. On grpc.aio one loop
writes every stream's messages, and a Generate call is woken only when its leg has events.

`LoopServer` owns the loop (its own thread, started with the server, closed by stop()) and a
grpc.aio server on it, behind the calls a grpc.Server takes before it starts (ports, handlers),
so the router builds it as it built the synchronous one. Handlers written as plain functions run
on `executor`, as grpc.aio runs them. The PDServe service's Generate and Embed are coroutines
that run their blocking code through a `BridgeContext`, which looks like a synchronous gRPC
context to that code: abort() raises `Refused`, which the coroutine turns into the status; the
client leaving runs the callbacks add_callback() registered, as gRPC's own would, at once.
`drive()` steps a Generate call's generator the way router/stepping.py describes: on the
executor by default, on the loop while it only streams tokens (the HTTP front's calls: every
step on the executor, router/service.py says why), and ends the call DEADLINE_EXCEEDED when a
write is still waiting for its client at the call's deadline (a client that stopped reading).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent import futures

import grpc

from pdserve.router import stepping

log = logging.getLogger(__name__)


class Refused(Exception):
    """BridgeContext.abort(): the call ends with `code` and `details`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class BridgeContext:
    """What blocking handler code sees of a grpc.aio context (the module docstring). The peer
    and the metadata are read on the loop when it is made; the rest is safe from any thread."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self._peer = context.peer()
        self._metadata = context.invocation_metadata()
        self._lock = threading.Lock()
        self._callbacks: list | None = []  # None once the RPC ended
        self._code: grpc.StatusCode | None = None
        self.initial_metadata: tuple | None = None  # to send before the next message
        # time.monotonic() (the loop's clock) by which the call must end, set by the handler
        # once it knows it; None: none. A write still waiting for the client then ends the
        # call DEADLINE_EXCEEDED (drive())
        self.deadline: float | None = None

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self):
        return self._metadata

    def abort(self, code: grpc.StatusCode, details: str = ""):
        self._code = code
        raise Refused(code, details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def send_initial_metadata(self, metadata) -> None:
        self.initial_metadata = tuple(metadata)

    def add_callback(self, callback) -> bool:
        """False when the RPC already ended (the callback is not kept), as gRPC's."""
        with self._lock:
            if self._callbacks is None:
                return False
            self._callbacks.append(callback)
            return True

    def ended(self) -> None:
        """The RPC ended (finished, failed or cancelled): the callbacks run, once."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback()
            except Exception:
                log.exception("an RPC-end callback failed")


async def _send_metadata(bridge: BridgeContext, context) -> None:
    metadata, bridge.initial_metadata = bridge.initial_metadata, None
    if metadata is not None:
        await context.send_initial_metadata(metadata)


async def _readable(stream, loop) -> None:
    """Until `stream` has an item, or about when its deadline passes (at most a second)."""
    waker = stream.readable(loop)
    if waker is None:
        return
    deadline = stream.deadline
    timeout = 1.0 if deadline is None else min(1.0, max(0.0, deadline - loop.time()) + 0.001)
    timer = loop.call_later(timeout, lambda: waker.done() or waker.set_result(None))
    try:
        await waker
    finally:
        timer.cancel()


WRITE_TOO_LATE = (
    "the client did not read the stream's responses before the request's deadline (its "
    "deadline_ms, else the router's limit of an hour); read the stream as it comes"
)


class _WriteDeadline:
    """Lets go of a call whose write the client has not taken by its deadline
    (BridgeContext.deadline). Past the deadline a leg's read fails (router/decode_streams.py),
    but a client that stops reading stalls the write before it (flow control), so that read
    never comes: the call would keep its admission slot and its legs for as long as its
    connection lives. A grpc.aio write cannot be cancelled (it returns once the client took
    it), so at the deadline `let_go` closes the generator and runs the end-of-call callbacks
    while the write waits; the call then ends DEADLINE_EXCEEDED, once the client reads or
    leaves. One timer a call, armed at its first write, not one a write (asyncio's timeout_at
    around each write costs microseconds a token)."""

    __slots__ = ("_let_go", "_timer", "passed", "writing")

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float, let_go):
        self._let_go = let_go
        self.passed = self.writing = False
        self._timer = loop.call_at(deadline, self._fire)

    def _fire(self) -> None:
        self.passed = True
        if self.writing:
            self._let_go()

    async def write(self, context, item) -> None:
        """context.write(item); Refused (DEADLINE_EXCEEDED) once the deadline passed."""
        if not self.passed:
            self.writing = True
            try:
                await context.write(item)
            finally:
                self.writing = False
        if self.passed:  # (the generator may be closed already: it is not stepped again)
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, WRITE_TOO_LATE)

    def close(self) -> None:
        self._timer.cancel()


async def drive(
    gen, bridge: BridgeContext, context, executor: futures.Executor, blocking: bool = False
) -> None:
    """Writes the responses of `gen`, a handler generator that uses `bridge`, to `context`,
    stepping it as router/stepping.py describes (`blocking`: every step on the executor, each
    waiting there for its leg's events); its refusal becomes the call's status, and so does a
    write that the client has not taken by bridge.deadline (`_WriteDeadline`). The client
    leaving runs the bridge's callbacks and closes `gen` on the executor once no step of it is
    running."""
    loop = asyncio.get_running_loop()
    on_loop, running, guard, gone = False, None, None, False

    def let_go() -> None:
        """Once: closes `gen` if it did not run to its end (the client left, the server stops,
        a write outlived the deadline), and runs the bridge's callbacks."""
        nonlocal gone
        if not gone:
            gone = True
            if gen.gi_frame is not None:
                _close_later(gen, running, executor)
            bridge.ended()

    try:
        while True:
            if on_loop:
                item = stepping.step(gen, True)
            else:
                running = executor.submit(stepping.step, gen, False, not blocking)
                item = await asyncio.wrap_future(running, loop=loop)
                running = None
            if bridge.initial_metadata is not None:
                await _send_metadata(bridge, context)
            if item is stepping.DONE:
                return
            if type(item) is stepping.Wait:
                await _readable(item.stream, loop)
                on_loop = True
            elif item is stepping.OFF_LOOP:
                on_loop = False
            elif bridge.deadline is None:
                await context.write(item)
            else:
                if guard is None:
                    guard = _WriteDeadline(loop, bridge.deadline, let_go)
                await guard.write(context, item)
    except Refused as refused:
        await context.abort(refused.code, refused.details)
    finally:
        if guard is not None:
            guard.close()
        let_go()


def _close_later(gen, running: futures.Future | None, executor: futures.Executor) -> None:
    """Closes `gen` (its finally blocks let go of what it holds) on the executor, once the step
    `running` (None: none) is done."""

    def close(_=None):
        try:
            executor.submit(_close, gen)
        except RuntimeError:  # the executor is shut down: the router is stopping
            pass

    if running is None or running.done():
        close()
    else:
        running.add_done_callback(close)


def _close(gen) -> None:
    try:
        gen.close()
    except Exception:  # a refusal or a failure while it let go: the client is gone anyway
        pass


async def run_blocking(fn, request, context, executor: futures.Executor):
    """A unary handler's blocking body `fn(request, bridge)` on the executor; its refusal
    becomes the call's status, the client leaving runs the bridge's callbacks at once."""
    bridge = BridgeContext(context)
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(executor, fn, request, bridge)
    except Refused as refused:
        await context.abort(refused.code, refused.details)
    finally:
        bridge.ended()


class _Stopping:
    def __init__(self, future: futures.Future, server: LoopServer):
        self._future, self._server = future, server

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.result(timeout)
        except futures.TimeoutError:
            return False
        finally:
            self._server._close_loop()
        return True


class LoopServer:
    """A grpc.aio server on a loop of its own, with grpc.Server's calls before start() (the
    module docstring). `run(coro)` runs a coroutine on the loop and returns its result."""

    def __init__(self, executor: futures.Executor, interceptors, options):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="router-grpc-loop", daemon=True
        )
        self._thread.start()

        async def make():
            return grpc.aio.server(
                migration_thread_pool=executor, interceptors=interceptors, options=options
            )

        self.aio = self.run(make())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.aio.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self.aio.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self.aio.add_insecure_port(address)

    def add_secure_port(self, address: str, credentials) -> int:
        return self.aio.add_secure_port(address, credentials)

    def start(self) -> None:
        self.run(self.aio.start())

    def stop(self, grace: float | None) -> _Stopping:
        """Stops taking calls, cancels those still open after `grace` seconds; wait() on the
        result returns once they ended, and closes the loop."""
        if self.loop.is_closed():
            done: futures.Future = futures.Future()
            done.set_result(None)
            return _Stopping(done, self)
        return _Stopping(asyncio.run_coroutine_threadsafe(self.aio.stop(grace), self.loop), self)

    def _close_loop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()
