"""The router's view of its workers: channels, stubs, cached load, and who gets the next request.

Decode: most free KV blocks first, from Stats cached for `stats_ttl_s` (a Reserve lowers the
cached count at once, so a burst between refreshes spreads out instead of piling onto one
worker). Prefill: fewest prefills this router has in flight there. Ties go round-robin.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import grpc

from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 << 20   # long prompts' token id lists
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


@dataclass
class _Worker:
    address: str
    channel: grpc.Channel
    stub: object
    worker_id: str = ""
    num_free_blocks: int = -1      # -1: unknown or unreachable, ranks last
    num_inflight: int = 0          # prefills this router has running there


class WorkerPool:
    def __init__(self, prefill_addresses, decode_addresses, stats_ttl_s: float = 0.5,
                 stats_timeout_s: float = 1.0):
        if not prefill_addresses or not decode_addresses:
            raise ValueError("the router needs at least one prefill and one decode worker address")
        self.stats_ttl_s = stats_ttl_s
        self.stats_timeout_s = stats_timeout_s
        self.prefill = {a: self._connect(a, worker_pb2_grpc.PrefillWorkerStub) for a in prefill_addresses}
        self.decode = {a: self._connect(a, worker_pb2_grpc.DecodeWorkerStub) for a in decode_addresses}
        self._lock = threading.Lock()
        self._stats_at = float("-inf")
        self._refreshing = False
        self._decode_rr = itertools.count()
        self._prefill_rr = itertools.count()

    @staticmethod
    def _connect(address: str, stub_cls) -> _Worker:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return _Worker(address, channel, stub_cls(channel))

    # ---- decode ---------------------------------------------------------------------------------
    def decode_order(self) -> list[_Worker]:
        """Decode workers, the preferred one first; the rest are fallbacks for a full pool."""
        self._maybe_refresh()
        with self._lock:
            workers = list(self.decode.values())
            start = next(self._decode_rr) % len(workers)
            rotated = workers[start:] + workers[:start]
            return sorted(rotated, key=lambda w: -w.num_free_blocks)   # stable: ties keep the rotation

    def note_reserved(self, worker: _Worker, num_blocks: int) -> None:
        with self._lock:
            if worker.num_free_blocks >= 0:
                worker.num_free_blocks = max(0, worker.num_free_blocks - num_blocks)

    def _maybe_refresh(self) -> None:
        with self._lock:
            if self._refreshing or time.monotonic() - self._stats_at < self.stats_ttl_s:
                return
            self._refreshing = True   # one caller refreshes; the others use the cached numbers
        try:
            # prefill Stats only name the worker (for Timings.prefill_worker)
            for worker in (*self.decode.values(), *self.prefill.values()):
                try:
                    stats = worker.stub.Stats(worker_pb2.StatsRequest(), timeout=self.stats_timeout_s)
                    free, wid = stats.num_free_blocks, stats.worker_id
                except grpc.RpcError as e:
                    log.warning("Stats of worker %s failed: %s", worker.address, e.code())
                    free, wid = -1, worker.worker_id
                with self._lock:
                    worker.num_free_blocks, worker.worker_id = free, wid
        finally:
            with self._lock:
                self._stats_at = time.monotonic()
                self._refreshing = False

    # ---- prefill --------------------------------------------------------------------------------
    def pick_prefill(self, exclude: _Worker | None = None) -> _Worker:
        """The least busy prefill worker other than `exclude` (or `exclude` when it is the only
        one), counted as busy until end_prefill."""
        with self._lock:
            workers = [w for w in self.prefill.values() if w is not exclude] or list(self.prefill.values())
            start = next(self._prefill_rr) % len(workers)
            rotated = workers[start:] + workers[:start]
            worker = min(rotated, key=lambda w: w.num_inflight)
            worker.num_inflight += 1
            return worker

    def end_prefill(self, worker: _Worker) -> None:
        with self._lock:
            worker.num_inflight -= 1

    def name(self, worker: _Worker) -> str:
        return worker.worker_id or worker.address

    def close(self) -> None:
        for worker in (*self.prefill.values(), *self.decode.values()):
            worker.channel.close()
