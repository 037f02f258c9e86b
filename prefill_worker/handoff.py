"""Prefill-side hand-off: one prompt's KV pushed, layer by layer, into a decode reservation.

It owns what lies between the engine and the KV channel for one Prefill call: the engine KV sink
(PushSink, wrapped in GuardedSink so that a send error fails only its own request), the Waiter
that takes the finished output off the engine loop and sends the commit, and HandoffTimings, the
stamps the hand-off records. The servicer (service.py) checks the call, picks the channel,
flushes it and replies. The lifecycle of one request:
  prefill-only engine request with a GuardedSink -> as each layer finishes, "kv" frames for the
    tokens that became final, less those the decode side's prefix cache holds (after the step's
    last layer instead when the compute takes every core: PushSink.overlap)
  first token sampled -> "commit" frame on the same channel, so it follows all the KV; n>1: the
    frame carries every sequence's first token, and the KV goes once
  failure or abort -> "abort" frame, and the decode side frees the reservation at once
Under pipeline stages the sink pushes the first stage's layers, and the later stages' ranks push
their own on their own channels (engine/kv_publish.py, stage_push.py) from the sink's
`stage_spec`; each step's reports reach it (`on_stage_report`) a step or two later, and all of
them by the end of the step that samples its first token: the bytes they sent, or a failure,
which fails the request (StagePushError) before its commit. The commit is sent once
every stage has flushed its frames, and marked await_kv, since another channel's last frames
may still be in the decode side's hands. Its Destination then names the pipelined sender
(PipelineStage: a random id per request, the stage count, stage 0 and its layers), which the
stage spec hands on, so that on nixl and shm each stage claims the reservation as its own part
of one sender (kvtransfer/backends/claims.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.engine.request import RequestOutput
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.reshard import chunk_header, read_chunk
from pdserve.kvtransfer.transport import Destination, Transport
from pdserve.kvtransfer.wire import ChunkHeader
from pdserve.protos.convert import unix_ns
from pdserve.protos.pdserve.v1 import pdserve_pb2

log = logging.getLogger(__name__)


class StagePushError(RuntimeError):
    """A later pipeline stage could not push its layers' KV of a request (its rank's log says
    why): the request fails, and the decode side frees its reservation."""


@dataclass
class HandoffTimings:
    """The stamps of one Prefill call's hand-off, in unix ns (0: not reached), and the one place
    they become the Timings this worker reports in its PrefillResponse."""

    arrival_unix_ns: int  # the Prefill call arrived
    num_layers: int = 1  # the model's: the first step's start is estimated from its layers' ends
    step_start_unix_ns: int = 0  # the first engine step that computes the prompt began
    first_layer_unix_ns: int = 0  # the first engine step's first layer done
    first_step_end_unix_ns: int = 0  # the first engine step's last layer done
    transfer_start_unix_ns: int = 0  # the first KV handed to the transport
    prefill_end_unix_ns: int = 0  # the finished output arrived (first token sampled), pre-commit
    transfer_end_unix_ns: int = 0  # the channel flushed: every frame handed to the decode side

    def __post_init__(self):
        self.num_layers = max(1, self.num_layers)

    def compute_start_unix_ns(self) -> int:
        """When the engine step that began this prompt started: as the engine said it
        (step_start_unix_ns), else the first layer's end less one layer's share of that step;
        0 when no layer ran."""
        if self.step_start_unix_ns:
            return self.step_start_unix_ns
        first, step_end = self.first_layer_unix_ns, self.first_step_end_unix_ns
        if not first:
            return 0
        if not step_end or self.num_layers == 1:
            return first
        per_layer = (step_end - first) / (self.num_layers - 1)
        return int(first - per_layer)

    def to_proto(self) -> pdserve_pb2.Timings:
        return pdserve_pb2.Timings(
            prefill_arrival_unix_ns=self.arrival_unix_ns,
            prefill_start_unix_ns=max(self.arrival_unix_ns, self.compute_start_unix_ns()),
            transfer_start_unix_ns=self.transfer_start_unix_ns,
            prefill_end_unix_ns=self.prefill_end_unix_ns,
            transfer_end_unix_ns=self.transfer_end_unix_ns,
        )


def compute_takes_every_core(kv: torch.Tensor) -> bool:
    """Whether this process's torch compute threads use every core it may run on (CPU KV only)."""
    if kv.device.type != "cpu":
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() >= cores


class PushSink:
    """rank_caches: with tensor parallelism, every rank's KV pool (engine.rank_kv_caches()): rank
    0's layer hook runs once every rank has written that layer (the layer ends in an all-reduce),
    so each rank's heads are read from its own pool and joined into one frame of all the heads
    (one frame per layer whatever the TP size; each decode rank takes the heads it holds).

    traceparent: the request's prefill span (W3C), carried on every frame so the receiver can link
    its spans to the sender's ("" when the request is not traced).

    overlap: push each layer as it finishes, while the next computes (True), or push a step's
    layers after its last one (False). None decides at the first layer: overlap unless the KV is
    on the CPU and the compute threads take every core this process may use. Overlap hides the
    transfer only where it has a core to run on: when the prefill takes every core, the per-layer
    sends (and the decode side's receiving) preempt the compute, whose OpenMP barriers then wait
    on them, and the prefill slows by more than the transfer takes.
    """

    def __init__(
        self,
        request_id: str,
        layout: KVLayout,
        transport: Transport,
        dest: Destination,
        num_cached_on_decode: int,
        rank_caches: list[torch.Tensor] | None = None,
        overlap: bool | None = None,
        traceparent: str = "",
        endpoint: bytes = b"",
    ):
        self.request_id = request_id
        # the reservation's KVEndpoint (serialized, its offers included): where the later
        # pipeline stages' ranks push their layers, each choosing what it can use (stage_spec)
        self.endpoint = endpoint
        self.staged = False  # later pipeline stages push too: the commit says await_kv
        self.stage_bytes: dict[int, int] = {}  # what each later stage's ranks reported sent
        self.traceparent = traceparent  # every frame's, when the request is traced
        self.layout = layout
        tp = len(rank_caches) if rank_caches else 1
        self.sources = (
            None
            if tp == 1
            else [  # each head once: a head several ranks hold leaves from its first
                (rank_layout, cache)
                for r, cache in enumerate(rank_caches)
                if (rank_layout := dataclasses.replace(layout, tp_size=tp, tp_rank=r)).sends
            ]
        )
        self.transport = transport
        # a single rank's chunks go straight out of its pool where the transport can (nixl)
        paged = getattr(type(transport), "send_paged", Transport.send_paged)
        self.paged = self.sources is None and paged is not Transport.send_paged
        self.dest = dest
        self.skip = num_cached_on_decode
        self.bytes_sent = 0
        self.send_s = 0.0  # time spent handing frames to the transport (the flush's is not in)
        self.last_send_time: float | None = None
        self.overlap = overlap
        self._deferred: list[tuple] = []

    def on_layer(
        self, layer: int, layer_kv: torch.Tensor, block_ids: list[int], start: int, end: int
    ) -> None:
        start = max(start, self.skip)
        if start >= end:
            return
        if self.overlap is None:
            self.overlap = not compute_takes_every_core(layer_kv)
        if self.overlap:
            self._push(layer, layer_kv, block_ids, start, end)
            return
        # layer_kv is a view of the cache: these tokens' KV stays put until the request ends
        self._deferred.append((layer, layer_kv, list(block_ids), start, end))
        if layer == self.layout.num_layers - 1:
            self.end_step()

    def end_step(self) -> None:
        """The step's forward pass is over on this rank: the layers deferred leave (a pipeline
        stage's last layer is not the model's)."""
        deferred, self._deferred = self._deferred, []
        for args in deferred:
            self._push(*args)

    def stage_spec(self) -> dict:
        """What a later pipeline stage's rank needs to push its layers of this request (plain
        data: it travels to the ranks with the step; stage_push.py StageChannels.open)."""
        self.staged = True
        stage = self.dest.stage
        return dict(
            layout=dataclasses.asdict(self.layout),
            endpoint=self.endpoint,
            blocks=list(self.dest.block_ids),
            block_size=self.dest.layout.block_size,
            skip=self.skip,
            traceparent=self.traceparent,
            # the pipelined sender a later stage claims as a part of (nixl, shm), and its stages
            sender=stage.sender if stage is not None else "",
            stages=stage.stages if stage is not None else 0,
        )

    def on_stage_report(self, stage: int, sent: int, ok: bool) -> None:
        """A later stage's ranks pushed `sent` bytes of this step's KV; not ok: one failed."""
        self.stage_bytes[stage] = self.stage_bytes.get(stage, 0) + sent
        self.bytes_sent += sent
        if not ok:
            raise StagePushError(
                f"pipeline stage {stage} could not push its layers' KV of {self.request_id!r} "
                f"(its rank's log says why)"
            )

    def _push(
        self, layer: int, layer_kv: torch.Tensor, block_ids: list[int], start: int, end: int
    ) -> None:
        def read(kv: torch.Tensor, layout: KVLayout):
            return read_chunk(
                kv, layout, self.request_id, layer, block_ids, start, end, self.traceparent
            )

        if self.paged and layer_kv.is_contiguous():
            # straight out of the pool where the transport can (nixl), else gathered first
            lay = self.layout
            paged = layer_kv.view(2, -1, lay.block_size, lay.heads_per_rank, lay.head_dim)
            header = chunk_header(
                lay, self.request_id, layer, start, end, layer_kv.dtype, self.traceparent
            )
            sent = time.perf_counter()
            if self.transport.send_paged(header, paged, block_ids, self.dest):
                row = lay.heads_per_rank * lay.head_dim * layer_kv.element_size()
                self._sent(sent, 2 * (end - start) * row)
                return
        if self.sources is None:
            header, data = read(layer_kv, self.layout)
        else:
            parts = [read(cache[layer], layout) for layout, cache in self.sources]
            header = dataclasses.replace(parts[0][0], head_end=parts[-1][0].head_end)
            data = torch.cat([d for _, d in parts], dim=2)  # [2, tokens, heads, head_dim]
        sent = time.perf_counter()
        self.transport.send(header, data, self.dest)
        self._sent(sent, data.numel() * data.element_size())

    def _sent(self, began: float, nbytes: int) -> None:
        self.send_s += time.perf_counter() - began
        self.bytes_sent += nbytes
        self.last_send_time = time.monotonic()

    def on_state(self, layer: int, tensors: list[torch.Tensor]) -> None:
        """A hybrid model's linear layer `layer`'s recurrent state after the prompt ([conv,
        ssm] of the whole model, every rank's part joined: engine/recurrent_state.py
        SlotState): one "state" frame, float32, before the commit."""
        data = torch.cat([t.reshape(-1).float() for t in tensors])
        header = ChunkHeader(
            self.request_id,
            self.layout.fingerprint,
            layer=layer,
            dtype="float32",
            kind="state",
            traceparent=self.traceparent,
        )
        sent = time.perf_counter()
        self.transport.send(header, data, self.dest)
        self._sent(sent, data.numel() * 4)

    def on_draft(
        self, head_kv: torch.Tensor, layout: dict, block_ids: list[int], start: int, end: int
    ) -> None:
        """An EAGLE head's KV of prompt tokens [start, end) (its cache's one layer; `layout` the
        head's KVLayout fields; engine/spec/eagle.py): a "draft" chunk, before the commit, past
        the tokens the decode side holds. Nothing where the transport carries no payload frames
        (nixl): the decode side's head then starts without the prompt."""
        start = max(start, self.skip)
        if start >= end or not self.transport.carries_payload_frames:
            return
        header, data = read_chunk(
            head_kv, KVLayout(**layout), self.request_id, 0, block_ids, start, end, self.traceparent
        )
        sent = time.perf_counter()
        self.transport.send(dataclasses.replace(header, kind="draft"), data, self.dest)
        self._sent(sent, data.numel() * data.element_size())

    def commit(self, first_tokens: list[int], logprobs: list[float] | None = None) -> None:
        """first_tokens: every sequence's first token in index order (one for n=1); logprobs:
        theirs, when the request asked for logprobs (the decode side streams them)."""
        self.transport.send(
            ChunkHeader(
                self.request_id,
                self.layout.fingerprint,
                kind="commit",
                first_tokens=tuple(first_tokens),
                first_logprobs=tuple(logprobs or ()),
                traceparent=self.traceparent,
                await_kv=self.staged,
            ),
            None,
            self.dest,
        )

    def abort(self) -> None:
        self.transport.send(
            ChunkHeader(
                self.request_id,
                self.layout.fingerprint,
                kind="abort",
                traceparent=self.traceparent,
            ),
            None,
            self.dest,
        )


class GuardedSink:
    """A PushSink whose send errors are recorded instead of raised: raised inside an engine step
    they would fail the whole batch, every other request on this worker with it."""

    def __init__(self, sink: PushSink, timings: HandoffTimings):
        self.sink = sink
        self.error: Exception | None = None
        self.timings = timings  # stamps its first and first step's last layer, its first KV sent

    def on_step_start(self) -> None:
        """An engine step that computes this prompt begins (engine/kv_publish.py)."""
        if not self.timings.step_start_unix_ns:
            self.timings.step_start_unix_ns = unix_ns()

    def on_layer(self, layer: int, *args) -> None:
        now, t = unix_ns(), self.timings
        if not t.first_layer_unix_ns:
            t.first_layer_unix_ns = now
        if not t.first_step_end_unix_ns and layer == t.num_layers - 1:
            t.first_step_end_unix_ns = now
        if self.error is None:
            sent = self.sink.bytes_sent
            try:
                self.sink.on_layer(layer, *args)
            except Exception as e:
                self.error = e
            if not t.transfer_start_unix_ns and self.sink.bytes_sent > sent:
                t.transfer_start_unix_ns = now

    def end_step(self) -> None:
        if self.error is None:
            try:
                self.sink.end_step()
            except Exception as e:
                self.error = e

    def on_state(self, layer: int, tensors: list[torch.Tensor]) -> None:
        if self.error is None:
            try:
                self.sink.on_state(layer, tensors)
            except Exception as e:
                self.error = e

    def on_draft(self, *args) -> None:
        if self.error is None:
            try:
                self.sink.on_draft(*args)
            except Exception as e:
                self.error = e

    def stage_spec(self) -> dict:
        return self.sink.stage_spec()

    def on_stage_report(self, stage: int, sent: int, ok: bool) -> None:
        try:
            self.sink.on_stage_report(stage, sent, ok)
        except StagePushError as e:
            if self.error is None:
                self.error = e

    def commit(self, first_tokens: list[int], logprobs: list[float] | None = None) -> None:
        if self.error is None:
            try:
                self.sink.commit(first_tokens, logprobs)
            except Exception as e:
                self.error = e

    def abort(self) -> None:
        try:
            self.sink.abort()
        except Exception as e:  # the channel is gone: the decode side's lease frees the blocks
            log.debug("abort frame for %s not sent: %r", self.sink.request_id, e)


def prefill_done(out: RequestOutput) -> bool:
    """Whether every sequence of a finished prefill-only request sampled its first token."""
    return bool(out.outputs) and all(
        c.finish_reason == "prefill_done" and c.token_ids for c in out.outputs
    )


def first_tokens(out: RequestOutput) -> list[int]:
    """Each sequence's first token, in index order."""
    return [c.token_ids[0] for c in sorted(out.outputs, key=lambda c: c.index)]


def first_logprobs(out: RequestOutput) -> list[float] | None:
    """Each sequence's first token's logprob, in index order; None without logprobs."""
    comps = sorted(out.outputs, key=lambda c: c.index)
    if not all(c.logprobs for c in comps):
        return None
    return [c.logprobs[0] for c in comps]


class Waiter:
    """The finished output of one prefill-only request, handed from the loop thread; it stamps the
    prefill's end and sends the commit."""

    def __init__(self, sink: GuardedSink):
        self.sink = sink
        self.done = threading.Event()
        self.output: RequestOutput | None = None

    def __call__(self, out: RequestOutput) -> None:  # on the loop thread
        if not out.finished:
            return
        # before the commit: the decode side may stamp its arrival first
        self.sink.timings.prefill_end_unix_ns = unix_ns()
        if prefill_done(out):
            self.sink.commit(first_tokens(out), first_logprobs(out))
        self.output = out
        self.done.set()
