"""gpt-oss (engine/models/gpt_oss.py) beyond the token-for-token checks every architecture gets
(tests/unit/test_architectures.py, kind gpt-oss): a head's sink takes its share of the softmax
exactly as transformers' eager attention gives it, where a window or a cached prefix masks keys
too; the output projection's bias that attention_bias also means in transformers' Llama; and
what the engine does not run for these models yet is refused before anything starts."""

from __future__ import annotations

import pytest
import torch

from helpers.arch import arch_prompts, build_arch_model
from helpers.engine import KV, greedy
from helpers.models import LazyGreedy
from pdserve.engine import LLM
from pdserve.engine.attention import PagedAttention
from pdserve.engine.config import EngineConfig, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _eager_with_sinks(q, k, v, mask, sinks, scale):
    """transformers' gpt-oss eager attention: the sink as one more logit, dropped after the
    softmax (q [1, H, Tq, D], k and v expanded to H heads, mask boolean [Tq, Tk])."""
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(1, -1, q.shape[2], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return probs @ v


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_take_their_share_of_each_query(window):
    torch.manual_seed(0)
    heads, kv_heads, dim, tq, tk = 4, 2, 16, 6, 11
    attn = PagedAttention(0, heads, kv_heads, dim, window=window, sinks=True)
    attn.sinks.data.copy_(torch.tensor([-2.0, 0.0, 1.5, 4.0]))
    q = torch.randn(1, heads, tq, dim)
    k, v = torch.randn(1, kv_heads, tk, dim), torch.randn(1, kv_heads, tk, dim)
    q_pos, k_pos = torch.arange(tk - tq, tk), torch.arange(tk)
    diff = q_pos[:, None] - k_pos[None, :]
    mask = (diff >= 0) & (diff < (window or tk))
    got = attn._attend(q, k, v, mask, False)
    want = _eager_with_sinks(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask, attn.sinks, attn.scale
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # a large sink leaves its head almost nothing; the keys keep a head with a small one
    norms = got.norm(dim=-1).mean(dim=(0, 2))
    assert norms[3] < 0.3 * norms[0]


def test_llama_attention_bias_biases_the_output_projection(tmp_path):
    """transformers' Llama gives o_proj a bias with attention_bias (Qwen2's does not): the
    engine loads and adds it."""
    hf = build_arch_model(tmp_path, "llama", attention_bias=True, initializer_range=0.1)
    prompts = arch_prompts()[:4]
    llm = LLM(str(tmp_path), kv_cache_memory=KV, block_size=4)
    try:
        assert llm.engine.model_config.o_proj_bias
        outs = llm.generate(prompts, greedy(8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == LazyGreedy(hf, prompts, 8)
    finally:
        llm.shutdown()


def test_cuda_is_refused(tmp_path):
    from transformers import AutoConfig

    build_arch_model(tmp_path, "gpt-oss")
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
    assert mc.attention_sinks and mc.o_proj_bias
    with pytest.raises(ValueError, match=r"attention sinks\) runs on device='cpu' only"):
        EngineConfig(model=str(tmp_path), kv_cache_memory=KV, device="cuda").resolve(mc)
