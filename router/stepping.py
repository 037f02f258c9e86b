"""How a Generate call's generator is stepped on the router's event loop without blocking it.

The router's gRPC server runs on one asyncio loop (router/grpc_loop.py). A Generate call is
still written as one plain generator (router/service.py -> router/call.py -> router/legs.py),
which blocks in a few places: admission, Reserve and Prefill calls, a resume, waiting for the
prefill's reply. The driver (grpc_loop.drive) steps it on the server's thread pool by default,
and on the loop itself while the call is only streaming tokens, which is where a call spends
nearly all its steps: one token event in, one response out, no thread woken.

The generator tells the driver what it needs by yielding one of two pauses instead of a response:
- `Wait(stream)`: the leg's stream (router/decode_streams.py) has nothing queued; the driver
  awaits `stream.readable()` and steps again on the loop.
- `OFF_LOOP`: the next step may block (the leg's last event, a failure, a blocking call ahead);
  the driver runs the next step on the thread pool.
Code that may block checks `on_loop()` first and yields OFF_LOOP when it is true. Outside a
driven step (a test iterating a leg directly, or the HTTP front's calls: router/grpc_loop.py)
`driven()` is false and streams block, the step running on the pool.
"""

from __future__ import annotations

import threading

_local = threading.local()


class Wait:
    """A pause: `stream` has nothing to read yet (it has `readable()`, see grpc_loop.drive)."""

    __slots__ = ("stream",)

    def __init__(self, stream):
        self.stream = stream


class _OffLoop:
    def __repr__(self) -> str:
        return "OFF_LOOP"


OFF_LOOP = _OffLoop()


def is_pause(item) -> bool:
    return item is OFF_LOOP or type(item) is Wait


def driven() -> bool:
    """Whether the running step belongs to a driven call (its streams must not block)."""
    return getattr(_local, "driven", False)


def on_loop() -> bool:
    """Whether the running step runs on the event loop (nothing in it may block)."""
    return getattr(_local, "on_loop", False)


def off_loop(what: str) -> None:
    """Raises where `what`, which blocks, would run on the event loop: a pause is missing before
    it (a tripwire that the tests' paths run into, rather than a loop that stalls)."""
    if on_loop():
        raise RuntimeError(f"{what} would block the router's event loop")


DONE = object()  # step(): the generator returned


def step(gen, loop_side: bool, driven: bool = True):
    """One step of `gen`: its next item, or `DONE` when it returned. Not `driven`: a step on
    the pool that blocks on its leg's events as a thread of its own would (no pauses)."""
    _local.driven, _local.on_loop = driven, loop_side and driven
    try:
        return next(gen)
    except StopIteration:
        return DONE
    finally:
        _local.driven = _local.on_loop = False
