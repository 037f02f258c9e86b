"""Prefill-only requests' KV leaving layer by layer, while the step's later layers compute.

A prefill-only request added with a kv_sink (engine_core.add_request) has each layer's KV handed
to `kv_sink.on_layer(layer, layer_kv, block_ids, start, end)` as soon as that layer's KV is
final, so a transfer to another engine overlaps the rest of the step. The engine builds one
LayerPublisher per step that computes such a request (`layer_publisher`), the model runner puts
it in the step's forward context, and each attention layer calls it once it has written its KV.
Under tensor parallelism the hook runs on rank 0, and a sink reads every rank's pool: a layer's
KV on the other ranks is known written only once rank 0 has passed that layer's closing
all-reduce, so there the publisher hands layer i - 1 on when layer i reports, and the last layer
when the forward pass is over (`finish`). `finish` also records how far each request's KV has
been published, so the next chunk of a long prompt starts where this one ended.

Under pipeline parallelism rank 0 runs the first stage only: its layers leave as above, and the
later stages' layers leave in `finish`, once the forward pass came back through the last stage
(each stage wrote its KV before handing its activations on), read from the stages' pools through
their shared files (StageCaches).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch


class StageCaches:
    """The KV pools of one TP index in every pipeline stage, indexed by global layer: stage s's
    pool holds its contiguous range of layers (engine/parallel.py's stage_layers)."""

    def __init__(self, pools: list[torch.Tensor]):
        self.pools = pools
        self.starts = [0]
        for pool in pools[:-1]:
            self.starts.append(self.starts[-1] + pool.shape[0])
        self.num_layers = self.starts[-1] + pools[-1].shape[0]

    def __getitem__(self, layer: int) -> torch.Tensor:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside the model's {self.num_layers}")
        stage = bisect.bisect_right(self.starts, layer) - 1
        return self.pools[stage][layer - self.starts[stage]]


class LayerPublisher:
    """The kv_sinks of one step: (request, its block ids, the end of what this step computes)."""

    def __init__(
        self,
        layer_kv: Callable[[int], torch.Tensor],
        num_local: int,
        num_layers: int,
        pubs: list[tuple],
        lag: bool,
    ):
        self.layer_kv = layer_kv  # global layer -> its KV on TP rank 0 of its stage
        self.num_local = num_local  # the layers this rank's stage runs (the first ones)
        self.num_layers = num_layers  # the model's
        self.pubs = pubs
        self.lag = lag  # tensor parallelism: publish a layer once the next one is reached

    def __call__(self, layer: int) -> None:
        """Layer `layer` has written its KV on this rank."""
        if not self.lag:
            self._publish(layer)
        elif layer > 0:
            self._publish(layer - 1)

    def finish(self) -> None:
        """The forward pass is over: the layer still held back leaves, and every request's
        published position moves to the end of this step's tokens."""
        if self.lag:
            self._publish(self.num_local - 1)
        for layer in range(self.num_local, self.num_layers):  # the later pipeline stages'
            self._publish(layer)
        for req, _, end in self.pubs:
            req.published = end

    def _publish(self, layer: int) -> None:
        kv = self.layer_kv(layer)
        for req, block_ids, end in self.pubs:
            req.kv_sink.on_layer(layer, kv, block_ids, req.published, end)


def layer_publisher(
    plan,
    requests: dict,
    layer_kv: Callable[[int], torch.Tensor],
    num_local: int,
    num_layers: int,
    lag: bool,
):
    """The step's LayerPublisher, or None when no scheduled request has a kv_sink."""
    pubs = []
    for item in plan.scheduled:
        req = requests.get(item.seq.request_id)
        if req is not None and req.kv_sink is not None:
            pubs.append((req, item.seq.block_ids, item.end))
    return LayerPublisher(layer_kv, num_local, num_layers, pubs, lag) if pubs else None
