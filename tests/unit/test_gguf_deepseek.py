"""GGUF conversion of llama.cpp's "deepseek2" (engine/loader/gguf_deepseek.py): the tiny DeepSeek
V2 (one q_proj, softmax gating in expert groups) and V3 (q compressed, sigmoid gating with
e_score_correction_bias, YaRN) of tests/helpers/arch.py are written as llama.cpp's
convert_hf_to_gguf.py (DeepseekV2Model) writes them: its tensor names and metadata keys, the
experts stacked, the key/value heads given as 1, mscale_all_dim as 0.1 * it; V2 with the older
single attn_kv_b and key widths, V3 with kv_b_proj split per head into attn_k_b (transposed) and
attn_v_b and the *_mla widths. Each converted back must give the original's logits in
transformers and its greedy tokens in the engine."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.arch import ARCH_SCALE, build_arch_model
from helpers.gguf_files import add_byte_tokenizer, assert_engine_greedy_matches, finish
from pdserve.engine.loader import load_hf_config, resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def llama_cpp_tensors(model, split_kv_b: bool):
    """(GGUF name, array) of `model` as DeepseekV2Model.modify_tensors writes them."""
    cfg = model.config
    top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
    top["lm_head.weight"] = "output"
    for name, tensor in model.state_dict().items():
        arr = tensor.numpy()
        if name in top:
            yield f"{top[name]}.weight", arr
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.startswith("mlp.experts."):  # transformers' fused [E, 2I, H] gate_up, [E, H, I]
            if "gate_up" in rest:
                gate, up = np.split(arr, 2, axis=1)
                yield f"blk.{layer}.ffn_gate_exps.weight", gate
                yield f"blk.{layer}.ffn_up_exps.weight", up
            else:
                yield f"blk.{layer}.ffn_down_exps.weight", arr
        elif rest == "mlp.gate.e_score_correction_bias":
            yield f"blk.{layer}.exp_probs_b.bias", arr
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            # kv_b viewed [heads, nope + v, rank]; k_b = the nope rows transposed, v_b the rest
            kv_b = arr.reshape(cfg.num_key_value_heads, -1, arr.shape[-1])
            k_b, v_b = np.split(kv_b, [cfg.qk_nope_head_dim], axis=1)
            yield f"blk.{layer}.attn_k_b.weight", k_b.transpose(0, 2, 1)
            yield f"blk.{layer}.attn_v_b.weight", v_b
        else:
            module, kind = rest.rsplit(".", 1)
            yield f"blk.{layer}.{_LAYER[module]}.{kind}", arr


def write_deepseek_gguf(path, model, split_kv_b: bool) -> None:
    cfg = model.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)  # MLA run as one latent head
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if split_kv_b:  # the widths since the split: the latent's, then the heads' in *_mla
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(qk)
        w.add_value_length_mla(cfg.v_head_dim)
    else:  # before it: the heads' widths
        w.add_key_length(qk)
        w.add_value_length(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    if cfg.model_type == "deepseek_v3":  # V2 files have no gating key (llama.cpp: softmax)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    add_byte_tokenizer(w, cfg.vocab_size)
    for name, arr in llama_cpp_tensors(model, split_kv_b):
        w.add_tensor(name, np.ascontiguousarray(arr))
    finish(w)


# the config keys both transformers classes read, compared with the original's
_KEYS = [
    "architectures",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "norm_topk_prob",
    "n_group",
    "topk_group",
    "rope_parameters",
    "tie_word_embeddings",
]


@pytest.mark.parametrize("kind,split_kv_b", [("deepseek-v2", False), ("deepseek-v3", True)])
def test_gguf_deepseek_round_trip(tmp_path, kind, split_kv_b):
    model = build_arch_model(tmp_path / "hf", kind, initializer_range=ARCH_SCALE)
    write_deepseek_gguf(tmp_path / f"tiny-{kind}.gguf", model, split_kv_b)
    out = resolve_model(str(tmp_path / f"tiny-{kind}.gguf"), cache_dir=tmp_path / "cache")

    cfg, want = load_hf_config(out), model.config.to_dict()
    want["architectures"] = [type(model).__name__]
    keys = _KEYS + (["topk_method"] if kind == "deepseek-v2" else [])
    assert {k: cfg[k] for k in keys} == {k: want[k] for k in keys}

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == type(model).__name__
    ids = torch.tensor([list(range(2, 202))])  # (past V3's 128 YaRN positions)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)

    assert_engine_greedy_matches(out, model)
