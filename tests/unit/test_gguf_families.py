"""GGUF conversion of the dense families beyond llama/qwen2 (engine/loader/gguf_convert.py): a
tiny random model of each is written as llama.cpp's converter would (its tensor names, Gemma's
norms as 1 + w, Phi-3's fused tensors, the metadata keys), converted back, and must give the
original model's logits in transformers and its greedy tokens in the engine."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from arch_helpers import build_arch_model
from conftest import hf_greedy
from engine_helpers import KV, greedy
from pdserve.engine import LLM
from pdserve.engine.loader import resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")

# kind of tests/arch_helpers.py, GGUF architecture, config keys over the kind's: what a GGUF
# carries (transformers fills the rest with its defaults: Gemma 3's layer pattern of 6, ...)
CASES = {
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3": (
        "gemma3",
        {
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention"] * 2,  # the first 2 of the default pattern
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        },
    ),
}

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_ARCH_LAYER = {
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "gemma2": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
_ARCH_LAYER["gemma3"] = _ARCH_LAYER["gemma2"]


def gguf_name(name: str, arch: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{({**_LAYER, **_ARCH_LAYER.get(arch, {})})[module]}.{kind}"


def write_gguf(path, model, arch: str) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "gemma3":
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    else:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    # byte-level BPE over the 256 ids (transformers needs one merge to build it)
    tokens = [bytes_to_unicode()[b] for b in range(cfg.vocab_size)]
    tokens[255] = tokens[97] + tokens[98]  # the merge's result (byte 255 goes without)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges([f"{tokens[97]} {tokens[98]}"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, tensor in sd.items():
        arr = tensor.numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # as llama.cpp's Gemma converters write them
        w.add_tensor(gguf_name(name, arch), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", list(CASES))
def test_gguf_family_round_trip(tmp_path, kind):
    arch, overrides = CASES[kind]
    model = build_arch_model(tmp_path / "hf", kind, **overrides)
    write_gguf(tmp_path / f"tiny-{kind}.gguf", model, arch)
    out = resolve_model(str(tmp_path / f"tiny-{kind}.gguf"), cache_dir=tmp_path / "cache")

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == type(model).__name__
    ids = torch.tensor([list(range(2, 120))])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)

    prompt = [
        int(t) for t in torch.randint(2, 256, (70,), generator=torch.Generator().manual_seed(1))
    ]
    llm = LLM(str(out), dtype="float32", kv_cache_memory=KV, block_size=4)
    try:
        got = llm.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
        assert got == hf_greedy(model, prompt, 16)
    finally:
        llm.shutdown()
