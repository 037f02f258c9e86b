"""What one client call shares with the threads that run its legs (router/legs.py): Inflight (the
call's state the cancel callback, the prefill threads and the stream readers all read), Leg (one
reservation on one decode worker, the prefill that fills it and the calls open on the workers),
and the two errors a leg raises: RouterStatus (a failure the router found itself, shaped like a
worker's status) and LegFailed (a leg that could not start).

A ClientCall (router/call.py) is an Inflight; it makes a Leg per attempt (the first, and one per
resume), and a Leg lives until the call lets go of it. Fields that several threads write are
under Inflight.lock.
"""

from __future__ import annotations

import threading
import uuid
from concurrent import futures

import grpc


class RouterStatus(grpc.RpcError):
    """A failure the router found itself, shaped like a worker's RpcError for the same handling."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LegFailed(Exception):
    """A leg could not start; the call ends with `error` (a worker's or the router's status)."""

    def __init__(self, error: grpc.RpcError | None, who: str):
        super().__init__(who)
        self.error, self.who = error, who


class Inflight:
    """What a call shares with its legs' threads and the cancel callback (router/call.py's
    ClientCall is the call itself); fields shared across threads go under `lock`."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.lock = threading.Lock()
        self.leg: Leg | None = None  # the reservation and streams now running
        self.dead_decodes: list = []  # decode workers that failed this request: not again
        self.cancelled = False  # the client went away
        self.abort_requested = False  # PDServe.Abort for this id
        self.finished = False  # ended normally or already cleaned up
        self.first_token_ns = 0  # when the router got the first token
        self.token_clock: dict[int, int] = {}  # sequence index -> unix ns of its last tokens


class Leg:
    """Leg `number` of a call, with a worker-side id of its own (the module docstring)."""

    def __init__(self, number: int):
        self.number = number
        self.request_id = uuid.uuid4().hex  # what the workers know this leg by
        self.decode = None  # pool worker holding the reservation
        self.reservation = None
        self.stream_call = self.prefill_call = None  # the calls open on the workers
        self.reserve_call = self.reserving = None  # a Reserve in flight, and its worker
        self.prefill = None  # pool worker running (or last running) the prefill
        self.charged_tokens = (
            0  # colocated: prompt tokens charged to `decode` until the first token
        )
        self.prefill_future: futures.Future | None = None
        self.prefill_error: grpc.RpcError | None = None
        self.decode_lost = False  # the prefill could not reach the decode worker to abort
        self.lost_why = self.prefill_lost = ""  # the pool dropped the decode / prefill worker
        self.moved = False  # its worker was flipped to another role (router/flips.py): no death
        self.local = False  # its decode worker prefills it too (colocated, or local_prefill.py)
        # time.monotonic(): the decode stream's last event (or opening), the last Prefill sent
        self.heard = self.prefill_sent = 0.0
        # unix ns: Reserve started and succeeded, the (last) Prefill call sent (Timings)
        self.reserve_start_ns = self.reserved_ns = self.prefill_dispatch_ns = 0
        self.ended = threading.Event()  # superseded by the next leg: its prefill stops retrying

    def prefill_reply(self):
        """The PrefillResponse if the prefill already succeeded, without waiting."""
        fut = self.prefill_future
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()
