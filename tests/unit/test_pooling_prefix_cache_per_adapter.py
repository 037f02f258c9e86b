"""Pooling requests (embeddings) under LoRA adapters in the engine (engine/scheduler.py, the
pooled request's blocks): each gives HF + PEFT's last-token hidden state, and the full blocks it
leaves in the prefix cache are keyed by its adapter, so the base model's request for the same
prompt afterwards finds none of them cached and still gives the base model's vector, as a
generated request under an adapter leaves the base model's cache alone (tests/unit/test_lora.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import run_until_done
from helpers.lora import lora_family
from pdserve.engine import LLM
from pdserve.engine.request import PoolingParams

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
IDS = [5, 6, 7, 8, 9, 4, 3, 5, 6]  # two full blocks of 4, and one token more


def _reference(model, ids: list[int]) -> torch.Tensor:
    """HF's (HF + PEFT's, its adapter active) last-token final hidden state, L2-normalised."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        h = inner.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(h, dim=-1)


def test_an_adapters_pooled_blocks_are_not_the_base_models(tmp_path):
    base, dirs, models = lora_family(tmp_path, "llama")
    engine = LLM(
        base,
        dtype="float32",
        kv_cache_memory=1 << 22,
        block_size=4,
        enable_lora=True,
        lora_modules=dict(dirs),
        max_loras=2,
        max_lora_rank=8,
    ).engine
    for i, name in enumerate(["sql", "poem", "base", "sql"]):
        adapter = {} if name == "base" else {"lora_request": name}
        engine.add_request(f"r{i}", IDS, None, pooling=PoolingParams(), **adapter)
        (out,) = [o for o in run_until_done(engine) if o.finished]
        # the third request is the base model's first: nothing of the adapters' may serve it;
        # the fourth finds the first's blocks, under its own adapter
        assert out.num_cached_tokens == (8 if i == 3 else 0), (name, out.num_cached_tokens)
        assert (out.pooled - _reference(models[name], IDS)).abs().max().item() < TOL, name
