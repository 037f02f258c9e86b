"""`up()` on a local Ray (the `pdserve up` code path): 1 prefill + 1 decode actor and the router,
or two colocated workers; a client's greedy Generate through the router equals the in-process
engine's tokens."""
from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("router") is None
                       or importlib.util.find_spec("router.server") is None,
                       reason="router not available"),
]

MAX_TOKENS = 16
KV_BYTES = 4 << 20


@pytest.mark.parametrize("shape", ["disaggregated", "colocated"])
def test_up_generate_stop(tiny_models, shape):
    import grpc

    from deploy.config import validate_config
    from deploy.launcher import up
    from engine import LLM, SamplingParams
    from protos.pdserve.v1 import pdserve_pb2 as pb
    from protos.pdserve.v1 import pdserve_pb2_grpc
    from conftest import random_prompts

    model_dir, _ = tiny_models("llama-gqa")
    prompt_ids = random_prompts([23], seed=5)[0]
    llm = LLM(model_dir, kv_cache_memory=KV_BYTES)
    want = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
    want = list(want[0].outputs[0].token_ids)
    llm.shutdown()
    assert len(want) == MAX_TOKENS

    # a short private temp dir: Ray's Unix socket paths live under it and have a length limit
    ray_tmp = tempfile.mkdtemp(prefix="pdray")
    pool = {"replicas": 1, "tp": 1, "resources": {"num_cpus": 1}, "kv_cache_memory": KV_BYTES}
    pools = {"prefill": pool, "decode": pool} if shape == "disaggregated" else \
        {"colocated": {**pool, "replicas": 2}}
    config = validate_config({"model": model_dir, "pools": pools,
                              "router": {"port": 0}, "ray": {"num_cpus": 2, "temp_dir": ray_tmp}})
    t0 = time.perf_counter()
    cluster = up(config, block=False)
    try:
        t_up = time.perf_counter() - t0
        want_workers = (1, 1) if shape == "disaggregated" else (2, 0)
        assert (len(cluster.addresses("decode")), len(cluster.addresses("prefill"))) == want_workers
        assert cluster.router_address
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt_ids),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        got, finish = [], None
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            for resp in stub.Generate(request, timeout=60):
                if resp.HasField("delta"):
                    got += list(resp.delta.token_ids)
                else:
                    finish = resp.finish
        assert got == want
        assert finish is not None and finish.finish_reason == "length", finish
    finally:
        cluster.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    import ray
    assert not ray.is_initialized()      # up() started this Ray, so stop() shut it down
    print(f"{shape}: up {t_up:.1f}s, total {time.perf_counter() - t0:.1f}s")
