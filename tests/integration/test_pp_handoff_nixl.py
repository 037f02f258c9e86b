"""The KV hand-off from a pipelined prefill worker over nixl (issue #53): a prefill worker of 2
pipeline stages hands off to a decode worker serving only nixl, each stage's rank claiming the
reservation as its part of one sender and WRITEing its own layers from its own process
(prefill_worker/stage_push.py, kvtransfer/backends/nixl_backend.py). The greedy tokens are one
stage's, in one step and in chunks (a claim and a release per step on the later stage); every
block is free afterwards on both sides, and the decode worker holds no claim and stays healthy.
A reservation the decode side ends while the later stage's claim is open (it claimed, its
WRITEs are to come) is held, not freed, and freed once that stage released and rank 0 sent its
last word: well before the claim's bound, with no stuck claim. Skipped where NIXL is not
installed."""

from __future__ import annotations

import threading

import grpc
import pytest

from helpers.threads import wait_until
from helpers.worker import Cluster, idle, staged_reference, start_decode
from pdserve.engine.parallel import stage_layers
from pdserve.kvtransfer.backends.claims import Grants
from pdserve.kvtransfer.backends.nixl_backend import nixl_available
from pdserve.protos.pdserve.v1 import worker_pb2

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not nixl_available(), reason="NIXL is not installed: pip install 'pdserve[nixl]'"
    ),
]
LAYERS = 5
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """A 5-layer tiny Llama (GQA) and one stage's greedy tokens for its prompts."""
    path = str(tmp_path_factory.mktemp("tiny5-nixl-pp"))
    return staged_reference(path, [30, 7, 45, 100], 53, MAX_MODEL_LEN, LAYERS)


class NixlStaged(Cluster):
    """A decode worker on nixl alone and a prefill worker of 2 stages of `tp` ranks each
    (prompts in chunks of `chunk` tokens)."""

    def __init__(self, model_dir, chunk: int | None = None, tp: int = 1):
        engine = dict(kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
        staged = dict(pipeline_parallel_size=2, tensor_parallel_size=tp)
        if chunk is not None:  # every chunk takes the whole budget (tokens per step)
            staged.update(max_num_batched_tokens=chunk, max_num_seqs=4, prefill_step_target_s=0)
        self.decode = start_decode(model_dir, engine=engine, lease_ms=30_000, kv_backend="nixl")
        self.add_prefill(model_dir, engine=staged)

    @property
    def grants(self) -> Grants:
        return self.decode.handoff.grants


def record_claims(monkeypatch) -> list:
    """Every claim the decode side took: (request id, agent, its PipelineStage)."""
    claims, original = [], Grants.claim

    def claim(self, request_id, token, block_ids, agent="", process=None, peer="", stage=None):
        window = original(self, request_id, token, block_ids, agent, process, peer, stage)
        claims.append((request_id, agent, stage))
        return window

    monkeypatch.setattr(Grants, "claim", claim)
    return claims


def all_clear(cluster, refused: int = 0) -> None:
    """Every block free on both sides, no claim held or stuck, the decode worker healthy;
    `refused` claims and frames refused meanwhile."""
    wait_until(lambda: idle(cluster), 10, f"decode pool not back to idle: {cluster.stats()}")
    grants = cluster.grants
    assert grants.num_held == 0 and grants.stuck() == "" and grants.num_stuck_total == 0
    assert grants.num_refused == refused
    assert cluster.decode.handoff.unhealthy == ""
    p = cluster.p.Stats(worker_pb2.StatsRequest(), timeout=30)
    assert p.num_free_blocks == p.num_total_blocks, "prefill blocks still held"


@pytest.mark.parametrize(
    "chunk, tp", [(None, 1), (16, 1), (None, 2)], ids=["pp2", "pp2-chunked", "tp2xpp2"]
)
def test_a_pipelined_prefill_hands_off_over_nixl(five_layers, monkeypatch, chunk, tp):
    path, prompts, want = five_layers
    claims = record_claims(monkeypatch)
    cluster = NixlStaged(path, chunk, tp)
    try:
        assert [cluster.generate(f"pp-{i}", p) for i, p in enumerate(prompts)] == want
        # each stage claimed as its part of one sender per request, from an agent of its own
        for i, prompt in enumerate(prompts):
            mine = [(agent, s) for rid, agent, s in claims if rid == f"pp-{i}"]
            parts = {(s.stage, s.rank, s.layers) for _, s in mine}
            later = {(1, r, stage_layers(LAYERS, 1, 2)) for r in range(tp)}
            assert parts == {(0, 0, stage_layers(LAYERS, 0, 2))} | later, mine
            assert len({s.sender for _, s in mine}) == 1 and all(s.stages == 2 for _, s in mine)
            # rank 0 and each rank of the later stage: a process and an agent each
            assert len({agent for agent, _ in mine}) == 1 + tp
            steps = -(-len(prompt) // chunk) if chunk else 1
            # each later stage's rank claims once per step it pushes in (and releases after it)
            assert sum(1 for _, s in mine if s.stage == 1) == steps * tp
        sent = cluster.prefill.servicer.stage_bytes
        first, later = (e - f for f, e in (stage_layers(LAYERS, s, 2) for s in (0, 1)))
        assert sent[0] > 0 and sent[1] * first == sent[0] * later, sent
        all_clear(cluster)
    finally:
        cluster.stop()


def test_a_reservation_ended_while_the_later_stage_may_write_is_held_until_it_released(
    five_layers, monkeypatch
):
    """The decode side aborts the reservation right after the later stage's claim (the router's
    Abort, say), before that stage posted a WRITE: its blocks stay held (that stage may still
    write), and the worker is not unhealthy; the stage then WRITEs into the held blocks, flushes
    (its headers are dropped: the reservation is gone) and releases, rank 0 sends its commit,
    and the blocks are freed, long before the claim's bound."""
    path, prompts, _ = five_layers
    cluster = NixlStaged(path)
    seen, original = [], Grants.claim

    def claim(self, request_id, token, block_ids, agent="", process=None, peer="", stage=None):
        window = original(self, request_id, token, block_ids, agent, process, peer, stage)
        if stage is not None and stage.stage == 1 and not seen:
            # on the decode worker's control thread, the stage's claim not answered yet
            found = cluster.decode.handoff.abort(request_id, "aborted by the test")
            seen.append((found, self.num_held, self.stuck(), cluster.decode.handoff.unhealthy))
        return window

    monkeypatch.setattr(Grants, "claim", claim)
    try:
        reservation = cluster.reserve("h0", prompts[0])
        replies, errors = [], []

        def prefill():
            try:
                replies.append(cluster.prefill_req("h0", prompts[0], reservation))
            except grpc.RpcError as e:
                errors.append(e)

        call = threading.Thread(target=prefill, daemon=True)
        call.start()
        call.join(timeout=60)
        assert not call.is_alive()
        assert seen == [(True, 1, "", "")], seen  # held, and healthy
        assert cluster.grants.release_bound_s > 60  # (freed below well within it)
        wait_until(lambda: cluster.grants.num_held == 0, 10, "the held blocks were not freed")
        assert cluster.grants.num_released_sender_gone == 0  # by the senders' words, not proof
        # (rank 0 may have claimed after the abort: refused, it sends its abort instead)
        refused = cluster.grants.num_refused
        assert refused <= 1 and len(replies) + len(errors) == 1
        all_clear(cluster, refused)
        # the worker serves the next request as before
        assert cluster.generate("h1", prompts[1])
        all_clear(cluster, refused)
    finally:
        cluster.stop()
