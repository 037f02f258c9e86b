"""Must-show d of issue 49, in part: the decode worker that holds a conversation's KV blocks is
killed (kill -9, not restarted) between two turns. The next turn, sent at once (the router still
believes that worker holds the earlier turns: its block index has not heard of the death), is
served with the engine's own greedy tokens, recomputed (no cached token from anywhere: the other
decode worker never held them), and without an error to the client; once the router declares the
worker dead, the index holds nothing of it.

A secured router in this process, one prefill and two decode workers in child processes
(tests/helpers/scenario_cluster.py, as the chaos scenarios run them)."""

from __future__ import annotations

import os
import signal

import pytest

from helpers.models import random_prompts
from helpers.scenario_cluster import LocalTarget
from helpers.threads import wait_until
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def generate(api, prompt: list[int]):
    """(token ids, Finish) of one request; raises the RpcError of a failed one."""
    responses = list(
        api.Generate(
            pdserve_pb2.GenerateRequest(
                sampling=GREEDY, token_ids=pdserve_pb2.TokenIds(ids=prompt)
            ),
            timeout=120,
        )
    )
    tokens = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
    assert responses[-1].HasField("finish")
    return tokens, responses[-1].finish


def local_prefills(target) -> float:
    return target.router.metrics_registry.get_sample_value(
        "pdserve:local_prefills_total", {"model_name": target.router.servicer.options.model_id}
    )


def holder_of(pool, prompt: list[int]):
    """The decode worker the router's block index says holds most of `prompt`, or None."""
    matched = pool.kv_index.matched_tokens(prompt, {w: 16 for w in pool.decode})
    best = max(matched, key=matched.get, default=None)
    return best if best is not None and matched[best] > 0 else None


def test_the_next_turn_is_served_after_the_holder_is_killed(model_dir):
    llm = LLM(model_dir, kv_cache_memory=1 << 20, max_model_len=256)
    params = SamplingParams(**sampling_kwargs(GREEDY))
    target = LocalTarget(model_dir, prefill=1, decode=2, step_s=0.0)
    try:
        api = pdserve_pb2_grpc.PDServeStub(target.channel)
        pool = target.router.pool
        turn1, message, message3 = random_prompts([40, 12, 6], seed=71)
        answer, _ = generate(api, turn1)
        turn2 = turn1 + answer + message
        wait_until(lambda: holder_of(pool, turn2) is not None, 60, "no holder in the index")
        holder = holder_of(pool, turn2)
        name = holder.worker_id
        os.kill(target.pid(name), signal.SIGKILL)
        target.killed(name, restart=False)
        want = list(llm.generate([turn2], params)[0].outputs[0].token_ids)
        local = local_prefills(target)
        got, finish = generate(api, turn2)  # at once: the router has not declared it dead
        assert got == want
        # it was still sent for the reuse the router believed in (and served by the other one)
        assert local_prefills(target) == local + 1
        assert finish.usage.cache_hits.decode_worker == 0  # recomputed, nothing stale used
        # the dead worker leaves the pool, and the index with it
        wait_until(lambda: holder not in pool.decode, 60, "the killed worker never left")
        assert not pool.kv_index.synced(holder)
        # the conversation goes on where turn 2 was served
        turn3 = turn2 + got + message3
        want3 = list(llm.generate([turn3], params)[0].outputs[0].token_ids)
        assert generate(api, turn3)[0] == want3
    finally:
        target.stop()
