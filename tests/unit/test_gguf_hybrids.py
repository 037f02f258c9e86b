"""The hybrid families' GGUFs. Granite 4.0-H (engine/loader/gguf_granite.py): a tiny random GraniteMoeHybrid model
(tests/helpers/arch.py granite-4.0-h: Mamba2 layers 0 and 2, attention without position encoding
1 and 3, four experts beside a shared MLP; and its Micro variant, the shared MLP alone) written as
llama.cpp's convert_hf_to_gguf.py (GraniteHybridModel) writes it: the per-layer kv head counts
(0 for a Mamba2 layer), Granite's scalars, A as -exp(A_log) and D as [heads, 1], the conv
squeezed, the gated norm as [groups, inner / groups], the gate and up halves of the fused MLPs
apart, q and k permuted as llama's, the placeholder context of a model without rope. LFM2
(engine/loader/gguf_lfm2.py) and Nemotron-H, dense and MoE (engine/loader/gguf_nemotron_h.py):
as llama.cpp's LFM2Model and NemotronHModel write them. Converted back, each must give the
original's logits in transformers and its greedy tokens in the engine."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers.arch import ARCH_SCALE, build_arch_model
from helpers.gguf_files import add_byte_tokenizer, assert_engine_greedy_matches, finish
from pdserve.engine.loader import load_hf_config, resolve_model

pytestmark = pytest.mark.usefixtures("one_thread")

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.out_proj.weight": "ssm_out.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias",
    "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.output_linear.weight": "ffn_down_exps.weight",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # LlamaModel.permute of llama.cpp's convert_hf_to_gguf.py (the forward direction)
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_tensors(model_dir, cfg):
    """(GGUF name, array) of every tensor of the checkpoint in `model_dir` (the hub's names, as
    the converter reads them), as the converter writes them."""
    experts = cfg.num_local_experts > 0
    groups, inner = cfg.mamba_n_groups, cfg.mamba_n_heads * cfg.mamba_d_head
    for name, t in sorted(load_file(f"{model_dir}/model.safetensors").items()):
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            yield "token_embd.weight", arr
            continue
        if name == "model.norm.weight":
            yield "output_norm.weight", arr
            continue
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                yield "output.weight", arr
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "self_attn.q_proj.weight":
            yield blk + "attn_q.weight", _permute(arr, cfg.num_attention_heads)
        elif rest == "self_attn.k_proj.weight":
            yield blk + "attn_k.weight", _permute(arr, cfg.num_key_value_heads)
        elif rest == "mamba.conv1d.weight":
            yield blk + "ssm_conv1d.weight", arr.squeeze(1)
        elif rest == "mamba.A_log":
            yield blk + "ssm_a", -np.exp(arr).reshape(-1, 1)
        elif rest == "mamba.D":
            yield blk + "ssm_d", arr.reshape(-1, 1)
        elif rest == "mamba.norm.weight":
            yield blk + "ssm_norm.weight", arr.reshape(groups, inner // groups)
        elif rest == "block_sparse_moe.input_linear.weight":
            gate, up = np.split(arr, 2, axis=1)
            yield blk + "ffn_gate_exps.weight", gate
            yield blk + "ffn_up_exps.weight", up
        elif rest == "shared_mlp.input_linear.weight":
            gate, up = np.split(arr, 2, axis=0)
            tail = "_shexp" if experts else ""
            yield blk + f"ffn_gate{tail}.weight", gate
            yield blk + f"ffn_up{tail}.weight", up
        elif rest == "shared_mlp.output_linear.weight":
            yield blk + ("ffn_down_shexp.weight" if experts else "ffn_down.weight"), arr
        else:
            yield blk + _LAYER[rest], arr


def write_granite_gguf(path, model_dir, cfg, rotary_dims: int | None = None) -> None:
    kinds = cfg.layer_types
    rope = cfg.position_embedding_type == "rope"
    w = gguf.GGUFWriter(str(path), "granitehybrid")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings if rope else 2**20)  # (a placeholder)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if k != "linear_attention" else 0 for k in kinds])
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_logit_scale(cfg.logits_scaling)
    if cfg.num_local_experts:
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(cfg.mamba_n_heads * cfg.mamba_d_head)
    w.add_ssm_time_step_rank(cfg.mamba_n_heads)
    w.add_rope_scaling_finetuned(rope)  # (the converter's flag for rope)
    if rotary_dims is not None:  # (Bamba's attn_rotary_emb)
        w.add_rope_dimension_count(rotary_dims)
    add_byte_tokenizer(w, cfg.vocab_size)
    for name, arr in llama_cpp_tensors(model_dir, cfg):
        w.add_tensor(name, np.ascontiguousarray(arr))
    finish(w)


_KEYS = [
    "architectures",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "layer_types",
    "intermediate_size",
    "shared_intermediate_size",
    "num_local_experts",
    "num_experts_per_tok",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_d_state",
    "mamba_n_groups",
    "mamba_d_conv",
    "mamba_conv_bias",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "tie_word_embeddings",
]


_EXPERT_KEYS = ("intermediate_size", "num_experts_per_tok")


@pytest.mark.parametrize(
    "experts,rope", [(4, False), (0, False), (4, True)], ids=["h-moe", "h-micro", "h-rope"]
)
def test_gguf_granite_hybrid_round_trip(tmp_path, experts, rope):
    """(h-rope: attention with RoPE, as a file may say, where q and k's permutation matters)"""
    extra = {"position_embedding_type": "rope"} if rope else {}
    model = build_arch_model(
        tmp_path / "hf",
        "granite-4.0-h",
        initializer_range=ARCH_SCALE,
        num_local_experts=experts,
        **extra,
    )
    write_granite_gguf(tmp_path / "tiny-granite.gguf", tmp_path / "hf", model.config)
    out = resolve_model(str(tmp_path / "tiny-granite.gguf"), cache_dir=tmp_path / "cache")

    cfg, want = load_hf_config(out), model.config.to_dict()
    want["architectures"] = [type(model).__name__]
    # (without experts, the expert width and count are unused: the file says neither)
    keys = _KEYS if experts else [k for k in _KEYS if k not in _EXPERT_KEYS]
    assert {k: cfg[k] for k in keys} == {k: want[k] for k in keys}
    assert cfg["position_embedding_type"] == ("rope" if rope else "nope")
    assert cfg["max_position_embeddings"] == (512 if rope else 131072)

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(2, 90))])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)

    assert_engine_greedy_matches(out, model, max_model_len=512)  # (a tiny pool for 131072)


def test_gguf_granite_refuses_bambas_partial_rotary(tmp_path):
    """Bamba's granitehybrid GGUF rotates part of each head, which GraniteMoeHybridConfig cannot
    say: refused with what to serve instead."""
    model = build_arch_model(tmp_path / "hf", "granite-4.0-h", position_embedding_type="rope")
    path = tmp_path / "bamba-like.gguf"
    write_granite_gguf(path, tmp_path / "hf", model.config, rotary_dims=8)
    with pytest.raises(ValueError, match="partial rotary .8 of 16 dims"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")


def test_gguf_granite_refuses_a_positive_a(tmp_path):
    model = build_arch_model(tmp_path / "hf", "granite-4.0-h")
    with torch.no_grad():
        model.model.layers[0].mamba.A_log.fill_(float("nan"))
    model.save_pretrained(tmp_path / "hf")
    write_granite_gguf(tmp_path / "bad.gguf", tmp_path / "hf", model.config)
    with pytest.raises(ValueError, match="ssm_a holds values that are not negative"):
        resolve_model(str(tmp_path / "bad.gguf"), cache_dir=tmp_path / "cache")


def write_lfm2_gguf(path, model_dir, cfg) -> None:
    """As llama.cpp's LFM2Model writes it: kv heads 0 for a conv layer, the MLP width adjusted as
    transformers adjusts it, the conv squeezed, the names gguf-py's map gives."""
    from pdserve.engine.models.lfm2 import _ff_size

    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(_ff_size(cfg))
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types])
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    add_byte_tokenizer(w, cfg.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, cfg.num_hidden_layers)
    for name, t in sorted(load_file(f"{model_dir}/model.safetensors").items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.float().numpy()
        if "conv.conv.weight" in name:
            arr = arr.squeeze(1)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), arr)
    finish(w)


def test_gguf_lfm2_round_trip(tmp_path):
    """LFM2 (tests/helpers/arch.py lfm2: short convolutions with biases at 0 and 2, attention
    with q/k norms at 1 and 3) through llama.cpp's lfm2 GGUF."""
    model = build_arch_model(tmp_path / "hf", "lfm2", initializer_range=ARCH_SCALE)
    write_lfm2_gguf(tmp_path / "tiny-lfm2.gguf", tmp_path / "hf", model.config)
    out = resolve_model(str(tmp_path / "tiny-lfm2.gguf"), cache_dir=tmp_path / "cache")
    cfg = load_hf_config(out)
    assert cfg["architectures"] == ["Lfm2ForCausalLM"] and cfg["conv_bias"] is True
    assert cfg["layer_types"] == model.config.layer_types
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(2, 90))])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    assert_engine_greedy_matches(out, model)


def write_nemotron_h_gguf(path, model_dir, cfg) -> None:
    """As llama.cpp's NemotronHModel writes it: nemotron_h_moe where the model has experts, the
    per-layer kv heads and MLP widths (0 where a layer has none), the Mamba2 tensors as Granite's,
    the experts stacked, dt_bias as ssm_dt.bias, the names gguf-py's map gives."""
    kinds = cfg.layers_block_type
    moe = "moe" in kinds
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if moe else gguf.MODEL_ARCH.NEMOTRON_H
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(2**20)  # (no rope: the placeholder of the converter's Granite base)
    w.add_embedding_length(cfg.hidden_size)
    width = cfg.moe_intermediate_size if moe else cfg.intermediate_size
    w.add_feed_forward_length([width if k in ("mlp", "moe") else 0 for k in kinds])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if k == "full_attention" else 0 for k in kinds])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    w.add_vocab_size(cfg.vocab_size)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_state_size(cfg.ssm_state_size)
    w.add_ssm_group_count(cfg.n_groups)
    w.add_ssm_inner_size(cfg.mamba_num_heads * cfg.mamba_head_dim)
    w.add_ssm_time_step_rank(cfg.mamba_num_heads)
    if moe:
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_group_count(cfg.n_group)
    add_byte_tokenizer(w, cfg.vocab_size)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    groups, inner = cfg.n_groups, cfg.mamba_num_heads * cfg.mamba_head_dim
    tensors = load_file(f"{model_dir}/model.safetensors")
    experts: dict = {}
    for name, t in sorted(tensors.items()):
        arr = t.float().numpy()
        layer = name.split(".")[2] if name.startswith("backbone.layers.") else None
        if ".mixer.experts." in name:  # stacked per layer, as the converter merges them
            which = name.rsplit(".", 2)[-2]
            experts.setdefault((layer, which), {})[int(name.split(".")[5])] = arr
            continue
        if name.endswith("gate.e_score_correction_bias"):
            w.add_tensor(f"blk.{layer}.exp_probs_b.bias", arr)
            continue
        if name.endswith("q_proj.weight"):
            arr = _permute(arr, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = _permute(arr, cfg.num_key_value_heads)
        elif name.endswith("conv1d.weight"):
            arr = arr.squeeze(1)
        elif name.endswith("A_log"):
            arr = -np.exp(arr).reshape(-1, 1)
        elif name.endswith("mixer.D"):
            arr = arr.reshape(-1, 1)
        elif name.endswith("mixer.norm.weight"):
            arr = arr.reshape(groups, inner // groups)
        hub = name.replace(".dt_bias", ".dt_proj.bias")
        w.add_tensor(names.get_name(hub, try_suffixes=(".weight", ".bias")), arr)
    for (layer, which), per in sorted(experts.items()):
        stacked = np.stack([per[e] for e in sorted(per)])
        w.add_tensor(f"blk.{layer}.ffn_{which.split('_')[0]}_exps.weight", stacked)
    finish(w)


@pytest.mark.parametrize(
    "kinds",
    [["mamba", "mlp", "attention", "mamba"], ["mamba", "moe", "attention", "mamba"]],
    ids=["nemotron-h", "nemotron-h-moe"],
)
def test_gguf_nemotron_h_round_trip(tmp_path, kinds):
    """Nemotron-H (Nano 2's layer kinds) and Nemotron-H MoE (Nemotron 3 Nano's) through
    llama.cpp's nemotron_h and nemotron_h_moe GGUFs."""
    model = build_arch_model(
        tmp_path / "hf",
        "nemotron-h",
        initializer_range=ARCH_SCALE,
        num_hidden_layers=4,
        layers_block_type=kinds,
    )
    write_nemotron_h_gguf(tmp_path / "tiny-nemotron.gguf", tmp_path / "hf", model.config)
    out = resolve_model(str(tmp_path / "tiny-nemotron.gguf"), cache_dir=tmp_path / "cache")
    cfg = load_hf_config(out)
    assert cfg["architectures"] == ["NemotronHForCausalLM"]
    assert cfg["layers_block_type"] == model.config.layers_block_type
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(2, 90))])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    assert_engine_greedy_matches(out, model, max_model_len=512)
