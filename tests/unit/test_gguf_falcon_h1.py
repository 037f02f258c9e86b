"""Falcon-H1's GGUFs (engine/loader/gguf_falcon_h1.py): a tiny random Falcon-H1 model
(tests/helpers/arch.py falcon-h1: attention and Mamba2 with two groups side by side in each of
three layers, every muP multiplier away from 1) written as llama.cpp's converter (FalconH1Model
over Mamba2Model) writes it: Mamba2Model's metadata with FalconH1Model's overrides, dt_bias as
ssm_dt.bias, the conv squeezed, A as -exp(A_log) and D as [heads, 1], the gated norm as
[groups, inner / groups], every multiplier folded into the weights (and none written as a key),
the names gguf-py's map gives (the MLP's norm as `blk.N.ffn_norm`, without ".weight"), no output
tensor where the checkpoint ties it. Converted back, each must give the original's logits in
transformers and its greedy tokens in the engine."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
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


def _add_metadata(w, hp: dict) -> None:
    """Mamba2Model.set_gguf_parameters, then FalconH1Model's, from the config.json's `hp` (its
    find_hparam tries each key with a "mamba_" prefix too: mamba_d_conv, mamba_d_state, ...).
    A key written twice keeps its second value, as gguf.GGUFWriter keeps it."""
    w.add_context_length(2**20)  # Mamba2Model's placeholder, written over below
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_ssm_conv_kernel(hp["mamba_d_conv"])
    w.add_ssm_inner_size(hp["mamba_d_ssm"])
    w.add_ssm_state_size(hp["mamba_d_state"])
    w.add_ssm_time_step_rank(hp["mamba_d_ssm"] // hp["mamba_d_head"])
    w.add_ssm_group_count(hp["mamba_n_groups"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # FalconH1Model.set_gguf_parameters
    w.add_vocab_size(hp["vocab_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp.get("max_position_embeddings", 0))
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])


def _mamba2_edits(name: str, new_name: str, t: torch.Tensor, hp: dict) -> torch.Tensor:
    """Mamba2Model.modify_tensors on a tensor mapped to `new_name`."""
    groups, inner = hp["mamba_n_groups"], hp["mamba_d_ssm"]
    if new_name.endswith(".ssm_conv1d.weight"):
        t = t.squeeze()
    elif new_name.endswith((".ssm_a", ".ssm_d")):
        t = t.reshape((*t.shape, 1))
    elif new_name.endswith(".ssm_norm.weight"):
        t = t.reshape((groups, inner // groups))
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    return t


def _falcon_edits(name: str, t: torch.Tensor, hp: dict) -> torch.Tensor:
    """FalconH1Model.modify_tensors after Mamba2Model's: each multiplier folded into the tensor
    whose hub name holds the converter's substring, in the converter's order of tests."""
    inner, bc = hp["mamba_d_ssm"], hp["mamba_n_groups"] * hp["mamba_d_state"]
    mlp, attn_in = hp["mlp_multipliers"], hp["attention_in_multiplier"]
    if "down_proj" in name:
        t = t * mlp[1]
    elif "gate_proj" in name:
        t = t * mlp[0]
    elif "k_proj" in name:
        t = t * hp["key_multiplier"] * attn_in
    elif "q_proj" in name or "v_proj" in name:
        t = t * attn_in
    elif "o_proj" in name:
        t = t * hp["attention_out_multiplier"]
    elif "out_proj" in name:
        t = t * hp["ssm_out_multiplier"]
    elif "in_proj" in name:  # rows z, x, B, C, dt
        t = t * hp["ssm_in_multiplier"]
        m = hp["ssm_multipliers"]
        t[:inner] *= m[0]
        t[inner : 2 * inner] *= m[1]
        t[2 * inner : 2 * inner + bc] *= m[2]
        t[2 * inner + bc : 2 * inner + 2 * bc] *= m[3]
        t[2 * inner + 2 * bc :] *= m[4]
    elif "lm_head" in name:
        t = t * hp["lm_head_multiplier"]
    elif "embed_tokens" in name:
        t = t * hp["embedding_multiplier"]
    elif "mamba.norm" in name:
        t = t.reshape(hp["mamba_n_groups"], inner // hp["mamba_n_groups"])
    return t


def llama_cpp_tensors(model_dir, hp: dict):
    """(GGUF name, array) of every tensor of the checkpoint in `model_dir`, as the converter
    writes them: Mamba2Model's rename of dt_bias and gguf-py's map, its edits, then
    FalconH1Model's (by the hub's name, not the mapped one)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, hp["num_hidden_layers"])
    for name, t in load_file(f"{model_dir}/model.safetensors").items():
        hub = name
        if hub.endswith(".dt_bias"):
            hub = hub.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        new_name = names.get_name(hub, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, name
        t = _falcon_edits(name, _mamba2_edits(name, new_name, t.float(), hp), hp)
        yield new_name, t.numpy()


def write_falcon_h1_gguf(path, model_dir) -> None:
    """As llama.cpp's FalconH1Model writes the checkpoint in `model_dir` (float32 tensors), its
    tokenizer's pre-tokenizer named as the converter names Falcon-H1's."""
    with open(f"{model_dir}/config.json", encoding="utf-8") as f:
        hp = json.load(f)
    w = gguf.GGUFWriter(str(path), "falcon-h1")
    _add_metadata(w, hp)
    add_byte_tokenizer(w, hp["vocab_size"])
    w.add_tokenizer_pre("falcon-h1")  # (over add_byte_tokenizer's "default")
    for name, arr in llama_cpp_tensors(model_dir, hp):
        w.add_tensor(name, np.ascontiguousarray(arr))
    finish(w)


def _assert_same_logits(out, model) -> None:
    """transformers' logits of the converted checkpoint are the original's, to float32's
    rounding of the folded multipliers ((x * a) @ W against x @ (a * W)) and of A_log's
    log(exp()): 1e-5 absolute and relative (measured: 2.2e-6 and 4.7e-6 at most, the logits
    up to 2.5 and 5.7; any one multiplier applied twice moves them by 0.09 or more)."""
    assert_same_logits(out, model, 1e-5)


_KEYS = [
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "mamba_d_ssm",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_n_groups",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_conv_bias",
    "mamba_proj_bias",
    "mamba_rms_norm",
    "mamba_norm_before_gate",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "vocab_size",
]
_MULTIPLIERS = {
    "embedding_multiplier": 1.0,
    "lm_head_multiplier": 1.0,
    "key_multiplier": 1.0,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 1.0,
    "mlp_multipliers": [1.0, 1.0],
    "ssm_multipliers": [1.0] * 5,
    "ssm_in_multiplier": 1.0,
    "ssm_out_multiplier": 1.0,
}


def _round_trip(tmp_path, **overrides):
    """The kind (its gated norm after the gate, llama.cpp's order), its A_log and D drawn away
    from HF's initial values, written and converted back: (model, GGUF path, converted dir)."""
    model = build_arch_model(
        tmp_path / "hf",
        "falcon-h1",
        initializer_range=ARCH_SCALE,
        mamba_norm_before_gate=False,
        **overrides,
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mamba.A_log.add_(torch.randn_like(layer.mamba.A_log) * 0.3)
            layer.mamba.D.normal_(1.0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "tiny-falcon-h1.gguf"
    write_falcon_h1_gguf(path, tmp_path / "hf")
    out = resolve_model(str(path), cache_dir=tmp_path / "cache")
    got, want = load_hf_config(out), model.config.to_dict()
    assert {k: got[k] for k in _KEYS} == {k: want[k] for k in _KEYS}
    assert got["rope_parameters"]["rope_theta"] == want["rope_parameters"]["rope_theta"]
    # the multipliers are in the weights now: 1.0 in the config, not applied twice
    assert {k: got[k] for k in _MULTIPLIERS} == _MULTIPLIERS
    return model, path, out


def test_gguf_falcon_h1_round_trip(tmp_path):
    """Every multiplier away from 1 (the kind's), the gated norm over two groups, an output
    tensor of its own, the names as llama.cpp's loader asks for them."""
    model, path, out = _round_trip(tmp_path)
    assert all(model.config.to_dict()[k] != v for k, v in _MULTIPLIERS.items())
    names = {t.name for t in open_gguf(path).tensors}
    assert {"blk.0.ffn_norm", "blk.0.ssm_a", "blk.0.ssm_d", "blk.2.ssm_dt.bias"} <= names
    assert "blk.0.ssm_norm.weight" in names and "output.weight" in names
    assert not any(n.endswith("ffn_norm.weight") for n in names)
    written = load_file(f"{out}/model.safetensors")
    assert written["model.layers.0.mamba.conv1d.weight"].shape == (128, 1, 4)
    assert written["model.layers.0.mamba.norm.weight"].shape == (64,)
    assert written["model.layers.0.mamba.D"].shape == (8,)
    _assert_same_logits(out, model)
    assert_engine_greedy_matches(out, model)


def test_gguf_falcon_h1_tied_embedding_without_gated_norm(tmp_path):
    """A tied checkpoint has no lm_head, so the file has no output tensor and llama.cpp reads
    the LM head from token_embd, which holds the embedding multiplier: the original's logits
    where its LM head multiplier equals the embedding's (1.5 here). Without the gated norm
    (mamba_rms_norm False) there is no ssm_norm to read; the heads of 32 (not hidden / heads)
    and the rope theta away from the default are read from the file."""
    model, path, out = _round_trip(
        tmp_path,
        tie_word_embeddings=True,
        lm_head_multiplier=1.5,
        mamba_rms_norm=False,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    names = {t.name for t in open_gguf(path).tensors}
    assert "output.weight" not in names and "blk.0.ssm_norm.weight" not in names
    assert "lm_head.weight" not in load_file(f"{out}/model.safetensors")
    _assert_same_logits(out, model)
    assert_engine_greedy_matches(out, model)
