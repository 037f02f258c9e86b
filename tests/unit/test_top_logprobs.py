"""Sampled tokens' most likely alternatives (SamplingParams.top_logprobs): the sampler's numbers
equal the raw distribution's log-softmax top-k, they survive the engine's output path and
pickling, and the workers' wire helpers (worker_common/logprobs.py) turn the engine's prompt and
sampled logprobs into pdserve.v1.TopLogprobs. The HTTP shapes are tests/unit/test_http_logprobs.py's.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from helpers.engine import KV
from helpers.prompt_logprobs import hf_prompt_logprobs
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import BadSamplingParams
from pdserve.engine.sampler import Sampler, SamplingRow, TokenLogprob
from pdserve.protos.limits import check_sampling
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.worker_common.logprobs import prompt_fields, top_of, wants_top

pytestmark = pytest.mark.usefixtures("one_thread")


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [1, 2], [], None)


def test_sampler_top_k_is_the_raw_log_softmax_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    rows = [
        _row(temperature=0, logprobs=True, top_logprobs=4),
        _row(temperature=0, logprobs=True),
        _row(temperature=0.7, logprobs=True, top_logprobs=1, presence_penalty=1.0),
    ]
    out = Sampler()(logits, rows)
    want = torch.log_softmax(logits, dim=-1)
    for row, k in ((0, 4), (2, 1)):
        lp = out.logprobs[row]
        assert isinstance(lp, TokenLogprob)
        top = want[row].topk(k)
        assert list(lp.top) == top.indices.tolist()  # most likely first
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(lp.top[t], v, abs_tol=1e-5)
        assert math.isclose(lp, want[row, out.token_ids[row]].item(), abs_tol=1e-5)
    assert type(out.logprobs[1]) is float  # no top_logprobs: a plain float
    # greedy: the sampled token is the most likely one
    assert next(iter(out.logprobs[0].top)) == out.token_ids[0]
    again = pickle.loads(pickle.dumps(out.logprobs[0]))
    assert again == out.logprobs[0] and again.top == out.logprobs[0].top


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=1.5), "top_logprobs"),
    ],
)
def test_engine_refuses_bad_top_logprobs(kw, field):
    with pytest.raises(BadSamplingParams, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "sampling, field",
    [
        (pdserve_pb2.SamplingParams(logprobs=True, top_logprobs=21), "sampling.top_logprobs"),
        (pdserve_pb2.SamplingParams(top_logprobs=3), "sampling.top_logprobs"),
        (pdserve_pb2.SamplingParams(prompt_logprobs=21), "sampling.prompt_logprobs"),
    ],
)
def test_the_wire_refuses_bad_logprob_counts(sampling, field):
    refusal = check_sampling(sampling, 256, 1000)
    assert refusal is not None and field in refusal.message
    assert refusal.code.name == "INVALID_ARGUMENT"


def test_the_wire_takes_logprob_counts_within_the_bound():
    ok = pdserve_pb2.SamplingParams(logprobs=True, top_logprobs=20, prompt_logprobs=20)
    assert check_sampling(ok, 256, 1000) is None


def test_engine_outputs_carry_each_tokens_alternatives_and_the_prompts(refs):
    model_dir, hf, prompts, _ = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV)
    prompt = prompts[1]
    params = SamplingParams(
        temperature=0, max_tokens=3, logprobs=True, top_logprobs=2, prompt_logprobs=2
    )
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids) == 3
    full = prompt + comp.token_ids
    want = hf_prompt_logprobs(hf, full)  # row p: the distribution of token p + 1
    for i, (t, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = want[len(prompt) - 1 + i]
        assert len(lp.top) == 2 and next(iter(lp.top)) == t  # greedy: the top one
        for a, v in lp.top.items():
            assert math.isclose(v, row[a].item(), abs_tol=1e-4)
        proto = top_of(lp)
        assert list(proto.token_ids) == list(lp.top)
    assert wants_top(comp.logprobs) and not wants_top([0.5])
    assert not top_of(-0.25).token_ids  # a plain float: no alternatives
    fields = prompt_fields(prompt, out.prompt_logprobs, 2)
    assert len(fields["prompt_logprobs"]) == len(prompt) - 1
    for p, (x, top) in enumerate(zip(fields["prompt_logprobs"], fields["prompt_top_logprobs"])):
        assert math.isclose(x, want[p, prompt[p + 1]].item(), abs_tol=1e-4)
        assert list(top.token_ids) == want[p].topk(2).indices.tolist()
    assert prompt_fields(prompt, None, 2) == {}


def test_prompt_fields_take_the_first_k_entries_and_the_prompt_tokens_own():
    prompt = [5, 6, 7]
    # the runner's entry: the top-k in order, then the prompt token (when not among them)
    entries = [None, {1: -0.1, 2: -2.0, 6: -5.0}, {7: -0.2, 3: -1.9}]
    fields = prompt_fields(prompt, entries, 2)
    assert fields["prompt_logprobs"] == pytest.approx([-5.0, -0.2])
    assert [list(t.token_ids) for t in fields["prompt_top_logprobs"]] == [[1, 2], [7, 3]]
    with pytest.raises(ValueError, match="position 2"):
        prompt_fields(prompt, [None, {6: -1.0}, None], 0)
