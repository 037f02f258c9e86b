"""SamplingParams.output_kind and detokenize: a request's outputs carry everything so far
(CUMULATIVE), only what is new (DELTA) or come once at the end (FINAL_ONLY), with the same tokens,
text and logprobs in the end; a running output's text holds back what a stop string could still
take back; detokenize=False makes no text."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy
from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, RequestOutputKind, SamplingParams
from pdserve.engine.errors import BadSamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind


@pytest.fixture(scope="module")
def llm(refs):
    model_dir, *_ = refs("llama-gqa")
    return LLM(model_dir, kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)


def stream(llm, prompts, params) -> dict[str, list]:
    """Every output of each prompt's request, in order, run together in one engine."""
    engine = llm.engine
    outs = {f"k{i}": [] for i in range(len(prompts))}
    for rid, prompt in zip(outs, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    assert_no_leaks(engine)
    return outs


def joined(outputs, index: int = 0) -> tuple[list[int], str, list]:
    """A DELTA stream's pieces of sequence `index`, put together."""
    tokens, text, logprobs = [], "", []
    for out in outputs:
        for comp in out.outputs:
            if comp.index == index:
                tokens += comp.token_ids
                text += comp.text
                logprobs += comp.logprobs or []
    return tokens, text, logprobs


def test_delta_and_final_only_carry_what_cumulative_does(llm):
    prompts = random_prompts([9, 30, 17], seed=71)
    want = dict(max_tokens=14, logprobs=True, top_logprobs=2, n=2, temperature=0.8, seed=5)
    cumulative = stream(llm, prompts, SamplingParams(**want))
    delta = stream(llm, prompts, SamplingParams(**want, output_kind=DELTA))
    final = stream(llm, prompts, SamplingParams(**want, output_kind=FINAL_ONLY))
    for rid, outs in cumulative.items():
        assert len(final[rid]) == 1 and final[rid][0].finished
        assert [o.finished for o in delta[rid]] == [o.finished for o in outs]
        last = {c.index: c for c in outs[-1].outputs}
        for index in (0, 1):
            tokens, text, logprobs = joined(delta[rid], index)
            assert len(last[index].token_ids) == 14
            assert tokens == last[index].token_ids
            assert text == last[index].text
            assert logprobs == last[index].logprobs
            ending = {c.index: c for c in final[rid][0].outputs}[index]
            assert (ending.token_ids, ending.text) == (last[index].token_ids, last[index].text)
        # a delta never repeats a token: the pieces add up to each step's count
        sizes = [sum(len(c.token_ids) for c in o.outputs) for o in delta[rid]]
        assert sum(sizes) == 28 and all(sizes)


def test_prompt_logprobs_go_out_once_under_delta(llm):
    prompt = random_prompts([40], seed=72)[0]
    cumulative = stream(llm, [prompt], greedy(6, prompt_logprobs=3))["k0"]
    delta = stream(llm, [prompt], greedy(6, prompt_logprobs=3, output_kind=DELTA))["k0"]
    carried = [o.prompt_logprobs for o in delta if o.prompt_logprobs is not None]
    assert len(carried) == 1
    assert carried[0] == cumulative[-1].prompt_logprobs
    assert len(carried[0]) == 40 and carried[0][0] is None


def test_running_text_never_shows_what_a_stop_string_takes_back(llm):
    prompt = random_prompts([12], seed=49)[0]
    full = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    a, b = full.token_ids[4], full.token_ids[5]
    stop = f"{str(a)[-1]} t{str(b)[0]}"  # the end of one word and the start of the next
    cut = full.text.index(stop)
    for kind in (CUMULATIVE, DELTA):
        outs = stream(llm, [prompt], greedy(20, stop=stop, output_kind=kind))["k0"]
        texts = [o.outputs[0].text for o in outs]
        shown = "".join(texts) if kind == DELTA else texts[-1]
        assert shown == full.text[:cut] and outs[-1].outputs[0].finish_reason == "stop"
        if kind == CUMULATIVE:  # each text is a prefix of every later one
            assert all(later.startswith(t) for t, later in zip(texts, texts[1:]))
    # with the stop string kept in the text, nothing needs holding back
    kept = stream(llm, [prompt], greedy(20, stop=stop, include_stop_str_in_output=True))["k0"]
    assert kept[-2].outputs[0].text == full.text[: len(kept[-2].outputs[0].text)]
    assert kept[-1].outputs[0].text == full.text[: cut + len(stop)]


def test_detokenize_false_makes_no_text(llm):
    prompt = random_prompts([15], seed=73)[0]
    with_text = stream(llm, [prompt], greedy(10))["k0"][-1].outputs[0]
    outs = stream(llm, [prompt], greedy(10, detokenize=False, output_kind=DELTA))["k0"]
    tokens, text, _ = joined(outs)
    assert tokens == with_text.token_ids and with_text.text
    assert text == ""
    with pytest.raises(BadSamplingParams, match="need detokenize=True"):
        greedy(10, stop=["x"], detokenize=False)
    for bad in ("delta", 3, True, None):
        with pytest.raises(BadSamplingParams, match="output_kind must be one of"):
            greedy(10, output_kind=bad)
    with pytest.raises(BadSamplingParams, match="detokenize must be a bool"):
        greedy(10, detokenize=1)


def test_llm_generate_asks_for_the_final_output_only(llm):
    prompt = random_prompts([11], seed=74)[0]
    params = greedy(8, output_kind=DELTA).with_bad_words_token_ids([[3]])
    engine, seen = llm.engine, []
    add = engine.add_request

    def spy(rid, prompt, params, **kw):
        seen.append(params)
        return add(rid, prompt, params, **kw)

    engine.add_request = spy
    try:
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    finally:
        del engine.add_request
    assert seen[0].output_kind == FINAL_ONLY
    assert seen[0].bad_words_token_ids == ((3,),)  # the ids set on the params survive
    assert len(out.token_ids) == 8 and 3 not in out.token_ids
