"""Speculative decoding in the engine (engine/spec/speculator.py): the same tokens as without it.

Tiny random models rarely repeat themselves, so most tests force the gate to speculate whenever a
guess is on offer (`always_speculate`), and one feeds deliberately bad guesses, so the paths that
reject, roll KV back and wind generators back run in every test. Greedy and seeded outputs,
logprobs, stop strings, penalties and min_tokens must equal those of an engine without
speculation; every block must be free at the end. The sampling distribution itself is checked
statistically in tests/integration/test_spec_distribution.py.
"""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy, needs_x86_int8
from helpers.models import random_prompts
from helpers.spec import exacting_params, run_spec
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.spec import gate as spec_gate, ngram as spec_ngram
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.gate import Offer, SpecGate, StepCosts

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
DRAFT_INT8 = {
    "method": "draft_model",
    "model": "self",
    "quantization": "int8",
    "num_speculative_tokens": 3,
}


def _run(model_dir, prompts, params, spec=None, **kw):
    return run_spec(model_dir, prompts, params, spec, kv_cache_memory=KV, block_size=4, **kw)


def _prompts(n):
    # each prompt quotes itself, so prompt lookup has something to find
    return [p + p[: len(p) // 2] for p in random_prompts([5 + (7 * i) % 60 for i in range(n)])]


def test_ngram_proposes_what_followed_the_latest_match():
    assert spec_ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 1, 3) == [7, 5]
    assert spec_ngram.propose([5, 6, 7, 8], 3, 1, 2) == []  # nothing recurs
    # the longest suffix wins over a later, shorter match
    assert spec_ngram.propose([4, 1, 2, 8, 9, 2, 6, 1, 2], 1, 1, 2) == [8]
    # a byte pattern that straddles two tokens is not a match
    assert spec_ngram.propose([0x0100, 0x02, 0x01, 0x0201], 1, 1, 1) == []
    h = spec_ngram.History()
    h.sync([1, 2, 1])
    assert h.propose(3, 1, 1) == [2, 1]
    h.sync([1, 2, 1, 3])  # appended
    h.sync([1, 2])  # cut short (a stop string took tokens back): packed again
    assert h.propose(2, 1, 1) == []


def test_config_refuses_bad_keys_by_name():
    for bad, words in (
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
        ({"model": "self", "num_speculative_tokens": 2, "quantization": "int3"}, "quantization"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
    ):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    cfg = SpeculativeConfig.parse({"model": "self", "num_speculative_tokens": 3})
    assert cfg.method == "draft_model" and SpeculativeConfig.parse(cfg.to_dict()) == cfg


MODES = {"float32": {"dtype": "float32"}, "int8": {"quantization": "int8"}}


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("spec", ["ngram", "bad-ngram", "draft-int8"])
@pytest.mark.parametrize("mode", [pytest.param("int8", marks=needs_x86_int8), "float32"])
def test_greedy_tokens_equal_without_speculation(
    tiny_models, always_speculate, request, batch, spec, mode
):
    model_dir, _ = tiny_models()
    prompts = _prompts(batch)
    want, _ = _run(model_dir, prompts, greedy(40), None, **MODES[mode])
    if spec == "bad-ngram":
        request.getfixturevalue("bad_guesses")
    config = DRAFT_INT8 if spec == "draft-int8" else NGRAM
    got, stats = _run(model_dir, prompts, greedy(40), config, **MODES[mode])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_drafts"] > 0
    assert stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert sum(stats["spec_accepted_per_pos"]) == stats["spec_accepted_tokens"]
    if spec == "bad-ngram":
        assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    if spec == "draft-int8":  # the draft's prompt KV was computed here, and counted
        assert stats["spec_draft_prefill_tokens"] >= sum(map(len, prompts))
        assert stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("spec", ["bad-ngram", "draft-int8"])
def test_seeded_sampling_equal_without_speculation(tiny_models, always_speculate, request, spec):
    """Each position is sampled with the noise its seed gives it with or without speculation."""
    model_dir, _ = tiny_models()
    prompts = _prompts(6)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)
    want, _ = _run(model_dir, prompts, params)
    if spec == "bad-ngram":
        request.getfixturevalue("bad_guesses")
    got, stats = _run(model_dir, prompts, params, NGRAM if spec == "bad-ngram" else DRAFT_INT8)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_drafts"] > 0


def test_logprobs_stops_and_penalties_exact(tiny_models, always_speculate, bad_guesses):
    model_dir, _ = tiny_models()
    prompts = _prompts(4)
    plain, _ = _run(model_dir, prompts, greedy(30))
    # stop at a word that appears mid-way through the second output
    stop = plain[1].text.split()[12]
    params = exacting_params(stop)
    want, _ = _run(model_dir, prompts, params)
    got, stats = _run(model_dir, prompts, params, NGRAM)
    assert stats["spec_drafts"] > 0
    for a, b in zip(got, want):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [lp.top.keys() for lp in a.logprobs] == [lp.top.keys() for lp in b.logprobs]
    assert any(o.finish_reason == "stop" for o in got)


def test_opted_out_request_is_never_speculated(tiny_models, always_speculate, bad_guesses):
    model_dir, _ = tiny_models()
    got, stats = _run(model_dir, _prompts(3), greedy(20, speculative=False), NGRAM)
    assert stats["spec_drafts"] == 0 and all(len(o.token_ids) == 20 for o in got)


def test_step_costs_interpolate_and_extrapolate():
    costs = StepCosts()
    costs.observe(4, 9.0)  # a shape's first step pays one-time costs: replaced by the second
    costs.observe(4, 1.0)
    costs.observe(64, 4.0)
    assert costs.predict(4) == pytest.approx(1.0)
    assert costs.predict(34) == pytest.approx(2.5, rel=0.05)
    assert costs.predict(128) > costs.predict(64)  # beyond: extrapolated upward
    assert costs.predict(64, upto=4) < costs.predict(64)  # exploring forgets the larger steps


def _gate(cost_per_row: float, base: float = 1.0, acceptance: float = 0.8) -> SpecGate:
    gate = SpecGate(4, acceptance, None)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for _ in range(3):
            gate.target.observe(rows, base + cost_per_row * rows)
    return gate


def test_gate_speculates_when_rows_are_cheap_and_not_when_they_are_not():
    offers = [Offer(4, 40, 10)]  # a sequence that accepted 80% so far
    assert _gate(0.01).choose(1, offers, uses_draft=False) == [4]
    # compute-bound: every row costs as much as the step's fixed part: no gain possible
    assert _gate(1.0, base=0.0).choose(1, offers, uses_draft=False) == [0]
    # 32 streams on a step whose cost grows with its rows: off
    offers32 = [Offer(4, 40, 10)] * 32
    assert _gate(0.2, base=1.0).choose(32, offers32, uses_draft=False) == [0] * 32
    # a sequence that never agreed is not speculated on even when rows are cheap
    assert _gate(0.01).choose(2, [Offer(4, 40, 10), Offer(4, 0, 40)], False) == [4, 0]
    # disable_by_batch_size
    gate = _gate(0.01)
    gate.disable_by_batch_size = 4
    assert gate.choose(8, [Offer(4, 40, 10)] * 8, False) == [0] * 8


def test_gate_explores_now_and_then(monkeypatch):
    """A bucket measured badly once is retried: one choice in EXPLORE_EVERY forgets larger steps."""
    monkeypatch.setattr(spec_gate, "EXPLORE_EVERY", 3)
    gate = _gate(0.01)
    for _ in range(3):
        gate.target.observe(5, 50.0)  # one bad spell at 5 rows
    picks = [gate.choose(1, [Offer(4, 40, 10)], False) for _ in range(3)]
    assert [4] in picks and picks.count([4]) < 3


def test_gate_spreads_a_drafts_catch_up_over_what_is_left():
    gate = _gate(0.01)
    for _ in range(3):
        gate.draft.observe(1, 0.1)
        gate.draft.observe(512, 200.0)  # a draft's catch-up on a long prompt is dear
    short = Offer(4, 40, 10, catch_up=500, remaining=8)
    long = Offer(4, 40, 10, catch_up=500, remaining=100_000)
    assert gate.choose(1, [short], uses_draft=True) == [0]
    assert gate.choose(1, [long], uses_draft=True) == [4]


def test_gate_charges_the_drafts_second_row_after_a_kept_guess():
    """After a step that kept every guess the draft lacks two tokens, so its next first step
    computes two rows: where the draft's second row is dear (int4 at one thread: 9.9 ms for one
    row, 12 ms for two, against the int8 target's 9.3 ms), a sequence that keeps nearly every
    guess must not be speculated on at the price of one row."""
    sure = [Offer(1, 99, 1)]  # keeps nearly every guess
    dear = _gate(0.01)
    cheap = _gate(0.01)
    for _ in range(3):
        dear.draft.observe(1, 0.3)
        dear.draft.observe(2, 1.5)
        cheap.draft.observe(1, 0.3)
        cheap.draft.observe(2, 0.4)
    assert dear.choose(1, sure, uses_draft=True) == [0]
    assert cheap.choose(1, sure, uses_draft=True) == [1]


@pytest.mark.parametrize("spec", ["bad-ngram", "draft-int8"])
def test_warm_up_counts_no_speculation(tiny_models, always_speculate, request, spec):
    """The worker's warm-up request is no user's: the counters read zero after it (a prefill
    worker, which never decodes a user's request, reported two drafts from it), while the gate
    keeps the step costs it measured."""
    if spec == "bad-ngram":
        request.getfixturevalue("bad_guesses")
    model_dir, _ = tiny_models()
    config = DRAFT_INT8 if spec == "draft-int8" else NGRAM
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, speculative_config=config)
    try:
        engine = llm.engine
        engine.warm_up(max_tokens=12)
        stats = engine.spec_stats()
        assert engine.spec.gate.target.known  # what warming up is for
        assert stats["spec_drafts"] == stats["spec_draft_tokens"] == 0
        assert stats["spec_draft_prefill_tokens"] == 0 and not any(stats["spec_accepted_per_pos"])
        llm.generate(_prompts(1), greedy(12), use_tqdm=False)
        assert engine.spec_stats()["spec_drafts"] > 0
    finally:
        llm.shutdown()
