"""LFM2-MoE's GGUFs (engine/loader/gguf_lfm2moe.py): a tiny random LFM2-MoE model
(tests/helpers/arch.py lfm2-moe: short convolutions in layers 0 and 2, attention with q/k norms in
1 and 3, layer 0 dense, then eight experts, two a token) written as llama.cpp's converter
(LFM2MoeModel over TextModel) writes it: the per-layer kv head counts (0 for a conv layer), the
dense layers' count, the experts' width and the sigmoid gating, the conv squeezed, the router's
expert_bias as `exp_probs_b.bias`, each layer's experts stacked (w1, w2, w3: gate, down, up), the
names gguf-py's map gives, no output tensor (the embedding tied). Converted back, each must give
the original's logits in transformers and its greedy tokens in the engine."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

from helpers.arch import ARCH_SCALE, build_arch_model
from helpers.gguf_files import (
    add_byte_tokenizer,
    assert_engine_greedy_matches,
    assert_same_logits,
    finish,
)
from pdserve.engine.loader import load_hf_config, resolve_model
from pdserve.engine.loader.gguf_convert import open_gguf

pytestmark = pytest.mark.usefixtures("one_thread")


def _add_metadata(w, hp: dict, scale: float | None, gating) -> None:
    """What TextModel.set_gguf_parameters and LFM2MoeModel's write, from the config.json's
    `hp`; `scale`: an `expert_weights_scale` too (which llama.cpp reads where a file has it)."""
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    kv = hp["num_key_value_heads"]
    w.add_head_count_kv([kv if t == "full_attention" else 0 for t in hp["layer_types"]])
    w.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["norm_eps"])
    w.add_expert_count(hp["num_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if "head_dim" in hp:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_leading_dense_block_count(hp["num_dense_layers"])
    w.add_expert_gating_func(gating)
    w.add_vocab_size(hp["vocab_size"])
    w.add_shortconv_l_cache(hp["conv_L_cache"])
    if scale is not None:
        w.add_expert_weights_scale(scale)


def llama_cpp_tensors(model_dir, n_experts: int):
    """(name as the converter maps it, array) of every tensor of the checkpoint, as
    LFM2MoeModel.modify_tensors writes them: the conv squeezed, expert_bias renamed, each layer's
    experts stacked under "layers.N.feed_forward.experts.{w1,w2,w3}.weight"."""
    experts: dict = {}
    for name, t in sorted(load_file(f"{model_dir}/model.safetensors").items()):
        arr = t.float().numpy()
        if name == "lm_head.weight":  # (tied: the converter's map has no output tensor)
            continue
        if "conv.conv" in name and arr.ndim == 3:
            arr = arr.squeeze(1)
        if name.endswith(".expert_bias"):
            name = name + ".bias"
        if ".experts." in name:  # model.layers.N.feed_forward.experts.E.wK.weight
            parts = name.split(".")
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = arr
            continue
        yield name, arr
    for layer in sorted({layer for layer, _ in experts}):
        for which in ("w1", "w2", "w3"):
            per = experts[(layer, which)]
            assert sorted(per) == list(range(n_experts))
            stacked = np.stack([per[e] for e in range(n_experts)])
            yield f"layers.{layer}.feed_forward.experts.{which}.weight", stacked


def write_lfm2moe_gguf(
    path, model_dir, scale: float | None = None, gating=gguf.ExpertGatingFuncType.SIGMOID
) -> None:
    """As llama.cpp's LFM2MoeModel writes the checkpoint in `model_dir`."""
    with open(f"{model_dir}/config.json", encoding="utf-8") as f:
        hp = json.load(f)
    w = gguf.GGUFWriter(str(path), "lfm2moe")
    _add_metadata(w, hp, scale, gating)
    add_byte_tokenizer(w, hp["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2MOE, hp["num_hidden_layers"])
    for name, arr in llama_cpp_tensors(model_dir, hp["num_experts"]):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, np.ascontiguousarray(arr))
    finish(w)


def _assert_same_logits(out, model, **load) -> None:
    """transformers' logits of the converted checkpoint are the original's (nothing is
    recomputed: the same float32 values, so the same logits to the last bits)."""
    assert_same_logits(out, model, 1e-5, **load)


_KEYS = [
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "layer_types",
    "conv_L_cache",
    "conv_bias",
    "num_dense_layers",
    "num_experts",
    "num_experts_per_tok",
    "use_expert_bias",
    "routed_scaling_factor",
    "norm_topk_prob",
    "norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "vocab_size",
]


def _round_trip(tmp_path, scale=None, **overrides):
    model = build_arch_model(tmp_path / "hf", "lfm2-moe", initializer_range=ARCH_SCALE, **overrides)
    path = tmp_path / "tiny-lfm2moe.gguf"
    write_lfm2moe_gguf(path, tmp_path / "hf", scale)
    out = resolve_model(str(path), cache_dir=tmp_path / "cache")
    got, want = load_hf_config(out), model.config.to_dict()
    assert {k: got[k] for k in _KEYS} == {k: want[k] for k in _KEYS}
    assert got["rope_parameters"]["rope_theta"] == want["rope_parameters"]["rope_theta"]
    return model, path, out


def test_gguf_lfm2moe_round_trip(tmp_path):
    """As llama.cpp writes a released model (no routing scale in the file: theirs is 1.0), the
    conv with biases (which released models leave out) to cover the conv bias flag."""
    model, path, out = _round_trip(tmp_path, routed_scaling_factor=1.0, conv_bias=True)
    names = {t.name for t in open_gguf(path).tensors}
    assert "blk.1.ffn_gate_exps.weight" in names and "blk.1.exp_probs_b.bias" in names
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    assert "output.weight" not in names
    written = load_file(f"{out}/model.safetensors")
    assert written["model.layers.0.conv.conv.weight"].shape == (64, 1, 3)
    assert "model.layers.3.feed_forward.experts.7.w2.weight" in written
    _assert_same_logits(out, model)
    assert_engine_greedy_matches(out, model)


def test_gguf_lfm2moe_expert_weights_scale(tmp_path):
    """A file with `expert_weights_scale` (the arch kind's routing scale, 1.5): read as the
    routed_scaling_factor, as llama.cpp's graph reads it."""
    model, _, out = _round_trip(tmp_path, scale=1.5)
    assert model.config.routed_scaling_factor == 1.5
    _assert_same_logits(out, model)
    assert_engine_greedy_matches(out, model)


def test_gguf_lfm2moe_writer_agrees_with_transformers_own_reader(tmp_path):
    """The writer above against a second reading of llama.cpp's format: transformers' own lfm2moe
    GGUF loader, where a release has one (none does up to 5.25), reads the same file into the
    original's logits and the config the loader here builds."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_config_mapping")
    if "lfm2moe" not in getattr(mapping, "GGUF_CONFIG_ARCHS", {}):
        pytest.skip("this transformers reads no lfm2moe GGUF")
    from transformers import AutoConfig

    model, path, out = _round_trip(tmp_path, routed_scaling_factor=1.0)
    theirs = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()
    ours = load_hf_config(out)
    keys = [k for k in _KEYS if k != "norm_eps"]  # (theirs the float32 as it is, ours its decimal)
    assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}
    assert ours["norm_eps"] == pytest.approx(theirs["norm_eps"], rel=1e-6)
    _assert_same_logits(tmp_path, model, gguf_file=path.name)


def test_gguf_lfm2moe_refuses_softmax_gating(tmp_path):
    """LFM2-MoE routes by sigmoid; a file that says otherwise is not one the config can hold."""
    build_arch_model(tmp_path / "hf", "lfm2-moe", initializer_range=ARCH_SCALE)
    path = tmp_path / "bad.gguf"
    write_lfm2moe_gguf(path, tmp_path / "hf", gating=gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(ValueError, match="gating function 1, LFM2-MoE's is sigmoid"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")
