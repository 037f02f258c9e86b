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
    # least the answer: 1 x (0 + 100) < 400 + 64
    assert policy.choose(2000, prefill_backlog=400, decode_backlog=0, held=1900)
    # everything held: one token to compute, still local
    assert policy.choose(2000, prefill_backlog=64, decode_backlog=0, held=2000)
    # too many new tokens for the decode worker to take on beside its streams
    assert not policy.choose(2000, prefill_backlog=10_000, decode_backlog=0, held=1000)
    # the decode worker is busy prefilling others: 1 x (400 + 100) > 400 + 64
    assert not policy.choose(2000, prefill_backlog=400, decode_backlog=400, held=1900)
    # a decode worker half as fast as a prefill worker: 2 x (0 + 300) > 400 + 64
    assert policy.choose(2000, prefill_backlog=400, decode_backlog=0, held=1700)
    assert not LocalPrefill(cost=2.0).choose(2000, prefill_backlog=400, decode_backlog=0, held=1700)
    # nothing held: the fresh-prompt rule, off here
    assert not policy.choose(100, prefill_backlog=10_000, decode_backlog=0, held=0)
    # reuse off
    off = LocalPrefill(reuse_max_new_tokens=0)
    assert not off.choose(2000, prefill_backlog=400, decode_backlog=0, held=1990)
    with pytest.raises(ValueError, match="reuse_max_new_tokens"):
        LocalPrefill(reuse_max_new_tokens=-1)


def test_auto_cost_is_a_prefill_worker_over_a_decode_worker(tmp_path):
    """The deployment's cost "auto": 1 where the pools' workers are alike (the local layouts),
    else their tp x devices (GPUs, or CPUs on a CPU pool) in ratio; a number is taken as given."""
    from helpers.deploy_config import error_of, write
    from pdserve.deploy.config.load import load_config
    from pdserve.deploy.launcher import _local_prefill

    def cost(tmp_path, text, name):
        return _local_prefill(load_config(write(tmp_path, text, name))).cost

    assert cost(tmp_path, "model: smollm2\n", "default.yaml") == 1.0
    wide = "pools:\n  prefill: {tp: 2}\n  decode: {resources: {num_cpus: 0.5}}\n"
    assert cost(tmp_path, wide, "wide.yaml") == 4.0
    gpus = (
        "pools:\n  prefill: {tp: 1, resources: {num_cpus: 4, num_gpus: 1}}\n"
        "  decode: {tp: 2, resources: {num_cpus: 8, num_gpus: 1}}\n"
    )
    assert cost(tmp_path, gpus, "gpus.yaml") == 0.5  # CPUs do not count beside GPUs
    assert cost(tmp_path, "pools:\n  colocated: {}\n", "colocated.yaml") == 1.0
    given = "pools:\n  prefill: {tp: 2}\nrouter:\n  local_prefill: {cost: 1.5}\n"
    assert cost(tmp_path, given, "given.yaml") == 1.5
    bad = error_of(write(tmp_path, "router:\n  local_prefill: {cost: fast}\n", "bad.yaml"))
    assert "router.local_prefill.cost" in bad


def test_the_start_table_says_the_rule_and_where_its_cost_came_from(tmp_path):
    from helpers.deploy_config import write
    from pdserve.deploy.config.load import load_config
    from pdserve.deploy.launcher import Cluster

    def last_line(text, name):
        cfg = load_config(write(tmp_path, text, name))
        return Cluster(config=cfg, started_ray=False).start_table().splitlines()[-1]

    line = last_line("model: smollm2\n", "default.yaml")
    assert line == (
        "Local prefill: a turn with at most 512 new tokens may run on the decode worker holding "
        "the rest; fresh prompts never (max_prompt_tokens 0); cost 1, hop 64 tokens (auto: a "
        "prefill worker's tp x devices 1 over a decode worker's 1)"
    )
    wide = "pools:\n  prefill: {tp: 2}\nplanner: {enabled: true}\n"
    line = last_line(wide, "wide.yaml")
    assert "cost 2, hop 64 tokens; the planner may raise max_prompt_tokens to 1024" in line
    assert line.endswith("(auto: a prefill worker's tp x devices 2 over a decode worker's 1)")
    given = "router:\n  local_prefill: {cost: 1.5, max_prompt_tokens: 256}\n"
    line = last_line(given, "given.yaml")
    assert line.endswith("a fresh prompt of at most 256 tokens may too; cost 1.5, hop 64 tokens")
    colocated = last_line("pools:\n  colocated: {}\n", "colocated.yaml")
    assert not colocated.startswith("Local prefill")
