"""Speculative sampling keeps the target's distribution: a statistical test that passes with the
engine's acceptance rule and fails with wrong ones (#31 must-show b).

A tiny random target with peaked next-token distributions samples a short continuation of one
prompt N times without speculation and N times with it (other seeds, so the samples are
independent), guesses forced at every position. The second and third output tokens, both checked
as guesses, are compared by a chi-square test of homogeneity. Guesses come from a different random
model (method draft_model) or from a proposer that always guesses the same token (prompt lookup's
path): either puts its own, very different, distribution on the outputs if the acceptance rule
lets guesses through that the target did not sample. The wrong rules tried: keep every guess, and
keep the first guess always (an off-by-one).
"""

from __future__ import annotations

import pytest
import torch

from helpers.arch import build_arch_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.spec import draft as spec_draft, ngram as spec_ngram, verify
from pdserve.engine.spec.gate import SpecGate

pytestmark = pytest.mark.usefixtures("one_thread")

N = 1500
PROMPT = [5, 9, 33, 71, 2, 140, 200, 17]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target and a draft of the same shape and tokenizer, with peaked distributions."""
    out = {}
    for name, seed in (("target", 0), ("draft", 1)):
        path = tmp_path_factory.mktemp(name)
        build_arch_model(path, "llama", seed=seed, initializer_range=0.3)
        out[name] = str(path)
    return out


def _samples(model_dir: str, spec: dict | None, seed0: int) -> list[tuple[int, int]]:
    """(second, third) output token of N seeded samples."""
    llm = LLM(
        model_dir,
        kv_cache_memory=1 << 24,
        max_num_seqs=256,
        speculative_config=spec,
    )
    try:
        params = [
            SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=4, ignore_eos=True)
            for i in range(N)
        ]
        outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
        if spec is not None:
            stats = llm.engine.spec_stats()
            assert stats["spec_drafts"] > N // 2, stats  # most samples were checked guesses
    finally:
        llm.shutdown()
    return [tuple(o.outputs[0].token_ids[1:3]) for o in outs]


def homogeneity_p(a: list[int], b: list[int], min_count: int = 10) -> float:
    """Chi-square test that two samples of tokens share one distribution; tokens seen fewer than
    min_count times in both together share one bin."""
    tokens = sorted(set(a) | set(b))
    ca = {t: 0 for t in tokens}
    cb = dict(ca)
    for t in a:
        ca[t] += 1
    for t in b:
        cb[t] += 1
    bins, rest = [], [0, 0]
    for t in tokens:
        if ca[t] + cb[t] >= min_count:
            bins.append([ca[t], cb[t]])
        else:
            rest[0] += ca[t]
            rest[1] += cb[t]
    if sum(rest) >= min_count:
        bins.append(rest)
    table = torch.tensor(bins, dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


@pytest.fixture
def forced(monkeypatch):
    """Guesses at every position of every sequence (the draft catches up on all prompts at once)."""
    monkeypatch.setattr(spec_draft, "CATCH_UP_TOKENS", 1 << 20)
    monkeypatch.setattr(
        SpecGate, "choose", lambda self, base, offers, uses_draft: [o.limit for o in offers]
    )


def _spec(method: str, models, monkeypatch) -> dict:
    if method == "draft":
        return {"model": models["draft"], "num_speculative_tokens": 2}
    monkeypatch.setattr(spec_ngram.History, "propose", lambda self, k, lo, hi: [42] * k)
    return {"method": "ngram", "num_speculative_tokens": 2}


_RIGHT = verify.accepted_prefix
RULES = {
    "every guess": lambda samples, guesses: len(guesses),
    "first guess always": lambda samples, guesses: max(1, _RIGHT(samples, guesses)),
}


@pytest.fixture(scope="module")
def plain(models):
    return _samples(models["target"], None, seed0=0)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_keeps_the_target_distribution(models, plain, forced, monkeypatch, method):
    spec = _spec(method, models, monkeypatch)
    got = _samples(models["target"], spec, seed0=10**6)
    for pos in (0, 1):
        p = homogeneity_p([s[pos] for s in plain], [s[pos] for s in got])
        assert p > 1e-3, f"output token {pos + 2}: p = {p:.2e}"


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_the_test_fails_with_a_wrong_acceptance_rule(
    models, plain, forced, monkeypatch, method, rule
):
    spec = _spec(method, models, monkeypatch)
    monkeypatch.setattr(verify, "accepted_prefix", RULES[rule])
    got = _samples(models["target"], spec, seed0=10**6)
    p = homogeneity_p([s[0] for s in plain], [s[0] for s in got])
    assert p < 1e-6, f"a wrong rule ({rule}) went unnoticed: p = {p:.2e}"
