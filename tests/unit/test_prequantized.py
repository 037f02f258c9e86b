"""Checkpoints quantized by GPTQ, AWQ, llm-compressor (compressed-tensors) and in block FP8 load
as the float weights they stand for (engine/loader/prequantized.py): the engine's greedy tokens
equal HF transformers' on a model holding those weights (tests/helpers/prequantized.py builds
both), for a dense model and a mixture of experts; the formats' bit orders are pinned on words
written out by hand from the formats' definitions; a format the loader does not read, and a
checkpoint missing a part, are refused at load with a line that names them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers.arch import arch_prompts, build_arch_model
from helpers.engine import KV
from helpers.models import LazyGreedy
from helpers.prequantized import FORMATS, engine_greedy, quantized_copy
from pdserve.engine import LLM
from pdserve.engine.loader.prequantized import (
    AwqReader,
    UnsupportedQuantization,
    dequantized,
    unpack_words,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    """kind -> (directory, HF model) of a float checkpoint, built once."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"float-{kind}")
            cache[kind] = (path, build_arch_model(path, kind, initializer_range=0.1))
        return cache[kind]

    return get


def _served_as_hf(tmp_path, float_models, kind: str, fmt: str) -> None:
    src, hf = float_models(kind)
    ref = quantized_copy(src, tmp_path / fmt, fmt, hf)
    prompts = arch_prompts()[:4]
    got = engine_greedy(tmp_path / fmt, prompts, NEW)
    assert got == LazyGreedy(ref, prompts, NEW)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_llama_serves_hf_s_tokens_on_its_dequantized_weights(
    tmp_path, float_models, fmt
):
    _served_as_hf(tmp_path, float_models, "llama", fmt)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_a_quantized_mixture_of_experts_serves_hf_s_tokens(tmp_path, float_models, fmt):
    """Each expert's linears quantized, one set of tensors per expert, as GPTQ and AWQ MoE
    checkpoints (Qwen's, Mixtral's) store them."""
    _served_as_hf(tmp_path, float_models, "qwen2-moe", fmt)
    from safetensors import safe_open

    with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.down_proj.qweight" in set(f.keys())


def test_the_quantized_weights_differ_from_the_float_ones(tmp_path, float_models):
    """(So the tests above compare the quantized model, not the float one that was its source.)"""
    src, hf = float_models("llama")
    ref = quantized_copy(src, tmp_path / "q", "gptq", hf)
    a = hf.model.layers[0].self_attn.q_proj.weight
    b = ref.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(a, b)


def _int32(value: int) -> torch.Tensor:
    return torch.tensor([value - (1 << 32) if value >= 1 << 31 else value], dtype=torch.int32)


def test_gptq_words_hold_their_values_lowest_bits_first():
    # eight 4-bit values 1..8, the first in the lowest four bits (GPTQ packs along the inputs)
    word = _int32(0x87654321)
    assert unpack_words(word.view(1, 1), 4, 0).view(-1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert unpack_words(_int32(0xFF018002).view(1, 1), 8, 1).tolist() == [[2, 128, 1, 255]]


def test_awq_words_hold_outputs_in_awq_order():
    # outputs 0..7 with values 1..8: AutoAWQ writes output AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5,
    # 7)[i] into the i-th four bits, so the nibbles from the lowest read 1, 3, 5, 7, 2, 4, 6, 8
    reader = AwqReader({"quant_method": "awq", "bits": 4, "group_size": 8, "version": "gemm"})
    assert reader._unpack(_int32(0x86427531).view(1, 1)).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]


def test_an_unread_quantization_is_refused_at_load_naming_it(tmp_path, float_models):
    src, _ = float_models("llama")
    dst = tmp_path / "bnb"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match="quant_method='bitsandbytes'"):
        LLM(str(dst), dtype="float32", kv_cache_memory=KV)


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "gptq", "bits": 3}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}},
            },
            "nvfp4-pack-quantized",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
    ],
)
def test_unread_options_of_read_formats_are_named(qc, match):
    with pytest.raises(UnsupportedQuantization, match=match):
        list(dequantized(iter([]), [], {"quantization_config": qc}))


def test_a_linear_missing_a_part_is_named():
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    names = ["m.l.qweight", "m.l.qzeros", "m.l.scales"]
    words = torch.zeros(4, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="m.l lacks some of"):
        list(dequantized(iter([("m.l.qweight", words)]), names, {"quantization_config": qc}))


def test_scales_that_do_not_fit_their_weight_are_named_with_the_module():
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    parts = {
        "m.l.qweight": torch.zeros(64, 2, dtype=torch.int32),
        "m.l.qzeros": torch.zeros(2, 2, dtype=torch.int32),
        "m.l.scales": torch.ones(3, 16, dtype=torch.float16),
    }
    with pytest.raises(ValueError, match="m.l cannot be read: scales"):
        list(dequantized(iter(parts.items()), list(parts), {"quantization_config": qc}))


def test_a_linear_whose_files_have_no_zero_points_is_named():
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    parts = {"m.l.qweight": torch.zeros(4, 16, dtype=torch.int32), "m.l.scales": torch.ones(1, 16)}
    with pytest.raises(ValueError, match="m.l has no qzeros tensor"):
        list(dequantized(iter(parts.items()), list(parts), {"quantization_config": qc}))
