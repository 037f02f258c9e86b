"""A hybrid model's worker in the router's block index (router/kv_index.py): its block manager
reports after which blocks a recurrent state is held (engine/block_manager.py state_changed,
"state" events, a reset's state_snapshot), kept in a slot (engine/recurrent_state.py SlotPool) or
saved in the host tier (engine/kv_host_tier.py), and its match ends at the last held block a
state follows, as its engine's hit does (held_prefix_tokens). Through the worker's wire form
(worker_common/kv_events.py); no model, no sockets."""

from __future__ import annotations

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_host_tier import HostTier, fingerprint
from pdserve.engine.recurrent_state import RecurrentStates, SlotPool
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.kv_index import KVIndex, chain_hashes
from pdserve.worker_common import kv_events as wire

BS = 4
SHAPES = [((3, 8), (4, 4, 4))]  # (352 bytes a state: above MIN_ENTRY_BYTES)
TOKENS = list(range(100, 117))  # four full blocks and one token


def hybrid(num_slots: int = 3, tier_states: int = 0):
    """A block manager with a hybrid's slots (as the scheduler wires them) and, with
    `tier_states`, a host tier of about that many states and no room for blocks."""
    bm, slots = BlockManager(16, BS), SlotPool(num_slots)
    bm.kept_states = slots
    slots.on_change = bm.state_changed
    if tier_states:
        states = RecurrentStates(SHAPES, num_slots, "cpu")
        cap = tier_states * RecurrentStates.bytes_for(SHAPES, 1)
        fp = fingerprint(dict(model="m", block_size=BS), 1)
        tier = HostTier(cap, lambda: [torch.zeros(1, 2, 16, BS, 1, 1)], fp, states=lambda: [states])
        bm.attach_tier(tier)
        slots.on_push_out = bm.save_state
    ids = bm.allocate(bm.blocks_needed(len(TOKENS)))
    bm.register_full_blocks(ids, TOKENS, 0, len(TOKENS))
    bm.free(ids)
    return bm, slots, bm.chain(TOKENS, 4)


class Reader:
    """What the pool does for one worker: ask from the index's place, apply the answer."""

    def __init__(self, index: KVIndex, bm: BlockManager):
        self.index, self.bm, self.polls = index, bm, 0

    def poll(self) -> str:
        epoch, after = self.index.position("w")
        self.polls += 1
        request = worker_pb2.StatsRequest(
            want_kv_events=True, kv_events_epoch=epoch, kv_events_after=after
        )
        events = wire.kv_events(self.bm, request)
        return self.index.apply("w", (epoch, after), events, self.polls)

    def matched(self, tokens=TOKENS) -> int:
        held = self.index.matched_tokens(tokens, {"w": BS}).get("w", 0)
        # (the engine's own count, what a local prefill's check reads, agrees)
        assert held == self.bm.held_prefix_tokens(tokens, len(tokens))
        return held


def test_a_hybrid_workers_match_ends_at_its_last_block_with_a_state():
    bm, slots, hashes = hybrid()
    reader = Reader(KVIndex(), bm)
    assert reader.poll() == "reset"
    assert reader.matched() == 0  # four blocks held, no state after any
    slots.keep(hashes[1])
    reader.poll()
    assert reader.matched() == 8
    slots.keep(hashes[3])
    reader.poll()
    assert reader.matched() == 16
    slots.drop(hashes[3])
    for _ in range(3):  # sequences take every slot: the plain free ones, then block 2's state's
        slots.take()
    assert slots.num_kept == 0
    assert reader.poll() == "events" and reader.matched() == 0
    # a reset's snapshot carries the states
    slots.give_back(0)
    slots.keep(hashes[2])
    fresh = Reader(KVIndex(), bm)
    assert fresh.poll() == "reset" and fresh.matched() == 12
    # and a prefix-cache reset drops them with the blocks
    assert bm.reset_prefix_cache()
    reader.poll()
    assert reader.matched() == 0 and slots.num_kept == 0


def test_a_state_in_the_host_tier_still_counts_until_the_tier_lets_it_go():
    bm, slots, hashes = hybrid(num_slots=1, tier_states=1)
    reader = Reader(KVIndex(), bm)
    slots.keep(hashes[3])
    reader.poll()
    assert reader.matched() == 16
    assert slots.take() == 0  # its slot taken: the state moves to the tier, no event
    assert bm.tier.has_state(hashes[3]) and hashes[3] not in slots
    reader.poll()
    assert reader.matched() == 16
    slots.give_back(0)
    slots.keep(hashes[1])  # kept, then pushed out to the tier too: the tier holds one state
    slots.take()
    assert bm.tier.has_state(hashes[1]) and not bm.tier.has_state(hashes[3])
    reader.poll()
    assert reader.matched() == 8
    # a state the tier refuses when asked back is reported gone
    bm.tier._entries[(bm.tier.fingerprint, hashes[1], "state")].shards[0].view(-1)[0] += 1
    assert not bm.tier.load_state(hashes[1], 0)
    reader.poll()
    assert reader.matched() == 0


def test_a_finished_turn_is_expected_with_its_state_until_the_next_poll():
    bm, slots, hashes = hybrid()
    index = KVIndex()
    reader = Reader(index, bm)
    reader.poll()
    turn = TOKENS[:-1] + [7, 8, 9, 10, 11]  # five blocks, the router believes it computed
    index.expect("w", chain_hashes(turn, BS), reader.polls)  # a prompt: no state expected
    assert index.matched_tokens(turn, {"w": BS}) == {"w": 0}
    index.expect("w", chain_hashes(turn, BS), reader.polls, state=True)  # a finished turn
    assert index.matched_tokens(turn, {"w": BS}) == {"w": 20}
    reader.poll()  # the worker's answer: it kept no state there
    assert index.matched_tokens(turn, {"w": BS}) == {"w": 0}


def test_a_worker_without_states_matches_its_blocks():
    bm = BlockManager(16, BS)
    ids = bm.allocate(bm.blocks_needed(len(TOKENS)))
    bm.register_full_blocks(ids, TOKENS, 0, len(TOKENS))
    bm.free(ids)
    reader = Reader(KVIndex(), bm)
    reader.poll()
    assert reader.matched() == 16
    index = reader.index
    index.expect("w", chain_hashes(TOKENS + [1, 2, 3, 4], BS), reader.polls, state=True)
    assert index.matched_tokens(TOKENS + [1, 2, 3, 4, 5], {"w": BS}) == {"w": 20}
