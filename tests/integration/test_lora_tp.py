"""LoRA adapters under tensor parallelism (engine/lora.py shard_adapter): two ranks (gloo, one
process each) split each adapter as the base weights are split, column-parallel layers by B's
rows and row-parallel ones by A's columns, and a batch mixing two random PEFT adapters and the
base gives HF + PEFT's greedy tokens, for a Llama (attention and MLP adapted), a Qwen2-MoE
(attention adapted) and a Qwen3.5 hybrid (its Gated DeltaNet projections too: each of in_proj_qkv's
q, k and v rows split by heads, as the fused projection's shards are) and a Granite 4.0-H (its
Mamba2 mixers' in_proj rows picked per rank as the mixer picks its weight's: its one group of B
and C on both ranks) and a Nemotron-H (two groups, one a rank; its MLP's up_proj a plain
column-parallel layer)."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy
from helpers.lora import ADAPTERS, LORA_NEW, lora_family, lora_prompts, lora_refs
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, LoRARequest

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["llama", "qwen2-moe", "qwen3.5", "granite-4.0-h", "nemotron-h"])
def test_tp2_mixed_adapters_match_hf_peft(tmp_path, kind):
    base, dirs, models = lora_family(tmp_path, kind)
    prompts = lora_prompts()
    want = lora_refs(models, prompts)
    llm = LLM(
        base,
        dtype="float32",
        tensor_parallel_size=2,
        kv_cache_memory=KV,
        block_size=16,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        speculative_config=None,
    )
    try:
        keys = [(k, i) for k in ("base", *ADAPTERS) for i in range(len(prompts))]
        loras = [
            None if k == "base" else LoRARequest(k, ADAPTERS.index(k) + 1, dirs[k]) for k, _ in keys
        ]
        outs = llm.generate(
            [prompts[i] for _, i in keys], greedy(LORA_NEW), use_tqdm=False, lora_request=loras
        )
        for (k, i), out in zip(keys, outs):
            assert out.outputs[0].token_ids == want[k][i], (k, i)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
