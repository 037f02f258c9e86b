"""max_loras within one step (engine/scheduler.py, the LoRA paragraph of its docstring), with the
fake runner of scheduler_harness.py (no model): a step never runs sequences of more distinct
adapters than max_loras, the base model's sequences are never held back, and a deferred
adapter's requests run once those planned before them leave, first come first served, whether
they wait for admission or were committed into the running set by a reservation (the decode
side), under the plain policy and the long-prefill one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.scheduler_harness import Harness
from pdserve.engine.request import SeqStatus


def _harness(max_loras, long_policy=False):
    # the harness checks the prefix cache's chains from the base model's root, so these tests
    # run with the cache off (the adapters' roots are engine/lora.py's, tested there)
    h = Harness(num_blocks=128, block_size=4, caching=False, budget=64)
    h.sched.max_loras = max_loras
    if long_policy:
        h.sched.prefill_step_target_s = 0.5
    return h


def _seq(h, prompt, lora_id, max_tokens=3):
    seq = h.new(prompt, max_tokens=max_tokens, ignore_eos=True)
    # what the scheduler reads of an engine/lora.py AdapterInfo
    seq.lora = SimpleNamespace(lora_id=lora_id, cache_root=None) if lora_id else None
    return seq


def _add(h, prompt, lora_id, max_tokens=3):
    seq = _seq(h, prompt, lora_id, max_tokens)
    h.seqs.append(seq)
    h.sched.add([seq])
    return seq


def _drain(h, max_steps=200):
    """Runs every step to the end; returns each step's [(seq id, adapter id)] in plan order."""
    steps = []
    for _ in range(max_steps):
        if h.sched.num_unfinished == 0:
            h.assert_no_leaks()
            return steps
        plan = h.step()
        steps.append([(item.seq.seq_id, item.seq.lora_id) for item in plan.scheduled])
    raise AssertionError("did not drain")


def _adapters_per_step(steps) -> list[set[int]]:
    return [{lora for _, lora in step if lora} for step in steps]


def _first_step(steps, seq) -> int:
    return next(i for i, step in enumerate(steps) if any(s == seq.seq_id for s, _ in step))


def _last_step(steps, seq) -> int:
    return max(i for i, step in enumerate(steps) if any(s == seq.seq_id for s, _ in step))


@pytest.mark.parametrize("long_policy", [False, True])
def test_one_adapter_per_step_first_come_first_served(long_policy):
    h = _harness(1, long_policy)
    a1 = _add(h, range(10, 17), 1)
    b1 = _add(h, range(20, 27), 2)
    a2 = _add(h, range(30, 37), 1)
    base = _add(h, range(40, 47), 0)
    b2 = _add(h, range(50, 57), 2)
    steps = _drain(h)
    assert all(len(ids) <= 1 for ids in _adapters_per_step(steps)), steps
    assert {2} in _adapters_per_step(steps)  # both adapters ran, one at a time
    # the base model's prompt is not held behind the deferred adapters: it runs with a1
    assert _first_step(steps, base) == _first_step(steps, a1) == 0
    # b1 waits for a1 alone; a2 (a1's adapter, arrived after b1) does not pass it, nor b2 a2
    assert _last_step(steps, a1) < _first_step(steps, b1)
    assert _last_step(steps, b1) < _first_step(steps, a2)
    assert _last_step(steps, a2) < _first_step(steps, b2)
    assert all(s.num_output_tokens == 3 for s in (a1, b1, a2, base, b2))


@pytest.mark.parametrize("long_policy", [False, True])
def test_two_slots_three_adapters(long_policy):
    h = _harness(2, long_policy)
    a = _add(h, range(10, 17), 1, max_tokens=4)
    b = _add(h, range(20, 27), 2, max_tokens=2)
    c = _add(h, range(30, 37), 3)
    a2 = _add(h, range(40, 47), 1)
    steps = _drain(h)
    assert all(len(ids) <= 2 for ids in _adapters_per_step(steps)), steps
    assert _first_step(steps, a) == _first_step(steps, b) == 0
    # c takes b's slot once b leaves, while a still runs; a2 came after c and does not pass it
    assert _first_step(steps, c) == _last_step(steps, b) + 1 < _last_step(steps, a)
    assert _first_step(steps, a2) == _first_step(steps, c)
    assert all(s.status == SeqStatus.FINISHED for s in (a, b, c, a2))


def test_committed_reservations_take_turns():
    """The decode side: reservations committed into the running set with three adapters; each
    step decodes one adapter's sequences, in the order they were committed."""
    h = _harness(1)
    a1, b1, a2 = (
        _seq(h, range(10 * i, 10 * i + 8), lora, 4) for i, lora in [(1, 1), (2, 2), (3, 1)]
    )
    for seq in (a1, b1, a2):
        h.reserve(seq)
    for seq in (a1, b1, a2):
        h.commit(seq, [5])
    steps = _drain(h)
    assert all(len(ids) <= 1 for ids in _adapters_per_step(steps)), steps
    assert _last_step(steps, a1) < _first_step(steps, b1)
    assert _last_step(steps, b1) < _first_step(steps, a2)
    assert all(s.num_output_tokens == 4 for s in (a1, b1, a2))


def test_no_bound_without_max_loras():
    h = _harness(None)
    seqs = [_add(h, range(10 * i, 10 * i + 5), i) for i in (1, 2, 3)]
    steps = _drain(h)
    assert _adapters_per_step(steps)[0] == {1, 2, 3}
    assert all(s.num_output_tokens == 3 for s in seqs)
