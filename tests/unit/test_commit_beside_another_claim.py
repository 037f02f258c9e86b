"""A commit into a reservation that two senders claimed (decode_worker/handoff.py, claims.py).

The router retried a prefill on another worker into the same reservation: both senders claimed
it, and the first may still write (a stalled step that resumes). The second's commit cannot end
the first's claim, so the committed request runs, but its blocks stay out of the free pool,
even once it finished, until both senders are over; past the bound the worker reports itself
unhealthy meanwhile. A lone sender's commit holds nothing. Also: a reservation's write grant
covers only the blocks past its cached prefix, and a frame into that prefix fails the request
and leaves the shared block as it was. With a tiny model on a real engine loop, frames handed
to the hand-off as the claims' control server would (no sockets).
"""

from __future__ import annotations

import threading

import pytest
import torch

from helpers.models import random_prompts
from helpers.threads import wait_until
from pdserve.decode_worker.handoff import DecodeHandoff
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.engine_loop import EngineLoop
from pdserve.kvtransfer.backends import claims
from pdserve.kvtransfer.backends.claims import Grants
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.wire import ChunkHeader

BLOCK_SIZE = 16
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
TIMEOUT = 30.0


class Collector:
    def __init__(self):
        self.outputs, self.done = [], threading.Event()

    def __call__(self, out):
        self.outputs.append(out)
        if out.finished:
            self.done.set()


@pytest.fixture
def side(tiny_models, monkeypatch):
    """A decode engine loop, its hand-off with write grants, and which sending pids are dead."""
    dead: set[int] = set()
    monkeypatch.setattr(claims, "process_gone", lambda p: p.get("pid") in dead)
    model_dir, _ = tiny_models("llama-gqa")
    loop = EngineLoop(LLM(model_dir, kv_cache_memory=1 << 22, block_size=BLOCK_SIZE).engine).start()
    mc = loop.engine.model_config
    layout = KVLayout("tiny", "float32", mc.num_layers, mc.num_kv_heads, mc.head_dim, BLOCK_SIZE)
    grants = Grants()
    handoff = DecodeHandoff(loop, layout, lease_s=TIMEOUT, sweep_s=0.02, grants=grants)
    yield loop, handoff, grants, dead
    used = loop.call(lambda: loop.engine.block_manager.num_used_blocks)
    loop.stop()
    assert used == 0, f"{used} KV blocks still held"


def deliver(handoff, grants, header, payload=None) -> None:
    """A frame as the claims' control server hands it on: screened by the grants first."""
    if grants.check(header) is None:
        handoff.on_frame(header, payload)


def push_in_place(handoff, grants, layout, rid, token, start, end, first_token) -> None:
    """What a shm or nixl sender reports after writing tokens [start, end) of every layer into
    the pool itself: an in-place header per layer, then the commit."""
    for layer in range(layout.num_layers):
        header = ChunkHeader(
            rid, layout.fingerprint, layer, start, end, 0, layout.num_kv_heads, layout.head_dim,
            "float32", in_place=True, grant=token,
        )  # fmt: skip
        deliver(handoff, grants, header)
    commit = ChunkHeader(
        rid, layout.fingerprint, kind="commit", first_tokens=(first_token,), grant=token
    )
    deliver(handoff, grants, commit)


def ref_counts(loop, block_ids) -> list[int]:
    bm = loop.engine.block_manager
    return loop.call(lambda: [bm.ref_count(b) for b in block_ids])


@pytest.mark.parametrize("refused", [False, True], ids=["committed", "commit-refused"])
def test_a_commit_with_another_senders_claim_open_holds_the_blocks_until_both_are_gone(
    side, refused
):
    """Modelled on test_kv_nixl.py's abort-path test: sender a claims, the router retries on
    sender b into the same reservation, b writes and commits. The request runs and finishes (or,
    with a first token the engine refuses, is aborted), but its blocks are not freed: a's claim
    may still write. Past the bound the worker is unhealthy; once a's process is gone too, the
    blocks go back to the pool and the worker is healthy again."""
    loop, handoff, grants, dead = side
    prompt = random_prompts([40], seed=3)[0]
    out = Collector()
    res = handoff.reserve("r1", prompt, PARAMS, out)
    token = handoff.grant_for("r1")
    grants.claim("r1", token, res.block_ids, agent="prefill-a", process={"pid": 1})
    grants.claim("r1", token, res.block_ids, agent="prefill-b", process={"pid": 2})
    vocab = loop.engine.model_config.vocab_size
    push_in_place(
        handoff, grants, handoff.layout, "r1", token, 0, len(prompt), vocab if refused else 5
    )
    assert out.done.wait(TIMEOUT), "the request never finished"
    reason = out.outputs[-1].outputs[0].finish_reason
    assert reason == ("abort" if refused else "length")
    # finished (or aborted), yet its blocks stay out of the free pool: a's WRITE may still land
    assert all(n >= 1 for n in ref_counts(loop, res.block_ids))
    assert handoff.num_held == 1 and handoff.num_reserved == 1
    assert loop.call(lambda: loop.engine.block_manager.num_used_blocks) >= len(res.block_ids)
    dead.add(2)  # b is gone; a may still write
    grants.release_bound_s = 0.0  # and the bound has passed: the worker reports it
    wait_until(lambda: "held past" in handoff.unhealthy, TIMEOUT, "the hold reported stuck")
    assert handoff.num_held == 1 and all(n >= 1 for n in ref_counts(loop, res.block_ids))
    dead.add(1)  # a's process is gone too: no write of the reservation is left
    wait_until(lambda: handoff.num_held == 0, TIMEOUT, "the held blocks freed")
    assert ref_counts(loop, res.block_ids) == [0] * len(res.block_ids)
    assert handoff.unhealthy == "" and grants.num_released_sender_gone == 1


def test_a_lone_senders_commit_holds_nothing(side):
    loop, handoff, grants, _ = side
    prompt = random_prompts([40], seed=4)[0]
    out = Collector()
    res = handoff.reserve("r2", prompt, PARAMS, out)
    token = handoff.grant_for("r2")
    grants.claim("r2", token, res.block_ids, agent="prefill-a", process={"pid": 1})
    push_in_place(handoff, grants, handoff.layout, "r2", token, 0, len(prompt), 5)
    assert out.done.wait(TIMEOUT) and out.outputs[-1].outputs[0].finish_reason == "length"
    wait_until(
        lambda: ref_counts(loop, res.block_ids) == [0] * len(res.block_ids), TIMEOUT, "freed"
    )
    assert handoff.num_held == 0 and handoff.num_reserved == 0


def test_a_frame_into_the_cached_prefix_fails_and_leaves_the_shared_block_alone(side):
    """The second request of a prompt finds its first blocks in the prefix cache: its grant
    covers only the blocks after them, and a frame that starts before its cached tokens fails
    it with the reason, the cached block unchanged."""
    loop, handoff, grants, _ = side
    prompt = random_prompts([40], seed=5)[0]
    first = Collector()
    warm = handoff.reserve("warm", prompt, PARAMS, first)
    token = handoff.grant_for("warm")
    grants.claim("warm", token, warm.block_ids, agent="a")
    push_in_place(handoff, grants, handoff.layout, "warm", token, 0, len(prompt), 5)
    assert first.done.wait(TIMEOUT)
    out = Collector()
    res = handoff.reserve("r3", prompt, PARAMS, out)
    assert res.num_cached_tokens == 2 * BLOCK_SIZE  # 40 tokens: two full blocks cached
    assert grants.first_block("r3") == 2
    cache = loop.engine.kv_cache
    shared = res.block_ids[0]
    before = cache[:, :, shared].clone()
    mc, lay = loop.engine.model_config, handoff.layout
    header = ChunkHeader(
        "r3", lay.fingerprint, 0, 8, len(prompt), 0, mc.num_kv_heads, mc.head_dim, "float32"
    )
    data = torch.randn(2, len(prompt) - 8, mc.num_kv_heads, mc.head_dim)
    handoff.on_frame(header, data)  # a grpc frame: the receiver would write it itself
    assert torch.equal(cache[:, :, shared], before)
    assert out.done.wait(TIMEOUT)
    last = out.outputs[-1].outputs[0]
    assert last.finish_reason == "abort" and "cached prompt tokens" in str(last.stop_reason)
