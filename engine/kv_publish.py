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
"""

from __future__ import annotations

import torch


class LayerPublisher:
    """The kv_sinks of one step: (request, its block ids, the end of what this step computes)."""

    def __init__(self, kv_cache: torch.Tensor, pubs: list[tuple], lag: bool):
        self.kv = kv_cache
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
            self._publish(self.kv.shape[0] - 1)
        for req, _, end in self.pubs:
            req.published = end

    def _publish(self, layer: int) -> None:
        for req, block_ids, end in self.pubs:
            req.kv_sink.on_layer(layer, self.kv[layer], block_ids, req.published, end)


def layer_publisher(plan, requests: dict, kv_cache: torch.Tensor, lag: bool):
    """The step's LayerPublisher, or None when no scheduled request has a kv_sink."""
    pubs = []
    for item in plan.scheduled:
        req = requests.get(item.seq.request_id)
        if req is not None and req.kv_sink is not None:
            pubs.append((req, item.seq.block_ids, item.end))
    return LayerPublisher(kv_cache, pubs, lag) if pubs else None
