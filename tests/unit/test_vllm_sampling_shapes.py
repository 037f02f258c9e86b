"""vLLM's SamplingParams forms and offline output shapes (engine/sampling_params.py,
engine/outputs.py vllm_output): `logprobs` as vLLM's count (None, 0, k, -1) with each sampled
position a dict {token id: Logprob(logprob, rank, decoded_token)} and cumulative_logprob,
`prompt_logprobs` likewise per prompt position, `max_tokens=None` (the rest of the context),
`seed=-1` (no seed), `truncate_prompt_tokens`, and vLLM's structured-output objects. The numbers
are checked against HF's log-softmax of the same positions; pdserve's own `logprobs=True` form
keeps the engine's floats, which the workers' wire needs (tests/unit/test_top_logprobs.py)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from helpers.engine import KV
from helpers.prompt_logprobs import hf_prompt_logprobs
from helpers.structured import byte_level_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.outputs import Logprob, _TokenTexts, vllm_output
from pdserve.engine.sampler import Sampler, SamplingRow, TokenLogprob, plain_greedy
from pdserve.engine.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from pdserve.engine.structured.spec import StructuredSpec

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4


@pytest.fixture(scope="module")
def model(refs):
    model_dir, hf, prompts, _ = refs("llama-gqa")
    return LLM(model_dir, kv_cache_memory=KV, max_model_len=64), hf, prompts


def _generate(llm, prompt, params):
    """LLM.generate's output as the offline API gives it (vllm_output leaves one it already
    shaped as it is)."""
    return vllm_output(llm.generate(prompt, params, use_tqdm=False)[0], params, llm.get_tokenizer())


def _rank_bounds(row: torch.Tensor, value: float) -> tuple[int, int]:
    """The ranks vLLM's count (tokens at least as likely) may give a token of logprob `value`
    in HF's distribution `row`, allowing for rounding between the two."""
    return int((row > value + TOL).sum()) + 1, int((row >= value - TOL).sum())


@pytest.mark.parametrize(
    "kw, logprobs, top",
    [
        (dict(logprobs=5), 5, 5),
        (dict(logprobs=0), 0, 0),
        (dict(logprobs=-1), -1, -1),
        (dict(logprobs=None), None, 0),
        (dict(logprobs=False), None, 0),
        (dict(logprobs=True, top_logprobs=3), True, 3),
    ],
)
def test_logprobs_take_vllms_counts_and_pdserves_bool(kw, logprobs, top):
    params = SamplingParams(**kw)
    assert params.logprobs == logprobs and params.top_logprobs == top
    assert params.vllm_logprobs == (logprobs is not None and logprobs is not True)


def test_prompt_logprobs_seed_and_max_tokens_take_vllms_values():
    assert SamplingParams(prompt_logprobs=-1).prompt_logprobs == -1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(seed=-1).seed is None  # vLLM's: random, as None
    assert SamplingParams(max_tokens=None, min_tokens=4).max_tokens is None
    kw = dict(spaces_between_special_tokens=False, truncate_prompt_tokens=-1)
    params = SamplingParams(**kw, extra_args={"a": [1]})
    assert params.extra_args == {"a": [1]} and params == SamplingParams(**kw)  # (not compared)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-2), "logprobs"),
        (dict(logprobs=1.5), "logprobs"),
        (dict(logprobs=3, top_logprobs=2), "top_logprobs"),
        (dict(prompt_logprobs=-2), "prompt_logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        (dict(spaces_between_special_tokens=1), "spaces_between_special_tokens"),
        (dict(extra_args=[1]), "extra_args"),
        (dict(structured_outputs={"jsn": {}}), "unknown fields"),
        (dict(structured_outputs=3), "structured_outputs"),
    ],
)
def test_bad_vllm_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_vllm_structured_outputs_become_pdserves_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        (StructuredOutputsParams(json=schema), StructuredSpec(json_schema=schema)),
        (StructuredOutputsParams(regex="a+"), StructuredSpec(regex="a+")),
        (StructuredOutputsParams(choice=["x", "y"]), StructuredSpec(choice=("x", "y"))),
        (StructuredOutputsParams(grammar='root ::= "a"'), StructuredSpec(grammar='root ::= "a"')),
        (StructuredOutputsParams(json_object=True), StructuredSpec(json_object=True)),
        ({"json": schema}, StructuredSpec(json_schema=schema)),
    ]
    for given, want in cases:
        assert SamplingParams(structured_outputs=given).structured == want
    old = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+", backend="auto"))
    assert old.structured == StructuredSpec(regex="a+")
    assert SamplingParams(guided_decoding=GuidedDecodingParams()).structured is None
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert SamplingParams(structured_outputs=closed).structured.json_schema == {
        **schema,
        "additionalProperties": False,
    }
    assert "additionalProperties" not in schema  # the caller's schema is left as it was
    same = SamplingParams(structured={"regex": "a+"}, structured_outputs={"regex": "a+"})
    assert same.structured == StructuredSpec(regex="a+")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: StructuredOutputsParams(), "exactly one"),
        (lambda: StructuredOutputsParams(regex="a", choice=["b"]), "exactly one"),
        (lambda: GuidedDecodingParams(regex="a", backend="xgrammar"), "backend"),
        (
            lambda: SamplingParams(
                structured_outputs=StructuredOutputsParams(regex="a", whitespace_pattern=" ")
            ),
            "whitespace_pattern",
        ),
        (
            lambda: SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag="{}")),
            "structural_tag",
        ),
        (
            lambda: SamplingParams(structured={"regex": "a"}, guided_decoding={"regex": "b"}),
            "different structured outputs",
        ),
    ],
)
def test_structured_outputs_it_cannot_honour_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_sampler_ranks_vllm_rows_and_keeps_pdserves_floats():
    torch.manual_seed(0)
    logits = torch.randn(4, 40)
    rows = [
        SamplingRow(SamplingParams(temperature=0.9, seed=1, logprobs=2), [1], [], None),
        SamplingRow(SamplingParams(temperature=0, logprobs=0), [1], [], None),
        SamplingRow(SamplingParams(temperature=0, logprobs=-1), [1], [], None),
        SamplingRow(SamplingParams(temperature=0, logprobs=True), [1], [], None),
    ]
    out = Sampler()(logits, rows)
    want = torch.log_softmax(logits, dim=-1)
    for i, k in ((0, 2), (1, 0), (2, 40)):
        lp, t = out.logprobs[i], out.token_ids[i]
        assert isinstance(lp, TokenLogprob) and len(lp.top) == k
        assert lp.rank == int((logits[i] >= logits[i, t]).sum())
        assert list(lp.top) == want[i].topk(k).indices.tolist()
    assert type(out.logprobs[3]) is float  # pdserve's form without top_logprobs: unchanged
    again = pickle.loads(pickle.dumps(out.logprobs[0]))
    assert again.rank == out.logprobs[0].rank and again.top == out.logprobs[0].top
    # a greedy row that wants vLLM's logprobs=0 is not taken on the device (it needs them)
    assert not plain_greedy(rows[1:2])


def test_offline_logprobs_have_vllms_shape_and_hfs_numbers(model):
    llm, hf, prompts = model
    prompt, tok = prompts[1], llm.get_tokenizer()
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=3)
    comp = _generate(llm, prompt, params).outputs[0]
    ref = hf_prompt_logprobs(hf, prompt + comp.token_ids)
    assert len(comp.logprobs) == len(comp.token_ids) == 6
    total = 0.0
    for i, (t, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert next(iter(entry)) == t  # the sampled token first
        assert all(isinstance(v, Logprob) for v in entry.values())
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(entry) and len(entry) in (3, 4)
        for a, v in entry.items():
            assert math.isclose(v.logprob, row[a].item(), abs_tol=TOL)
            assert v.decoded_token == tok.decode([a])
        lo, hi = _rank_bounds(row, row[t].item())
        assert lo <= entry[t].rank <= hi
        assert sorted(v.rank for v in entry.values())[:3] == [1, 2, 3]  # then the sampled one
        total += entry[t].logprob
    assert math.isclose(comp.cumulative_logprob, total, abs_tol=1e-6)


def test_offline_logprobs_counts_zero_and_whole_vocabulary(model):
    llm, hf, prompts = model
    prompt = prompts[2]
    greedy = dict(temperature=0, max_tokens=3, ignore_eos=True)
    only = _generate(llm, prompt, SamplingParams(**greedy, logprobs=0)).outputs[0]
    assert [list(e) for e in only.logprobs] == [[t] for t in only.token_ids]
    assert all(e[t].rank == 1 for t, e in zip(only.token_ids, only.logprobs))  # greedy
    every = _generate(llm, prompt, SamplingParams(**greedy, logprobs=-1)).outputs[0]
    vocab = hf.config.vocab_size
    assert all(len(e) == vocab for e in every.logprobs)
    assert all(
        sorted(v.rank for v in e.values()) == list(range(1, vocab + 1)) for e in every.logprobs
    )
    bare = _generate(llm, prompt, SamplingParams(**greedy, logprobs=1, detokenize=False))
    assert all(v.decoded_token is None for e in bare.outputs[0].logprobs for v in e.values())
    none = _generate(llm, prompt, SamplingParams(**greedy)).outputs[0]
    assert none.logprobs is None and none.cumulative_logprob is None
    # pdserve's own form keeps the engine's floats, with the sum as vLLM's cumulative_logprob
    own = _generate(llm, prompt, SamplingParams(**greedy, logprobs=True, top_logprobs=2))
    comp = own.outputs[0]
    assert all(isinstance(x, TokenLogprob) and len(x.top) == 2 for x in comp.logprobs)
    assert math.isclose(comp.cumulative_logprob, sum(comp.logprobs), abs_tol=1e-9)


def test_offline_prompt_logprobs_have_vllms_shape_and_hfs_numbers(model):
    llm, hf, prompts = model
    prompt = prompts[1]
    out = _generate(llm, prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    ref = hf_prompt_logprobs(hf, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry, row, t = out.prompt_logprobs[p], ref[p - 1], prompt[p]
        assert next(iter(entry)) == t  # the prompt token first
        assert math.isclose(entry[t].logprob, row[t].item(), abs_tol=TOL)
        lo, hi = _rank_bounds(row, row[t].item())
        assert lo <= entry[t].rank <= hi
        for rank, a in enumerate(row.topk(2).indices.tolist(), start=1):
            assert math.isclose(entry[a], row[a].item(), abs_tol=TOL)
            assert a == t or entry[a].rank == rank
    every = _generate(llm, prompt, SamplingParams(max_tokens=1, prompt_logprobs=-1))
    assert all(len(e) == hf.config.vocab_size for e in every.prompt_logprobs[1:])


def test_max_tokens_none_runs_to_the_end_of_the_context(model):
    llm, _, prompts = model
    prompt = prompts[1]
    out = llm.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    comp = out[0].outputs[0]
    assert len(comp.token_ids) == 64 - len(prompt) and comp.finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_last_tokens(model):
    llm, _, prompts = model
    prompt = prompts[4]  # 40 tokens
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate(prompt, SamplingParams(**greedy, truncate_prompt_tokens=5), use_tqdm=False)
    alone = llm.generate(prompt[-5:], SamplingParams(**greedy), use_tqdm=False)
    assert cut[0].prompt_token_ids == prompt[-5:]
    assert cut[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    long = prompt + prompt  # 80 tokens, past max_model_len=64
    most = llm.generate(
        long, SamplingParams(max_tokens=None, truncate_prompt_tokens=-1), use_tqdm=False
    )
    assert most[0].prompt_token_ids == long[-63:] and len(most[0].outputs[0].token_ids) == 1


def test_vllm_structured_outputs_steer_generation(tiny_models, tmp_path_factory):
    model_dir, _ = tiny_models("llama-gqa")
    llm = LLM(
        byte_level_model(model_dir, tmp_path_factory.mktemp("byte-level")),
        kv_cache_memory=KV,
        block_size=16,
        max_num_batched_tokens=64,
    )
    choices = ["yes", "no", "maybe so"]
    for params in (
        SamplingParams(
            seed=1, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=choices)
        ),
        SamplingParams(seed=2, max_tokens=40, guided_decoding=GuidedDecodingParams(choice=choices)),
    ):
        comp = llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
        assert comp.finish_reason == "stop" and comp.text in choices


class _Bytes:
    """A tokenizer whose token i is byte i (a character of several bytes is several tokens)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_tokens_text_cut_inside_a_character_is_repaired_as_vllm_does():
    # "中" is E4 B8 AD: alone, B8 and AD are incomplete; AD after B8 and the previous position's
    # E4 is the whole character, and B8 after E4 is still incomplete, so it gets ""
    texts = _TokenTexts(_Bytes())
    assert texts.position([0xB8, 0xAD], previous=0xE4) == ["", "中"]
    assert texts.position([ord("a"), 0xB8], previous=None) == ["a", ""]
    assert _TokenTexts(None).position([1, 2], previous=None) == [None, None]
