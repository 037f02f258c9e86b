"""gpt-oss's MXFP4 checkpoints (`quant_method: mxfp4`) load as the float checkpoint of the same
model (engine/loader/prequantized.py): each layer's experts, stored as `*_blocks` (two FP4 e2m1
values a byte, low nibble first) and `*_scales` (one E8M0 exponent per 32 values), arrive as
the float32 `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] that transformers'
GptOssForCausalLM holds, under those names, and every other tensor arrives as written. The
checkpoint is written here from a tiny transformers model whose experts hold values MXFP4 holds
exactly, by a packer that follows the format's definition; transformers' own loader, asked to
dequantize the same directory, holds the same tensors. A pair missing a half, or halves that
do not fit, are refused with a line naming the tensor."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import save_file

from pdserve.engine.loader.prequantized import (
    UnsupportedQuantization,
    checkpoint_weights,
    dequantized,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# e2m1 by its definition (sign, two exponent bits, one mantissa bit): code c holds E2M1[c]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
EXPERTS = ("gate_up_proj", "down_proj")
QC = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def _representable(shape, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 [E, in, out] tensor MXFP4 holds exactly, with its E8M0 exponents [E, out,
    in / 32]: FP4 values (no -0) times a power of two per 32 consecutive inputs of an output."""
    e, n_in, n_out = shape
    codes = torch.randint(0, 15, (e, n_out, n_in), generator=generator)
    codes = codes + (codes >= 8).long()  # skip code 8, -0, which equals 0 under torch.equal
    exps = torch.randint(127 - 4, 127 + 3, (e, n_out, n_in // 32), generator=generator)
    values = torch.tensor(E2M1)[codes] * torch.exp2(exps.repeat_interleave(32, -1) - 127.0)
    return values.transpose(1, 2).contiguous(), exps.to(torch.uint8)


def _pack(dense: torch.Tensor, exps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's `_blocks` [E, out, in / 32, 16] and `_scales` [E, out, in / 32] of a dense
    [E, in, out] tensor and its exponents (the reader's inverse)."""
    e, n_in, n_out = dense.shape
    groups = dense.transpose(1, 2).reshape(e, n_out, n_in // 32, 32)
    q = groups / torch.exp2(exps.float() - 127).unsqueeze(-1)
    hit = q.unsqueeze(-1) == torch.tensor(E2M1)
    assert bool(hit.any(-1).all()), "a value MXFP4 does not hold"
    codes = hit.to(torch.uint8).argmax(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), exps.clone()


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """(directory, the float model it stands for, the tensors written besides the experts')."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    tensors, plain = {}, {}
    for name, param in model.state_dict().items():
        if name.rsplit(".", 1)[-1] in EXPERTS:
            dense, exps = _representable(param.shape, generator)
            param.copy_(dense)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = _pack(dense, exps)
        else:  # as gpt-oss's own files hold them
            plain[name] = tensors[name] = param.to(torch.bfloat16).contiguous()
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "quantization_config": QC}))
    return path, model, plain


def _dense_experts(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.state_dict().items() if n.rsplit(".", 1)[-1] in EXPERTS}


def test_the_experts_arrive_as_the_float_model_s_dense_tensors(mxfp4_checkpoint):
    path, model, plain = mxfp4_checkpoint
    got = dict(checkpoint_weights(path))
    want = _dense_experts(model)
    assert len(want) == 4 and want["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert want["model.layers.1.mlp.experts.down_proj"].shape == (4, 32, 64)
    assert set(got) == set(want) | set(plain)  # no *_blocks, *_scales, nor `.weight` on them
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    for name, tensor in plain.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor), name


def test_the_low_nibble_is_the_first_value():
    """One byte 0x72 with exponent 128 (x2): codes 2 (1.0) then 7 (6.0), as 2.0 then 12.0; the
    32 values of the group run along the dense tensor's inputs (its second dimension)."""
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x72
    parts = {"e.w_blocks": blocks, "e.w_scales": torch.full((1, 1, 1), 128, dtype=torch.uint8)}
    (name, w), *_ = dequantized(iter(parts.items()), list(parts), {"quantization_config": QC})
    assert name == "e.w" and w.shape == (1, 32, 1)
    assert w[0, :3, 0].tolist() == [2.0, 12.0, 0.0]


def test_transformers_own_dequantization_holds_the_same_tensors(mxfp4_checkpoint):
    """transformers' GptOssForCausalLM loading the same directory with Mxfp4Config(dequantize=
    True) (on CPU: no kernels, no GPU) holds every tensor the loader hands on."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    path, _, _ = mxfp4_checkpoint
    hf = GptOssForCausalLM.from_pretrained(
        str(path), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    theirs = hf.state_dict()
    ours = dict(checkpoint_weights(path))
    assert set(theirs) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name].float(), tensor.float()), name


def _halves(scales_shape=(2, 64, 2)) -> dict[str, torch.Tensor]:
    return {
        "m.experts.down_proj_blocks": torch.zeros(2, 64, 2, 16, dtype=torch.uint8),
        "m.experts.down_proj_scales": torch.full(scales_shape, 127, dtype=torch.uint8),
    }


def test_scales_that_do_not_fit_their_blocks_are_named():
    parts = _halves(scales_shape=(2, 64, 1))
    with pytest.raises(ValueError, match=r"m.experts.down_proj cannot be read: blocks \[2, 64, 2"):
        list(dequantized(iter(parts.items()), list(parts), {"quantization_config": QC}))


def test_blocks_without_their_scales_are_named():
    parts = _halves()
    del parts["m.experts.down_proj_scales"]
    with pytest.raises(ValueError, match="m.experts.down_proj lacks some of"):
        list(dequantized(iter(parts.items()), list(parts), {"quantization_config": QC}))


def test_without_transformers_mxfp4_the_version_needed_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.integrations.mxfp4", None)
    with pytest.raises(UnsupportedQuantization, match=r"mxfp4 .*transformers >= 4\.55"):
        list(dequantized(iter(_halves().items()), list(_halves()), {"quantization_config": QC}))


def test_the_refusal_of_an_unread_format_lists_mxfp4():
    with pytest.raises(UnsupportedQuantization, match="fp8 and mxfp4 checkpoints"):
        list(dequantized(iter([]), [], {"quantization_config": {"quant_method": "hqq"}}))
