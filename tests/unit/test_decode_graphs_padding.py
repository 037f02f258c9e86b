"""The decode graphs' padded forward (engine/cuda_graphs.py), run eagerly on CPU: the same static
buffers, bucketed batch and block-table widths, and spare block that CUDA replays, so the padding
is checked on every machine. The capture and replay themselves are checked by tests/gpu."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import KV, greedy
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, model_runner
from pdserve.engine.cuda_graphs import BATCH_BUCKETS, batch_bucket

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Runners built inside the test take the graph path on CPU."""
    monkeypatch.setattr(model_runner, "graphs_apply", lambda device, tp, enabled: enabled)


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 3, 5, 17, 256)] == [1, 4, 8, 24, 256]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias"])
def test_padded_decode_matches_hf(refs, graphs_on_cpu, kind):
    model_dir, _, prompts, expected = refs(kind)
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.graphs is not None
    # the spare block is outside what the scheduler may hand out
    assert runner.num_blocks == runner.kv_cache.shape[2] - 1
    assert llm.engine.block_manager.num_blocks == runner.num_blocks
    spare = runner.kv_cache[:, :, -1].clone()
    # five at once: their decode steps are padded to the bucket of 8
    outs = llm.generate(prompts[:5], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:5]
    assert not runner.graphs.capture and not runner.graphs.recorded  # eager on CPU
    assert not torch.equal(spare, runner.kv_cache[:, :, -1])  # padded rows wrote the spare
    assert_no_leaks(llm.engine)


def test_graphs_off_keeps_every_block(refs, graphs_on_cpu):
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, cuda_graphs=False)
    assert llm.engine.runner.graphs is None
    assert llm.engine.runner.num_blocks == llm.engine.runner.kv_cache.shape[2]
    assert [
        o.outputs[0].token_ids for o in llm.generate(prompts[:2], greedy(), use_tqdm=False)
    ] == expected[:2]


def test_steps_that_graphs_do_not_take(refs, graphs_on_cpu, monkeypatch):
    """Only decode-only steps take the graph path: prompt chunks (here 16 tokens a step, so
    prompts are chunked beside running decodes) and steps with a prompt chunk run eagerly."""
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_batched_tokens=16)
    graphs = llm.engine.runner.graphs
    steps = []
    real_step = graphs._step

    def step(seqs, key):
        steps.append([(len(s.token_ids), bool(s.prompt_targets)) for s in seqs])
        return real_step(seqs, key)

    monkeypatch.setattr(graphs, "_step", step)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert steps and all(row == (1, False) for step in steps for row in step)
    assert max(map(len, steps)) > 1  # batched decodes were padded together
