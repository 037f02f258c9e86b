"""Speculative decoding on hybrid models (engine/scheduler.py plan_rollbacks): a recurrent
layer's state cannot take a rejected guess back, so a step that checks guesses copies each
sequence's state first, and a sequence that rejects one takes the copy back and computes its kept
tokens again in its next step.

One tiny random model of each recurrent layer kind (Gated DeltaNet, short convolutions, Mamba2,
Mamba, and Falcon-H1's Mamba2 beside attention in every layer), prompt lookup whose guesses are
right for a random number of positions and then wrong (so steps keep all, some or none of them),
and a draft model of the target's own weights (all kept). Tokens equal the model's without
speculation, greedy and seeded, with the prefix cache on; every slot comes back.
"""

from __future__ import annotations

import random

import pytest

from helpers.arch import arch_refs
from helpers.engine import KV, greedy, run_until_done
from helpers.models import make_tiny_model, random_prompts
from helpers.spec import run_spec
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.spec import ngram as spec_ngram

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["qwen3-next", "lfm2", "granite-4.0-h", "mamba", "falcon-h1"]
ENGINE = dict(dtype="float32", kv_cache_memory=KV, block_size=4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
PROMPTS = random_prompts([3, 9, 17, 30], seed=12)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}
    return lambda kind: arch_refs(tmp_path_factory, cache, kind)[0]


def partly_right(monkeypatch, want: list[list[int]], always: bool = False) -> dict:
    """Prompt lookup guesses the true continuation (a sequence of `want`: prompt and output)
    for a random number of positions (`always`: every one), then wrong tokens; counts the steps
    by how many of their guesses were right: {"all": n, "some": n, "none": n}."""
    rng = random.Random(3)
    counts = {"all": 0, "some": 0, "none": 0}

    def propose(self, k, n_min, n_max):
        tokens = list(self._ids[: self._len])
        for full in want:
            if full[: len(tokens)] == tokens and len(full) >= len(tokens) + k:
                right = full[len(tokens) : len(tokens) + k]
                j = k if always else rng.randint(0, k)
                counts["all" if j == k else "some" if j else "none"] += 1
                return right[:j] + [(t + 1) % 256 for t in right[j:]]
        return []

    monkeypatch.setattr(spec_ngram.History, "propose", propose)
    return counts


@pytest.mark.parametrize("kind", KINDS)
def test_guesses_kept_some_or_none_leave_the_tokens_alone(
    models, always_speculate, monkeypatch, kind
):
    path = models(kind)
    want, _ = run_spec(path, PROMPTS, greedy(24), None, **ENGINE)
    counts = partly_right(monkeypatch, [p + w.token_ids for p, w in zip(PROMPTS, want)])
    got, stats = run_spec(path, PROMPTS, greedy(24), NGRAM, **ENGINE)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(counts.values()), counts
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0, stats


def test_a_step_that_keeps_every_guess_computes_nothing_again(
    models, always_speculate, monkeypatch
):
    """(Only a rejected guess costs the kept tokens' second pass.)"""
    from pdserve.engine.scheduler import Scheduler

    path = models("qwen3-next")
    want, _ = run_spec(path, PROMPTS, greedy(24), None, **ENGINE)
    partly_right(monkeypatch, [p + w.token_ids for p, w in zip(PROMPTS, want)], always=True)
    computed = []
    finish = Scheduler._finish_plan

    def counting(self, scheduled):
        plan = finish(self, scheduled)
        computed.append(plan.num_tokens)
        return plan

    monkeypatch.setattr(Scheduler, "_finish_plan", counting)
    got, stats = run_spec(path, PROMPTS, greedy(24), NGRAM, **ENGINE)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_accepted_tokens"] > 0
    # each position once, and at most a step's guesses past the last token per sequence
    assert sum(computed) <= sum(len(p) + 24 + 3 for p in PROMPTS), computed


@pytest.mark.parametrize("kind", ["qwen3-next", "granite-4.0-h"])
def test_seeded_sampling_equal_without_speculation(models, always_speculate, bad_guesses, kind):
    path = models(kind)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True)
    want, _ = run_spec(path, PROMPTS, params, None, **ENGINE)
    got, stats = run_spec(path, PROMPTS, params, NGRAM, **ENGINE)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_draft_tokens"] > 0


def test_a_draft_model_over_a_hybrid_target(models, always_speculate, tmp_path):
    """A draft of attention layers guesses for a hybrid; a hybrid draft is refused."""
    path = models("qwen3-next")
    want, _ = run_spec(path, PROMPTS, greedy(24), None, **ENGINE)
    draft = tmp_path / "draft"
    make_tiny_model(draft, "llama-gqa", seed=4)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    got, stats = run_spec(path, PROMPTS, greedy(24), spec, **ENGINE)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_draft_tokens"] > 0
    hybrid = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="a draft model with recurrent layers"):
        LLM(path, speculative_config=hybrid, **ENGINE)


def test_a_request_aborted_while_its_guesses_are_checked_gives_its_slots_back(
    models, always_speculate, bad_guesses, monkeypatch
):
    """(The state copied before the guesses, and the sequence's own, both come back.)"""
    from pdserve.engine.model_runner import ModelRunner

    llm = LLM(models("qwen3-next"), speculative_config=NGRAM, **ENGINE)
    engine, aborted = llm.engine, []
    execute = ModelRunner.execute

    def aborting(self, inp, *args, **kwargs):
        checking = any(len(s.token_ids) > 1 and s.start > 0 for s in inp.seqs)
        if checking and not aborted and self is engine.runner:
            aborted.append(engine.abort("r1"))
        return execute(self, inp, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute", aborting)
    try:
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(f"r{i}", prompt, greedy(12))
        run_until_done(engine)
        assert aborted == [True]
        assert_no_leaks(engine)
    finally:
        llm.shutdown()
