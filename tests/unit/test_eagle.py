"""Speculative decoding with EAGLE heads (engine/spec/eagle.py, engine/models/eagle.py).

A tiny random target of six layers (so EAGLE-3's default layers 2, 3 and 3 exist) and random
heads in the released checkpoints' formats: EAGLE-1 (fc with a bias over [embed, h]) and EAGLE-3
(three layers' inputs, a draft vocabulary of the target's size or a pruned one with d2t). Every
guess the engine makes is recomputed with plain torch from the target's states
(tests/helpers/eagle.py), and outputs equal those of the target alone, greedy and seeded.
"""

from __future__ import annotations

import pytest
import torch

from helpers.eagle import combine, head_logits, make_head, target_states
from helpers.engine import KV, greedy
from helpers.models import make_tiny_model, random_prompts
from helpers.spec import run_spec
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.eagle import EagleDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(dtype="float32", kv_cache_memory=KV, block_size=4)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle-target")
    return str(path), make_tiny_model(path, "llama-gqa", num_hidden_layers=6)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    """kind ("eagle", "eagle3", "eagle3-pruned") -> (speculative_config, the head's tensors)."""
    cache = {}

    def get(kind: str, k: int = 3):
        if kind not in cache:
            path = tmp_path_factory.mktemp(kind)
            method = kind.split("-")[0]
            tensors = make_head(
                path, target[1], method, draft_vocab=128 if "pruned" in kind else None
            )
            cache[kind] = (method, str(path), tensors)
        method, path, tensors = cache[kind]
        return {"method": method, "model": path, "num_speculative_tokens": k}, tensors

    return get


def _prompts(n: int) -> list[str]:
    return random_prompts([5 + (9 * i) % 40 for i in range(n)], seed=3)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-pruned"])
def test_guesses_are_the_heads_and_tokens_the_targets(
    target, heads, always_speculate, monkeypatch, kind
):
    """Each guess is the head's most likely token given the target's states at the positions
    before it and the head's own output after them; the output is the target's."""
    model_dir, hf = target
    spec, tensors = heads(kind)
    records = []
    propose = EagleDrafter.propose

    def recording(self, items, eos, costs):
        propose(self, items, eos, costs)
        records.extend((list(i.seq.token_ids), list(i.spec_token_ids)) for i in items)

    monkeypatch.setattr(EagleDrafter, "propose", recording)
    prompts = _prompts(5)
    want, _ = run_spec(model_dir, prompts, greedy(24), None, **ENGINE)
    got, stats = run_spec(
        model_dir, prompts, greedy(24), spec, enable_prefix_caching=False, **ENGINE
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_drafts"] > 0 and stats["spec_draft_prefill_tokens"] > 0
    assert any(len(g) == 3 for _, g in records)
    method = spec["method"]
    gaps = []
    for tokens, guesses in records[::3]:
        n = len(tokens)
        x0 = combine(tensors, method, target_states(hf, tokens[: n - 1], method))
        inputs = tokens[1:]
        for guess in guesses:
            logits, out = head_logits(tensors, hf, method, x0, inputs)
            last = logits[-1]
            gaps.append(float(last.max() - last[guess]))
            x0, inputs = torch.cat([x0, out[-1:]]), inputs + [guess]
    # (the head's KV is bfloat16 on a CPU: near-ties may go either way, nothing more; the
    # logits spread over about 9 here, a wrong input or weight moves them by whole units)
    assert max(gaps) < 0.05 and gaps.count(0.0) >= 0.9 * len(gaps), gaps


def test_seeded_sampling_equal_without_speculation(target, heads, always_speculate):
    model_dir, _ = target
    spec, _ = heads("eagle3", k=4)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)
    prompts = _prompts(6)
    want, _ = run_spec(model_dir, prompts, params, None, **ENGINE)
    got, stats = run_spec(model_dir, prompts, params, spec, **ENGINE)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_drafts"] > 0


def test_refusals_say_what_to_change(target, heads, tmp_path):
    model_dir, hf = target
    spec, _ = heads("eagle3")
    for bad, words in (
        ({**spec, "model": "self"}, "head's checkpoint"),
        ({**spec, "quantization": "int8"}, "no 'quantization'"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
    ):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir, speculative_config=spec, tensor_parallel_size=2, **ENGINE)
    other = tmp_path / "other"
    make_tiny_model(other, "llama-gqa", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(other), speculative_config=spec, **ENGINE)
    short = tmp_path / "short"
    make_tiny_model(short, "llama-gqa", num_hidden_layers=2)  # no layer 3 to read
    with pytest.raises(ValueError, match="three of the target's 2 layers"):
        LLM(str(short), speculative_config=spec, **ENGINE)
