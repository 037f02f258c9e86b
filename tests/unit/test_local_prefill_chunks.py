"""A prefill beside running streams (engine/scheduler.py's module docstring, max_step_slowdown):
a step that decodes streams computes at most `stream_prefill_cap` prompt tokens, sized from the
measured cost of a plain decode step and of a prompt token beside it; a prompt with no stream
beside it is not split; greedy tokens are those of the unsplit schedule. And the local-prefill
rule's price for such a prompt (planner/local_prefill.py), and the setting's way from the YAML to
the decode pool's engines."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy, run_until_done
from helpers.models import random_prompts
from helpers.scheduler_harness import Harness
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM
from pdserve.engine.scheduler import StepPlan
from pdserve.planner.local_prefill import MAX_STEP_SLOWDOWN, LocalPrefill

pytestmark = pytest.mark.usefixtures("one_thread")


def _prefill_tokens(plan: StepPlan) -> int:
    """The plan's prompt tokens: every piece but the decodes (one token of a sequence that has
    output already, guesses aside)."""
    return sum(
        s.num_new_tokens
        for s in plan.scheduled
        if not (s.num_new_tokens - s.num_spec == 1 and s.seq.num_output_tokens > 0)
    )


def _decodes(plan: StepPlan) -> int:
    return len(plan.scheduled) - sum(
        1
        for s in plan.scheduled
        if not (s.num_new_tokens - s.num_spec == 1 and s.seq.num_output_tokens > 0)
    )


def _streams(h: Harness, count: int = 3, max_tokens: int = 200) -> list:
    """`count` short prompts, run to their first token: streams decoding from the next step."""
    seqs = [h.add([10 + i] * 5, max_tokens=max_tokens, ignore_eos=True)[0] for i in range(count)]
    h.step()
    assert all(s.num_output_tokens == 1 for s in seqs)
    return seqs


def _measure(h: Harness, decode_s: float, token_s: float) -> None:
    """Feeds the scheduler a plain decode step of `decode_s` and one that also computed a
    prompt's tokens at `token_s` each, through observe_step as the engine does."""
    sched = h.sched
    plan = h.step()
    assert _decodes(plan) and not _prefill_tokens(plan)
    sched.observe_step(plan, decode_s)
    (probe,) = h.add(list(range(60, 68)), max_tokens=1)
    plan = h.step()
    k = _prefill_tokens(plan)
    assert _decodes(plan) and k
    sched.observe_step(plan, decode_s + k * token_s)
    while not probe.is_finished:
        h.step()


@pytest.mark.parametrize("target", [0.0, 1.0])  # the plain policy and the long-prefill one
def test_a_turn_beside_running_streams_is_split_within_the_measured_bound(target):
    h = Harness(num_blocks=512, budget=256)
    h.sched.max_step_slowdown = 0.5
    h.sched.prefill_step_target_s = target
    streams = _streams(h)
    _measure(h, decode_s=0.020, token_s=0.001)
    assert h.sched.decode_step_s == pytest.approx(0.020)
    assert h.sched.stream_token_s == pytest.approx(0.001)
    bound = int(0.5 * 0.020 / 0.001)  # 10 tokens: half a decode step's time
    (turn,) = h.add(list(range(100, 220)), max_tokens=2)  # 120 prompt tokens
    pieces = []
    while not turn.num_output_tokens:
        plan = h.step()
        assert _decodes(plan) == len(streams)  # every stream decodes at every step
        assert _prefill_tokens(plan) <= bound
        pieces += [s.num_new_tokens for s in plan.scheduled if s.seq is turn]
    assert sum(pieces) == 120 and max(pieces) == bound and len(pieces) >= 120 // bound
    h.run()
    assert turn.is_finished and all(s.is_finished for s in streams)


def test_a_turn_alone_is_not_split():
    h = Harness(num_blocks=512, budget=256)
    h.sched.max_step_slowdown = 0.5
    h.sched.decode_step_s, h.sched.stream_token_s = 0.020, 0.001  # a 10-token cap, if streams ran
    (turn,) = h.add(list(range(100, 220)), max_tokens=2)
    plan = h.step()
    assert [(s.seq, s.num_new_tokens) for s in plan.scheduled] == [(turn, 120)]
    assert turn.num_output_tokens == 1


def test_a_long_conversations_next_turn_over_its_cached_turns_is_not_a_long_prefill():
    """Under the long-prefill policy a prompt longer than the token budget runs in long chunks;
    a turn whose earlier turns the prefix cache holds computes only its new tokens, and those
    fit the budget: it runs whole in one step, not in long chunks."""
    h = Harness(num_blocks=512, budget=64)
    h.sched.prefill_step_target_s = 1.0
    h.sched.sec_per_token = 1.0 / 8  # a long chunk: 8 tokens
    (first,) = h.add(list(range(2, 202)), max_tokens=4, ignore_eos=True)  # 200 tokens: long
    pieces = []
    while not first.num_output_tokens:
        pieces += [s.num_new_tokens for s in h.step().scheduled]
    assert max(pieces) < 64 and len(pieces) > 3  # (in long chunks)
    h.run()
    turn_prompt = first.token_ids + list(range(300, 330))  # 204 held, 30 new
    (turn,) = h.add(turn_prompt, max_tokens=1)
    plan = h.step()
    assert [s.num_new_tokens for s in plan.scheduled] == [len(turn_prompt) - 200]
    assert turn.num_cached_tokens == 200 and turn.is_finished


def test_off_keeps_the_whole_budget_beside_streams():
    h = Harness(num_blocks=512, budget=256)  # max_step_slowdown 0: the default
    _streams(h)
    h.sched.decode_step_s, h.sched.stream_token_s = 0.020, 0.001
    (turn,) = h.add(list(range(100, 220)), max_tokens=2)
    plan = h.step()
    assert _prefill_tokens(plan) == 120 and turn.num_output_tokens == 1


def test_the_cap_starts_at_a_block_and_grows_at_most_twofold():
    h = Harness(num_blocks=512, budget=256, block_size=4)
    sched = h.sched
    sched.max_step_slowdown = 0.5
    _streams(h)
    assert sched.stream_prefill_cap() == 4  # nothing measured: one block
    (turn,) = h.add(list(range(100, 600)), max_tokens=1)
    assert _prefill_tokens(h.step()) == 4
    sched.decode_step_s, sched.stream_token_s = 0.020, 0.0001  # would allow 100 tokens
    got = [_prefill_tokens(h.step()) for _ in range(5)]
    assert got == [8, 16, 32, 64, 100]
    # steps that took longer than the decode step shrink the next chunk at once
    plan = h.step()
    assert _prefill_tokens(plan) == 100
    sched.observe_step(plan, 0.020 + 100 * 0.002)  # 2 ms a token
    assert sched.stream_token_s == pytest.approx(0.002)
    assert _prefill_tokens(h.step()) == 5  # 0.5 x 20 ms / 2 ms
    plan = h.step()
    sched.observe_step(plan, 0.020 - 0.005)  # 5 tokens in 5 ms under a plain step (noise)
    # the averages of the extra seconds and of the tokens: (0.2 - 0.005) / 2 over (100 + 5) / 2
    assert sched.stream_token_s == pytest.approx(0.195 / 105)
    assert _prefill_tokens(h.step()) == int(0.5 * 0.020 / (0.195 / 105))
    h.run()
    assert turn.is_finished


def test_a_prefill_measured_alone_bounds_the_cost_until_one_beside_streams_is():
    h = Harness(num_blocks=512, budget=256)
    sched = h.sched
    sched.max_step_slowdown = 0.25
    (alone,) = h.add(list(range(100, 140)), max_tokens=1)
    sched.observe_step(h.step(), 0.080)  # 40 tokens alone: 2 ms a token, fixed cost included
    assert alone.is_finished and sched.alone_token_s == pytest.approx(0.002)
    _streams(h)
    sched.observe_step(h.step(), 0.040)  # a plain decode step
    assert sched.stream_prefill_cap() == 5  # 0.25 x 40 ms / 2 ms


def test_slowdown_and_cost_measurements_ignore_empty_and_zero_steps():
    h = Harness(num_blocks=512, budget=256)
    sched = h.sched
    sched.max_step_slowdown = 0.5
    _streams(h)
    plan = h.step()
    sched.observe_step(plan, 0.0)
    assert sched.decode_step_s is None
    sched.observe_step(plan, 0.030)
    sched.observe_step(plan, 0.010)
    assert sched.decode_step_s == pytest.approx(0.020)  # each step weighs half


@pytest.mark.parametrize("bad", [-0.1, float("inf"), "1", True])
def test_max_step_slowdown_is_checked(bad):
    from pdserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="max_step_slowdown"):
        EngineConfig(model="x", max_step_slowdown=bad)
    with pytest.raises(ValueError, match="max_step_slowdown"):
        LocalPrefill(max_step_slowdown=-1.0 if bad is True or bad == "1" else bad)


def _engine_turns(model_dir, slowdown: float, cap: int | None, with_streams: bool):
    """An engine serves a conversation's first turn, then (with_streams) starts two streams and
    adds the second turn (the first turn's prompt and answer, then 37 new tokens) once they
    decode. With `cap` the stream cap is that many tokens. Returns every request's greedy
    tokens, the second turn's prompt pieces (tokens per step) and the prompt tokens of each step
    that decoded streams while it prefilled."""
    llm = LLM(model_dir, kv_cache_memory=KV, max_num_batched_tokens=256, max_step_slowdown=slowdown)
    engine = llm.engine
    if cap is not None:
        engine.scheduler.stream_prefill_cap = lambda: cap
    first, new, s1, s2 = random_prompts([70, 37, 9, 11], seed=23)
    engine.add_request("turn1", first, greedy(12))
    done = {o.request_id: o for o in run_until_done(engine) if o.finished}
    turn2 = first + list(done["turn1"].outputs[0].token_ids) + new
    if with_streams:
        engine.add_request("s1", s1, greedy(30))
        engine.add_request("s2", s2, greedy(30))
        for out in engine.step():  # their prompts: both decode from the next step
            assert not out.finished
    pieces: list[int] = []
    beside: list[int] = []  # prompt tokens of each step that decoded streams while turn2 prefilled
    schedule = engine.scheduler.schedule

    def record():  # (at planning time: the counts a plan is judged by change as it runs)
        plan = schedule()
        mine = [
            s.num_new_tokens
            for s in plan.scheduled
            if s.seq.request_id == "turn2" and s.seq.num_output_tokens == 0
        ]
        if mine:
            pieces.extend(mine)
            if _decodes(plan):
                beside.append(_prefill_tokens(plan))
        return plan

    engine.scheduler.schedule = record
    engine.add_request("turn2", turn2, greedy(12))
    done |= {o.request_id: o for o in run_until_done(engine) if o.finished}
    tokens = {rid: list(out.outputs[0].token_ids) for rid, out in done.items()}
    assert_no_leaks(engine)
    return tokens, pieces, beside


def test_engine_splits_a_turn_beside_streams_with_identical_greedy_tokens(tiny_models):
    """The second turn hits the first turn's blocks in the prefix cache and computes the rest in
    3-token pieces while the two streams decode, every such step within the cap; every request's
    greedy tokens equal an engine's that runs the turn unsplit (max_step_slowdown 0)."""
    model_dir = tiny_models("llama-gqa")[0]
    want, whole, _ = _engine_turns(model_dir, slowdown=0.0, cap=None, with_streams=True)
    got, pieces, beside = _engine_turns(model_dir, slowdown=0.25, cap=3, with_streams=True)
    # unsplit: the tail the prefix cache does not hold, in one step (the first turn's prompt and
    # answer, 82 tokens, of which the 81 computed fill five 16-token blocks)
    assert whole == [70 + 12 + 37 - 80]
    assert len(pieces) >= whole[0] // 3 and sum(pieces) == whole[0]
    assert beside and all(tokens <= 3 for tokens in beside)
    assert got == want


def test_engine_runs_a_turn_alone_unsplit(tiny_models):
    model_dir = tiny_models("llama-gqa")[0]
    want, whole, _ = _engine_turns(model_dir, slowdown=0.0, cap=None, with_streams=False)
    got, pieces, beside = _engine_turns(model_dir, slowdown=0.25, cap=3, with_streams=False)
    assert pieces == whole and len(pieces) == 1 and not beside
    assert got == want


# ---- the rule and the setting ---------------------------------------------------------------


def test_the_rule_prices_a_turn_beside_streams_by_its_chunks():
    policy = LocalPrefill(cost=2.0, hop_tokens=64, max_step_slowdown=0.25)
    assert policy.price(False) == 2.0 and policy.price(True) == pytest.approx(10.0)
    # 100 new tokens of a 2,000-token turn, 300 uncached on the prefill pool: local alone
    # (2 x 100 < 364), the prefill pool beside streams (10 x 100 > 364)
    assert policy.choose(2000, 300, 0, held=1900)
    assert not policy.choose(2000, 300, 0, held=1900, streams=True)
    assert policy.choose(2000, 1200, 0, held=1900, streams=True)  # 1,000 < 1,264
    # no bound: the full-speed price either way
    off = LocalPrefill(cost=2.0, max_step_slowdown=0.0)
    assert off.price(True) == 2.0 and off.choose(2000, 300, 0, held=1900, streams=True)


def test_the_setting_defaults_alike_and_reaches_the_decode_pool_only():
    from pdserve.deploy.config.load import ConfigError, validate_config
    from pdserve.deploy.config.schema import LocalPrefillSettings
    from pdserve.engine.config import EngineConfig

    default = LocalPrefillSettings().max_step_slowdown
    assert default == MAX_STEP_SLOWDOWN == LocalPrefill().max_step_slowdown
    cfg = validate_config({"router": {"local_prefill": {"max_step_slowdown": 0.1}}})
    kwargs = cfg.engine_kwargs(cfg.pools.decode)
    assert kwargs["max_step_slowdown"] == 0.1
    EngineConfig(model="m", **kwargs)  # the engine takes it
    assert "max_step_slowdown" not in cfg.engine_kwargs(cfg.pools.prefill)
    colocated = validate_config({"pools": {"colocated": {}}})
    assert "max_step_slowdown" not in colocated.engine_kwargs(colocated.pools.colocated)
    with pytest.raises(ConfigError, match="max_step_slowdown"):
        validate_config({"router": {"local_prefill": {"max_step_slowdown": -1}}})


def test_the_router_prices_a_turn_by_the_streams_open_on_its_holder():
    """Legs._prefill_here: a conversation's turn runs on the decode worker holding it while no
    leg of this router has a call open there, and goes to the prefill pool at the chunked price
    while one does (a stream it would run beside)."""
    from pdserve.router.legs import Leg, Legs

    holder = object()

    class Pool:  # what _prefill_here asks of the router's WorkerPool
        decode = [holder]

        def on_drop(self, listener):
            pass

        def is_member(self, worker):
            return True

        def prefill_backlog(self, prompt, adapter="", held=0):
            return 300  # the turn's tokens the prefill pool does not cache

        def decode_backlog(self, worker=None):
            return 0

        def handoff_bandwidth(self):
            return 0.0  # nothing measured: no peer fetch priced

    legs = Legs(pool=Pool(), executor=None, options=None)
    legs.local_prefill = LocalPrefill(cost=2.0, hop_tokens=64, max_step_slowdown=0.1)
    prompt = list(range(2000))

    def local() -> bool:
        leg = Leg(1)
        leg.held = {holder: 1900}
        return legs._prefill_here(prompt, leg) and leg.expect_worker is holder

    assert local()  # alone: 2 x 100 < 300 + 64
    stream = Leg(2)
    legs.open.add(holder, stream)
    assert not local()  # beside a stream: 2 x 11 x 100 > 364
    legs.open.remove(holder, stream)
    assert local()
    legs.close()
