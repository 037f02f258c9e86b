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
