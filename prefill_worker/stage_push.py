"""A pipelined prefill worker's later stages: each rank pushes its own layers' KV.

A prefill worker whose engine runs in pipeline stages gives the engine a StageSender
(EngineConfig.kv_stage_sender, set by worker_common/process.py from PrefillPart). It is plain
data (the cluster security and the bounds), so it travels to every rank, on this host or another
one, with the engine's config. On a rank of a later stage the engine calls `channels()` once and
then, for each step that prefills a hand-off request, `open` per request (from the request
sink's `stage_spec`: handoff.py PushSink), the layer hook, and `flush` (engine/kv_publish.py
StageStep). Lifecycle of that rank's channels:
  first request to an endpoint -> a channel of the reservation's best backend that this rank can
    use (kvtransfer/choose.py: shm only where the rank shares the decode worker's host and
    memory, else grpc; a named backend as named), kept for later requests
  each step -> a PushSink of this rank's heads of its stage's layers, its frames flushed (handed
    to the decode side) before the step's report goes to rank 0
  a send or flush that fails -> that channel is dropped (the next request opens a fresh one)
  unused for TRANSPORT_IDLE_S, or the rank stops (`close`) -> closed
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from pdserve.kvtransfer.backends import connect
from pdserve.kvtransfer.choose import choices
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.transport import Destination, Transport
from pdserve.prefill_worker.handoff import PushSink
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.protos.security import INSECURE, ClusterSecurity

TRANSPORT_IDLE_S = 300.0  # as the servicer's (service.py)


@dataclass(frozen=True)
class StageSender:
    """What the later stages' ranks need to open KV channels (picklable: it crosses to them)."""

    security: ClusterSecurity = INSECURE
    connect_timeout_s: float = 5.0
    flush_timeout_s: float = 10.0

    def channels(self) -> StageChannels:
        return StageChannels(self)


class StageChannels:
    """One rank's KV channels, one per decode endpoint, shared by every request it pushes."""

    def __init__(self, sender: StageSender):
        self.sender = sender
        self._transports: dict[tuple[str, str], Transport] = {}
        self._used: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str, spec: dict, tp_size: int, tp_rank: int) -> PushSink:
        """This step's sink of `request_id` on this rank (TP rank `tp_rank` of `tp_size` in its
        stage): its own heads, into the reservation `spec` names (PushSink.stage_spec)."""
        layout = KVLayout(**spec["layout"])
        endpoint = worker_pb2.KVEndpoint.FromString(spec["endpoint"])
        errors = []
        for one in choices(endpoint):
            if one.backend == "nixl":
                errors.append("nixl: not for the later stages of a pipelined prefill worker")
                continue
            try:
                transport = self._transport(one.backend, one.address)
            except (ConnectionError, OSError, ValueError) as e:
                errors.append(f"{one.backend}: {e}")
                continue
            dest = Destination(
                list(spec["blocks"]),
                dataclasses.replace(
                    layout, block_size=spec["block_size"], tp_size=max(1, one.tp_size)
                ),
                grant=one.write_grant,
            )
            sink = PushSink(
                request_id,
                dataclasses.replace(layout, tp_size=tp_size, tp_rank=tp_rank),
                transport,
                dest,
                spec["skip"],
                traceparent=spec["traceparent"],
            )
            sink.channel = (one.backend, one.address)
            return sink
        raise ConnectionError(f"no KV channel for {request_id!r}: {'; '.join(errors) or 'none'}")

    def flush(self, sink: PushSink) -> None:
        """Every frame on `sink`'s channel handed to the decode side; raises when it fails."""
        sink.transport.flush(self.sender.flush_timeout_s)

    def failed(self, sink: PushSink) -> None:
        """`sink`'s channel failed: the next request to its endpoint opens a fresh one."""
        key = getattr(sink, "channel", None)
        with self._lock:
            if key is None or self._transports.get(key) is not sink.transport:
                return
            del self._transports[key]
            self._used.pop(key, None)
        threading.Thread(target=sink.transport.close, daemon=True).start()

    def _transport(self, backend: str, address: str) -> Transport:
        key, now = (backend, address), time.monotonic()
        with self._lock:
            idle = [k for k, t in self._used.items() if now - t > TRANSPORT_IDLE_S]
            closing = [self._transports.pop(k) for k in idle if k in self._transports]
            for k in idle:
                del self._used[k]
            self._used[key] = now
            transport = self._transports.get(key)
        for old in closing:
            threading.Thread(target=old.close, daemon=True).start()
        if transport is None:
            transport = connect(
                backend,
                address,
                timeout=self.sender.connect_timeout_s,
                security=self.sender.security,
            )
            with self._lock:
                self._transports[key] = transport
        return transport

    def close(self) -> None:
        with self._lock:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()
