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
    memory, nixl where NIXL is installed, else grpc; a named backend as named), kept for later
    requests
  each step -> a PushSink of this rank's heads of its stage's layers, its frames flushed (handed
    to the decode side) before the step's report goes to rank 0; on nixl and shm the rank
    claims the reservation as its part of the pipelined sender (PipelineStage: the sender id
    rank 0 made, which the stage spec carries, its stage, rank and layers) at the step's first
    chunk and releases the claim after the flush (its writes ended), so an abort that rank 0
    sends while this rank is between steps frees the reservation at once, and one sent mid-step
    frees it once this rank's writes ended (kvtransfer/backends/claims.py)
  a send or flush that fails -> that channel is dropped (the next request opens a fresh one),
    unless the decode side refused that request alone (a claim after its reservation ended),
    which leaves the channel to the other requests
  unused for TRANSPORT_IDLE_S, or the rank stops (`close`) -> closed (the claims it still
    holds released once their writes ended)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from pdserve.kvtransfer.backends import connect
from pdserve.kvtransfer.backends.claims import CLAIMING
from pdserve.kvtransfer.choose import choices
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.transport import Destination, PipelineStage, Transport
from pdserve.prefill_worker.handoff import PushSink
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)

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

    def open(
        self,
        request_id: str,
        spec: dict,
        tp_size: int,
        tp_rank: int,
        stage: int = 1,
        layers: tuple[int, int] | None = None,
    ) -> PushSink:
        """This step's sink of `request_id` on this rank (TP rank `tp_rank` of `tp_size` in
        pipeline stage `stage`, which runs the decoder `layers` [first, end)): its own heads, into
        the reservation `spec` names (PushSink.stage_spec)."""
        layout = KVLayout(**spec["layout"])
        endpoint = worker_pb2.KVEndpoint.FromString(spec["endpoint"])
        part = None
        if spec.get("sender") and layers is not None:  # a claim says which part this is
            part = PipelineStage(spec["sender"], stage, spec["stages"], tuple(layers), tp_rank)
        errors = []
        for one in choices(endpoint):
            claims = one.backend in CLAIMING and bool(one.write_grant)
            if claims and part is None:
                errors.append(
                    f"{one.backend}: the stage spec names no pipelined sender to claim as"
                )
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
                stage=part if claims else None,
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
        """Every frame on `sink`'s channel handed to the decode side, and (nixl, shm) this step's
        claim of its request released; raises when either fails."""
        sink.transport.flush(self.sender.flush_timeout_s)
        release = getattr(sink.transport, "release", None)
        if release is not None:
            release(sink.request_id)

    def failed(self, sink: PushSink, error: BaseException | None = None) -> None:
        """`sink`'s push failed with `error`: the next request to its endpoint opens a fresh
        channel, unless the decode side refused this request alone (PermissionError: a
        claim of a reservation that ended), whose claim is then released, if it holds one."""
        if isinstance(error, PermissionError):
            release = getattr(sink.transport, "release", None)
            try:
                if release is not None:
                    release(sink.request_id)
            except (ConnectionError, OSError) as e:
                log.info("releasing the claim of %s: %r", sink.request_id, e)
            return
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
            with self._lock:  # a second first call for this address may have connected too
                kept = self._transports.setdefault(key, transport)
            if kept is not transport:
                threading.Thread(target=transport.close, daemon=True).start()
            transport = kept
        return transport

    def close(self) -> None:
        with self._lock:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()
