"""quantization="auto" accepts a mode only if it answers like float32 (engine/quality.judge): the
verdict's rules, the probe's greedy chat decoding through the runner's own steps (the same tokens
the engine serves), and a mode refused by its agreement alone. The real SmolLM2's verdict and
answer: tests/integration/test_default_mode_answers.py."""

from __future__ import annotations

import pytest

from helpers.engine import needs_x86_int8
from pdserve.engine import LLM, SamplingParams, precision
from pdserve.engine.layers.quant import auto_candidates
from pdserve.engine.quality import (
    AGREEMENT_BOUND,
    CHAT_PROBE_TOKENS,
    QUALITY_BOUNDS,
    ProbeScore,
    agreement,
    first_divergence,
    judge,
    top1,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_x86_int8]
KV_BYTES = 1 << 22


@pytest.fixture(autouse=True)
def probe_every_start(monkeypatch):
    """These tests change what the probe judges by (monkeypatched bounds and checks): a verdict
    kept from an earlier start of the same model must not stand in for their probe."""
    monkeypatch.setenv("PDSERVE_PRECISION_CACHE", "0")


def test_top1_and_agreement():
    assert top1([{5: -0.1, 7: -3.0}, {2: -1.0}]) == [5, 2]
    assert agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75


def test_first_divergence_reads_up_to_float32s_end():
    assert first_divergence([1, 2, 3], [1, 2, 3], eos=(9,)) is None
    assert first_divergence([1, 5, 3], [1, 2, 3], eos=(9,)) == 1
    assert first_divergence([1, 9, 4, 4], [1, 9, 7, 7], eos=(9,)) is None  # after the end
    assert first_divergence([1, 2, 4], [1, 2, 9], eos=(9,)) == 2  # the end itself counts


def test_judge_needs_all_three_checks():
    base = ProbeScore(10.0, [1] * 100, [[1, 2, 3]])
    good = ProbeScore(10.1, [1] * 99 + [2], [[1, 2, 3]])
    ok, words = judge(good, base, 0.03, eos=())
    assert ok, words
    assert "top-1 agreement 99.0%" in words and "chat 1/1 answers as float32's" in words
    assert not judge(ProbeScore(11.0, good.top1, good.chat), base, 0.03, ())[0]  # perplexity
    low = [1] * 90 + [2] * 10
    assert not judge(ProbeScore(10.0, low, good.chat), base, 0.03, ())[0]  # agreement
    ok, words = judge(ProbeScore(10.0, good.top1, [[1, 5, 3]]), base, 0.03, ())
    assert not ok and "differs at token 1" in words  # the chat answer


def test_the_probes_greedy_chat_is_what_the_engine_serves(tiny_models):
    """greedy_chat decodes all prompts together through the runner's steps: the same tokens as
    the engine's own greedy generation of each prompt."""
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV_BYTES, enable_prefix_caching=False)
    try:
        prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], list(range(20, 57))]
        got = precision.greedy_chat(llm.engine.runner, prompts)
        params = SamplingParams(temperature=0, max_tokens=CHAT_PROBE_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert got == [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_auto_refuses_a_mode_below_the_agreement_bound(tiny_models, monkeypatch):
    """A tiny random model whose perplexity bounds are wide open: with an agreement bound no mode
    can meet, auto keeps float32 and the note says each mode's agreement and chat verdict."""
    monkeypatch.setattr("pdserve.engine.quality.informative", lambda ppl, vocab: True)
    for mode in ("bfloat16", "int8", "int4", "bf16"):
        monkeypatch.setitem(QUALITY_BOUNDS, mode, 1.0)
    monkeypatch.setattr("pdserve.engine.quality.AGREEMENT_BOUND", 1.01)
    modes = auto_candidates()
    if not modes:
        pytest.skip("no quantized mode is a candidate on this CPU (no int8 or bf16 units)")
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV_BYTES)
    try:
        note = llm.engine.mode_note
        assert llm.engine.config.quantization is None, note
        assert f"{modes[0]}: probe perplexity" in note and "top-1 agreement" in note, note
        assert "(bound >= 101%)" in note and "float32 kept" in note, note
        assert "answers as float32's" in note, note
    finally:
        llm.shutdown()
    assert AGREEMENT_BOUND == 0.98


def test_auto_probes_no_mode_where_none_is_faster(tiny_models, monkeypatch):
    """On a CPU without int8 or bf16 dot-product units no quantized mode is a candidate: auto
    serves float32 at once, without the int8 calibration (minutes for SmolLM2 on such a CPU)
    or a mode's probe, and says why."""
    monkeypatch.setattr("pdserve.engine.quality.informative", lambda ppl, vocab: True)
    monkeypatch.setattr("pdserve.engine.layers.quant.auto_candidates", lambda: [])
    calibrated = []
    monkeypatch.setattr(precision, "calibrate", lambda *a, **k: calibrated.append(a))
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV_BYTES)
    try:
        note = llm.engine.mode_note
        assert llm.engine.config.quantization is None and not calibrated, note
        assert "float32: no quantized mode runs faster on this CPU" in note, note
        assert "probe perplexity" not in note.split(";")[0], note  # no mode was scored
    finally:
        llm.shutdown()
