"""The KV hand-off from a pipelined prefill worker (issue #53, must-show b): a prefill worker
whose engine runs in 2 pipeline stages (and TP 2 inside 2 stages) hands off to a decode worker
of one stage, over grpc, shm and torch: the greedy tokens are PP=1's, and every decode block is
free afterwards on both sides. Each stage pushes its own layers as they finish, every rank of a
later stage its own heads over its own channel (engine/kv_publish.py, prefill_worker/
stage_push.py): each stage's bytes are exactly its layers' share, and rank 0 maps no later
stage's pool (those ranks have no shared file at all). Rank 0 does not wait for the last stage at
the end of each chunk of a prompt handed off in chunks (a stopped stage lets it run ahead, within
the bound). A decode worker with stages is refused."""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest
import torch

from helpers.threads import wait_until
from helpers.worker import Cluster, idle, staged_reference, start_decode
from pdserve.decode_worker.server import DecodeWorkerConfig
from pdserve.engine.parallel import stage_layers
from pdserve.protos.pdserve.v1 import worker_pb2

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_MODEL_LEN = 320  # room for the long prompt


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """A 5-layer tiny Llama (GQA: 2 kv heads) and one stage's greedy tokens for its prompts (the
    last one long enough for its prefill step to run in micro-batches through the stages)."""
    path = str(tmp_path_factory.mktemp("tiny5-handoff"))
    return staged_reference(path, [30, 7, 45, 300], 31, MAX_MODEL_LEN)


class StagedCluster(Cluster):
    """A prefill worker of `pp` stages x `tp` ranks and a decode worker of one rank."""

    def __init__(self, model_dir, backend: str, pp: int, tp: int, chunk: int | None = None, **more):
        engine = dict(kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
        staged = dict(pipeline_parallel_size=pp, tensor_parallel_size=tp, **more)
        if chunk is not None:  # a prompt longer than this is prefilled in several steps
            staged.update(max_num_batched_tokens=chunk, max_num_seqs=4)
        self.decode = start_decode(model_dir, engine=engine, lease_ms=10_000, kv_backend=backend)
        self.add_prefill(model_dir, engine=staged)


@pytest.mark.parametrize(
    "backend,pp,tp,chunk",
    [("grpc", 2, 1, None), ("shm", 2, 1, None), ("torch", 2, 1, None), ("grpc", 2, 2, None),
     ("shm", 3, 1, 16)],
    ids=["grpc-pp2", "shm-pp2", "torch-pp2", "grpc-tp2xpp2", "shm-pp3-chunked"],
)  # fmt: skip
def test_a_pipelined_prefill_hands_off_one_stages_tokens(five_layers, backend, pp, tp, chunk):
    path, prompts, want = five_layers
    cluster = StagedCluster(path, backend, pp, tp, chunk)
    try:
        assert [cluster.generate(f"pp-{i}", p) for i, p in enumerate(prompts)] == want
        each_stage_pushed_its_own_layers(cluster, pp, tp)

        def idle():
            s = cluster.stats()
            return s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0

        wait_until(idle, 5, f"decode pool not back to idle: {cluster.stats()}")
        p = cluster.p.Stats(worker_pb2.StatsRequest(), timeout=30)
        assert p.num_free_blocks == p.num_total_blocks, "prefill blocks still held"
    finally:
        cluster.stop()


class LastStageStopped:
    """A 2-stage prefill worker (shm, chunks of 64) with `prompt` reserved as `rid`, and its last
    stage's process stopped (SIGSTOP) for the `with` block's length, or until `resume()`; the
    cluster stops when the block ends."""

    def __init__(self, path, rid: str, prompt):
        self.cluster = StagedCluster(path, "shm", 2, 1, chunk=64, prefill_step_target_s=0)
        self.engine = self.cluster.prefill.loop.engine
        self._last = self.engine.tp.procs[-1]
        self._stopped = False
        try:
            self.reservation = self.cluster.reserve(rid, prompt)
            self.steps = len(self.engine.step_trace)  # before the stop
            os.kill(self._last.pid, signal.SIGSTOP)
            self._stopped = True
        except BaseException:
            self.cluster.stop()
            raise

    def resume(self) -> None:
        if self._stopped:
            os.kill(self._last.pid, signal.SIGCONT)
            self._stopped = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.resume()
        self.cluster.stop()


def test_rank_0_hands_off_a_chunk_without_waiting_for_the_last_stage(five_layers):
    """A prompt handed off in chunks: rank 0 does not wait for the last stage's push report at
    the end of each chunk (engine/tp.py TPGroup.gather_reports). With that stage's process
    stopped before the Prefill call, rank 0 still finishes PP_STEPS_AHEAD chunk steps (their
    reports pending), and the next one waits (the bound); resumed, the hand-off completes with
    PP=1's tokens, every stage's bytes reported before the reply, and every block free on both
    sides. Before, the first chunk's step waited for the stopped stage's report and never
    ended."""
    from pdserve.engine.model_runner import PP_STEPS_AHEAD

    path, prompts, want = five_layers
    prompt = prompts[-1]  # 300 tokens: 5 chunks of 64, the first 4 sample nothing
    with LastStageStopped(path, "long", prompt) as stop:
        cluster, engine, reservation, steps = (
            stop.cluster,
            stop.engine,
            stop.reservation,
            stop.steps,
        )
        replies = []
        call = threading.Thread(
            target=lambda: replies.append(cluster.prefill_req("long", prompt, reservation)),
            daemon=True,
        )
        call.start()

        def ahead():
            return len(engine.step_trace) >= steps + PP_STEPS_AHEAD

        # (generous: before, a stopped stage never let the first chunk's step end)
        wait_until(ahead, 60, "rank 0 waited for the stopped stage's push report")
        call.join(timeout=1)
        assert call.is_alive() and len(engine.step_trace) == steps + PP_STEPS_AHEAD  # the bound
        assert engine.tp.reports_pending == PP_STEPS_AHEAD
        stop.resume()
        call.join(timeout=60)
        assert not call.is_alive() and len(replies) == 1
        tokens = [t for e in cluster.stream("long") for t in e.token_ids]
        assert tokens == want[-1] and replies[0].first_tokens[0] == tokens[0]
        assert engine.tp.reports_pending == 0
        each_stage_pushed_its_own_layers(cluster, 2, 1)
        wait_until(lambda: idle(cluster), 5, f"decode pool not back to idle: {cluster.stats()}")
        p = cluster.p.Stats(worker_pb2.StatsRequest(), timeout=30)
        assert p.num_free_blocks == p.num_total_blocks, "prefill blocks still held"


def test_an_abort_is_answered_once_the_later_stages_pushed_the_request(five_layers):
    """Rank 0 runs ahead of a stopped last stage, whose pushes of the request's KV are still to
    come, in place into the decode worker's reservation (shm). The prefill worker's Abort must
    not be answered before they are over: the router frees the reservation once it is, and the
    decode side hands its blocks to other requests. Before, rank 0 answered with the stage's
    reports of the steps it ran ahead still pending (2 here), and the stage's writes could land
    in blocks already freed."""
    from pdserve.engine.model_runner import PP_STEPS_AHEAD

    path, prompts, _ = five_layers
    prompt = prompts[-1]  # 300 tokens: 5 chunks of 64
    with LastStageStopped(path, "cut", prompt) as stop:
        cluster, engine, reservation = stop.cluster, stop.engine, stop.reservation
        errors = []

        def prefill():
            try:
                cluster.prefill_req("cut", prompt, reservation)
            except grpc.RpcError as e:
                errors.append(e.code())

        call = threading.Thread(target=prefill, daemon=True)
        call.start()
        wait_until(lambda: engine.tp.reports_pending == PP_STEPS_AHEAD, 60, "rank 0 ran ahead")
        assert len(engine.step_trace) == stop.steps + PP_STEPS_AHEAD
        answers = []
        abort = threading.Thread(
            target=lambda: answers.append(
                cluster.p.Abort(worker_pb2.WorkerAbortRequest(request_id="cut"), timeout=60)
            ),
            daemon=True,
        )
        abort.start()
        abort.join(timeout=1.5)
        assert abort.is_alive(), "the Abort was answered while the last stage was stopped"
        stop.resume()
        abort.join(timeout=60)
        assert not abort.is_alive() and answers[0].found
        # every step's push reports were in before the answer: the stage's writes are over
        assert engine.tp.reports_pending == 0
        pool = cluster.decode.loop.engine.kv_cache[:, :, list(reservation.block_ids)].clone()
        call.join(timeout=60)
        assert not call.is_alive() and errors, "the aborted Prefill call was answered"
        wait_until(lambda: idle(cluster), 10, f"decode pool not back to idle: {cluster.stats()}")
        # nothing landed in the freed blocks after the Abort's answer
        now = cluster.decode.loop.engine.kv_cache[:, :, list(reservation.block_ids)]
        assert torch.equal(now, pool)
        p = cluster.p.Stats(worker_pb2.StatsRequest(), timeout=30)
        assert p.num_free_blocks == p.num_total_blocks, "prefill blocks still held"


def each_stage_pushed_its_own_layers(cluster, pp: int, tp: int) -> None:
    """Every stage sent exactly its layers' share of the KV (the same tokens and heads for every
    layer), and rank 0 maps no later stage's pool: only its own stage's TP ranks have files."""
    engine = cluster.prefill.loop.engine
    sent = cluster.prefill.servicer.stage_bytes
    layers = [end - first for first, end in (stage_layers(5, s, pp) for s in range(pp))]
    assert sorted(sent) == list(range(pp)) and all(sent[s] > 0 for s in range(pp)), sent
    for s in range(1, pp):
        assert sent[s] * layers[0] == sent[0] * layers[s], (sent, layers)
    if tp == 1:  # no shared file at all
        assert engine.kv_cache_paths == []
    else:  # the first stage's TP ranks' files only, which rank 0 reads as under TP alone
        assert all(engine.kv_cache_paths[:tp]) and engine.kv_cache_paths[tp:] == [None] * (
            tp * (pp - 1)
        )
    assert len(engine.rank_kv_caches()) == tp


def test_a_decode_worker_with_stages_is_refused():
    with pytest.raises(ValueError, match="a decode worker runs in one pipeline stage"):
        DecodeWorkerConfig(model="m", engine_kwargs={"pipeline_parallel_size": 2})
