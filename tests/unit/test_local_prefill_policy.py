"""LocalPrefill (planner/local_prefill.py): which prompts run on their decode worker."""

from __future__ import annotations

import pytest

from pdserve.planner.local_prefill import LocalPrefill


def test_off_by_default_and_past_the_length_bound():
    assert not LocalPrefill().choose(8, prefill_backlog=10_000, decode_backlog=0)
    policy = LocalPrefill(max_prompt_tokens=100)
    assert not policy.choose(101, prefill_backlog=10_000, decode_backlog=0)
    assert policy.choose(100, prefill_backlog=10_000, decode_backlog=0)


def test_short_prompts_go_local_on_an_idle_pool_long_ones_only_when_it_queues():
    policy = LocalPrefill(max_prompt_tokens=4096, cost=2.0, hop_tokens=64)
    # idle prefill pool: its backlog is the prompt itself; local wins below hop/(cost-1) tokens
    assert policy.choose(40, prefill_backlog=40, decode_backlog=0)
    assert not policy.choose(80, prefill_backlog=80, decode_backlog=0)
    # a queued prefill pool: 2 x (0 + 800) < 2000 + 64
    assert policy.choose(800, prefill_backlog=2000, decode_backlog=0)
    # unless the decode worker is busy prefilling others itself: 2 x (500 + 800) > 2064
    assert not policy.choose(800, prefill_backlog=2000, decode_backlog=500)


def test_no_prefill_worker_serving_sends_what_fits_local():
    assert LocalPrefill(max_prompt_tokens=64).choose(64, prefill_backlog=None, decode_backlog=9)


def test_bad_settings():
    for kwargs in ({"max_prompt_tokens": -1}, {"cost": 0}, {"hop_tokens": -5}):
        with pytest.raises(ValueError, match="local prefill"):
            LocalPrefill(**kwargs)


def test_a_held_conversation_goes_local_for_its_new_tokens_only():
    """A turn whose decode worker holds all but a few of its tokens runs there even with local
    prefill off for fresh prompts: the inequality is asked of the new tokens."""
    policy = LocalPrefill()  # max_prompt_tokens 0, reuse_max_new_tokens 512
    # a 2,000-token turn, 1,900 held on the decode worker; the prefill pool would recompute at
    # least the answer: 2 x (0 + 100) < 400 + 64
    assert policy.choose(2000, prefill_backlog=400, decode_backlog=0, held=1900)
    # everything held: one token to compute, still local
    assert policy.choose(2000, prefill_backlog=64, decode_backlog=0, held=2000)
    # too many new tokens for the decode worker to take on beside its streams
    assert not policy.choose(2000, prefill_backlog=10_000, decode_backlog=0, held=1000)
    # the decode worker is busy prefilling others: 2 x (300 + 100) > 400 + 64
    assert not policy.choose(2000, prefill_backlog=400, decode_backlog=300, held=1900)
    # nothing held: the fresh-prompt rule, off here
    assert not policy.choose(100, prefill_backlog=10_000, decode_backlog=0, held=0)
    # reuse off
    off = LocalPrefill(reuse_max_new_tokens=0)
    assert not off.choose(2000, prefill_backlog=400, decode_backlog=0, held=1990)
    with pytest.raises(ValueError, match="reuse_max_new_tokens"):
        LocalPrefill(reuse_max_new_tokens=-1)
