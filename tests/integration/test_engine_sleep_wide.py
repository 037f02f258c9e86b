"""Sleep mode across tensor-parallel ranks and model families (engine/sleep.py): with TP 2 and
the pools in shared files (as a decode worker's, which shm senders write in place), a level-2
sleep frees every rank's pool file on the filesystem and every rank's weights, and the woken
engine answers as HF's model does, token for token; and each family whose layers keep more than
plain linears (mixtures of experts, Gemma's norms and windows, Phi-3's fused tensors, Granite's
multipliers) answers after a level-2 sleep and wake as it did before. One engine's levels, tags
and refusals: tests/unit/test_engine_sleep.py."""

from __future__ import annotations

import os

import pytest

from helpers.arch import build_arch_model
from helpers.engine import greedy
from helpers.models import hf_greedy, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")
POOL = 16 << 20
MAX_TOKENS = 10


def _allocated(paths) -> list[int]:
    return [os.stat(p).st_blocks * 512 for p in paths]


def test_every_ranks_pool_and_weights_sleep_and_wake(tiny_models, tmp_path):
    model_dir, hf = tiny_models("llama-gqa")
    prompts = random_prompts([7, 45], seed=22)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = LLM(
        model_dir,
        tensor_parallel_size=2,
        kv_cache_memory=POOL,
        block_size=16,
        kv_cache_shared_dir=str(tmp_path),
        enable_sleep_mode=True,
    )
    try:
        paths = llm.engine.kv_cache_paths
        assert len(paths) == 2 and all(p for p in paths)
        outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        full = _allocated(paths)
        llm.sleep(2)
        assert all(now < before // 8 for now, before in zip(_allocated(paths), full))
        llm.wake_up()
        assert _allocated(paths) == full
        outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want  # rank 1's weights came back too
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe", "gemma3", "phi3", "granite"])
def test_each_family_answers_the_same_after_its_weights_slept(tmp_path, kind):
    build_arch_model(tmp_path, kind)
    prompts = random_prompts([5, 40], seed=23)
    llm = LLM(str(tmp_path), kv_cache_memory=POOL, block_size=16, enable_sleep_mode=True)
    try:
        before = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
        llm.sleep(2)
        llm.wake_up()
        after = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    finally:
        llm.shutdown()
