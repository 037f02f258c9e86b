"""LoRA adapters on hybrid models (engine/lora.py): the Qwen3.5 family's Gated DeltaNet
projections, LFM2's short convolutions, Granite 4.0-H's and Nemotron-H's Mamba2 mixers beside
their attention and MLPs (Nemotron-H's ReLU-squared MLP, under its `mixer` names), in one batch
mixing two random PEFT adapters and the base, give HF + PEFT's greedy tokens; an adapter naming
a module of the wrong layer kind, Nemotron-H's experts, Qwen3-Next's fused projections and the
hybrids not served are refused by name. (Here rather than in tests/unit/test_lora.py for the
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


@pytest.mark.parametrize("kind", ["qwen3.5", "lfm2", "granite-4.0-h", "nemotron-h"])
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
    build_arch_model(tmp_path / "bamba", "bamba")
    with pytest.raises(ValueError, match="LoRA adapters on BambaForCausalLM are not"):
        _llm(str(tmp_path / "bamba"))


def test_nemotron_h_adapters_name_each_layers_mixer_and_never_its_experts(family, tmp_path):
    """Nemotron-H's PEFT names put every layer's one mixer under `mixer` (layer 1 of the test
    model is a mixture of experts, 4 an MLP, 0 and 3 Mamba2, 2 and 5 attention): the MLP's
    up_proj moved onto layer 1 is refused as the experts', an adapter of the shared expert by
    its path, attention's q_proj moved onto a Mamba2 layer as another model's."""
    from safetensors.torch import load_file, save_file

    base, dirs, _, _ = family("nemotron-h")
    weights = load_file(f"{dirs['sql']}/adapter_model.safetensors")
    assert any(".layers.4.mixer.up_proj." in k for k in weights)  # (the test adapts the MLP)
    llm = _llm(base)
    try:
        for i, (old, new, complaint) in enumerate(
            [
                ("layers.4.mixer.up_proj", "layers.1.mixer.up_proj", "layer 1's mixture of ex"),
                ("layers.4.mixer.up_proj", "layers.1.mixer.shared_experts.up_proj", "not experts"),
                ("layers.2.mixer.q_proj", "layers.0.mixer.q_proj", "which is a Mamba2 layer"),
            ]
        ):
            moved = tmp_path / f"moved{i}"
            shutil.copytree(dirs["sql"], moved)
            save_file(
                {k.replace(old, new): v for k, v in weights.items()},
                moved / "adapter_model.safetensors",
            )
            with pytest.raises(LoRAError, match=complaint):
                llm.engine.add_lora(LoRARequest(f"moved{i}", i + 1, str(moved)))
    finally:
        llm.shutdown()
