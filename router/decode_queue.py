"""The router's wait queue for decode KV blocks (router/legs.py): when every decode worker's KV is
full, a disaggregated request waits here until blocks free, in priority order (the lower value
first, vLLM's), first come first served within equal values.
"""

from __future__ import annotations

import threading
import time
from collections import deque

DECODE_QUEUE_POLL_S = 0.05  # a waiting request retries Reserve at least this often


class DecodeFull(Exception):
    """Every decode worker that answered a Reserve had no free KV blocks for the prompt."""


class DecodeQueue:
    """Requests waiting for decode KV blocks, in priority order, first come first served within
    equal priorities: only the head retries its Reserve; the others wait their turn. Stream ends
    call freed() to wake the head at once."""

    def __init__(self):
        self._cv = threading.Condition()
        self._tickets: deque = deque()
        self._freed = 0

    def waiting(self) -> int:
        with self._cv:
            return len(self._tickets)

    def longest_wait_s(self) -> float:
        """How long the longest waiting request has waited (0: none waits): the planner's sign
        of a decode pool short of KV."""
        with self._cv:
            return time.monotonic() - min(t[0] for t in self._tickets) if self._tickets else 0.0

    def join(self, first: bool = False, priority: int = 0):
        """A ticket behind every waiting one of its priority or a lower value (first: in front of
        those of its priority, for a request that was already trying)."""
        ticket = [time.monotonic(), priority]  # a list: each ticket is its own object
        with self._cv:
            t = self._tickets
            if first:
                i = 0
                while i < len(t) and t[i][1] < priority:
                    i += 1
            else:
                i = len(t)
                while i > 0 and t[i - 1][1] > priority:
                    i -= 1
            t.insert(i, ticket)
            self._cv.notify_all()  # a new head waits no longer than its poll
        return ticket

    def leave(self, ticket) -> None:
        with self._cv:
            if ticket in self._tickets:
                self._tickets.remove(ticket)
            self._cv.notify_all()

    def head(self, ticket, timeout: float) -> bool:
        """Whether `ticket` heads the queue, waiting up to `timeout` for it to."""
        with self._cv:
            return self._cv.wait_for(lambda: self._tickets and self._tickets[0] is ticket, timeout)

    def wait_for_blocks(self, timeout: float) -> None:
        """Until freed() is called or `timeout` passes."""
        with self._cv:
            seen = self._freed
            self._cv.wait_for(lambda: self._freed != seen, timeout)

    def freed(self) -> None:
        with self._cv:
            self._freed += 1
            self._cv.notify_all()
