"""Sleep mode on one engine (engine/sleep.py; LLM.sleep and wake_up, vLLM's): a sleeping engine
gives its KV pool's pages back (the process's resident memory falls by the pool's size) and, at
level 2, its weights; it refuses requests until woken; woken, it answers token for token as HF
does, from a cold prefix cache. A level-2 sleep's weights load again from the checkpoint at the
last wake, or not at all when an update loaded others meanwhile. Wrong levels and tags, a
running request, a quantized engine at level 2 and an LLM without enable_sleep_mode are refused
before anything changed. The pools' page release itself: test_kvpool_release.py."""

from __future__ import annotations

import pytest

from helpers.engine import greedy
from helpers.models import LazyGreedy, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM
from pdserve.engine.errors import EngineAsleep, SleepRefused
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
POOL = 64 << 20  # large enough that its pages show in the process's resident memory
MAX_TOKENS = 10


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.fixture(scope="module")
def setup(tiny_models):
    model_dir, hf = tiny_models("llama-gqa")
    prompts = random_prompts([6, 40], seed=21)
    return model_dir, prompts, LazyGreedy(hf, prompts, MAX_TOKENS)


@pytest.fixture
def llm(setup):
    llm = LLM(setup[0], kv_cache_memory=POOL, block_size=16, enable_sleep_mode=True)
    yield llm
    llm.shutdown()


def _answers(llm, prompts):
    outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_level_1_frees_the_pool_refuses_work_and_wakes_to_the_same_answers(setup, llm):
    _, prompts, want = setup
    assert _answers(llm, prompts)[0] == want
    pool_mib = POOL // 2**20 * 3 // 4  # (most of it: other allocations come and go)
    awake = _rss_mib()
    llm.sleep(1)
    assert llm.engine.is_sleeping and llm.engine.asleep_tags == ("weights", "kv_cache")
    asleep = _rss_mib()
    assert awake - asleep >= pool_mib  # the pool's pages went back
    with pytest.raises(EngineAsleep, match="wake it up first"):
        llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    llm.wake_up()
    assert not llm.engine.is_sleeping and llm.engine.sleep_level == 0
    assert _rss_mib() - asleep >= pool_mib  # taken back at the wake, not on a first write
    answers, cached = _answers(llm, prompts)
    assert answers == want
    assert cached == [0, 0]  # the prefix cache was dropped with the pool
    assert_no_leaks(llm.engine)


def test_level_2_drops_the_weights_and_loads_them_at_the_last_wake(setup, llm):
    _, prompts, want = setup
    params = list(llm.engine.runner.model.parameters())
    held = [p.numel() for p in params]  # (a packed linear's dense weight is released already)
    llm.sleep(2)
    assert all(p.numel() == 0 for p in params)  # every parameter's storage dropped
    llm.wake_up(["weights"])  # vLLM's trainer wakes the weights, then loads new ones
    assert llm.engine.asleep_tags == ("kv_cache",)
    with pytest.raises(EngineAsleep):
        llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    llm.wake_up(["kv_cache"])  # no update came: the served checkpoint loads again
    assert [p.numel() for p in params] == held
    assert _answers(llm, prompts)[0] == want


def test_an_update_while_asleep_is_what_wakes(tiny_models, setup):
    """sleep(2), an update to checkpoint B, wake: B answers, and A is never read again."""
    a_dir, prompts, want_a = setup
    b_dir, b_hf = tiny_models("qwen2-bias")  # another family would be refused: same shapes
    llm = LLM(b_dir, kv_cache_memory=POOL, block_size=16, enable_sleep_mode=True)
    try:
        b_want = LazyGreedy(b_hf, prompts, MAX_TOKENS)
        llm.sleep(2)
        llm.engine.update_weights(b_dir, "v2")
        loads = []
        llm.engine._run_on_ranks = lambda inp, run=llm.engine._run_on_ranks: (
            loads.append(inp.reload_from),
            run(inp),
        )
        llm.wake_up()
        assert [r for r in loads if r] == []  # nothing loaded at the wake
        assert llm.engine.weight_version == "v2"
        assert _answers(llm, prompts)[0] == b_want
    finally:
        llm.shutdown()


@pytest.mark.parametrize("served", ["group:trainer#3", ""])
def test_weights_from_a_group_are_not_reloaded_but_refused(llm, served):
    """A group's update leaves weights_dir "group:...", and a failed one after it "": neither
    is a checkpoint to read again."""
    llm.engine.weights_dir = served  # (what those leave: engine_core.py)
    llm.sleep(2)
    with pytest.raises(SleepRefused, match="cannot be read again") as e:
        llm.wake_up()
    assert e.value.precondition
    assert llm.engine.asleep_tags == ("weights",)  # still asleep: nothing half woken serves


def test_sleeping_deeper_goes_deeper_and_shallower_changes_nothing(llm):
    llm.sleep(1)
    llm.sleep(1)
    assert llm.engine.sleep_level == 1
    llm.sleep(2)
    assert llm.engine.sleep_level == 2
    assert all(p.numel() == 0 for p in llm.engine.runner.model.parameters())
    llm.sleep(1)
    assert llm.engine.sleep_level == 2
    llm.wake_up()
    assert not llm.engine.is_sleeping


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda llm: llm.engine.sleep(3), "level must be 1 or 2"),
        (lambda llm: llm.engine.sleep(True), "level must be 1 or 2"),
        (lambda llm: llm.engine.wake_up(["weights", "gpu"]), "tags must be among"),
        (lambda llm: llm.engine.wake_up("weights"), "tags must be a list"),
    ],
)
def test_bad_levels_and_tags_are_refused(llm, call, match):
    with pytest.raises(SleepRefused, match=match) as e:
        call(llm)
    assert not e.value.precondition
    assert not llm.engine.is_sleeping


def test_a_running_request_is_refused_and_keeps_running(setup, llm):
    _, prompts, want = setup
    llm.engine.add_request("r", prompts[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    llm.engine.step()
    with pytest.raises(SleepRefused, match="requests still run") as e:
        llm.engine.sleep(1)
    assert e.value.precondition and not llm.engine.is_sleeping
    tokens = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    assert tokens == want[0]


def test_level_2_refused_where_the_linears_run_quantized(llm):
    llm.engine.runner.quantization = "int8"  # (the check reads only this: a real int8 start
    try:  # calibrates for minutes on some CPUs)
        with pytest.raises(SleepRefused, match="sleep at level 1") as e:
            llm.engine.sleep(2)
        assert e.value.precondition and not llm.engine.is_sleeping
        llm.engine.sleep(1)  # level 1 keeps the weights: allowed
        assert llm.engine.sleep_level == 1
    finally:
        llm.engine.runner.quantization = None


def test_an_llm_without_sleep_mode_refuses(setup):
    llm = LLM(setup[0], kv_cache_memory=1 << 22, block_size=16)
    try:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            llm.sleep()
        with pytest.raises(ValueError, match="level 0 pauses scheduling"):
            LLM.sleep(type("L", (), {"_sleep_mode": True, "engine": None})(), level=0)
    finally:
        llm.shutdown()
