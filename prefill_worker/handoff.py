"""Prefill-side hand-off: an engine KV sink that pushes each finished layer into a reservation.

Lifecycle of one request on a prefill worker:
  Prefill(request, reservation) -> engine prefill-only request with a PushSink
  each step, as each layer finishes -> "kv" frames for the tokens that became final (skipping the
                                       tokens the decode side already holds from its prefix cache);
                                       when the compute has every core, after the step's last layer
                                       instead (see PushSink.overlap)
  first token sampled -> "commit" frame on the same channel (so it follows all the KV); n>1: the
                         frame carries every sequence's first token (the KV is sent once)
  failure or abort    -> "abort" frame; the decode side frees the reservation
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.transport import Destination, Transport
from pdserve.kvtransfer.wire import ChunkHeader


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

    overlap: push each layer as it finishes, while the next computes (True), or push a step's
    layers after its last one (False). None decides at the first layer: overlap unless the KV is
    on the CPU and the compute threads take every core this process may use. Overlap hides the
    transfer only where it has a core to run on: with the prefill on both cores of the 2-core
    machine, the per-layer sends (and the decode side's receiving) preempted the compute, whose
    OpenMP barriers then waited on them, and cost 2-5x the transfer's own time (512 tokens of
    SmolLM2: grpc +56 ms against 29 ms sent after the compute, torch +88 ms against 21 ms;
    BENCHMARKS.md, benchmarks/cluster_bench.py).
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
    ):
        self.request_id = request_id
        self.layout = layout
        tp = len(rank_caches) if rank_caches else 1
        self.sources = (
            None
            if tp == 1
            else [
                (dataclasses.replace(layout, tp_size=tp, tp_rank=r), cache)
                for r, cache in enumerate(rank_caches)
            ]
        )
        self.transport = transport
        self.dest = dest
        self.skip = num_cached_on_decode
        self.bytes_sent = 0
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
            deferred, self._deferred = self._deferred, []
            for args in deferred:
                self._push(*args)

    def _push(
        self, layer: int, layer_kv: torch.Tensor, block_ids: list[int], start: int, end: int
    ) -> None:
        if self.sources is None:
            header, data = read_chunk(
                layer_kv, self.layout, self.request_id, layer, block_ids, start, end
            )
        else:
            parts = [
                read_chunk(cache[layer], layout, self.request_id, layer, block_ids, start, end)
                for layout, cache in self.sources
            ]
            header = dataclasses.replace(parts[0][0], head_end=parts[-1][0].head_end)
            data = torch.cat([d for _, d in parts], dim=2)  # [2, tokens, heads, head_dim]
        self.transport.send(header, data, self.dest)
        self.bytes_sent += data.numel() * data.element_size()
        self.last_send_time = time.monotonic()

    def commit(self, first_token: int | list[int], logprobs: list[float] | None = None) -> None:
        """first_token: the first token, or every sequence's in index order (n>1); logprobs:
        theirs, when the request asked for logprobs (the decode side streams them)."""
        tokens = [first_token] if isinstance(first_token, int) else list(first_token)
        self.transport.send(
            ChunkHeader(
                self.request_id,
                self.layout.fingerprint,
                kind="commit",
                first_token=tokens[0],
                first_tokens=tuple(tokens) if len(tokens) > 1 else (),
                first_logprobs=tuple(logprobs or ()),
            ),
            None,
            self.dest,
        )

    def abort(self) -> None:
        self.transport.send(
            ChunkHeader(self.request_id, self.layout.fingerprint, kind="abort"), None, self.dest
        )
