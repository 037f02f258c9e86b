"""Catch-up threads: bringing one worker up to date with what the router changed at run time
while it was away (router/lora.py's adapters, router/weights.py's weights), from its reports.

A report listener (on the health thread or a heartbeat's, which must return at once) calls
`start(worker, fn)`: `fn(worker)` runs on a thread of its own, at most one per worker at a time,
and not before the retry time a failed one set (`failed`: CATCH_UP_RETRY_S from now; `succeeded`
clears it). What `fn` does, and under which lock, is its owner's; this only bounds the threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CATCH_UP_RETRY_S = 10.0  # a worker's catch-up that failed is tried again after this long


class CatchUps:
    def __init__(self, thread_name: str, retry_s: float = CATCH_UP_RETRY_S):
        self.thread_name, self.retry_s = thread_name, retry_s
        self._lock = threading.Lock()
        self._running: set[int] = set()  # id() of the workers a catch-up thread serves
        self._retry_at: dict[int, float] = {}  # id() of a worker -> when to try again

    def start(self, worker, fn: Callable[[object], None]) -> None:
        with self._lock:
            key = id(worker)
            if key in self._running or time.monotonic() < self._retry_at.get(key, 0.0):
                return
            self._running.add(key)

        def run() -> None:
            try:
                fn(worker)
            finally:
                with self._lock:
                    self._running.discard(key)

        threading.Thread(target=run, name=self.thread_name, daemon=True).start()

    def failed(self, worker) -> None:
        with self._lock:
            self._retry_at[id(worker)] = time.monotonic() + self.retry_s

    def succeeded(self, worker) -> None:
        with self._lock:
            self._retry_at.pop(id(worker), None)
