"""The simulator's worker (tuning/sim_worker.py, "engine/scheduler.py's policy over token
counts") against the real thing: the same request trace through engine/scheduler.py's Scheduler
with a BlockManager (driven by tests/helpers/scheduler_harness.py's fake runner, no model) and
through sim_worker.Worker, step by step; every step must schedule the same requests with the same
number of tokens each, in the same order.

Traces: small synthetic ones (chunked prefill within the token budget; a KV cache small enough to
preempt and recompute; a prefill-only worker) and slices of the shipped traces (azure_conv,
azure_code, mooncake_synthetic), scaled down so that the fake runner stays fast. A request
arrives before the step of index arrival_s / STEP_S.

Deliberate difference, stated and bounded here: the simulator does not model the prefix cache
(tuning/simulator.py: "every prompt is computed in full; mooncake hash_ids are ignored").
The exact comparisons run the scheduler with prefix caching off; with it on, a Mooncake slice
whose prompts share prefix blocks is checked to differ by exactly the tokens the cache served:
the scheduler computes each prompt minus its cached prefix, the simulator the whole prompt, and
neither does anything else differently while no sequence is preempted.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from helpers.scheduler_harness import Harness
from pdserve.tuning.sim_worker import Seq, Worker
from pdserve.tuning.workload import RequestSpec, build_prompts, load_trace

STEP_S = 0.05  # seconds of arrivals per step


class _Model:
    """Step times do not matter here: only what each step schedules."""

    def decode_time(self, n, ctx):
        return 0.01

    def prefill_time(self, tokens, pairs, ctx):
        return 0.01


class _Req:
    def __init__(self, rid: int, prompt: int, output: int):
        self.rid, self.prompt, self.output, self.num_out = rid, prompt, output, 0


class _FastHarness(Harness):
    """The harness without its per-step invariant sweep (O(blocks x seqs)): the scheduler and the
    block manager are the real ones; the fake runner still checks every read and write."""

    def check(self):
        pass


def _arrival_steps(reqs: list[RequestSpec]) -> list[int]:
    t0 = reqs[0].arrival_s
    return [int((r.arrival_s - t0) / STEP_S) for r in reqs]


def run_scheduler(
    reqs, prompts, *, num_blocks, block_size, budget, max_seqs, caching=False, prefill_only=False
):
    """Per step: [(request index, tokens)], and the tokens the prefix cache served."""
    h = _FastHarness(num_blocks, block_size, caching, budget=budget, max_num_seqs=max_seqs)
    arrive = _arrival_steps(reqs)
    index, steps, nxt = {}, [], 0
    seqs = []
    for _ in range(100_000):
        while nxt < len(reqs) and arrive[nxt] <= len(steps):
            (seq,) = h.add(prompts[nxt], max_tokens=reqs[nxt].output_len, ignore_eos=True)
            seq.prefill_only = prefill_only
            index[seq.seq_id] = nxt
            seqs.append(seq)
            nxt += 1
        if nxt == len(reqs) and h.sched.num_unfinished == 0:
            break
        plan = h.step()
        steps.append([(index[s.seq.seq_id], s.num_new_tokens) for s in plan.scheduled])
    else:
        raise AssertionError("the scheduler did not drain")
    return steps, sum(s.num_cached_tokens for s in seqs), h.sched.num_preemptions


def run_sim(reqs, *, num_blocks, block_size, budget, max_seqs, prefill_only=False, fast=False):
    """Per step: [(request index, tokens)]; a fast-path step decodes one token of every running
    sequence."""
    w = Worker(
        _Model(), block_size, num_blocks * block_size, budget, max_seqs, prefill_only, fast=fast
    )
    arrive = _arrival_steps(reqs)
    steps, nxt, unfinished = [], 0, 0
    for _ in range(100_000):
        while nxt < len(reqs) and arrive[nxt] <= len(steps):
            r = reqs[nxt]
            w.enqueue(Seq(_Req(nxt, r.prompt_len, r.output_len), r.prompt_len, 0, 0, prefill_only))
            unfinished += 1
            nxt += 1
        if nxt == len(reqs) and unfinished == 0:
            break
        w.schedule()
        plan = (
            [(s.req.rid, 1) for s in w.running]
            if w.plan is None
            else [(s.req.rid, n) for s, _, n in w.plan]
        )
        steps.append(plan)
        if w.has_plan:
            first, done, prefilled = [], [], []
            w.complete(first, done, prefilled)
            unfinished -= len(done) + len(prefilled)
    else:
        raise AssertionError("the simulator did not drain")
    return steps, w.num_preemptions


def _synthetic(n, seed, prompt=(3, 60), output=(1, 30), gap=(0.0, 0.12)) -> list[RequestSpec]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(RequestSpec(t, rng.randint(*prompt), rng.randint(*output)))
        t += rng.uniform(*gap)
    return out


def _slice(name, n, scale, max_prompt, max_output, speedup=10.0) -> list[RequestSpec]:
    """The trace's first n requests, arriving `speedup` times faster (bigger batches)."""
    reqs = load_trace(name, scale=scale, max_prompt=max_prompt, max_output=max_output)[:n]
    return [replace(r, arrival_s=r.arrival_s / speedup) for r in reqs]


TRACES = {
    # chunked prefill within the budget, many sequences at once, KV to spare
    "synthetic-roomy": (lambda: _synthetic(60, 1), dict(num_blocks=400, block_size=4, budget=32)),
    # a KV cache too small for the load: preemptions and recomputation
    "synthetic-tight": (
        lambda: _synthetic(40, 2, prompt=(10, 40), output=(20, 60), gap=(0.0, 0.02)),
        dict(num_blocks=60, block_size=4, budget=48),
    ),
    "azure_conv": (
        lambda: _slice("azure_conv", 60, 0.05, 200, 40),
        dict(num_blocks=300, block_size=8, budget=64),
    ),
    "azure_code": (
        lambda: _slice("azure_code", 60, 0.05, 200, 20),
        dict(num_blocks=120, block_size=8, budget=64),
    ),
    "mooncake": (
        lambda: _slice("mooncake_synthetic", 120, 0.02, 300, 10),
        dict(num_blocks=1500, block_size=4, budget=128),
    ),
}


def _prompts(reqs, seed=0):
    return build_prompts(reqs, vocab_size=5000, seed=seed, low=100)


@pytest.mark.parametrize("max_seqs", [4, 32])
@pytest.mark.parametrize("name", list(TRACES))
def test_every_step_schedules_the_same_requests_and_tokens(name, max_seqs):
    make, shape = TRACES[name]
    reqs = make()
    assert len(reqs) >= 20
    want, _, sched_preempt = run_scheduler(reqs, _prompts(reqs), max_seqs=max_seqs, **shape)
    got, sim_preempt = run_sim(reqs, max_seqs=max_seqs, **shape)
    for k, (a, b) in enumerate(zip(want, got)):
        assert a == b, f"{name}: step {k} differs: scheduler {a}, simulator {b}"
    assert len(want) == len(got) and sched_preempt == sim_preempt
    if name == "synthetic-tight":
        assert sched_preempt > 0  # the trace does exercise preemption


@pytest.mark.parametrize("name", ["synthetic-roomy", "azure_conv", "synthetic-tight"])
def test_the_fast_decode_path_schedules_the_same_steps(name):
    make, shape = TRACES[name]
    reqs = make()
    want, _, _ = run_scheduler(reqs, _prompts(reqs), max_seqs=32, **shape)
    got, _ = run_sim(reqs, max_seqs=32, fast=True, **shape)
    # the fast path does not order a step's sequences: compare each step as a set
    assert [sorted(s) for s in want] == [sorted(s) for s in got]


@pytest.mark.parametrize("name", ["synthetic-roomy", "azure_code"])
def test_a_prefill_worker_schedules_the_same_steps(name):
    make, shape = TRACES[name]
    reqs = make()
    want, _, _ = run_scheduler(reqs, _prompts(reqs), max_seqs=8, prefill_only=True, **shape)
    got, _ = run_sim(reqs, max_seqs=8, prefill_only=True, **shape)
    assert want == got
    assert all(n > 0 for step in want for _, n in step)


def test_prefix_cache_hits_are_the_one_deliberate_difference():
    """With prefix caching on, Mooncake prompts that share hash_ids blocks are computed in part
    by the scheduler and in full by the simulator: the totals differ by exactly the cached
    tokens, each request's computed tokens by exactly its cached prefix, and the simulator never
    computes less."""
    make, shape = TRACES["mooncake"]
    reqs = make()
    assert sum(1 for r in reqs if r.block_ids) >= 20
    prompts = _prompts(reqs)
    want, cached, preempted = run_scheduler(reqs, prompts, max_seqs=32, caching=True, **shape)
    got, _ = run_sim(reqs, max_seqs=32, **shape)
    assert preempted == 0 and cached > 0  # the bound below holds without preemption

    def per_request(steps):
        out = {}
        for step in steps:
            for rid, n in step:
                out[rid] = out.get(rid, 0) + n
        return out

    sched, sim = per_request(want), per_request(got)
    assert sum(sim.values()) - sum(sched.values()) == cached
    for rid, r in enumerate(reqs):
        assert sim[rid] == r.prompt_len + r.output_len - 1
        assert 0 <= sim[rid] - sched[rid] <= r.prompt_len - 1
    assert len(got) >= len(want)
