"""Multi-head latent attention (engine/layers/mla.py) beyond the token-for-token checks every
architecture gets (tests/unit/test_architectures.py, kinds deepseek-v2 and deepseek-v3): what the
KV cache holds is the latent itself, transformers' own cache contents (so a hand-off moves
kv_lora_rank + qk_rope_head_dim values a token a layer, not per-head keys and values), and what
the engine does not run for these models yet is refused before anything starts."""

from __future__ import annotations

import pytest
import torch

from helpers.arch import arch_prompts, build_arch_model
from helpers.engine import KV, greedy, run_until_done
from helpers.models import LazyGreedy
from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")
LATENT = 32 + 16  # the kinds' kv_lora_rank + qk_rope_head_dim (tests/helpers/arch.py _MLA)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla-v3")
    hf = build_arch_model(path, "deepseek-v3", initializer_range=0.1)
    return str(path), hf


class LatentSink:
    """A prefill-only request's KV sink that keeps each layer's latents, token by token."""

    def __init__(self):
        self.latents: dict[int, torch.Tensor] = {}

    def on_layer(self, layer_idx, layer_kv, block_ids, start, end):
        bs = layer_kv.shape[2]
        rows = [layer_kv[:, block_ids[t // bs], t % bs, 0] for t in range(start, end)]
        got = torch.stack([torch.cat((r[0], r[1])) for r in rows])  # [tokens, latent]
        old = self.latents.get(layer_idx)
        self.latents[layer_idx] = got if old is None else torch.cat((old, got))


def test_the_cache_holds_transformers_latents(v3):
    model_dir, hf = v3
    prompt = arch_prompts()[3]  # 100 tokens: past the 4-token blocks and a 32-token chunk
    engine = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_batched_tokens=32).engine
    mc = engine.model_config
    assert (mc.num_kv_heads, mc.head_dim, mc.kv_latent_dim) == (1, LATENT // 2, LATENT)
    assert mc.kv_bytes_per_token(torch.float32) == mc.num_layers * LATENT * 4
    sink = LatentSink()
    engine.add_request("r", prompt, greedy(1), prefill_only=True, kv_sink=sink)
    run_until_done(engine)
    with torch.inference_mode():
        cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer in range(mc.num_layers):
        # transformers caches the normalized compression as keys, the rotated k_pe as values
        c, k_pe = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]
        want = torch.cat((c, k_pe), dim=-1)
        got = sink.latents[layer]
        assert got.shape == (len(prompt), LATENT)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(device="cuda"), "device='cpu' only"),
        (dict(enable_lora=True), "LoRA adapters on DeepseekV3ForCausalLM"),
    ],
)
def test_what_mla_does_not_run_yet_is_refused(v3, settings, words):
    from transformers import AutoConfig

    model_dir, _ = v3
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    with pytest.raises(ValueError, match=words):
        EngineConfig(model=model_dir, kv_cache_memory=KV, **settings).resolve(mc)


def test_a_rank_below_half_the_latent_matches_transformers(tmp_path):
    """kv_lora_rank 16 and 32 rotary dims: the values (the latent's first 16 dims) lie in the K
    plane alone (no released model's do, but nothing refuses such a config)."""
    hf = build_arch_model(
        tmp_path, "deepseek-v2", kv_lora_rank=16, qk_rope_head_dim=32, initializer_range=0.1
    )
    prompts = arch_prompts()[1:4]
    llm = LLM(str(tmp_path), kv_cache_memory=KV, block_size=4)
    try:
        outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == LazyGreedy(hf, prompts, 12)


def test_an_odd_latent_is_refused(tmp_path):
    from transformers import AutoConfig

    build_arch_model(tmp_path, "deepseek-v2", kv_lora_rank=31)
    with pytest.raises(ValueError, match="is odd"):
        ModelConfig.from_hf(AutoConfig.from_pretrained(str(tmp_path)))
