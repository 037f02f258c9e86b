"""Tensor parallelism on tiny random models: TP=2 gives TP=1's tokens, and a TP size that does not
divide the heads (or is 0) is refused without leaving a process group behind."""
from __future__ import annotations

import pytest

from conftest import assert_no_leaks
from engine import LLM
from engine_helpers import KV, greedy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias"])
def test_tp2_matches_tp1(refs, kind):
    model_dir, _, prompts, _ = refs(kind)
    prompts = [prompts[i] for i in (0, 3, 5, 6, 9)]   # 1, 17, 100, 200 and a shared-prefix one
    kw = dict(kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)
    tp1 = LLM(model_dir, **kw)
    want = [o.outputs[0].token_ids for o in tp1.generate(prompts, greedy(), use_tqdm=False)]
    llm = LLM(model_dir, tensor_parallel_size=2, **kw)
    try:
        got = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        # a later, smaller batch over the same ranks (decode + prefix hits across steps)
        again = llm.generate(prompts[:2], greedy(8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [w[:8] for w in want[:2]]
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
    assert llm.engine.tp is None


def test_tp_must_divide_heads(refs):
    model_dir, _, prompts, expected = refs("llama-gqa")
    with pytest.raises(ValueError, match="tensor_parallel_size") as exc:
        llm = LLM(model_dir, kv_cache_memory=KV, tensor_parallel_size=3)
        llm.shutdown()
    assert "heads" in str(exc.value)
    # nothing of the refused group is left behind: a single-process engine still works
    import torch.distributed as dist
    assert not dist.is_initialized()
    llm = LLM(model_dir, kv_cache_memory=KV)
    assert llm.generate(prompts[1], greedy(), use_tqdm=False)[0].outputs[0].token_ids == expected[1]


def test_tp_zero_is_refused(refs):
    model_dir, *_ = refs("llama-gqa")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir, kv_cache_memory=KV, tensor_parallel_size=0)
