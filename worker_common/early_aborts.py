"""Request ids a router aborted before this worker held them, so the call they belong to is refused
when it comes.

The router's Abort and the call it aborts (a decode worker's Reserve, a prefill worker's Prefill)
travel on separate calls and threads, so the Abort may arrive first: a call the router gave up on
while it was on its way. Served then, a Reserve would hold blocks for a lease nobody fills, and a
Prefill would compute a prompt and push its KV into a reservation that its router freed already,
blocks another request may hold by then. A worker keeps one EarlyAborts: its Abort handler
`remember`s an id the engine did not know, the call's admission `refuse`s a remembered id (once:
it is forgotten then, so a later call with the same id is served). Both run on the engine loop's
thread, so an Abort and its call are ordered there. An id is kept `ttl_s` at most (`sweep`, which
the loop runs every so often), and at most `cap` ids (the oldest go first): bounded whatever a
stranger sends.
"""

from __future__ import annotations

import time

import grpc

EARLY_ABORT_TTL_S = 60.0
MAX_EARLY_ABORTS = 4096


class AbortedEarly(Exception):
    """The router aborted this request id before its call (Reserve, Prefill) got here."""


class EarlyAborts:
    """Ids aborted before their call arrived -> time.monotonic() when; loop thread only."""

    def __init__(self, ttl_s: float = EARLY_ABORT_TTL_S, cap: int = MAX_EARLY_ABORTS):
        self.ttl_s, self.cap = ttl_s, cap
        self._ids: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, request_id: str) -> None:
        ids = self._ids
        ids.pop(request_id, None)  # re-inserted last: the oldest stays first
        ids[request_id] = time.monotonic()
        while len(ids) > self.cap:
            del ids[next(iter(ids))]

    def refuse(self, request_id: str) -> None:
        """Raises AbortedEarly when `request_id` was aborted before it came (and forgets it)."""
        if self._ids.pop(request_id, None) is not None:
            raise AbortedEarly(f"request_id {request_id!r} was aborted before this call arrived")

    def sweep(self) -> None:
        """Forgets the ids older than ttl_s."""
        ids, now = self._ids, time.monotonic()
        while ids and now - next(iter(ids.values())) > self.ttl_s:
            del ids[next(iter(ids))]


def refuse_aborted(context, err: BaseException) -> None:
    """Ends the call CANCELLED when the router had aborted its id before it came (`err` is
    AbortedEarly); returns otherwise."""
    if isinstance(err, AbortedEarly):
        context.abort(grpc.StatusCode.CANCELLED, str(err))
