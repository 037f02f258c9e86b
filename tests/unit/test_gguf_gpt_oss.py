"""GGUF conversion of llama.cpp's "gpt-oss" (engine/loader/gguf_gpt_oss.py): the tiny gpt-oss of
tests/helpers/arch.py (attention sinks, q/k/v/o biases, a sliding layer then a full one, YaRN, four
biased experts) is written as llama.cpp's convert_hf_to_gguf.py (GptOssModel) writes it: its
tensor names and metadata keys, the hub's fused gate_up split into gate and up (even and odd
columns) and transposed, down transposed, the experts in MXFP4 as in OpenAI's releases (quantized
by gguf-py) or in float32 in the newer fused `ffn_gate_up_exps` layout, and a byte-level
tokenizer with the "gpt-4o" pre-tokenizer and gpt-oss's control tokens. Converted back, the MXFP4
file must give the logits and greedy tokens of the model whose experts hold the dequantized values,
the float32 one the original's tensors exactly; what cannot be read is refused by name."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from helpers.arch import ARCH_SCALE, build_arch_model
from helpers.gguf_files import assert_engine_greedy_matches, finish
from pdserve.engine.loader import load_hf_config, resolve_model
from pdserve.engine.loader.gguf_convert import convert_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

MXFP4 = gguf.GGMLQuantizationType.MXFP4
# the clamped SwiGLU's limit is in no GGUF key: llama.cpp's (and transformers') 7.0
_LIMIT = {"swiglu_limit": 7.0}
# the hub's names (under model.layers.N.) -> llama.cpp's (under blk.N.)
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.router": "ffn_gate_inp",
}
# gpt-oss's control tokens at the top of the byte-level test vocabulary
_CONTROL = {251: "<|startoftext|>", 252: "<|endoftext|>", 253: "<|return|>", 254: "<|call|>"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_arch_model(
        tmp_path_factory.mktemp("hf"), "gpt-oss", initializer_range=ARCH_SCALE, **_LIMIT
    )


def llama_cpp_tensors(model, fuse_gate_up: bool):
    """(GGUF name, float32 array) of `model` as GptOssModel.modify_tensors writes a float
    checkpoint's (with --fuse-gate-up-exps: gate and up in one tensor, gate first)."""
    top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
    top["lm_head.weight"] = "output"
    for name, tensor in model.state_dict().items():
        arr = tensor.numpy()
        if name in top:
            yield f"{top[name]}.weight", arr
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "self_attn.sinks":
            yield f"{blk}.attn_sinks.weight", arr
        elif rest.startswith("mlp.experts.gate_up_proj"):
            if rest.endswith("_bias"):  # [E, 2I]
                gate, up, kind = arr[..., 0::2], arr[..., 1::2], "bias"
            else:  # [E, H, 2I] -> [E, 2I, H]
                arr = arr.transpose(0, 2, 1)
                gate, up, kind = arr[:, 0::2, :], arr[:, 1::2, :], "weight"
            if fuse_gate_up:
                yield f"{blk}.ffn_gate_up_exps.{kind}", np.concatenate([gate, up], axis=1)
            else:
                yield f"{blk}.ffn_gate_exps.{kind}", gate
                yield f"{blk}.ffn_up_exps.{kind}", up
        elif rest == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            yield f"{blk}.ffn_down_exps.weight", arr.transpose(0, 2, 1)
        elif rest == "mlp.experts.down_proj_bias":
            yield f"{blk}.ffn_down_exps.bias", arr
        else:
            module, kind = rest.rsplit(".", 1)
            yield f"{blk}.{_LAYER[module]}.{kind}", arr


def add_gpt_oss_tokenizer(writer, vocab_size: int) -> None:
    """A byte-level BPE over `vocab_size` ids with the "gpt-4o" pre-tokenizer (o200k's split) and
    gpt-oss's control tokens (_CONTROL); id 255 holds transformers' one needed merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(vocab_size)]
    types = [gguf.TokenType.NORMAL] * vocab_size
    for i, token in _CONTROL.items():
        tokens[i], types[i] = token, gguf.TokenType.CONTROL
    tokens[255] = tokens[97] + tokens[98]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{tokens[97]} {tokens[98]}"])
    writer.add_bos_token_id(251)
    writer.add_eos_token_id(253)  # <|return|>, as the hub's config.json
    writer.add_pad_token_id(252)


def write_gpt_oss_gguf(path, model, experts: str, fuse_gate_up: bool = False, edit=None):
    """`model` as llama.cpp's GGUF, its expert weights of type `experts` ("mxfp4" or "f32").
    `edit(metadata, tensors)` may change the metadata (key -> (value, type)) and the tensors
    first. Returns {GGUF name: the float32 values the file holds} for the MXFP4 tensors."""
    cfg, rope = model.config, model.config.rope_parameters
    g = gguf.GGUFValueType
    metadata = {
        "block_count": (cfg.num_hidden_layers, g.UINT32),
        "context_length": (cfg.max_position_embeddings, g.UINT32),
        "embedding_length": (cfg.hidden_size, g.UINT32),
        "feed_forward_length": (cfg.intermediate_size, g.UINT32),
        "attention.head_count": (cfg.num_attention_heads, g.UINT32),
        "attention.head_count_kv": (cfg.num_key_value_heads, g.UINT32),
        "rope.freq_base": (rope["rope_theta"], g.FLOAT32),
        "attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, g.FLOAT32),
        "attention.key_length": (cfg.head_dim, g.UINT32),
        "attention.value_length": (cfg.head_dim, g.UINT32),
        "rope.dimension_count": (cfg.head_dim, g.UINT32),
        "expert_count": (cfg.num_local_experts, g.UINT32),
        "expert_used_count": (cfg.num_experts_per_tok, g.UINT32),
        "attention.sliding_window": (cfg.sliding_window, g.UINT32),
        "expert_feed_forward_length": (cfg.intermediate_size, g.UINT32),
        "rope.scaling.type": ("yarn", g.STRING),
        "rope.scaling.factor": (rope["factor"], g.FLOAT32),
        "rope.scaling.original_context_length": (
            rope["original_max_position_embeddings"],
            g.UINT32,
        ),
        "rope.scaling.yarn_beta_fast": (rope["beta_fast"], g.FLOAT32),
        "rope.scaling.yarn_beta_slow": (rope["beta_slow"], g.FLOAT32),
    }
    tensors = dict(llama_cpp_tensors(model, fuse_gate_up))
    if edit is not None:
        edit(metadata, tensors)
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for key, (value, vtype) in metadata.items():
        w.add_key_value(f"gpt-oss.{key}", value, vtype)
    add_gpt_oss_tokenizer(w, cfg.vocab_size)
    held = {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if experts == "mxfp4" and name.endswith("_exps.weight"):
            blocks = gguf.quants.quantize(arr, MXFP4)  # (32 values a block, along the rows)
            held[name] = gguf.quants.dequantize(blocks, MXFP4)
            w.add_tensor(name, blocks, raw_dtype=MXFP4)
        else:
            w.add_tensor(name, arr)
    finish(w)
    return held


def with_experts(model, held: dict) -> None:
    """Sets `model`'s expert weights to the values the GGUF's MXFP4 tensors hold."""
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate = held[f"blk.{i}.ffn_gate_exps.weight"].transpose(0, 2, 1)  # [E, H, I]
            up = held[f"blk.{i}.ffn_up_exps.weight"].transpose(0, 2, 1)
            layer.mlp.experts.gate_up_proj[..., 0::2] = torch.from_numpy(gate.copy())
            layer.mlp.experts.gate_up_proj[..., 1::2] = torch.from_numpy(up.copy())
            down = held[f"blk.{i}.ffn_down_exps.weight"].transpose(0, 2, 1)  # [E, I, H]
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(down.copy()))


# the config keys a GGUF carries, compared with the original's
_KEYS = [
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_local_experts",
    "num_experts_per_tok",
    "sliding_window",
    "layer_types",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "swiglu_alpha",
    "swiglu_limit",
    "attention_bias",
    "tie_word_embeddings",
]


def test_gguf_gpt_oss_mxfp4_round_trip(tmp_path, model):
    """OpenAI's release as llama.cpp writes it: the experts in MXFP4."""
    held = write_gpt_oss_gguf(tmp_path / "tiny-gpt-oss.gguf", model, "mxfp4")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "tiny-gpt-oss.gguf").tensors}
    assert sorted(n for n, t in types.items() if t == MXFP4) == sorted(held) and len(held) == 6
    out = resolve_model(str(tmp_path / "tiny-gpt-oss.gguf"), cache_dir=tmp_path / "cache")

    cfg, want = load_hf_config(out), model.config.to_dict()
    want["architectures"] = [type(model).__name__]
    assert {k: cfg[k] for k in _KEYS} == {k: want[k] for k in _KEYS}
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (251, 253, 252)
    # the hub's gpt-oss generation config: <|return|>, <|endoftext|>, <|call|>
    assert GenerationConfig.from_pretrained(out).eos_token_id == [253, 252, 254]

    tok = AutoTokenizer.from_pretrained(out)  # o200k's split: digits in threes, space alone
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ab 12345")
    assert [p for p, _ in pieces] == ["ab", "Ġ", "123", "45"]
    assert tok("<|call|>ab", add_special_tokens=False)["input_ids"] == [254, 255]

    quantized = copy.deepcopy(model)
    with_experts(quantized, held)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "GptOssForCausalLM"
    ids = torch.tensor([list(range(2, 202))])  # (past the 32-token window and 128 YaRN positions)
    with torch.no_grad():
        got, ref = reloaded(ids).logits, quantized(ids).logits
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        assert not torch.equal(ref, model(ids).logits)  # (MXFP4 moved the experts)

    assert_engine_greedy_matches(out, quantized)


def test_gguf_gpt_oss_fused_float_experts(tmp_path, model):
    """A float checkpoint through the newer converter's fused ffn_gate_up_exps: every tensor
    comes back under the hub's name and layout, exactly."""
    write_gpt_oss_gguf(tmp_path / "fused.gguf", model, "f32", fuse_gate_up=True)
    convert_gguf(tmp_path / "fused.gguf", _out(tmp_path))
    got, want = load_file(tmp_path / "out" / "model.safetensors"), model.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def _out(tmp_path):
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


def _drop(key):
    return lambda metadata, tensors: metadata.pop(key)


def _set(key, value, vtype):
    return lambda metadata, tensors: metadata.__setitem__(key, (value, vtype))


def _drop_tensor(name):
    return lambda metadata, tensors: tensors.pop(name)


S = gguf.GGUFValueType
REFUSALS = {
    "no sliding window": (_drop("attention.sliding_window"), "gpt-oss.attention.sliding_window"),
    "no experts per token": (_drop("expert_used_count"), "gpt-oss.expert_used_count"),
    "linear rope": (_set("rope.scaling.type", "linear", S.STRING), "gpt-oss.rope.scaling.type"),
    "yarn log multiplier": (
        _set("rope.scaling.yarn_log_multiplier", 0.1, S.FLOAT32),
        "gpt-oss.rope.scaling.yarn_log_multiplier",
    ),
    "two ropes": (_set("rope.freq_base_swa", 10000.0, S.FLOAT32), "gpt-oss.rope.freq_base_swa"),
    "partial rotary": (_set("rope.dimension_count", 8, S.UINT32), "gpt-oss.rope.dimension_count"),
    "no sinks": (_drop_tensor("blk.1.attn_sinks.weight"), "blk.1.attn_sinks.weight"),
    "no up": (_drop_tensor("blk.0.ffn_up_exps.bias"), "blk.0.ffn_up_exps.bias"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_gguf_gpt_oss_refuses_what_it_cannot_read(tmp_path, model, case):
    edit, named = REFUSALS[case]
    write_gpt_oss_gguf(tmp_path / "bad.gguf", model, "f32", edit=edit)
    with pytest.raises(ValueError, match=f"gpt-oss GGUF: .*{named.replace('.', '[.]')}"):
        convert_gguf(tmp_path / "bad.gguf", _out(tmp_path))


def test_gguf_gpt_oss_layer_pattern(tmp_path, model):
    """llama.cpp's sliding_window_pattern period: layer i slides when i % period < period - 1
    (a period of 1: none; absent: 2, the even layers)."""
    edit = _set("attention.sliding_window_pattern", 1, S.UINT32)
    write_gpt_oss_gguf(tmp_path / "full.gguf", model, "f32", edit=edit)
    convert_gguf(tmp_path / "full.gguf", _out(tmp_path))
    assert load_hf_config(tmp_path / "out")["layer_types"] == ["full_attention"] * 2
