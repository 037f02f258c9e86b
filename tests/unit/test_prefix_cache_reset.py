"""The prefix-cache reset (vLLM's POST /reset_prefix_cache, SGLang's /flush_cache): one engine
forgets every cached prefix block (a repeated prompt is computed again; the host tier's entries
go only with `external`) and refuses, changing nothing, while a request holds blocks; across the
cluster (router/cache_reset.py) every live worker of both pools is asked at once, a worker that
refuses is named while the others reset; over HTTP, vLLM's query keys, SGLang's path, a client
key where keys are set. Through real workers: tests/integration/test_http_sleep.py."""

from __future__ import annotations

import grpc
import pytest
from fastapi.testclient import TestClient

from helpers.engine import greedy, tier_settings
from helpers.http_front import front_app
from helpers.models import random_prompts
from helpers.rpc import Answer, Refused
from pdserve.engine import LLM
from pdserve.engine.errors import PrefixCacheBusy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.protos.security import ClientKeys
from pdserve.router.cache_reset import CacheResetError, RouterCacheReset

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "sk-reset-0123456789abcdef"


def test_an_engine_forgets_its_prefixes_and_keeps_the_tier_unless_told(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    per_block, kw = tier_settings(model_dir, 32, 16)
    llm = LLM(model_dir, kv_host_tier_bytes=64 * per_block, **kw)
    try:
        prompts = random_prompts([70] * 8, seed=41)  # 40 blocks in a pool of 32: some to the tier
        for p in prompts:
            llm.generate([p], greedy(2), use_tqdm=False)
        again = llm.generate([prompts[-1]], greedy(2), use_tqdm=False)[0]
        assert again.num_cached_tokens >= 48
        tier = llm.engine.block_manager.tier
        assert tier.bytes > 0
        assert llm.engine.reset_prefix_cache() > 0
        assert tier.bytes > 0  # the host tier kept (vLLM's reset_external=false)
        assert llm.engine.reset_prefix_cache(external=True) == 0
        assert tier.bytes == 0
        after = llm.generate([prompts[-1]], greedy(2), use_tqdm=False)[0]
        assert after.num_cached_tokens == 0
        again = llm.generate([prompts[-1]], greedy(2), use_tqdm=False)[0]
        assert again.num_cached_tokens >= 48 and llm.reset_prefix_cache() is True  # vLLM's LLM
        assert llm.generate([prompts[-1]], greedy(2), use_tqdm=False)[0].num_cached_tokens == 0
    finally:
        llm.shutdown()


def test_a_request_holding_blocks_makes_it_refuse_and_change_nothing(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=1 << 22, block_size=16)
    try:
        prompt = random_prompts([40], seed=42)[0]
        llm.generate([prompt], greedy(2), use_tqdm=False)
        cached = llm.engine.block_manager.num_cached_blocks
        llm.engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=4))
        llm.engine.step()
        with pytest.raises(PrefixCacheBusy, match="hold KV blocks"):
            llm.engine.reset_prefix_cache()
        assert llm.engine.block_manager.num_cached_blocks >= cached
    finally:
        llm.shutdown()


class _Stub:
    def __init__(self, blocks: int, busy: bool = False):
        self.blocks, self.busy, self.asked = blocks, busy, []

    @property
    def ResetPrefixCache(self):
        return self

    def future(self, request, timeout=None):
        self.asked.append(request.external)
        if self.busy:
            return Answer(error=Refused(grpc.StatusCode.FAILED_PRECONDITION, "1 request(s)"))
        return Answer(worker_pb2.ResetPrefixCacheResponse(blocks=self.blocks))


class _Worker:
    def __init__(self, name, blocks=0, busy=False, dead=""):
        self.name, self.dead, self.stub = name, dead, _Stub(blocks, busy)


class _Pool:
    def __init__(self, workers):
        self.workers = workers

    def members(self):
        return list(self.workers)

    def name(self, worker):
        return worker.name


def test_every_live_worker_of_both_pools_resets_and_a_busy_one_is_named():
    p0, d0, gone = _Worker("p0", 3), _Worker("d0", 5), _Worker("gone", 9, dead="silent")
    reset = RouterCacheReset(_Pool([p0, d0, gone]))
    assert reset.reset(external=True) == (2, 8)
    assert p0.stub.asked == d0.stub.asked == [True] and gone.stub.asked == []
    d0.stub.busy = True
    with pytest.raises(
        CacheResetError, match=r"1 of 2 worker\(s\) kept their prefix cache \(d0: FAILED_PRE"
    ) as e:
        reset.reset(external=False)
    assert e.value.status == 409 and p0.stub.asked == [True, False]  # p0 reset anyway
    with pytest.raises(CacheResetError, match="no live worker"):
        RouterCacheReset(_Pool([])).reset(external=False)


def test_http_takes_vllms_and_sglangs_paths():
    p0 = _Worker("p0", 4)
    client = TestClient(
        front_app(cache_reset=RouterCacheReset(_Pool([p0])), keys=ClientKeys((KEY,)))
    )
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/reset_prefix_cache").status_code == 401  # the key first
    got = client.post("/reset_prefix_cache?reset_external=true", headers=auth)
    assert got.json() == {"status": "reset", "workers": 1, "blocks": 4}
    assert client.get("/flush_cache", headers=auth).status_code == 200
    assert p0.stub.asked == [True, True]
    bad = client.post("/reset_prefix_cache?reset_running_requests=true", headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reset_running_requests"
    bad = client.post("/reset_prefix_cache?reset_external=maybe", headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reset_external"
    p0.stub.busy = True
    busy = client.post("/reset_prefix_cache", headers=auth)
    assert busy.status_code == 409 and "p0" in busy.json()["error"]["message"]
