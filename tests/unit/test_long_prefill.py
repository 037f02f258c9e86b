"""The long-prefill policy (engine/scheduler.py's module docstring, prefill_step_target_s): a long
prompt runs in chunks sized from the measured step time, a short prompt that arrives while it is
mid-prefill is scheduled at the next step (the long one yields that step, never two in a row),
one long prefill runs at a time, and nothing of the results changes: the same tokens and the same
prompt logprobs as with the policy off, equal to HF's for a prompt of many chunks."""

from __future__ import annotations

import pytest

from helpers.engine import KV, run_until_done
from helpers.models import random_prompts
from helpers.prompt_logprobs import check
from helpers.scheduler_harness import Harness
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.scheduler import StepPlan

pytestmark = pytest.mark.usefixtures("one_thread")


def _harness(chunk_tokens: int, **kw) -> Harness:
    """A harness whose scheduler sizes long chunks at `chunk_tokens` (block size 4)."""
    h = Harness(num_blocks=256, budget=64, **kw)
    h.sched.prefill_step_target_s = 1.0
    h.sched.sec_per_token = 1.0 / chunk_tokens
    return h


def _tokens(plan: StepPlan) -> dict[int, int]:
    return {item.seq.seq_id: item.num_new_tokens for item in plan.scheduled}


def test_a_short_prompt_is_scheduled_while_a_long_one_is_mid_prefill():
    h = _harness(8)
    (long,) = h.add(list(range(2, 202)), max_tokens=1)  # 200 tokens: long at 8 per step
    assert _tokens(h.step()) == {long.seq_id: 8}
    assert _tokens(h.step()) == {long.seq_id: 8}
    (short,) = h.add(list(range(3, 23)), max_tokens=3)  # 20 tokens, more than a long chunk
    # the newcomer runs whole at the next step; the long prefill gives that step up
    assert _tokens(h.step()) == {short.seq_id: 20}
    assert short.num_output_tokens == 1 and long.num_computed_tokens == 16
    # then both: the short one's decode first, the long one's chunk
    assert _tokens(h.step()) == {short.seq_id: 1, long.seq_id: 8}
    h.run()
    assert long.is_finished and short.is_finished


def test_the_long_prefill_never_yields_two_steps_in_a_row():
    h = _harness(8)
    (long,) = h.add(list(range(2, 202)), max_tokens=1)
    h.step()
    seen = []
    for i in range(4):  # a new short prompt at every step
        h.add([5 + i] * 6, max_tokens=1)
        seen.append(long.seq_id in _tokens(h.step()))
    assert seen == [False, True, False, True]


def test_one_long_prefill_at_a_time_and_short_ones_pass_a_waiting_long_one():
    h = _harness(8)
    (first,) = h.add(list(range(2, 102)), max_tokens=1)
    h.step()
    (second,) = h.add(list(range(3, 103)), max_tokens=1)  # long too: waits for the first
    (short,) = h.add([7] * 5, max_tokens=1)  # behind it in the queue, but short
    plan = _tokens(h.step())
    assert short.seq_id in plan and second.seq_id not in plan
    while not first.is_finished:
        assert second.seq_id not in _tokens(h.step()) or first.is_finished
    h.run()
    assert second.is_finished


def test_off_and_unmeasured_keep_the_whole_budget():
    h = Harness(num_blocks=256, budget=64)  # prefill_step_target_s=0: the plain policy
    (long,) = h.add(list(range(2, 202)), max_tokens=1)
    assert _tokens(h.step()) == {long.seq_id: 64}
    h = _harness(8)
    h.sched.sec_per_token = None  # nothing measured yet: the token budget
    (long,) = h.add(list(range(2, 202)), max_tokens=1)
    assert _tokens(h.step()) == {long.seq_id: 64}


def test_the_first_long_chunk_is_small_and_grows_to_the_measured_rate():
    h = _harness(64)  # the measured rate allows the whole budget in one step
    (long,) = h.add(list(range(2, 202)), max_tokens=1)
    # four blocks first, then at most twice the last chunk, up to the budget
    assert [_tokens(h.step())[long.seq_id] for _ in range(4)] == [16, 32, 64, 64]
    h.run()
    (again,) = h.add(list(range(3, 203)), max_tokens=1)
    assert _tokens(h.step()) == {again.seq_id: 16}  # a new long prefill starts small again


def test_one_slow_step_moves_the_rate_halfway():
    h = _harness(8)
    sched = h.sched
    (long,) = h.add(list(range(2, 202)), max_tokens=1)
    plan = h.step()  # 8 tokens of the prompt
    sched.observe_step(plan, seconds=3.0)  # 3/8 s a token, after 1/8: 1/4 on average
    assert sched.sec_per_token == pytest.approx(0.25)
    assert sched.long_chunk() == 4  # a block: a second's worth at 4 tokens a second
    sched.observe_step(plan, seconds=0.0)  # no time measured: ignored
    h.sched.sec_per_token = 0.25
    h.add([5] * 3, max_tokens=1)
    short_plan = h.step()  # the 3-token prompt alone (the long one yields): under a block
    sched.observe_step(short_plan, seconds=100.0)
    assert sched.sec_per_token == pytest.approx(0.25)


def test_sliding_window_long_prefill_keeps_its_window():
    h = _harness(8, window=16)
    (long,) = h.add(list(range(2, 202)), max_tokens=2)
    (short,) = h.add([9] * 6, max_tokens=2)
    h.step()
    # a short prompt longer than a long chunk: admitted with the blocks of its whole prompt
    (wider,) = h.add(list(range(40, 60)), max_tokens=2)
    h.run()
    assert long.is_finished and short.is_finished and wider.is_finished


@pytest.mark.parametrize("budget", [32, 64])
def test_engine_serves_a_short_request_mid_prefill_with_identical_results(refs, budget):
    """A target below any step's time makes every long chunk one block: a 200-token prompt with
    prompt logprobs runs in many chunks, a short request added mid-prefill finishes first, and
    both equal what an engine without the policy computes (and the long one's logprobs, HF's)."""
    model_dir, hf, prompts, _ = refs("llama-gqa")
    long_prompt = prompts[6]  # 200 tokens
    short_prompt = random_prompts([12], seed=5)[0]
    params_long = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    params_short = SamplingParams(temperature=0, max_tokens=3)

    plain = LLM(
        model_dir, kv_cache_memory=KV, max_num_batched_tokens=budget, prefill_step_target_s=0
    )
    want_long, want_short = plain.generate(
        [long_prompt, short_prompt], [params_long, params_short], use_tqdm=False
    )

    llm = LLM(
        model_dir, kv_cache_memory=KV, max_num_batched_tokens=budget, prefill_step_target_s=1e-9
    )
    engine = llm.engine
    engine.add_request("long", long_prompt, params_long)
    engine.step()
    engine.step()
    assert engine.scheduler.long_chunk() == engine.config.block_size
    engine.add_request("short", short_prompt, params_short)
    finished: dict[str, object] = {}
    for _ in range(1000):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "short" in finished:
            break
    assert "long" not in finished  # the short one did not wait for the long prompt
    for out in run_until_done(engine):
        if out.finished:
            finished[out.request_id] = out
    got_long, got_short = finished["long"], finished["short"]
    assert got_short.outputs[0].token_ids == want_short.outputs[0].token_ids
    assert got_long.outputs[0].token_ids == want_long.outputs[0].token_ids
    assert len(got_long.prompt_logprobs) == len(long_prompt)
    for got, want in zip(got_long.prompt_logprobs[1:], want_long.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-5 for t in got)
    check(got_long, hf, long_prompt, 2)
    assert_no_leaks(engine)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), "1", True])
def test_prefill_step_target_is_checked(bad):
    from pdserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="prefill_step_target_s"):
        EngineConfig(model="x", prefill_step_target_s=bad)
