"""Every architecture of tests/helpers/arch.py under tensor parallelism: two ranks (gloo, one
process each) give HF transformers' greedy tokens, where the kind's shapes divide by two."""

from __future__ import annotations

import pytest

from helpers.arch import ARCH_KINDS, ARCH_NEW, arch_refs
from helpers.engine import KV, greedy
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    cache: dict = {}
    return lambda kind: arch_refs(tmp_path_factory, cache, kind)


# llama and qwen2 run under TP=2 in test_engine_tp_ranks.py; phi3-partial is phi3 and more;
# granite's, smollm3's and exaone4's layers shard as llama's and qwen3's (their scalars, rope
# flags and per-head norms are per layer or head, not across ranks); olmo3 runs olmo2's sharded
# q/k norm and more; deepseek-v2's and glm4-moe-lite's latent attention and gate shard as
# deepseek-v3's (q_proj as q_b_proj, a softmax gate on every rank as a sigmoid one); mixtral's
# experts shard as qwen3-moe's and gpt-oss's (FusedMoE without a shared expert); ministral3's
# query temperature is per token; seed-oss and glm4 shard as qwen2 (q/k/v biases, none on
# o_proj; glm4's pairs are reordered within each head before sharding, its norms per token);
# cohere2's layers shard as exaone4's (sliding layers, full ones without rotary), its parallel
# block adding two reduced outputs (its TP 2 run passed when it was added); ernie4.5 is llama
# with its rotary rows reordered before sharding (ernie4.5-moe runs: its router and shared experts)
SHARD_AS_OTHERS = (
    "hunyuan",  # (qwen3's per-head norms, after the rotary; its TP 2 run passed)
    "olmoe",  # (olmo2's sharded norms with minimax-m2's experts; its TP 2 run passed)
    "starcoder2",  # (llama's sharding with biases, as seed-oss and glm4; its TP 2 run passed)
    "cohere2",
    "ernie4.5",
    "ministral3",
    "seed-oss",
    "glm4",
    "granite",
    "smollm3",
    "exaone4",
    "olmo2",
    "deepseek-v2",
    "glm4-moe-lite",
    "mixtral",
)
TP_KINDS = [k for k in ARCH_KINDS if k not in ("llama", "qwen2", "phi3", *SHARD_AS_OTHERS)]


@pytest.mark.parametrize("kind", TP_KINDS)
def test_tp2_matches_hf(refs, kind):
    model_dir, _, prompts, want = refs(kind)
    picks = [0, 3, 4, 7]
    llm = LLM(
        model_dir,
        tensor_parallel_size=2,
        kv_cache_memory=KV,
        block_size=16,
        max_num_batched_tokens=64,
    )
    try:
        outs = llm.generate([prompts[i] for i in picks], greedy(ARCH_NEW), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in picks]
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
