"""The router's block index (router/kv_index.py) fed by a real block manager's KV events through
the worker's wire form (worker_common/kv_events.py), and the pool's use of it (router/pool.py):
stored and evicted blocks, a gap or a reset in the stream, a worker forgotten, what the router
expects between polls, and the bound. No sockets: the pool's Stats calls are answered in place."""

from __future__ import annotations

import pytest

from helpers.stats_workers import EngineWorker
from pdserve.engine.block_manager import BlockManager, block_hash
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.kv_index import KVIndex, chain_hashes
from pdserve.router.pool import WorkerPool, _Worker
from pdserve.worker_common import kv_events as wire

BS = 4


def fill(bm: BlockManager, tokens: list[int]) -> None:
    """A finished request: its full blocks computed, registered and freed (cached)."""
    ids = bm.allocate(bm.blocks_needed(len(tokens)))
    bm.register_full_blocks(ids, tokens, 0, len(tokens))
    bm.free(ids)


class Reader:
    """What the pool does for one worker: ask from the index's place, apply the answer."""

    def __init__(self, index: KVIndex, worker, bm: BlockManager):
        self.index, self.worker, self.bm, self.polls = index, worker, bm, 0

    def poll(self, **bounds) -> str:
        epoch, after = self.index.position(self.worker)
        self.polls += 1
        request = worker_pb2.StatsRequest(
            want_kv_events=True, kv_events_epoch=epoch, kv_events_after=after
        )
        events = wire.kv_events(self.bm, request)
        return self.index.apply(self.worker, (epoch, after), events, self.polls)


def test_chain_hashes_are_the_engines():
    tokens = list(range(3, 40))
    parent, want = None, []
    for i in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = block_hash(parent, tuple(tokens[i : i + BS]))
        want.append(parent.to_bytes(16, "little"))
    assert chain_hashes(tokens, BS) == want


def test_stored_blocks_match_and_evicted_ones_stop_matching():
    bm, index = BlockManager(4, BS), KVIndex()
    reader = Reader(index, "w", bm)
    assert reader.poll() == "reset"  # the first ask: a snapshot (empty)
    prompt = list(range(10))
    assert index.matched_tokens(prompt, {"w": BS}) == {"w": 0}
    fill(bm, prompt[:8])
    assert reader.poll() == "events"
    assert index.matched_tokens(prompt, {"w": BS}) == {"w": 8}
    assert index.matched_tokens([99] + prompt, {"w": BS}) == {"w": 0}
    # four fresh blocks evict both cached ones
    bm.free(bm.allocate(4))
    assert reader.poll() == "events"
    assert index.matched_tokens(prompt, {"w": BS}) == {"w": 0}
    assert len(index) == 0


def test_a_worker_that_never_answered_is_not_matched():
    index = KVIndex()
    assert index.matched_tokens(list(range(8)), {"w": BS}) == {}
    assert not index.synced("w")


def test_a_reader_behind_the_ring_resyncs_from_a_snapshot():
    bm, index = BlockManager(2, BS), KVIndex()
    reader = Reader(index, "w", bm)
    reader.poll()
    for i in range(bm._events.maxlen):  # far more events than the ring holds
        fill(bm, [i, i, i, i])
    last = bm._events.maxlen - 1
    assert reader.poll() == "reset"
    assert index.matched_tokens([last] * 4, {"w": BS}) == {"w": 4}
    assert index.matched_tokens([last - 1] * 4, {"w": BS}) == {"w": 4}
    assert index.matched_tokens([0] * 4, {"w": BS}) == {"w": 0}
    assert len(index) == 2


def test_answers_are_bounded_and_the_rest_comes_with_the_next_polls(monkeypatch):
    monkeypatch.setattr(wire, "MAX_EVENTS_PER_ANSWER", 3)
    bm, index = BlockManager(16, BS), KVIndex()
    reader = Reader(index, "w", bm)
    reader.poll()
    prompt = list(range(40))
    fill(bm, prompt)
    assert reader.poll() == "events"
    assert index.matched_tokens(prompt, {"w": BS}) == {"w": 12}
    while index.position("w")[1] < 10:
        assert reader.poll() == "events"
    assert index.matched_tokens(prompt, {"w": BS}) == {"w": 40}


def test_a_gap_breaks_the_stream_and_the_next_poll_resets():
    bm, index = BlockManager(8, BS), KVIndex()
    reader = Reader(index, "w", bm)
    reader.poll()
    fill(bm, list(range(8)))
    reader.poll()
    epoch, after = index.position("w")
    fill(bm, list(range(100, 108)))
    # an answer that skips an event (as a lost or reordered message would)
    events = wire.kv_events(
        bm,
        worker_pb2.StatsRequest(
            want_kv_events=True, kv_events_epoch=epoch, kv_events_after=after + 1
        ),
    )
    assert index.apply("w", (epoch, after), events, 9) == "broken"
    assert index.matched_tokens(list(range(8)), {"w": BS}) == {}  # dropped, not synced
    assert index.position("w") == (0, 0) and index.breaks == 1
    assert reader.poll() == "reset"
    assert index.matched_tokens(list(range(8)), {"w": BS}) == {"w": 8}
    assert index.matched_tokens(list(range(100, 108)), {"w": BS}) == {"w": 8}


def test_a_restarted_worker_resets_and_a_stale_answer_is_ignored():
    bm, index = BlockManager(8, BS), KVIndex()
    reader = Reader(index, "w", bm)
    reader.poll()
    fill(bm, list(range(8)))
    reader.poll()
    asked = index.position("w")
    reader.bm = BlockManager(8, BS)  # the process restarted: new epoch, empty cache
    events = wire.kv_events(
        reader.bm,
        worker_pb2.StatsRequest(
            want_kv_events=True, kv_events_epoch=asked[0], kv_events_after=asked[1]
        ),
    )
    assert events.reset
    assert index.apply("w", asked, events, 5) == "reset"
    assert index.matched_tokens(list(range(8)), {"w": BS}) == {"w": 0}
    # an answer to a poll asked from the old place is not applied
    assert index.apply("w", asked, events, 6) == "stale"


def test_forget_drops_a_workers_entries_only():
    bm_a, bm_b, index = BlockManager(8, BS), BlockManager(8, BS), KVIndex()
    a, b = Reader(index, "a", bm_a), Reader(index, "b", bm_b)
    for r in (a, b):
        r.poll()
        fill(r.bm, list(range(8)))
        r.poll()
    assert index.matched_tokens(list(range(8)), {"a": BS, "b": BS}) == {"a": 8, "b": 8}
    index.forget("a")
    assert index.matched_tokens(list(range(8)), {"a": BS, "b": BS}) == {"b": 8}
    assert index.position("a") == (0, 0)
    assert len(index) == 2


def test_what_the_router_sent_is_expected_until_a_later_poll_answers():
    bm, index = BlockManager(8, BS), KVIndex()
    reader = Reader(index, "w", bm)
    reader.poll()
    turn = list(range(12))
    index.expect("w", chain_hashes(turn, BS), reader.polls)
    assert index.matched_tokens(turn, {"w": BS}) == {"w": 12}
    # the worker stored only the first two blocks (the third one's KV was never computed)
    fill(bm, turn[:8])
    reader.poll()
    assert index.matched_tokens(turn, {"w": BS}) == {"w": 8}


def test_the_index_is_bounded_by_the_blocks_the_workers_hold():
    index = KVIndex()
    bm = BlockManager(4096, BS)
    reader = Reader(index, "w", bm)
    reader.poll()
    fill(bm, list(range(4 * 3000)))
    reader.poll()
    assert len(index) == 3000
    index.fit_to_blocks(2000)
    assert len(index) == 2000 and index.max_entries == 2000
    # the oldest stored go: the prompt's head no longer matches
    assert index.matched_tokens(list(range(4 * 3000)), {"w": BS}) == {"w": 0}
    index.fit_to_blocks(10)
    assert index.max_entries == 1024  # MIN_ENTRIES


# ---- the pool ---------------------------------------------------------------------------------
class Pool(WorkerPool):
    fakes: dict = {}

    def _connect(self, role, address, **fields):
        fields.setdefault("heard_at", self._clock())
        return _Worker(role, address, None, self.fakes[address], **fields)

    def close(self):
        pass


@pytest.fixture
def pool():
    Pool.fakes = {"d0": EngineWorker("d0", BlockManager(64, BS)), "d1": EngineWorker("d1", None)}
    Pool.fakes["d1"].bm = BlockManager(64, BS, enable_prefix_caching=False)  # reports no events
    return Pool([], ["d0", "d1"], stats_ttl_s=0.5)


def test_pool_matches_from_the_index_once_synced_and_from_its_record_before(pool):
    d0, d1 = pool.decode
    turn = list(range(40))
    # before any poll: the record of what the router sent (32-token chunks)
    pool.remember_decoded(d0, turn)
    pool.remember_decoded(d1, turn)
    assert pool.decode_matches(turn) == {d0: 32, d1: 32}
    pool.sweep(wait_s=0.01)  # d0 syncs (its cache is empty); d1 reports no events
    assert pool.kv_index.synced(d0) and not pool.kv_index.synced(d1)
    assert pool.decode_matches(turn) == {d1: 32}
    fill(pool.fakes["d0"].bm, turn)
    pool.sweep(wait_s=0.01)
    assert pool.decode_matches(turn) == {d0: 40, d1: 32}
    # the stats the pool keeps carry no events
    assert not d0.stats.HasField("kv_events")
    # the worker evicts: the next sweep says so
    pool.fakes["d0"].bm.free(pool.fakes["d0"].bm.allocate(64))
    pool.sweep(wait_s=0.01)
    assert pool.decode_matches(turn) == {d1: 32}


def test_pool_expects_what_it_sent_until_the_next_poll(pool):
    d0, _ = pool.decode
    pool.sweep(wait_s=0.01)
    turn = list(range(40))
    pool.remember_decoded(d0, turn)
    assert pool.decode_matches(turn)[d0] == 40
    pool.sweep(wait_s=0.01)  # the worker stored nothing of it
    assert d0 not in pool.decode_matches(turn)


def test_pool_forgets_a_worker_that_left_and_one_that_was_stale(pool):
    d0, _ = pool.decode
    pool.sweep(wait_s=0.01)
    fill(pool.fakes["d0"].bm, list(range(40)))
    pool.sweep(wait_s=0.01)
    assert pool.decode_matches(list(range(40)))[d0] == 40
    pool.forget_decoded(d0)
    assert d0 not in pool.decode_matches(list(range(40)))
    pool.sweep(wait_s=0.01)  # resynced from a snapshot
    assert pool.decode_matches(list(range(40)))[d0] == 40
    with pool._lock:
        pool._forget(d0)  # what leaving, dying, re-registering or a role change does
    assert not pool.kv_index.synced(d0) and len(pool.kv_index) == 0


def test_prefill_workers_are_not_asked_for_events():
    Pool.fakes = {"p0": EngineWorker("p0", BlockManager(8, BS))}
    asked = []
    fake = Pool.fakes["p0"]
    real = fake.future
    fake.future = lambda request, timeout=None: asked.append(request) or real(request)
    Pool(["p0"], []).sweep(wait_s=0.01)
    assert asked and not asked[0].want_kv_events


def test_pool_counts_only_the_blocks_before_the_prompts_last_token_as_usable(pool):
    d0, _ = pool.decode
    pool.sweep(wait_s=0.01)
    fill(pool.fakes["d0"].bm, list(range(8)))  # two blocks of 4
    pool.sweep(wait_s=0.01)
    assert pool.decode_matches(list(range(8)))[d0] == 8
    # the engine computes the last token: of a prompt of exactly those blocks it takes one
    assert pool.decode_usable(list(range(8))) == {d0: 4}
    assert pool.decode_usable(list(range(9))) == {d0: 8}
    assert pool.decode_usable(list(range(4))) == {}
