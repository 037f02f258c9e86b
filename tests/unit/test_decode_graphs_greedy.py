"""Greedy tokens taken on the device by the decode graphs (engine/cuda_graphs.py run_greedy), run
eagerly on CPU: an all-greedy graph step returns its rows' argmax without the host sampler, and
its tokens equal the host sampler's (HF's); a step with a sampled or shaped row samples on the
host as before. The replay and the pinned asynchronous copy are checked by tests/gpu."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy
from pdserve.engine import LLM, SamplingParams, model_runner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Runners built inside the test take the graph path on CPU."""
    monkeypatch.setattr(model_runner, "graphs_apply", lambda device, tp, enabled: enabled)


def _count_paths(monkeypatch, graphs) -> dict[str, int]:
    calls = {"greedy": 0, "logits": 0}
    real_greedy, real_run = graphs.run_greedy, graphs.run

    def run_greedy(seqs, key):
        calls["greedy"] += 1
        return real_greedy(seqs, key)

    def run(seqs, key):
        calls["logits"] += 1
        return real_run(seqs, key)

    monkeypatch.setattr(graphs, "run_greedy", run_greedy)
    monkeypatch.setattr(graphs, "run", run)
    return calls


def test_greedy_steps_take_the_device_argmax(refs, graphs_on_cpu, monkeypatch):
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_seqs=8)
    calls = _count_paths(monkeypatch, llm.engine.runner.graphs)
    # five at once, padded to the bucket of 8; one stops early on max_tokens
    params = [greedy() for _ in range(4)] + [greedy(max_tokens=3)]
    outs = llm.generate(prompts[:5], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected[:4] + [expected[4][:3]]
    assert calls["greedy"] > 0 and calls["logits"] == 0


def test_sampled_or_logprob_rows_sample_on_the_host(refs, graphs_on_cpu, monkeypatch):
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_seqs=8)
    calls = _count_paths(monkeypatch, llm.engine.runner.graphs)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts[:2], [greedy(), sampled], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[0]
    assert calls["logits"] > 0
    calls["greedy"] = calls["logits"] = 0
    outs = llm.generate(prompts[:1], [greedy(logprobs=True)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[0]
    assert outs[0].outputs[0].logprobs and calls["greedy"] == 0
