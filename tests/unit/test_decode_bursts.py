"""Decode bursts (engine/decode_burst.py, DecodeGraphs.run_burst) on the graphs' eager path on
CPU (PDSERVE_DECODE_BURSTS_ON_CPU=1): greedy steps run ahead, step j fed step j - 1's argmax on
the device at the next positions, give exactly the tokens of one step at a time (HF's greedy
continuations), with stops, max_tokens and arrivals inside a burst, and a batch with a sampled
row runs no burst. The CUDA replays are checked by tests/gpu/test_cuda_bursts.py."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy, run_until_done
from pdserve.engine import LLM, SamplingParams, model_runner
from pdserve.engine.decode_burst import BURSTS_ON_CPU_ENV

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def bursts_on_cpu(monkeypatch):
    """Runners built inside the test take the graph path on CPU, with bursts."""
    monkeypatch.setattr(model_runner, "graphs_apply", lambda device, tp, enabled: enabled)
    monkeypatch.setenv(BURSTS_ON_CPU_ENV, "1")


def _llm(model_dir, **kw) -> LLM:
    # no speculation: its gate turns guesses on and off by measured step times, and a step with
    # guesses runs no burst, so the number of bursts would depend on the machine's load
    kw.setdefault("speculative_config", None)
    return LLM(model_dir, kv_cache_memory=KV, block_size=16, max_num_seqs=8, **kw)


def _count_bursts(monkeypatch, runner) -> dict[str, int]:
    """Counts the bursts run and the steps handed out from one run ahead."""
    calls = {"bursts": 0, "taken": 0, "rows": []}
    real_run, real_take = runner.graphs.run_burst, runner.bursts.take

    def run_burst(seqs, key, steps):
        calls["bursts"] += 1
        calls["rows"].append(len(seqs))
        return real_run(seqs, key, steps)

    def take(seqs):
        tokens = real_take(seqs)
        calls["taken"] += tokens is not None
        return tokens

    monkeypatch.setattr(runner.graphs, "run_burst", run_burst)
    monkeypatch.setattr(runner.bursts, "take", take)
    return calls


def test_bursts_give_the_tokens_of_single_steps(refs, bursts_on_cpu, monkeypatch):
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = _llm(model_dir)
    calls = _count_bursts(monkeypatch, llm.engine.runner)
    outs = llm.generate(prompts[:3], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:3]
    assert calls["bursts"] > 0 and calls["taken"] > 2 * calls["bursts"]


def test_stops_and_max_tokens_inside_a_burst(refs, bursts_on_cpu, monkeypatch):
    """A stop token (as EOS would) and max_tokens end a request inside a burst: nothing after
    them is kept, and the other rows go on with the right tokens."""
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = _llm(model_dir)
    calls = _count_bursts(monkeypatch, llm.engine.runner)
    stop = expected[1][5]
    cut = expected[1].index(stop) + 1
    params = [greedy(), greedy(stop_token_ids=[stop]), greedy(max_tokens=6), greedy()]
    outs = llm.generate(prompts[:4], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [expected[0], expected[1][:cut], expected[2][:6], expected[3]]
    assert calls["bursts"] > 1 and calls["taken"] > 0


def test_a_sampled_row_runs_no_burst(refs, bursts_on_cpu, monkeypatch):
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = _llm(model_dir)
    calls = _count_bursts(monkeypatch, llm.engine.runner)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts[:2], [greedy(), sampled], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[0]
    # the greedy row bursts only once the sampled one is done
    assert len(outs[1].outputs[0].token_ids) == 3
    assert calls["bursts"] > 0 and set(calls["rows"]) == {1}


def test_requests_arriving_mid_run(refs, bursts_on_cpu, monkeypatch):
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = _llm(model_dir)
    engine = llm.engine
    calls = _count_bursts(monkeypatch, engine.runner)
    engine.add_request("r0", prompts[0], greedy())
    outs = []
    for i in range(1, 4):  # another request every few steps, inside the running bursts
        for _ in range(3 * i):
            outs += engine.step()
        engine.add_request(f"r{i}", prompts[i], greedy())
    outs += run_until_done(engine)
    last = {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    assert [last[f"r{i}"] for i in range(4)] == expected[:4]
    assert calls["bursts"] > 0 and calls["taken"] > 0
