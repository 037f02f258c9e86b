"""GGUF conversion of the families beyond dense llama/qwen2 (engine/loader/gguf_convert.py,
gguf_moe.py): a tiny random model of each is written as llama.cpp's converter would (its tensor
names, Gemma's norms as 1 + w, Phi-3's fused tensors, the experts stacked into 3-D tensors,
Mixtral as a permuted llama with experts, the metadata keys), converted back, and must give the
original model's logits in transformers and its greedy tokens in the engine."""

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

# The MoE weights at ARCH_SCALE: at HF's default scale a mixed-up expert or a dropped shared
# expert still gave HF's greedy tokens (the logits are compared either way).
_MOE = {"initializer_range": ARCH_SCALE}
# kind of tests/helpers/arch.py, GGUF architecture, config keys over the kind's: what a GGUF
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
    # layer 0 sparse, layer 1 dense (mlp_only_layers): llama.cpp makes every layer sparse, but a
    # dense one must come back as one
    "qwen2-moe": ("qwen2moe", _MOE),
    "qwen3-moe": ("qwen3moe", _MOE),  # layer 0 dense, layer 1 sparse
    "mixtral": ("llama", _MOE),
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
    "mlp.gate": "ffn_gate_inp",  # router (Mixtral's block_sparse_moe.gate, mlp.gate in memory)
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
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


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # LlamaModel.permute of llama.cpp's convert_hf_to_gguf.py (the forward direction)
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(model, arch: str, per_expert: bool = False):
    """(GGUF name, array) of `model` as llama.cpp's converter writes them: the experts of a layer
    stacked into [experts, out, in] (or one tensor per expert, as the first Mixtral GGUFs)."""
    cfg = model.config
    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, tensor in sd.items():
        arr = tensor.numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # as llama.cpp's Gemma converters write them
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            arr = llama_cpp_permute(arr, heads)
        if ".experts." in name:  # transformers' fused [E, 2I, H] gate_up and [E, H, I] down
            layer = name.split(".")[2]
            parts = (
                dict(zip(("gate", "up"), np.split(arr, 2, axis=1)))
                if "gate_up" in name
                else {"down": arr}
            )
            for which, stacked in parts.items():
                if per_expert:
                    for e, one in enumerate(stacked):
                        yield f"blk.{layer}.ffn_{which}.{e}.weight", one
                else:
                    yield f"blk.{layer}.ffn_{which}_exps.weight", stacked
            continue
        if name.endswith("shared_expert_gate.weight"):
            arr = arr.reshape(-1)  # llama.cpp squeezes the [1, hidden] gate
        yield gguf_name(name, arch), arr


def write_gguf(
    path, model, arch: str, per_expert: bool = False, quantize=frozenset(), drop=frozenset()
) -> dict:
    """Write `model` as llama.cpp would, less the tensors in `drop`; returns the arrays as stored
    (the quantized ones after a dequantize round trip)."""
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
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch.endswith("moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
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
    add_byte_tokenizer(w, cfg.vocab_size)
    stored = {}
    for name, arr in gguf_tensors(model, arch, per_expert):
        if name in drop:
            continue
        arr = np.ascontiguousarray(arr)
        if name in quantize:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            arr = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
        stored[name] = arr
    finish(w)
    return stored


@pytest.mark.parametrize(
    "kind,per_expert", [(k, False) for k in CASES] + [("mixtral", True)], ids=lambda v: str(v)
)
def test_gguf_family_round_trip(tmp_path, kind, per_expert):
    arch, overrides = CASES[kind]
    model = build_arch_model(tmp_path / "hf", kind, **overrides)
    write_gguf(tmp_path / f"tiny-{kind}.gguf", model, arch, per_expert)
    out = resolve_model(str(tmp_path / f"tiny-{kind}.gguf"), cache_dir=tmp_path / "cache")

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == type(model).__name__
    ids = torch.tensor([list(range(2, 120))])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)

    assert_engine_greedy_matches(out, model)


@pytest.mark.parametrize("kind", ["qwen2-moe", "mixtral"])
def test_gguf_moe_quantized_experts_and_config(tmp_path, kind):
    """Q8_0 stacked experts dequantize expert by expert; the config keys transformers' GGUF
    mapping leaves out (expert widths, dense layers; Mixtral as a whole) come back."""
    arch, overrides = CASES[kind]
    model = build_arch_model(tmp_path / "hf", kind, **overrides)
    quantized = {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"}
    stored = write_gguf(tmp_path / "q.gguf", model, arch, quantize=quantized)
    out = resolve_model(str(tmp_path / "q.gguf"), cache_dir=tmp_path / "cache")
    got = load_file(str(out / "model.safetensors"))
    module, gate, down = (
        ("block_sparse_moe", "w1", "w2") if kind == "mixtral" else ("mlp", "gate_proj", "down_proj")
    )
    for e in range(4):
        prefix = f"model.layers.0.{module}.experts.{e}"
        assert np.array_equal(
            got[f"{prefix}.{gate}.weight"].numpy(), stored["blk.0.ffn_gate_exps.weight"][e]
        )
        assert np.array_equal(
            got[f"{prefix}.{down}.weight"].numpy(), stored["blk.0.ffn_down_exps.weight"][e]
        )
    assert not any("_exps" in n or ".experts.gate_up" in n for n in got)

    cfg = load_hf_config(out)
    want = model.config
    keys = ["num_hidden_layers", "intermediate_size", "num_experts_per_tok", "head_dim"]
    if kind == "mixtral":
        assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
        keys += ["num_local_experts", "sliding_window"]
    else:
        assert cfg["architectures"] == ["Qwen2MoeForCausalLM"]
        keys += ["num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"]
        keys += ["mlp_only_layers", "norm_topk_prob"]
    assert {k: cfg[k] for k in keys} == {k: getattr(want, k) for k in keys}


def test_gguf_mixtral_without_a_router_refused(tmp_path):
    """A llama GGUF with experts where a layer has no router is no Mixtral: refused by name."""
    arch, overrides = CASES["mixtral"]
    model = build_arch_model(tmp_path / "hf", "mixtral", **overrides)
    write_gguf(tmp_path / "m.gguf", model, arch, drop={"blk.1.ffn_gate_inp.weight"})
    with pytest.raises(ValueError, match=r"Mixtral GGUF: layers \[1\] have no router"):
        resolve_model(str(tmp_path / "m.gguf"), cache_dir=tmp_path / "cache")
