"""The KV hand-off from a pipelined prefill worker (issue #53, must-show b): a prefill worker
whose engine runs in 2 pipeline stages (and TP 2 inside 2 stages) hands off to a decode worker
of one stage, over grpc, shm and torch: the greedy tokens are PP=1's, and every decode block is
free afterwards. Rank 0 runs the first stage and pushes its layers as they finish; the later
stages' layers leave once the forward pass has come back, read from their shared pool files
(engine/kv_publish.py). A decode worker with stages is refused."""

from __future__ import annotations

import grpc
import pytest

from helpers.models import make_tiny_model, random_prompts
from helpers.threads import wait_until
from helpers.worker import GREEDY, Cluster, start_decode, start_prefill
from pdserve.decode_worker.server import DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import worker_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_MODEL_LEN = 320  # room for the long prompt


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """A 5-layer tiny Llama (GQA: 2 kv heads) and one stage's greedy tokens for its prompts (the
    last one long enough for its prefill step to run in micro-batches through the stages)."""
    path = str(tmp_path_factory.mktemp("tiny5-handoff"))
    make_tiny_model(path, "llama-gqa", seed=5, num_hidden_layers=5)
    prompts = random_prompts([30, 7, 45, 300], seed=31)
    llm = LLM(path, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    llm.shutdown()
    return path, prompts, [o.outputs[0].token_ids for o in outs]


class StagedCluster(Cluster):
    """A prefill worker of `pp` stages x `tp` ranks and a decode worker of one rank."""

    def __init__(self, model_dir, backend: str, pp: int, tp: int, chunk: int | None = None):
        engine = dict(kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
        staged = dict(pipeline_parallel_size=pp, tensor_parallel_size=tp)
        if chunk is not None:  # a prompt longer than this is prefilled in several steps
            staged.update(max_num_batched_tokens=chunk, max_num_seqs=4)
        self.decode = start_decode(model_dir, engine=engine, lease_ms=10_000, kv_backend=backend)
        try:
            self.prefill = start_prefill(model_dir, engine=staged)
        except BaseException:
            self.decode.stop()
            raise
        self.channels = [grpc.insecure_channel(w.address) for w in (self.decode, self.prefill)]
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.channels[0])
        self.p = worker_pb2_grpc.PrefillWorkerStub(self.channels[1])


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

        def idle():
            s = cluster.stats()
            return s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0

        wait_until(idle, 5, f"decode pool not back to idle: {cluster.stats()}")
    finally:
        cluster.stop()


def test_a_decode_worker_with_stages_is_refused():
    with pytest.raises(ValueError, match="a decode worker runs in one pipeline stage"):
        DecodeWorkerConfig(model="m", engine_kwargs={"pipeline_parallel_size": 2})
