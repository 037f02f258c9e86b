"""The classification head under tensor parallelism (engine/score_head.py): with TP=2's rank
processes, a Qwen3 *ForSequenceClassification checkpoint and a Llama's label tokens (its LM
head split by vocabulary across the ranks, the tokens on both halves) give HF's logits within
1e-4, as TP=1 does (tests/unit/test_score_head.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.arch import build_arch_model
from helpers.engine import run_until_done
from helpers.models import random_prompts
from pdserve.engine import LLM
from pdserve.engine.request import PoolingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("labels", [("no", "yes"), ()], ids=["checkpoint", "label-tokens"])
def test_tp2_gives_hf_logits(tmp_path, labels):
    hf = build_arch_model(tmp_path, "qwen3" if labels else "llama", labels=labels)
    tokens = () if labels else (7, 250)  # one in each rank's half of the 256-token vocabulary
    kw = {"classifier_from_token": [f"t{t}" for t in tokens]} if tokens else {}
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 20, tensor_parallel_size=2, **kw)
    try:
        prompts = random_prompts([2, 33], seed=12)
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"c{i}", p, None, pooling=PoolingParams("classify"))
        outs = {o.request_id: o.pooled for o in run_until_done(llm.engine) if o.finished}
        for i, p in enumerate(prompts):
            with torch.no_grad():
                logits = hf(torch.tensor([p])).logits
            want = logits[0] if labels else logits[0, -1, list(tokens)]
            assert (outs[f"c{i}"] - want).abs().max().item() < 1e-4
    finally:
        llm.shutdown()
