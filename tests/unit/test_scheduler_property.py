"""Scheduler property tests: long random mixes of add / step / abort / finish / reserve / commit
(and aborts that land mid-step) against the fake runner of scheduler_harness.py, whose checks run
after every operation; at the end nothing may leak."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from helpers.scheduler_harness import EOS, Harness, abort_request
from pdserve.engine.block_manager import NoFreeBlocks
from pdserve.engine.request import FinishReason, SeqStatus, Sequence

# ---- property test ------------------------------------------------------------------------------

SYSTEM_PROMPTS = [[2 + (i * 7 + k) % 3 for i in range(80)] for k in range(3)]


def _random_prompt(rng, earlier=()):
    n = rng.randint(1, 80)
    if earlier and rng.random() < 0.25:  # a later turn: an earlier sequence's text, maybe shifted
        text = rng.choice(earlier).token_ids
        start = rng.choice((0, 0, 4 * rng.randint(0, len(text) // 4)))
        extra = [rng.choice((2, 3, 4)) for _ in range(rng.randint(0, 8))]
        return (text[start:] + extra)[:80] or [2]
    if rng.random() < 0.6:  # a shared prefix, so the cache gets hits (and collisions)
        base = rng.choice(SYSTEM_PROMPTS)
        k = rng.randint(0, n)
        return base[:k] + [rng.choice((2, 3, 4)) for _ in range(n - k)]
    return [rng.choice((2, 3)) for _ in range(n)]


def _random_params(rng, n=1):
    kw = dict(n=n, max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.3)
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [4]
    return kw


def _property_run(seed, num_ops=1000, caching=True, window=None):
    rng = random.Random(seed)

    def token_fn(seq):
        return EOS if rng.random() < 0.06 else rng.choice((2, 3, 4))

    h = Harness(
        num_blocks=24,
        block_size=4,
        caching=caching,
        budget=rng.choice((16, 24, 48)),
        max_num_seqs=rng.choice((4, 6, 8)),
        max_model_len=92,
        token_fn=token_fn,
        window=window,
    )
    requests: dict[str, list[Sequence]] = {}
    stats = dict(steps=0, aborts=0, finishes=0, reserves=0, commits=0, forks=0, hits=0)

    def live(fam):
        return any(s.status != SeqStatus.FINISHED for s in fam)

    for _ in range(num_ops):
        op = rng.choices(
            ["add", "step", "abort", "finish", "reserve", "commit", "abort_mid_step"],
            weights=[4, 10, 1, 1, 1, 1, 0.3],
        )[0]
        if op == "add":
            prompt = _random_prompt(rng, h.seqs[-30:])
            # sometimes a burst of one prompt: copies computed side by side are not cached twice
            for _ in range(rng.choice((1, 1, 1, 1, 2, 3))):
                n = 2 if rng.random() < 0.2 else 1
                fam = h.add(prompt, **_random_params(rng, n))
                if rng.random() < 0.05 and n == 1:
                    fam[0].prefill_only = True
                requests[fam[0].request_id] = fam
                stats["forks"] += n - 1
        elif op == "step":
            plan = h.step()
            stats["steps"] += 1
            stats["hits"] += sum(1 for s in plan.scheduled if s.start and s.seq.num_cached_tokens)
        elif op in ("abort", "abort_mid_step"):
            alive = [fam for fam in requests.values() if live(fam)]
            if not alive:
                continue
            fam = rng.choice(alive)
            if op == "abort_mid_step":  # the abort lands while the forward runs
                plan = h.sched.schedule()
                h.check()
                result = h.execute(plan) if not plan.is_empty else None
                abort_request(h, fam)
                if result is not None:
                    h.sched.update(plan, result)
                h.check()
            else:
                abort_request(h, fam)
            stats["aborts"] += 1
        elif op == "finish":  # e.g. a stop string seen by the detokenizer
            cands = [
                s
                for s in h.seqs
                if s.status in (SeqStatus.RUNNING, SeqStatus.WAITING) and s.num_output_tokens > 0
            ]
            if cands:
                h.finish(rng.choice(cands), FinishReason.STOP, "stop")
                stats["finishes"] += 1
        elif op == "reserve":
            seq = h.new(_random_prompt(rng, h.seqs[-30:]), **_random_params(rng))
            try:
                h.reserve(seq)
            except NoFreeBlocks:
                h.check()
                continue
            requests[seq.request_id] = [seq]
            stats["reserves"] += 1
        elif op == "commit":
            if h.sched.reserved:
                seq = rng.choice(list(h.sched.reserved.values()))
                h.commit(seq, [rng.choice((EOS, 2, 3, 4))])
                stats["commits"] += 1
        for s in h.seqs:
            if s.status != SeqStatus.FINISHED:
                assert s.num_tokens < 92 and s.num_output_tokens <= s.params.max_tokens
    return h, requests, stats


@pytest.mark.parametrize(
    "seed, caching, window",
    [(0, True, None), (1, True, None), (2, True, None), (3, False, None), (4, True, 10)],
)
def test_property_random_operations_never_leak(seed, caching, window):
    """window: every layer slides over 10 tokens (blocks of 4): sequences give back what their
    window has left, and the harness checks reads within the window and the blocks held."""
    h, requests, stats = _property_run(seed, caching=caching, window=window)
    assert h.sched.num_preemptions > 0, stats
    assert stats["aborts"] > 0 and stats["commits"] > 0 and stats["forks"] > 0, stats
    if caching:
        assert stats["hits"] > 0, stats
    for fam in requests.values():
        abort_request(h, fam)
    h.assert_no_leaks()


@pytest.mark.parametrize("window", [None, 7])
def test_property_random_operations_drain_to_completion(window):
    """Same mix, but at the end every reservation is committed and the rest runs to completion:
    nothing is stuck in waiting, every sequence finishes for a reason of its own."""
    h, requests, stats = _property_run(seed=10, num_ops=600, window=window)
    for seq in list(h.sched.reserved.values()):
        h.commit(seq, [2])
    h.run(max_steps=5000)
    assert h.sched.num_preemptions > 0
    for fam in requests.values():
        for s in fam:
            assert s.status == SeqStatus.FINISHED and s.finish_reason is not None
            if s.finish_reason == FinishReason.LENGTH:
                assert s.num_output_tokens == s.params.max_tokens or s.num_tokens == 92
    h.assert_no_leaks()


@settings(derandomize=True, database=None, max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    caching=st.booleans(),
    window=st.sampled_from([None, None, 3, 8, 13]),
)
def test_property_hypothesis_chosen_runs(seed, caching, window):
    h, requests, _ = _property_run(seed, num_ops=300, caching=caching, window=window)
    for fam in requests.values():
        abort_request(h, fam)
    h.assert_no_leaks()
