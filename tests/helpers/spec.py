"""Fixtures that make speculative decoding run its every path on tiny random models, which rarely
repeat themselves: `always_speculate` has the gate offer every guess it can, `bad_guesses` makes
prompt lookup guess at random, so rejection, KV rollback and generator rewinds run each step.
Test modules import them by name (`from helpers.spec import always_speculate, bad_guesses`)."""

from __future__ import annotations

import random

import pytest

from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.spec import ngram as spec_ngram
from pdserve.engine.spec.gate import SpecGate


@pytest.fixture
def always_speculate(monkeypatch):
    """The gate offers every guess it can (the cost model is tested on its own)."""
    monkeypatch.setattr(
        SpecGate, "choose", lambda self, base, offers, uses_draft: [o.limit for o in offers]
    )


@pytest.fixture
def bad_guesses(monkeypatch):
    """Prompt lookup guesses at random, mostly wrongly: rejection and rollback every step."""
    rng = random.Random(0)

    def propose(self, k, n_min, n_max):
        return [rng.randrange(256) for _ in range(k)]

    monkeypatch.setattr(spec_ngram.History, "propose", propose)


def exacting_params(stop: str, max_tokens: int = 30) -> SamplingParams:
    """Greedy sampling that leans on the output so far at each position (penalties, min_tokens),
    reports logprobs and stops at `stop`: what guesses around each position must not change."""
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        logprobs=True,
        top_logprobs=2,
        stop=[stop],
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        min_tokens=5,
    )


def run_spec(model_dir, prompts, params, spec=None, **engine):
    """(each request's first output, the engine's speculation counters) of `prompts` on a fresh
    engine with speculative_config `spec` and the `engine` keywords; no block left held."""
    llm = LLM(model_dir, speculative_config=spec, **engine)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.spec_stats()
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs], stats
