"""Structured output in the engine (engine/structured/grammar.py) on a tiny random model with a byte-level
tokenizer: outputs follow JSON schemas, any JSON object, regexes, choices and context-free
grammars (GBNF and Lark) under random and
greedy sampling with n>1; logprobs are the masked distribution's; preemption and the
prefill/decode hand-off (prefill_only -> reserve/commit) keep each matcher with its tokens; bad
specs are refused naming the field; the engine's bitmask apply equals xgrammar's."""

from __future__ import annotations

import pytest
import torch

from helpers.engine import KV, CopySink, run_until_done
from helpers.structured import GRAMMARS, SCHEMAS, byte_level_model, check_output
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import BadSamplingParams
from pdserve.engine.structured.grammar import apply_bitmask
from pdserve.engine.structured.spec import StructuredSpec

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = [{"json_schema": s} for s in SCHEMAS] + [
    {"json_object": True},
    *({"grammar": g} for g in GRAMMARS),
    {"regex": r"[a-c]{2,5}-\d{3}"},
    {"choice": ["yes", "no", "maybe so"]},
]
# the grammars, the regex and the choice always end within max_tokens; the JSON ones may not
BOUNDED = 2 + len(GRAMMARS)


@pytest.fixture(scope="module")
def byte_model(tiny_models, tmp_path_factory):
    model_dir, _ = tiny_models("llama-gqa")
    return byte_level_model(model_dir, tmp_path_factory.mktemp("byte-level"))


@pytest.fixture(scope="module")
def llm(byte_model):
    return LLM(byte_model, kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)


def _check(spec, out, must_finish: bool) -> None:
    if must_finish:
        assert out.finish_reason == "stop", out
    if out.finish_reason == "stop":
        check_output(spec, out.text)


@pytest.mark.parametrize("i", range(len(SPECS)))
def test_random_sampling_follows_the_grammar(llm, i):
    spec = SPECS[i]
    params = SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=160, structured=spec)
    outs = llm.generate(["hello", "{"], params, use_tqdm=False)
    for req in outs:
        for out in req.outputs:
            _check(spec, out, must_finish=i >= len(SPECS) - BOUNDED)
    finished = [o for r in outs for o in r.outputs if o.finish_reason == "stop"]
    assert finished, "no output completed its grammar"
    assert_no_leaks(llm.engine)


def test_greedy_batch_mixes_grammars_and_free_rows(llm):
    params = [SamplingParams(temperature=0, max_tokens=160, structured=s) for s in SPECS]
    params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = llm.generate(["abc"] * len(params), params, use_tqdm=False)
    alone = llm.generate("abc", params[4], use_tqdm=False)[0].outputs[0]
    assert outs[4].outputs[0].token_ids == alone.token_ids  # batch-invariant
    for spec, req in zip(SPECS, outs):
        _check(spec, req.outputs[0], must_finish=False)
    assert len(outs[-1].outputs[0].token_ids) == 8


def test_logprobs_are_the_masked_distributions(llm):
    """One choice: every token is forced, so its logprob under the mask is 0."""
    params = SamplingParams(
        temperature=1.0, max_tokens=20, logprobs=True, top_logprobs=2, structured={"choice": ["{}"]}
    )
    out = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert out.text == "{}" and out.finish_reason == "stop"
    assert all(abs(lp) < 1e-5 for lp in out.logprobs)
    assert all(len(lp.top) == 2 and min(lp.top.values()) == float("-inf") for lp in out.logprobs)


def test_preempted_sequences_keep_their_grammar(byte_model, llm):
    per_block = llm.engine.kv_cache[:, :, 0].numel() * llm.engine.kv_cache.element_size()
    small = LLM(
        byte_model,
        kv_cache_memory=16 * per_block,
        block_size=16,
        max_num_batched_tokens=64,
        max_model_len=192,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=120, structured=SPECS[i % len(SPECS)])
        for i in range(8)
    ]
    prompts = [f"prompt number {i}: " * 3 for i in range(8)]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    expected = llm.generate(prompts, params, use_tqdm=False)
    for i, (got, want) in enumerate(zip(outs, expected)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        _check(SPECS[i % len(SPECS)], got.outputs[0], must_finish=False)
    assert_no_leaks(small.engine)


@pytest.mark.parametrize("n", [1, 2])
def test_prefill_decode_hand_off_keeps_the_grammar(byte_model, llm, n):
    """The prefill engine samples the first token(s) with the mask; the decode engine's commit
    advances its own matchers by them; the outputs equal one engine's."""
    a = LLM(byte_model, kv_cache_memory=KV, block_size=16).engine
    b = LLM(byte_model, kv_cache_memory=KV, block_size=16).engine
    for i, spec in enumerate(SPECS):
        params = SamplingParams(temperature=0.8, seed=7 + i, n=n, max_tokens=100, structured=spec)
        prompt = a.tokenizer.encode(f"request {i}")
        rid = f"r{n}-{i}"
        res = b.reserve(rid, prompt, params)
        sink = CopySink(b, res, a.model_config.num_layers)
        a.add_request(rid, prompt, params, prefill_only=True, kv_sink=sink)
        firsts = [o for o in run_until_done(a) if o.finished][-1]
        b.commit(rid, [c.token_ids[0] for c in firsts.outputs])
        final = [o for o in run_until_done(b) if o.finished][-1]
        whole = llm.generate(prompt, params, use_tqdm=False)[0]
        assert [c.token_ids for c in final.outputs] == [c.token_ids for c in whole.outputs]
        for out in final.outputs:
            _check(spec, out, must_finish=i >= len(SPECS) - BOUNDED)
    assert_no_leaks(a)
    assert_no_leaks(b)


def test_a_first_token_the_grammar_rejects_ends_the_sequence(llm):
    b = llm.engine
    prompt = b.tokenizer.encode("abc")
    b.reserve("bad-first", prompt, SamplingParams(max_tokens=10, structured={"choice": ["yes"]}))
    b.commit("bad-first", b.tokenizer.encode("n")[:1])
    out = [o for o in run_until_done(b) if o.finished][-1].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "grammar rejected the token"


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"regex": "("}, "structured.regex"),
        ({"json_schema": {"type": "no-such-type"}}, "structured.json_schema"),
        ({"json_schema": "{not json"}, "structured.json_schema"),
        ({"json_schema": [1]}, "structured.json_schema"),
        ({"choice": []}, "structured.choice"),
        ({"choice": ["a", ""]}, "structured.choice"),
        ({"choice": "ab"}, "structured.choice"),
        ({"regex": ""}, "structured.regex"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({}, "exactly one of"),
        ({"grammar": "root ::= undefined_rule"}, "structured.grammar"),
        ({"grammar": "start: ("}, "structured.grammar"),
        ({"grammar": "  "}, "structured.grammar"),
        ({"lark": "start: x"}, "unknown fields"),
        ({"regex": "a", "reasoning": "sometimes"}, "structured.reasoning"),
        # this model has no <think> and </think> tokens
        ({"regex": "a", "reasoning": "open"}, "structured.reasoning needs a reasoning model"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(llm, spec, field):
    with pytest.raises(BadSamplingParams, match=field):
        llm.engine.add_request("bad", "abc", SamplingParams(structured=spec))
    assert not llm.engine.has_unfinished_requests()
    ok = llm.generate("abc", SamplingParams(max_tokens=20, structured=SPECS[-1]), use_tqdm=False)
    assert ok[0].outputs[0].text in SPECS[-1]["choice"]


def test_specs_compile_once_per_canonical_key(llm):
    cache = llm.engine.grammars
    a = StructuredSpec(json_schema={"type": "object", "properties": {"q": {"type": "integer"}}})
    b = StructuredSpec(json_schema='{"properties": {"q": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key
    misses = cache.misses
    assert cache.compile(a) is cache.compile(b)
    assert cache.misses == misses + 1


@pytest.mark.parametrize("rows", [[0, 1, 2], [1], [0, 2]])
def test_apply_bitmask_masks_exactly_the_zero_bits(rows):
    g = torch.Generator().manual_seed(len(rows))
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(3, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), (vocab + 31) // 32), generator=g)
    bitmask = bitmask.to(torch.int32)
    ours = logits.clone()
    apply_bitmask(ours, bitmask, rows)
    want = logits.clone()
    for j, r in enumerate(rows):
        for t in range(vocab):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    assert torch.equal(ours, want)


@pytest.fixture(scope="module")
def thinking_llm(tiny_models, tmp_path_factory):
    """A reasoning model: <think> is token 2, </think> token 3, the stop token 1."""
    model_dir, _ = tiny_models("llama-gqa")
    tags = ("<think>", "</think>")
    path = byte_level_model(model_dir, tmp_path_factory.mktemp("byte-think"), None, tags)
    return LLM(path, kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)


def _ids(llm, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text, add_special_tokens=False)


def test_a_grammar_holds_for_the_answer_after_the_reasoning(thinking_llm):
    cache = thinking_llm.engine.grammars
    spec = StructuredSpec(regex="[a-c]{3}", reasoning="open")
    assert spec.to_wire() == {"regex": "[a-c]{3}", "reasoning": "open"}

    def takes(spec_: StructuredSpec, text: str, then: list[int] = ()) -> object:
        m = cache.matcher(spec_).matcher
        tokens = [*_ids(thinking_llm, text), *then]
        return m if all(m.consume_token(t) for t in tokens) else None

    g = cache.matcher(spec)
    words = torch.zeros((1, 8), dtype=torch.int32)
    for token in _ids(thinking_llm, "x <think> {"):  # anything but </think> and the stop token
        g.fill(words, 0)
        assert not words[0, 0] >> 1 & 1, "the stop token is allowed inside the reasoning"
        assert g.matcher.consume_token(token)
    done = takes(spec, "x {", [3, *_ids(thinking_llm, "\n\nabc")])
    assert done is not None and done.is_accepting()
    assert takes(spec, "x", [3, *_ids(thinking_llm, "abx")]) is None  # the answer is the regex's
    # optional: the answer at once, or after a block the output opens itself; no lone </think>
    optional = StructuredSpec(regex="[a-c]{3}", reasoning="optional")
    for text in ("abc", "<think>hm</think>\nabc"):
        assert takes(optional, text).is_accepting(), text
    assert takes(optional, "", [3]) is None
    # none: the grammar from the first token
    assert takes(StructuredSpec(regex="[a-c]{3}", reasoning="none"), "<think>") is None


def test_random_reasoning_then_the_answer(thinking_llm):
    spec = {"json_schema": SCHEMAS[0], "reasoning": "open"}
    # </think> about 20 times likelier than another token: the reasoning ends within the budget
    params = SamplingParams(
        temperature=1.0, seed=3, n=3, max_tokens=200, structured=spec, logit_bias={3: 3.0}
    )
    outs = thinking_llm.generate(["hello"], params, use_tqdm=False)[0].outputs
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished, outs
    for out in finished:
        reasoning, _, answer = out.text.partition("</think>")
        assert "</think>" not in answer
        check_output({"json_schema": SCHEMAS[0]}, answer.strip())
