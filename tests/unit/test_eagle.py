"""Speculative decoding with EAGLE heads (engine/spec/eagle.py, engine/models/eagle.py).

A tiny random target of six layers (so EAGLE-3's default layers 2, 3 and 3 exist) and random
heads in the released checkpoints' formats: EAGLE-1 (fc with a bias over [embed, h]) and EAGLE-3
(three layers' inputs, a draft vocabulary of the target's size or a pruned one with d2t). Every
guess the engine makes is recomputed with plain torch from the target's states
(tests/helpers/eagle.py), and outputs equal those of the target alone, greedy and seeded.
"""

from __future__ import annotations

import json

import pytest

from helpers.eagle import check_guesses, check_head_hand_off, check_head_run, make_head, recording
from helpers.engine import KV, greedy, needs_x86_int8
from helpers.models import make_tiny_model, random_prompts
from helpers.spec import exacting_params, run_spec
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.layers.quant import Int8Weight
from pdserve.engine.spec import eagle as spec_eagle
from pdserve.engine.spec.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(dtype="float32", kv_cache_memory=KV, block_size=4)


@pytest.fixture(autouse=True)
def whole_chains(monkeypatch):
    """A random head is rarely sure of a guess: its chains go on whatever its confidence, so
    every guess step runs (test_an_unsure_head_stops_its_chain checks the stop itself)."""
    monkeypatch.setattr(spec_eagle, "CONTINUE_AT", 0.0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle-target")
    return str(path), make_tiny_model(path, "llama-gqa", num_hidden_layers=6)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    """kind ("eagle", "eagle3", "eagle3-pruned", "eagle3-speculators", "eagle3-aux": layers 0, 4
    and 2 named, out of order) -> (speculative_config, the head's tensors)."""
    cache = {}

    def get(kind: str, k: int = 3):
        if kind not in cache:
            path = tmp_path_factory.mktemp(kind)
            method = kind.split("-")[0]
            tensors = make_head(
                path,
                target[1],
                method,
                draft_vocab=128 if "pruned" in kind else None,
                speculators="speculators" in kind,
                aux=(0, 4, 2) if "aux" in kind else None,
            )
            cache[kind] = (method, str(path), tensors)
        method, path, tensors = cache[kind]
        return {"method": method, "model": path, "num_speculative_tokens": k}, tensors

    return get


def _prompts(n: int) -> list[str]:
    return random_prompts([5 + (9 * i) % 40 for i in range(n)], seed=3)


@pytest.mark.parametrize(
    "kind", ["eagle", "eagle3", "eagle3-pruned", "eagle3-speculators", "eagle3-aux"]
)
def test_guesses_are_the_heads_and_tokens_the_targets(
    target, heads, always_speculate, monkeypatch, kind
):
    """Each guess is the head's most likely token given the target's states at the positions
    before it and the head's own output after them; the output is the target's."""
    model_dir, hf = target
    spec, tensors = heads(kind)
    check_head_run(model_dir, hf, spec, tensors, monkeypatch, _prompts(5), **ENGINE)


@pytest.mark.parametrize("sent", [True, False])
def test_handoff_brings_the_heads_prompt_kv(target, heads, always_speculate, monkeypatch, sent):
    """A prefill-only engine runs the head over the prompt and its sink sends the head's KV on;
    the decode engine's guesses are then those of a head that saw the whole prompt. Without it
    (a sink that cannot carry it: nixl), the decode side clears those blocks of the head's cache
    and the head guesses from what it computes itself; the tokens are the target's either way."""
    model_dir, hf = target
    spec, tensors = heads("eagle3")
    check_head_hand_off(model_dir, hf, spec, tensors, monkeypatch, _prompts(4), sent, **ENGINE)


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
    with pytest.raises(ValueError, match="pipeline_parallel_size 1"):
        LLM(model_dir, speculative_config=spec, pipeline_parallel_size=2, **ENGINE)
    speculators, _ = heads("eagle3-speculators")
    for head in (spec, speculators):  # (a head given as a draft model: vLLM infers the method)
        as_draft = {"model": head["model"], "num_speculative_tokens": 2}
        with pytest.raises(ValueError, match="is an EAGLE head, not a model: give method 'eagle3'"):
            LLM(model_dir, speculative_config=as_draft, **ENGINE)
    fused = tmp_path / "fused"
    make_head(fused, hf, "eagle3", speculators=True)
    config = json.loads((fused / "config.json").read_text())
    (fused / "config.json").write_text(json.dumps({**config, "norm_before_fc": True}))
    with pytest.raises(ValueError, match="norm_before_fc"):
        LLM(model_dir, speculative_config={**spec, "model": str(fused)}, **ENGINE)
    other = tmp_path / "other"
    make_tiny_model(other, "llama-gqa", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(other), speculative_config=spec, **ENGINE)
    short = tmp_path / "short"
    make_tiny_model(short, "llama-gqa", num_hidden_layers=2)  # no layer 3 to read
    with pytest.raises(ValueError, match="three of the target's 2 layers"):
        LLM(str(short), speculative_config=spec, **ENGINE)


@needs_x86_int8
def test_the_head_runs_in_the_targets_quantized_mode(target, heads, always_speculate):
    """A head reads its weights for a row or two a step, so it runs in the target's mode (its
    linears int8 beside an int8 target, without a calibration of its own); the tokens stay the
    target's."""
    model_dir, _ = target
    spec, _ = heads("eagle3")
    mode = dict(quantization="int8", kv_cache_memory=KV, block_size=4)
    prompts = _prompts(3)
    want, _ = run_spec(model_dir, prompts, greedy(24), None, **mode)
    llm = LLM(model_dir, speculative_config=spec, **mode)
    try:
        head = llm.engine.spec.draft.head
        assert isinstance(head.fc._quant, Int8Weight)
        assert isinstance(head.self_attn.qkv_proj._quant, Int8Weight)
        got = llm.generate(prompts, greedy(24), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.token_ids for o in want]
        assert llm.engine.spec_stats()["spec_drafts"] > 0
    finally:
        llm.shutdown()


def test_an_unsure_head_stops_its_chain(target, heads, always_speculate, monkeypatch):
    """Guesses after one the head gave less than CONTINUE_AT of its probability are not made
    (none after the first when nothing is sure enough); the tokens stay the target's."""
    model_dir, hf = target
    spec, tensors = heads("eagle3")
    monkeypatch.setattr(spec_eagle, "CONTINUE_AT", 1.01)
    records = recording(monkeypatch)
    prompts = _prompts(3)
    want, _ = run_spec(model_dir, prompts, greedy(16), None, **ENGINE)
    got, _ = run_spec(model_dir, prompts, greedy(16), spec, **ENGINE)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert records and all(len(g) == 1 for _, _, g in records)
    check_guesses(records, hf, "eagle3", tensors)


def test_stops_penalties_logprobs_forks_and_preemption_as_without(target, heads, always_speculate):
    """What the target's own sampling does with guesses around it: stop strings, penalties,
    min_tokens and logprobs come out as without speculation; so do n=2 forks (their copied last
    block carries the head's KV too) and a KV cache small enough that sequences are preempted and
    recomputed (the head runs over the recomputed positions again). No block is left held."""
    model_dir, _ = target
    spec, _ = heads("eagle3")
    prompts = _prompts(4)
    plain, _ = run_spec(model_dir, prompts, greedy(30), None, **ENGINE)
    stop = plain[1].text.split()[12]
    params = exacting_params(stop)
    want, _ = run_spec(model_dir, prompts, params, None, **ENGINE)
    got, stats = run_spec(model_dir, prompts, params, spec, **ENGINE)
    assert stats["spec_drafts"] > 0
    for a, b in zip(got, want):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert any(o.finish_reason == "stop" for o in got)
    forks = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    small = {**ENGINE, "kv_cache_memory": 1 << 17, "max_model_len": 80}  # (a few at a time)
    for params, engine in ((forks, ENGINE), (greedy(40), small)):
        llms = [LLM(model_dir, speculative_config=s, **engine) for s in (None, spec)]
        try:
            outs = [llm.generate(_prompts(8), params, use_tqdm=False) for llm in llms]
            for a, b in zip(*outs):
                assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
            assert llms[1].engine.spec_stats()["spec_drafts"] > 0
            if engine is small:
                assert llms[1].engine.scheduler.num_preemptions > 0
            for llm in llms:
                assert_no_leaks(llm.engine)
        finally:
            for llm in llms:
                llm.shutdown()
