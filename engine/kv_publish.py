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

Under pipeline parallelism each stage pushes its own layers, wherever its ranks run (another
host included): rank 0 runs the first stage, whose layers leave through the request's sink as
above (with its stage's TP ranks' pools, as under tensor parallelism), and every rank of a later
stage pushes its own heads of its own layers as each finishes (`StagePusher`, on that rank; a
rank whose heads another rank of its stage holds too, as every rank holds an MLA model's latent,
pushes nothing and reports REPLICA).
What those ranks need travels with the step's ModelInput (`stage_pushes`: each request's
`kv_sink.stage_spec()`, plain data naming the decode side's reservation, and the token range);
the sender itself comes from the engine's `kv_stage_sender` (a prefill worker's, picklable, so
it reaches ranks on other hosts), whose `channels()` opens, caches and closes the ranks' own KV
channels. After the step each pushing rank flushes its frames (handed to the decode side) and
reports what it sent, or that it failed, to rank 0 (`report_rows`, gathered by engine/tp.py
without rank 0 waiting for it after a chunk that samples nothing); rank 0 hands the reports to
the sinks (`kv_sink.on_stage_report`) at the latest at the end of the step that samples the
request, before its output leaves the engine, so the request's commit follows every stage's KV,
and a stage that could not push fails its request. No rank reads another stage's pool.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# a push report's status (one row per request, per rank: [bytes sent, status]); REPLICA: a
# rank whose heads another rank of its stage holds too and sends (an MLA model's latent)
NOT_PUSHED, PUSHED, PUSH_FAILED, REPLICA = 0, 1, 2, 3


class LayerPublisher:
    """The kv_sinks of one step: (request, its block ids, the end of what this step computes)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        pubs: list[tuple],
        lag: bool,
        states=None,
        finals: list[tuple] = (),
    ):
        self.kv = kv_cache  # this rank's pool: the first stage's layers, global layer = local
        self.pubs = pubs
        self.lag = lag  # tensor parallelism: publish a layer once the next one is reached
        # a hybrid model's recurrent states, slot -> each layer's SlotState (every rank's part:
        # LLMEngine.state_views), and (request, slot) of the requests whose prompt this step
        # completes: their state leaves after the pass (every rank has written it by then: each
        # recurrent layer ends in its output projection's all-reduce)
        self.states = states
        self.finals = finals

    def __call__(self, layer: int) -> None:
        """Layer `layer` has written its KV on this rank."""
        if not self.lag:
            self._publish(layer)
        elif layer > 0:
            self._publish(layer - 1)

    def finish(self) -> None:
        """The forward pass is over: the layer still held back leaves, each sink ends its step
        (what it deferred leaves), and every request's published position moves to the end of
        this step's tokens."""
        if self.lag and self.kv.shape[0]:  # (none held back where no layer keeps KV: Mamba2's)
            self._publish(self.kv.shape[0] - 1)
        for req, slot in self.finals:  # (a hybrid's state is final once the prompt is)
            for layer, state in enumerate(self.states(slot)):
                req.kv_sink.on_state(layer, state.read())
        for req, _, _ in self.pubs:
            end_step = getattr(req.kv_sink, "end_step", None)
            if end_step is not None:
                end_step()
        for req, _, end in self.pubs:
            req.published = end

    def _publish(self, layer: int) -> None:
        for req, block_ids, end in self.pubs:
            req.kv_sink.on_layer(layer, self.kv[layer], block_ids, req.published, end)

    def stage_pushes(self) -> list:
        """What the later stages' ranks push of this step (ModelInput.kv_pushes): per request,
        [request id, its block ids, first token, end token, its sink's stage_spec()]. Called
        before the step runs, so the first token is where the published KV ends."""
        return [
            [req.request_id, list(block_ids), req.published, end, req.kv_sink.stage_spec()]
            for req, block_ids, end in self.pubs
        ]

    def stage_reports(self, reports: torch.Tensor, stage_of_rank: list[int]) -> None:
        """reports: [ranks, requests, 2] (bytes, status) as each rank reported them; each sink
        hears, per later stage, the bytes its ranks sent and whether any of them failed or did
        not push at all."""
        for i, (req, _, _) in enumerate(self.pubs):
            stages: dict[int, list] = {}
            for rank, stage in enumerate(stage_of_rank):
                if stage == 0:
                    continue
                sent, status = (int(v) for v in reports[rank, i])
                entry = stages.setdefault(stage, [0, True])
                entry[0] += sent
                entry[1] = entry[1] and status in (PUSHED, REPLICA)
            for stage, (sent, ok) in sorted(stages.items()):
                req.kv_sink.on_stage_report(stage, sent, ok)


def layer_publisher(plan, requests: dict, kv_cache: torch.Tensor, lag: bool, states=None):
    """The step's LayerPublisher, or None when no scheduled request has a kv_sink. states: a
    hybrid model's LLMEngine.state_views (None: the model has none). Called as the step starts:
    a sink with an `on_step_start()` hears of it (when its prompt's compute began: the first
    layer's KV may come much later, after a hybrid's recurrent layers or, under tensor
    parallelism, a layer late)."""
    pubs, finals = [], []
    for item in plan.scheduled:
        req = requests.get(item.seq.request_id)
        if req is not None and req.kv_sink is not None:
            pubs.append((req, item.seq.block_ids, item.end))
            if states is not None and item.end == item.seq.num_prompt_tokens:
                finals.append((req, item.seq.state_slot))
            started = getattr(req.kv_sink, "on_step_start", None)
            if started is not None:
                started()
    return LayerPublisher(kv_cache, pubs, lag, states, finals) if pubs else None


class StagePusher:
    """On a rank of a later pipeline stage: pushes this rank's heads of its stage's layers of
    each step's prefill-only requests (ModelInput.kv_pushes) through the engine's
    kv_stage_sender's channels. One per rank, for the rank's life (`close` ends its channels)."""

    def __init__(
        self, sender, first_layer: int, end_layer: int, tp_size: int, tp_rank: int, stage: int
    ):
        self.channels = sender.channels()
        # the global indices of this stage's first layer and of the one after its last
        self.first_layer, self.end_layer = first_layer, end_layer
        self.stage = stage  # this rank's pipeline stage
        self.tp_size, self.tp_rank = tp_size, tp_rank

    def open(self, request_id: str, spec: dict):
        """This rank's sink of one request's step, on the channel its spec leads to."""
        return self.channels.open(
            request_id,
            spec,
            self.tp_size,
            self.tp_rank,
            stage=self.stage,
            layers=(self.first_layer, self.end_layer),
        )

    def step(self, pushes: list, kv_cache: torch.Tensor) -> StageStep:
        return StageStep(self, pushes, kv_cache)

    def close(self) -> None:
        self.channels.close()


class StageStep:
    """One step's pushes on a later stage's rank: the layer hook, then `finish`, which returns
    this rank's report rows. A request whose push fails stops pushing; the others go on."""

    def __init__(self, pusher: StagePusher, pushes: list, kv_cache: torch.Tensor):
        self.pusher = pusher
        self.kv = kv_cache
        self.items = []  # [sink or None, block ids, start, end, failed (its error, or True)]
        for rid, block_ids, start, end, spec in pushes:
            try:
                sink = pusher.open(rid, spec)
            except Exception as e:
                log.warning("stage KV push of %s: no channel: %r", rid, e)
                self.items.append([None, block_ids, start, end, True])
            else:
                self.items.append([sink, block_ids, start, end, False])

    def __call__(self, layer: int) -> None:
        """Local layer `layer` has written its KV on this rank (its own pool: no lag)."""
        kv = self.kv[layer]
        for item in self.items:
            sink, block_ids, start, end, failed = item
            if failed:
                continue
            try:
                sink.on_layer(self.pusher.first_layer + layer, kv, block_ids, start, end)
            except Exception as e:
                log.warning("stage KV push of %s failed: %r", sink.request_id, e)
                item[4] = e

    def finish(self) -> list[list[int]]:
        """What was deferred leaves, every channel used is flushed (its frames handed to the
        decode side), and one [bytes sent, status] row per request comes back."""
        rows = []
        for item in self.items:
            sink, _, _, _, failed = item
            if not failed:
                try:
                    sink.end_step()
                    self.pusher.channels.flush(sink)
                except Exception as e:
                    log.warning("stage KV push of %s failed: %r", sink.request_id, e)
                    failed = e
            if failed and sink is not None:
                self.pusher.channels.failed(sink, failed)
            sent = sink.bytes_sent if sink is not None else 0
            rows.append([sent, PUSH_FAILED if failed else PUSHED])
        return rows


def report_rows(num_pushes: int, step: StageStep | None, replica: bool = False) -> torch.Tensor:
    """This rank's report of a step with `num_pushes` pushes, as the int64 tensor rank 0
    gathers: its StageStep's rows, or NOT_PUSHED rows from a rank that pushes nothing (REPLICA
    from one whose heads another rank of its stage sends)."""
    if step is not None:
        rows = step.finish()
    else:
        rows = [[0, REPLICA if replica else NOT_PUSHED]] * num_pushes
    return torch.tensor(rows, dtype=torch.int64).reshape(num_pushes, 2)
