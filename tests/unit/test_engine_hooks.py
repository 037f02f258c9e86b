"""The disaggregation hooks on tiny random models: a prefill-only engine publishes each layer's KV
through a kv_sink into another engine's reserved blocks, which commits the first token and decodes;
commit validation, reservations beyond capacity and aborted reservations."""

from __future__ import annotations

import pytest

from helpers.engine import KV, CopySink, greedy, run_until_done
from helpers.models import SHARED_PREFIX, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def disagg_reference(refs):
    model_dir, *_ = refs("qwen2-bias")
    llm = LLM(model_dir, kv_cache_memory=KV)
    cache = {}

    def get(prompt, max_tokens):
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = (
                llm.generate(prompt, greedy(max_tokens), use_tqdm=False)[0].outputs[0].token_ids
            )
        return cache[key]

    return get


@pytest.mark.parametrize(
    "a_kw, b_kw",
    [
        (dict(block_size=16), dict(block_size=16)),
        (dict(block_size=16, max_num_batched_tokens=32), dict(block_size=16)),
        (dict(block_size=4, max_num_batched_tokens=24), dict(block_size=16)),
        (dict(block_size=16), dict(block_size=4)),
    ],
    ids=["same", "chunked", "a4-b16-chunked", "a16-b4"],
)
def test_prefill_only_to_reserved_blocks(refs, disagg_reference, a_kw, b_kw):
    model_dir, *_ = refs("qwen2-bias")
    # the plain chunking: the step counts below are those of budget-sized chunks
    a = LLM(model_dir, kv_cache_memory=KV, prefill_step_target_s=0, **a_kw).engine
    b = LLM(model_dir, kv_cache_memory=KV, **b_kw).engine
    num_layers = a.model_config.num_layers
    assert b.kv_cache.shape[:2] == (num_layers, 2)
    prefix = random_prompts([SHARED_PREFIX], seed=21)[0]
    prompts = [
        random_prompts([70], seed=22)[0],
        random_prompts([1], seed=23)[0],
        prefix + [5, 6, 7],
        prefix + [9] * 19,
    ]  # the last two hit both prefix caches
    max_tokens = 12
    budget = a.config.max_num_batched_tokens
    for i, prompt in enumerate(prompts):
        rid = f"d{i}"
        params = greedy(max_tokens)
        res = b.reserve(rid, prompt, params)
        assert res.block_size == b.config.block_size
        assert len(res.block_ids) == -(-len(prompt) // res.block_size)
        if i == 3:
            assert res.num_cached_tokens == SHARED_PREFIX
        sink = CopySink(b, res, num_layers)
        a.add_request(rid, prompt, params, prefill_only=True, kv_sink=sink)
        outs = []
        while a.has_unfinished_requests():
            sink.step += 1
            outs += a.step()
        first = outs[-1]
        assert first.finished and first.outputs[0].finish_reason == "prefill_done"
        assert len(first.outputs[0].token_ids) == 1
        sink.check(len(prompt))
        uncached = len(prompt) - (first.num_cached_tokens if i else 0)
        assert sink.step == max(1, -(-uncached // budget))
        assert_no_leaks(a)

        b.commit(rid, [first.outputs[0].token_ids[0]])
        final = [o for o in run_until_done(b) if o.finished]
        assert len(final) == 1 and final[0].request_id == rid
        tokens = final[0].outputs[0].token_ids
        assert tokens[0] == first.outputs[0].token_ids[0]
        assert tokens == disagg_reference(prompt, max_tokens)
        assert final[0].outputs[0].finish_reason == "length"
        assert_no_leaks(b)


def test_commit_that_finishes_at_once_is_reported(refs):
    """max_tokens=1: the committed first token ends the request; the next step reports it."""
    model_dir, *_ = refs("llama-gqa")
    b = LLM(model_dir, kv_cache_memory=KV).engine
    prompt = random_prompts([20], seed=5)[0]
    b.reserve("one", prompt, greedy(1))
    b.commit("one", [42])
    outs = run_until_done(b)
    assert [
        (o.request_id, o.finished, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs
    ] == [("one", True, [42], "length")]
    assert_no_leaks(b)
    with pytest.raises(KeyError):
        b.commit("one", [42])


def test_commit_refuses_a_bad_first_token(refs):
    """An id outside the vocab would make the next step fail for every request in the batch."""
    model_dir, *_ = refs("llama-gqa")
    b = LLM(model_dir, kv_cache_memory=KV).engine
    b.reserve("r", random_prompts([20], seed=23)[0], greedy(12))
    for bad in (256, -1, True, 3.0):
        with pytest.raises(ValueError, match="first_token_id"):
            b.commit("r", [bad])
    assert not b.step()  # still only reserved: nothing ran
    b.commit("r", [7])
    final = [o for o in run_until_done(b) if o.finished]
    assert len(final[0].outputs[0].token_ids) == 12 and final[0].outputs[0].token_ids[0] == 7
    assert_no_leaks(b)


def test_reserve_beyond_capacity(refs):
    model_dir, *_ = refs("llama-gqa")
    probe = LLM(model_dir, kv_cache_memory=KV, max_model_len=64).engine
    per_block = probe.kv_cache[:, :, 0].numel() * probe.kv_cache.element_size()
    b = LLM(model_dir, kv_cache_memory=8 * per_block, max_model_len=64).engine
    prompts = random_prompts([40, 40, 40], seed=7)  # 3 blocks each, 8 blocks in all
    b.reserve("a", prompts[0], greedy(4))
    b.reserve("b", prompts[1], greedy(4))
    from pdserve.engine.block_manager import NoFreeBlocks

    with pytest.raises(NoFreeBlocks):
        b.reserve("c", prompts[2], greedy(4))
    b.block_manager.check_consistency()
    assert b.block_manager.num_used_blocks == 6
    assert b.abort("a") and b.abort("b") and not b.abort("c")
    assert_no_leaks(b)


def test_reservation_abort_frees_blocks(refs):
    model_dir, *_ = refs("llama-gqa")
    b = LLM(model_dir, kv_cache_memory=KV).engine
    res = b.reserve("x", random_prompts([40], seed=6)[0], greedy(4))
    assert b.block_manager.num_used_blocks == len(res.block_ids) == 3
    assert b.abort("x")
    assert_no_leaks(b)


def test_step_trace_records_each_step_shape(refs):
    """Two prompts in 16-token chunks, then decode: every step that computed is in step_trace with
    the shape the latency models use (tokens, n*(start+n) pairs per chunk, decode rows, context)."""
    model_dir, _, prompts, _ = refs("llama-gqa")
    # the plain policy: under the long-prefill one (tests/unit/test_long_prefill.py), b's short
    # prompt would take the budget before a's chunk
    engine = LLM(
        model_dir, kv_cache_memory=KV, max_num_batched_tokens=16, prefill_step_target_s=0
    ).engine
    engine.add_request("a", prompts[3], greedy(3))  # 17 tokens: chunks of 16 and 1
    engine.add_request("b", prompts[1], greedy(3))  # 5 tokens
    run_until_done(engine)
    trace = list(engine.step_trace)
    assert [(r.tokens, r.prefill_pairs, r.num_decode, r.decode_context) for r in trace[:2]] == [
        (16, 16 * 16, 0, 0),  # a's first chunk fills the budget
        (1 + 5, 5 * 5, 1, 17),
    ]  # a's last prompt token costs what a decode row does; b's prompt
    # b decodes one row from step 3 on; a joins as a decode row once its prompt is done
    assert all(r.prefill_pairs == 0 and r.tokens == r.num_decode for r in trace[2:])
    assert all(r.end >= r.start for r in trace) and len(trace) >= 4
    assert_no_leaks(engine)


def test_warm_up_leaves_no_trace_and_changes_no_output(refs):
    """A warmed engine (what workers register with) holds nothing afterwards, its step trace is
    empty, and greedy and seeded outputs equal a cold engine's."""
    from pdserve.engine import SamplingParams

    model_dir, _, prompts, want = refs("llama-gqa")
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    outputs = []
    for warm in (False, True):
        engine = LLM(model_dir, kv_cache_memory=KV).engine
        if warm:
            assert engine.warm_up() > 0
            assert not engine.step_trace and not engine._requests
            assert_no_leaks(engine)
            with pytest.raises(RuntimeError, match="before any request"):
                engine.add_request("busy", prompts[0], greedy(2))
                engine.warm_up()
            engine.abort("busy")
        engine.add_request("g", prompts[4], greedy())
        engine.add_request("s", prompts[2], seeded)
        outs = {
            o.request_id: list(o.outputs[0].token_ids) for o in run_until_done(engine) if o.finished
        }
        outputs.append(outs)
        assert_no_leaks(engine)
    assert outputs[0] == outputs[1]
    assert outputs[1]["g"] == want[4]
