"""Qwen3.5's GGUFs (engine/loader/gguf_qwen35.py): tiny random Qwen3.5 and Qwen3.5-MoE models
(tests/helpers/arch.py qwen3.5 and qwen3.5-moe: three Gated DeltaNet layers of two key heads, each
serving two value heads, then gated full attention) written as llama.cpp's converter
(Qwen3_5TextModel, Qwen3_5MoeTextModel over Qwen3NextModel) writes them: the value heads
reordered from grouped to tiled wherever a tensor has them, A as -exp(A_log), dt_bias as
ssm_dt.bias, the conv squeezed, every norm but the gated one as 1 + w, the experts stacked, the
names gguf-py's map gives, and (one variant) a multi-token-prediction block appended. Converted
back, each must give the original's logits in transformers and its greedy tokens in the engine."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from helpers.arch import ARCH_SCALE, build_arch_model
from helpers.gguf_files import (
    add_byte_tokenizer,
    assert_engine_greedy_matches,
    assert_same_logits,
    finish,
)
from pdserve.engine.loader import load_hf_config, resolve_model
from pdserve.engine.loader.gguf_convert import open_gguf
from pdserve.engine.loader.gguf_qwen35 import fix_pre_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _reorder_v_heads(t: np.ndarray, dim: int, num_k: int, per: int, head_dim: int) -> np.ndarray:
    # _LinearAttentionVReorderBase._reorder_v_heads: grouped by key head -> tiled
    shape = t.shape
    split = shape[:dim] + (num_k, per, head_dim) + shape[dim + 1 :]
    return np.swapaxes(t.reshape(split), dim, dim + 1).reshape(shape)


def _linear_attention(name: str, arr: np.ndarray, cfg) -> np.ndarray:
    """_LinearAttentionVReorderBase.modify_tensors: the value heads in tiled order."""
    num_k, num_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if num_k == num_v or "linear_attn." not in name:
        return arr
    per, dv = num_v // num_k, cfg.linear_value_head_dim
    qk = 2 * num_k * cfg.linear_key_head_dim
    if ".in_proj_qkv." in name:
        return np.concatenate([arr[:qk], _reorder_v_heads(arr[qk:], 0, num_k, per, dv)])
    if ".in_proj_z." in name:
        return _reorder_v_heads(arr, 0, num_k, per, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return _reorder_v_heads(arr, 0, num_k, per, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return _reorder_v_heads(arr[:, None], 0, num_k, per, 1)[:, 0]
    if ".conv1d" in name:
        data = arr.squeeze()
        return np.concatenate([data[:qk], _reorder_v_heads(data[qk:], 0, num_k, per, dv)])
    if ".out_proj." in name:
        return _reorder_v_heads(arr, 1, num_k, per, dv)
    return arr


def llama_cpp_tensors(model_dir, cfg, fuse_gate_up: bool = False):
    """(hub name as the converter maps it, array) of every tensor of the checkpoint, as the
    converter writes them: Qwen3NextModel's edits after the value-head reorder, the experts
    stacked per layer (Qwen2MoeModel; gate and up fused with --fuse-gate-up-exps)."""
    experts: dict = {}
    for name, t in sorted(load_file(f"{model_dir}/model.safetensors").items()):
        arr = _linear_attention(name, t.float().numpy(), cfg)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in name:  # model.layers.N.mlp.experts.E.which.weight
            layer, expert, which = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
            experts.setdefault((layer, which), {})[expert] = arr
            continue
        if name.endswith(".A_log"):
            arr = -np.exp(arr)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            arr = arr.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            arr = arr + 1
        yield name, arr
    stacked = {key: np.stack([per[e] for e in sorted(per)]) for key, per in sorted(experts.items())}
    for layer in sorted({layer for layer, _ in stacked}, key=int):
        prefix = f"model.layers.{layer}.mlp.experts."
        yield prefix + "down_proj.weight", stacked[(layer, "down_proj")]
        gate, up = stacked[(layer, "gate_proj")], stacked[(layer, "up_proj")]
        if fuse_gate_up:
            yield prefix + "gate_up_proj.weight", np.concatenate([gate, up], axis=1)
        else:
            yield prefix + "gate_proj.weight", gate
            yield prefix + "up_proj.weight", up


def _add_metadata(w, cfg, moe: bool, mtp: int) -> None:
    """What TextModel, Qwen2MoeModel, Qwen3NextModel and the Qwen3.5 mixins write."""
    w.add_block_count(cfg.num_hidden_layers + mtp)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if not moe:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_sections([11, 11, 10, 0])  # (the default, written whatever the model)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(4)
    partial = cfg.rope_parameters["partial_rotary_factor"]
    w.add_rope_dimension_count(int(cfg.head_dim * partial))
    if mtp:
        w.add_nextn_predict_layers(mtp)


def write_qwen35_gguf(path, model_dir, cfg, pre=None, fuse_gate_up=False, mtp=False) -> None:
    """As llama.cpp's converter writes Qwen3.5 (qwen35moe where the model has experts); `mtp`:
    with one multi-token-prediction block after the decoder's layers (a copy of the last
    layer's tensors and random nextn ones, as its MTP mixin names them)."""
    moe = cfg.model_type == "qwen3_5_moe_text"
    arch = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    layers, blocks = cfg.num_hidden_layers, cfg.num_hidden_layers + int(mtp)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _add_metadata(w, cfg, moe, int(mtp))
    add_byte_tokenizer(w, cfg.vocab_size)
    if pre is not None:  # (overwrites add_byte_tokenizer's "default")
        w.add_tokenizer_pre(pre)
    names = gguf.get_tensor_name_map(arch, blocks)
    written = []
    for name, arr in llama_cpp_tensors(model_dir, cfg, fuse_gate_up):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        w.add_tensor(gguf_name, np.ascontiguousarray(arr))
        written.append((gguf_name, arr))
    if mtp:
        for gguf_name, arr in written:
            if gguf_name.startswith(f"blk.{layers - 1}."):
                w.add_tensor(gguf_name.replace(f"blk.{layers - 1}.", f"blk.{layers}."), arr)
        rng, hidden = np.random.default_rng(0), cfg.hidden_size
        extra = {"eh_proj.weight": (hidden, 2 * hidden), "enorm.weight": (hidden,)}
        extra.update({"hnorm.weight": (hidden,), "shared_head_norm.weight": (hidden,)})
        for leaf, shape in extra.items():
            w.add_tensor(f"blk.{layers}.nextn.{leaf}", rng.normal(size=shape).astype(np.float32))
    finish(w)


def _assert_same_logits(out, model, **load) -> None:
    """transformers' logits of the converted checkpoint are the original's, to float32's
    rounding of the converter's edits (a norm's 1 + w - 1 and log(exp(A_log)) move its last bit:
    up to 3e-5 in the MoE's logits; a reorder or an offset left out moves them by more than 1)."""
    assert_same_logits(out, model, 1e-4, **load)


_KEYS = [
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "layer_types",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "vocab_size",
]
_MOE_KEYS = [
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
]


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3.5-moe"])
def test_gguf_qwen35_round_trip(tmp_path, kind):
    """(the kinds' two value heads per key head: the value-head reorder matters)"""
    model = build_arch_model(tmp_path / "hf", kind, initializer_range=ARCH_SCALE)
    cfg = model.config
    assert cfg.linear_num_value_heads != cfg.linear_num_key_heads
    write_qwen35_gguf(tmp_path / "tiny-qwen35.gguf", tmp_path / "hf", cfg)
    out = resolve_model(str(tmp_path / "tiny-qwen35.gguf"), cache_dir=tmp_path / "cache")

    got, want = load_hf_config(out), cfg.to_dict()
    keys = _KEYS + (_MOE_KEYS if kind == "qwen3.5-moe" else ["intermediate_size"])
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    for key in ("rope_theta", "partial_rotary_factor"):
        assert got["rope_parameters"][key] == want["rope_parameters"][key]

    _assert_same_logits(out, model)
    assert_engine_greedy_matches(out, model)


def test_gguf_qwen35_mtp_block_tied_embedding_and_qwen_pre_tokenizer(tmp_path):
    """A file with an MTP block after the decoder's layers (its tensors dropped), no output
    tensor (the embedding tied) and the "qwen35" pre-tokenizer that real files name."""
    model = build_arch_model(
        tmp_path / "hf", "qwen3.5", initializer_range=ARCH_SCALE, tie_word_embeddings=True
    )
    path = tmp_path / "tiny-qwen35-mtp.gguf"
    write_qwen35_gguf(path, tmp_path / "hf", model.config, pre="qwen35", mtp=True)
    assert "blk.4.nextn.eh_proj.weight" in {t.name for t in open_gguf(path).tensors}
    out = resolve_model(str(path), cache_dir=tmp_path / "cache")
    cfg = load_hf_config(out)
    assert cfg["num_hidden_layers"] == 4 and cfg["tie_word_embeddings"] is True
    assert not any(".layers.4." in n for n in load_file(f"{out}/model.safetensors"))
    _assert_same_logits(out, model)


def test_gguf_qwen35moe_fused_gate_up_experts(tmp_path):
    """convert_hf_to_gguf.py --fuse-gate-up-exps: each layer's experts as one gate_up tensor."""
    model = build_arch_model(tmp_path / "hf", "qwen3.5-moe", initializer_range=ARCH_SCALE)
    path = tmp_path / "tiny-qwen35moe.gguf"
    write_qwen35_gguf(path, tmp_path / "hf", model.config, fuse_gate_up=True)
    assert "blk.0.ffn_gate_up_exps.weight" in {t.name for t in open_gguf(path).tensors}
    _assert_same_logits(resolve_model(str(path), cache_dir=tmp_path / "cache"), model)


def _split_regex(tokenizer) -> str | None:
    pre = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    for part in pre.get("pretokenizers") or [pre]:
        if part["type"] == "Split":
            return part["pattern"]["Regex"]
    return None


@pytest.mark.parametrize("pre", ["qwen35", "qwen99-unknown", "default"])
def test_gguf_qwen35_pre_tokenizer(tmp_path, pre):
    """Real files name their pre-tokenizer "qwen35"; a Qwen name transformers does not know
    splits as Qwen3.5 does (not GPT-2's), any other name as transformers reads it."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    add_byte_tokenizer(w, 256)
    w.add_tokenizer_pre(pre)
    finish(w)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path, gguf_file=path.name)
    before = _split_regex(tokenizer)
    fix_pre_tokenizer(open_gguf(path), tokenizer)
    if pre == "default":
        assert _split_regex(tokenizer) == before != PRETOKENIZE_REGEX
    else:
        assert _split_regex(tokenizer) == PRETOKENIZE_REGEX


@pytest.mark.parametrize("kind", ["qwen3.5", "qwen3.5-moe"])
def test_gguf_qwen35_writer_agrees_with_transformers_own_reader(tmp_path, kind):
    """The writer above against a second reading of llama.cpp's format: transformers' own qwen35
    GGUF loader (its newest releases) reads the same file into the original's logits and the
    config the loader here builds."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_config_mapping")
    if "qwen35" not in getattr(mapping, "GGUF_CONFIG_ARCHS", {}):
        pytest.skip("this transformers reads no qwen35 GGUF")
    from transformers import AutoConfig

    model = build_arch_model(tmp_path / "hf", kind, initializer_range=ARCH_SCALE)
    write_qwen35_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", model.config)
    theirs = AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf").to_dict()
    ours = load_hf_config(resolve_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "c"))
    keys = _KEYS + (_MOE_KEYS if kind == "qwen3.5-moe" else ["intermediate_size"])
    keys.remove("rms_norm_eps")  # (theirs the float32 as it is, ours its decimal)
    assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}
    assert ours["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"], rel=1e-6)
    _assert_same_logits(tmp_path, model, gguf_file="tiny.gguf")
