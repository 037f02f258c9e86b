"""MiniMax-M2 beyond the architecture tests (tests/unit/test_architectures.py and
tests/integration/test_architectures_tp.py run the "minimax-m2" kind of tests/helpers/arch.py
against transformers, at TP 2 too, where the query and key norms span heads on both ranks).
Here: a checkpoint in the hub's layout (Mixtral's per-expert names under `block_sparse_moe`, the
correction bias beside the gate, multi-token-prediction layers past num_hidden_layers, the
config's `rotary_dim`) gives transformers' tokens.
"""

from __future__ import annotations

import json

from safetensors.torch import load_file, save_file

from helpers.arch import build_arch_model
from helpers.models import LazyGreedy, random_prompts
from pdserve.engine import LLM, SamplingParams

NEW = 16


def _hub_layout(path) -> None:
    """The saved tiny checkpoint rewritten as MiniMaxAI/MiniMax-M2 ships: fused experts split
    into w1 (gate), w3 (up) and w2 (down) per expert, `mlp.` as `block_sparse_moe.`, and one
    tensor of a multi-token-prediction layer after the last layer."""
    tensors = load_file(path / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)  # ([E, 2I, H] in memory: the gate's rows first)
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.w1.weight"] = gate[e].contiguous()
                out[f"{prefix}{e}.w3.weight"] = up[e].contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.w2.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    mtp = tensors["model.layers.0.self_attn.q_proj.weight"].clone()
    out[f"model.layers.{layers}.self_attn.q_proj.weight"] = mtp
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})


def test_the_hub_layout_gives_hf_tokens(tmp_path):
    hf = build_arch_model(tmp_path, "minimax-m2", initializer_range=0.1)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("partial_rotary_factor", None)  # (the hub's config says rotary_dim alone)
    config["rope_parameters"].pop("partial_rotary_factor", None)
    config["rotary_dim"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    _hub_layout(tmp_path)
    assert any(
        ".block_sparse_moe.experts.3.w2." in n for n in load_file(tmp_path / "model.safetensors")
    )
    prompts = random_prompts([5, 40], seed=3)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
        )
    finally:
        llm.shutdown()
    want = LazyGreedy(hf, prompts, NEW)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
