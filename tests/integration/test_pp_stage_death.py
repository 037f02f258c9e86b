"""A pipeline stage of a prefill worker dies (issue #53, must-show b's failure half): the follower
process of stage 1 is killed with SIGKILL; the next prompt sent there fails its step at once
(gloo: "Connection closed by peer"), the worker's engine is broken from then on, its Prefill
answers UNAVAILABLE, so the router prefills that prompt on the other worker and the client gets
the engine's greedy tokens; the decode worker holds nothing reserved, and the broken worker's
Stats fails UNAVAILABLE naming the dead rank (the router takes it down; in a deployment its
process exits and is replaced: deploy/workers.py)."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from helpers.models import make_tiny_model, random_prompts
from helpers.router import RPC_TIMEOUT, start_router, stop_router
from helpers.threads import wait_until
from helpers.worker import MAX_MODEL_LEN, start_decode, start_prefill
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_a_killed_stage_breaks_its_worker_and_the_prompt_is_served_elsewhere(tmp_path):
    path = str(tmp_path / "tiny5")
    make_tiny_model(path, "llama-gqa", seed=5, num_hidden_layers=5)
    prompts = random_prompts([30, 21], seed=37)
    llm = LLM(path, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.shutdown()

    engine = dict(kv_cache_memory=1 << 17, max_model_len=MAX_MODEL_LEN)
    decode = start_decode(path, engine=engine, lease_ms=10_000)
    staged = start_prefill(path, "p-staged", engine=dict(pipeline_parallel_size=2))
    plain = start_prefill(path, "p-plain")
    router = start_router(path, [staged.address, plain.address], [decode.address])
    channel = grpc.insecure_channel(staged.address)
    try:
        follower = staged.loop.engine.tp.procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        for prompt, tokens in zip(prompts, want):  # round-robin: one of them goes to p-staged
            got = []
            for r in router.api.Generate(
                pdserve_pb2.GenerateRequest(
                    token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=GREEDY
                ),
                timeout=RPC_TIMEOUT,
            ):
                if r.HasField("delta"):
                    got += r.delta.token_ids
                else:
                    assert r.finish.timings.prefill_worker == "p-plain"
            assert got == tokens
        assert "a rank of its engine died" in staged.loop.broken
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.PrefillWorkerStub(channel).Stats(
                worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine is broken" in refused.value.details()
        d = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(decode.address))
        wait_until(
            lambda: d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT).num_reserved == 0,
            5,
            "the decode worker holding nothing reserved",
        )
    finally:
        channel.close()
        stop_router(router)
        for w in (plain, staged, decode):
            w.stop()
