"""The engine's pooling requests (embeddings: engine/request.py PoolingParams) on a tiny random
Llama in float32: the last token's final hidden state (L2-normalised or not) and the mean over
the prompt equal HF's last_hidden_state within 1e-4, whether the prompt runs whole, in chunks
(a small token budget) or after a prefix-cache hit; the blocks are all free afterwards; a
pooling request beside generating ones leaves their tokens unchanged; priorities reorder the
engine's admissions."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import greedy, run_until_done
from helpers.models import random_prompts
from pdserve.engine import LLM
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.request import PoolingParams

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4


def _engine(model_dir, **kw):
    return LLM(model_dir, dtype="float32", kv_cache_memory=1 << 20, block_size=4, **kw).engine


def _hidden(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].float()


def _pooled(engine, prompts, pooling, **kw) -> list[torch.Tensor]:
    for i, p in enumerate(prompts):
        engine.add_request(f"pool{i}", p, None, pooling=pooling, **kw)
    outs = {o.request_id: o for o in run_until_done(engine) if o.finished}
    assert all(o.outputs[0].finish_reason == "pooled" for o in outs.values())
    return [outs[f"pool{i}"].pooled for i in range(len(prompts))]


@pytest.mark.parametrize("budget", [512, 8], ids=["whole", "chunked"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
def test_pooled_vectors_equal_hf(tiny_models, budget, pooling, normalize):
    model_dir, hf = tiny_models("llama-gqa")
    engine = _engine(model_dir, max_num_batched_tokens=budget)
    prompts = random_prompts([1, 7, 30, 45], seed=5)
    got = _pooled(engine, prompts, PoolingParams(pooling, normalize))
    for p, vec in zip(prompts, got):
        h = _hidden(hf, p)
        want = h[-1] if pooling == "last" else h.mean(0)
        if normalize:
            want = torch.nn.functional.normalize(want, dim=-1)
        assert (vec - want).abs().max().item() < TOL
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.num_unfinished == 0


def test_a_repeated_prompt_reuses_the_prefix_cache_and_gives_the_same_vector(tiny_models):
    model_dir, hf = tiny_models("llama-gqa")
    engine = _engine(model_dir)
    prompt = random_prompts([33], seed=6)[0]
    (first,) = _pooled(engine, [prompt], PoolingParams())
    engine.add_request("again", prompt, None, pooling=PoolingParams())
    out = [o for o in run_until_done(engine) if o.finished][0]
    assert out.num_cached_tokens == 32  # all but the last (partial) block
    assert (out.pooled - first).abs().max().item() < TOL
    want = torch.nn.functional.normalize(_hidden(hf, prompt)[-1], dim=-1)
    assert (out.pooled - want).abs().max().item() < TOL


def test_pooling_beside_generation_leaves_the_tokens_unchanged(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    prompts = random_prompts([9, 17], seed=7)
    alone = _engine(model_dir)
    for i, p in enumerate(prompts):
        alone.add_request(f"g{i}", p, greedy(8))
    want = {o.request_id: o.outputs[0].token_ids for o in run_until_done(alone) if o.finished}
    mixed = _engine(model_dir)
    for i, p in enumerate(prompts):
        mixed.add_request(f"g{i}", p, greedy(8))
        mixed.add_request(f"e{i}", p, None, pooling=PoolingParams())
    got = {o.request_id: o for o in run_until_done(mixed) if o.finished}
    assert {k: got[k].outputs[0].token_ids for k in want} == want
    assert got["e0"].pooled is not None and got["e0"].outputs[0].token_ids == []


def test_bad_pooling_requests_are_refused():
    with pytest.raises(ValueError, match="pooling"):
        PoolingParams("cls")


def test_pooling_with_n_above_one_is_refused(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    engine = _engine(model_dir)
    with pytest.raises(InvalidRequest, match="n=1"):
        engine.add_request("x", [5, 6], greedy(2, n=2), pooling=PoolingParams())
    assert engine.scheduler.num_unfinished == 0


def test_priorities_order_the_engines_admissions(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    engine = _engine(model_dir, max_num_seqs=1)
    order = []
    for name, prio in (("low", 9), ("mid", 1), ("high", -4), ("mid2", 1)):
        engine.add_request(name, [5, 6, 7], greedy(1), priority=prio)
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "mid2", "low"]
