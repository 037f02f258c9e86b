"""n > 1 below the Router (issue #16): the prompt is prefilled once, the prefill engine samples
the n first tokens (each sequence with its own generator), the KV goes once into one
reservation, and the decode engine forks the n sequences on copy-on-write blocks.

A prefill-only engine copies its KV into another engine's reservation: the n outputs equal
engine.LLM's (greedy and seeded sampling), reservations refuse what does not fit, forks short of
blocks are preempted; and the commit frame carries every first token. Through the workers and the
Router: test_n_sequences.py.
"""

from __future__ import annotations

import pytest

from helpers.engine import KV, CopySink, run_until_done
from helpers.models import random_prompts
from helpers.n_sequences import GREEDY, MAX_MODEL_LEN, SEEDED, proto_sampling
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequest, NoFreeBlocks
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2

pytestmark = pytest.mark.usefixtures("one_thread")


def engine_outputs(llm, prompt, sampling: pdserve_pb2.SamplingParams) -> list[list[int]]:
    """engine.LLM's n token lists for a prompt, by sequence index."""
    out = llm.generate([prompt], SamplingParams(**sampling_kwargs(sampling)), use_tqdm=False)[0]
    return [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)]


# ---- the engines alone --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("prompt_len", [21, 32])  # a partial last block (copied), whole blocks only
def test_prefill_once_fork_on_the_decode_engine_matches_one_engine(tiny_models, kind, prompt_len):
    model_dir = tiny_models("llama-gqa")[0]
    params = dict(GREEDY if kind == "greedy" else SEEDED, n=3)
    sp = proto_sampling(**params)
    prompt = random_prompts([prompt_len], seed=31)[0]
    llm = LLM(model_dir, kv_cache_memory=KV)
    want = engine_outputs(llm, prompt, sp)
    assert len({tuple(w) for w in want}) == (1 if kind == "greedy" else 3)
    a = LLM(model_dir, kv_cache_memory=KV, block_size=4).engine
    b = LLM(model_dir, kv_cache_memory=KV, block_size=16).engine
    free_before = b.block_manager.num_free_blocks
    res = b.reserve("r", prompt, SamplingParams(**params))
    assert len(res.block_ids) == -(-prompt_len // 16)
    copies = 2 if prompt_len % 16 else 0  # held for the forks' copies of the partial last block
    assert b.block_manager.num_free_blocks == free_before - len(res.block_ids) - copies
    sink = CopySink(b, res, a.model_config.num_layers)
    a.add_request("r", prompt, SamplingParams(**params), prefill_only=True, kv_sink=sink)
    first = [o for o in run_until_done(a) if o.finished][-1]
    assert [c.finish_reason for c in first.outputs] == ["prefill_done"] * 3
    firsts = [c.token_ids[0] for c in first.outputs]
    assert firsts == [w[0] for w in want]
    assert_no_leaks(a)  # the children never held KV on the prefill engine
    b.commit("r", firsts)
    final = [o for o in run_until_done(b) if o.finished]
    assert len(final) == 1
    assert [c.token_ids for c in final[0].outputs] == want
    assert [c.finish_reason for c in final[0].outputs] == ["length"] * 3
    assert_no_leaks(b)


def small_engine(model_dir, num_blocks: int, **kw):
    """An engine whose KV cache holds `num_blocks` blocks of 16 tokens."""
    probe = LLM(model_dir, kv_cache_memory=KV, block_size=16).engine
    per_block = probe.kv_cache[:, :, 0].numel() * probe.kv_cache.element_size()
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    engine = LLM(model_dir, kv_cache_memory=num_blocks * per_block, block_size=16, **kw).engine
    assert engine.block_manager.num_blocks == num_blocks
    return engine


def test_reserve_and_commit_of_n_sequences_refuse_what_does_not_fit(tiny_models):
    b = small_engine(tiny_models("llama-gqa")[0], 12)
    prompt = random_prompts([17], seed=3)[0]  # 2 blocks, the second partial: one copy per child
    with pytest.raises(InvalidRequest, match="lower n"):  # never fits: not a "retry later"
        b.reserve("huge", prompt, SamplingParams(n=12, max_tokens=4))
    # fits the pool but not what is free now: nothing is taken
    b.reserve("hold", random_prompts([16 * 8 - 1], seed=4)[0])  # 8 blocks
    assert b.block_manager.num_free_blocks == 4
    with pytest.raises(NoFreeBlocks):
        b.reserve("n4", prompt, SamplingParams(n=4, max_tokens=4))  # 2 + 3 copies > 4
    assert b.block_manager.num_free_blocks == 4
    b.reserve("n3", prompt, SamplingParams(n=3, max_tokens=4))  # 2 + 2 copies
    assert b.block_manager.num_free_blocks == 0
    with pytest.raises(InvalidRequest, match="n=3"):
        b.commit("n3", [5, 6])
    b.abort("n3")
    b.abort("hold")
    assert_no_leaks(b)


def test_forked_decodes_that_run_short_of_blocks_are_preempted_and_still_match(tiny_models):
    """Three sequences that each need 4 blocks in a pool of 8: the scheduler preempts forked
    children (recomputed later from the prefix cache) and every output is the engine's."""
    model_dir = tiny_models("llama-gqa")[0]
    prompt = random_prompts([20], seed=5)[0]
    params = dict(temperature=0, max_tokens=40, ignore_eos=True, n=3)
    want = engine_outputs(LLM(model_dir, kv_cache_memory=KV), prompt, proto_sampling(**params))
    a = LLM(model_dir, kv_cache_memory=KV, block_size=16).engine
    b = small_engine(model_dir, 8)
    res = b.reserve("r", prompt, SamplingParams(**params))
    sink = CopySink(b, res, a.model_config.num_layers)
    a.add_request("r", prompt, SamplingParams(**params), prefill_only=True, kv_sink=sink)
    first = [o for o in run_until_done(a) if o.finished][-1]
    b.commit("r", [c.token_ids[0] for c in first.outputs])
    final = [o for o in run_until_done(b) if o.finished]
    assert [c.token_ids for c in final[0].outputs] == want
    assert b.scheduler.num_preemptions > 0
    assert_no_leaks(b)


def test_the_commit_frame_carries_every_first_token_and_refuses_bad_ones():
    from pdserve.kvtransfer.backends.frames import encode_header
    from pdserve.kvtransfer.wire import ChunkHeader, WireError, decode_frame, encode_frame

    header = ChunkHeader(
        "r", "fp", kind="commit", first_tokens=(5, 6, 7), first_logprobs=(-1.5,) * 3
    )
    pieces = encode_frame(header)
    assert pieces[1] == encode_header(header)
    back, _ = decode_frame(b"".join(bytes(p) for p in pieces))
    assert back == header and back.first_tokens == (5, 6, 7)
    assert back.first_logprobs == (-1.5, -1.5, -1.5)
    for bad in (dict(first_tokens=[1] * 65), dict(first_tokens=["x"]), dict(first_tokens=5)):
        with pytest.raises(WireError, match="first_tokens"):
            ChunkHeader("r", "fp", kind="commit", **bad)
    with pytest.raises(WireError, match="first_logprobs"):
        ChunkHeader("r", "fp", kind="commit", first_logprobs=["x"])
