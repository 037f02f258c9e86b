"""LoRA adapters on hybrid models (engine/lora.py): the Qwen3.5 family's Gated DeltaNet
projections, LFM2's short convolutions and Granite 4.0-H's Mamba2 mixers beside their attention
and MLPs, in one batch mixing two random PEFT adapters and the base, give HF + PEFT's greedy
tokens; an adapter naming a module of the wrong layer kind, Qwen3-Next's fused projections and
the hybrids not served are refused by name. (Here rather than in tests/unit/test_lora.py for the
fast lane's time; at TP=2: tests/integration/test_lora_tp.py.)"""

from __future__ import annotations

import shutil

import pytest

from helpers.arch import build_arch_model
from helpers.lora import lora_families, lora_llm, make_adapter, mixed_batch
from pdserve.engine import LoRARequest
from pdserve.engine.lora import LoRAError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return lora_families(tmp_path_factory)


_llm = lora_llm


@pytest.mark.parametrize("kind", ["qwen3.5", "lfm2", "granite-4.0-h"])
def test_mixed_batch_matches_hf_peft(family, kind):
    base, dirs, prompts, want = family(kind)
    assert want["sql"] != want["base"] and want["poem"] != want["base"]  # the adapters matter
    llm = _llm(base, dtype="float32", max_loras=2)
    try:
        assert mixed_batch(llm, dirs, prompts) == want
    finally:
        llm.shutdown()


def test_a_hybrids_adapters_are_checked_against_its_layer_kinds(family, tmp_path):
    """Qwen3.5's layers 0-2 are Gated DeltaNet, 3 full attention: an adapter of layer 0's q_proj
    is of another model; Qwen3-Next's fused per-key-head projections are not adapted; Nemotron-H
    takes no adapter."""
    from safetensors.torch import load_file, save_file

    base, dirs, _, _ = family("qwen3.5")
    moved = tmp_path / "moved"
    shutil.copytree(dirs["sql"], moved)
    weights = load_file(moved / "adapter_model.safetensors")
    save_file(
        {k.replace("layers.3.self_attn", "layers.0.self_attn"): v for k, v in weights.items()},
        moved / "adapter_model.safetensors",
    )
    llm = _llm(base)
    try:
        with pytest.raises(LoRAError, match="targets self_attn of layer 0, which is a recurrent"):
            llm.engine.add_lora(LoRARequest("moved", 1, str(moved)))
    finally:
        llm.shutdown()
    nxt = tmp_path / "next"
    build_arch_model(nxt / "base", "qwen3-next")
    make_adapter(str(nxt / "base"), "qwen3-next", str(nxt / "a"), seed=3, targets=["in_proj_qkvz"])
    llm = _llm(str(nxt / "base"))
    try:
        with pytest.raises(LoRAError, match="in_proj_qkvz.* targets an unknown module"):
            llm.engine.add_lora(LoRARequest("fused", 1, str(nxt / "a")))
    finally:
        llm.shutdown()
    build_arch_model(tmp_path / "nemotron", "nemotron-h")
    with pytest.raises(ValueError, match="LoRA adapters on NemotronHForCausalLM are not"):
        _llm(str(tmp_path / "nemotron"))
