"""Decode bursts on CUDA (engine/decode_burst.py, DecodeGraphs.run_burst): greedy steps replayed
back to back from the graphs, each fed the last one's argmax on the device, give the tokens of
one step at a time (decode_burst=1) and HF's, with stops, max_tokens and arrivals inside a burst.
Skipped without CUDA; PDSERVE_GPU_TEST_DEVICE=cpu dry-runs it through the graphs' eager path
with bursts switched on there (as tests/unit/test_decode_bursts.py does)."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import greedy, run_until_done
from helpers.gpu import DEVICE, ON_CUDA, hf_greedy, hf_on
from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams, model_runner
from pdserve.engine.decode_burst import BURSTS_ON_CPU_ENV

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("graphs_anywhere")]

NEW = 24
CUDA = dict(device=DEVICE, kv_cache_memory=1 << 24, max_model_len=512, dtype="float32")


@pytest.fixture
def graphs_anywhere(monkeypatch):
    """On a dry run off CUDA, the graphs' eager path with bursts switched on."""
    if not ON_CUDA:
        monkeypatch.setattr(model_runner, "graphs_apply", lambda device, tp, enabled: enabled)
        monkeypatch.setenv(BURSTS_ON_CPU_ENV, "1")


def _counted(llm) -> dict[str, int]:
    """Counts the bursts the runner runs."""
    calls = {"bursts": 0}
    graphs = llm.engine.runner.graphs
    real = graphs.run_burst

    def run_burst(seqs, key, steps):
        calls["bursts"] += 1
        return real(seqs, key, steps)

    graphs.run_burst = run_burst
    return calls


def _params(expected):
    stop = expected[1][7]
    return [greedy(NEW), greedy(NEW, stop_token_ids=[stop]), greedy(5), greedy(NEW)]


def test_bursts_match_single_steps_and_hf(tiny_models):
    model_dir, hf = tiny_models("llama-gqa")
    hf = hf_on(hf, torch.float32)
    ps = random_prompts([3, 17, 40, 9], seed=21)
    expected = [hf_greedy(hf, p, NEW)[0] for p in ps]
    runs = {}
    for burst in (8, 1):
        llm = LLM(model_dir, block_size=16, decode_burst=burst, **CUDA)
        calls = _counted(llm)
        outs = llm.generate(ps, _params(expected), use_tqdm=False)
        runs[burst] = [o.outputs[0].token_ids for o in outs]
        assert (calls["bursts"] > 0) == (burst > 1)
        assert_no_leaks(llm.engine)
    assert runs[8] == runs[1]
    stop = expected[1][7]
    cut = expected[1].index(stop) + 1
    assert runs[8] == [expected[0], expected[1][:cut], expected[2][:5], expected[3]]


def test_arrivals_and_sampled_rows_inside_bursts(tiny_models):
    model_dir, hf = tiny_models("llama-gqa")
    hf = hf_on(hf, torch.float32)
    ps = random_prompts([5, 30, 12, 50], seed=22)
    expected = [hf_greedy(hf, p, NEW)[0] for p in ps]
    llm = LLM(model_dir, block_size=16, **CUDA)
    calls = _counted(llm)
    engine = llm.engine
    engine.add_request("r0", ps[0], greedy(NEW))
    outs = []
    for i in range(1, 4):
        for _ in range(3 * i):
            outs += engine.step()
        engine.add_request(f"r{i}", ps[i], greedy(NEW))
    engine.add_request("s", ps[0], SamplingParams(temperature=0.8, seed=1, max_tokens=4))
    outs += run_until_done(engine)
    last = {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    assert [last[f"r{i}"] for i in range(4)] == expected
    assert len(last["s"]) == 4 and calls["bursts"] > 0
    assert_no_leaks(engine)
