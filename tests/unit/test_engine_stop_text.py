"""The text and finish reason of a sequence that a stop ended (engine/outputs.py emit_tokens), as
vLLM V1 gives them: a stop string completed by the last token max_tokens allows cuts the text and
is the reason ("stop", the string), whole and streamed; the text of the token that ended the
sequence as a stop token (an end-of-sequence token, or one of stop_token_ids) is left out unless
include_stop_str_in_output, while the token stays in the token ids and logprobs."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy
from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 1  # the tiny tokenizer's </s> ("t1" when special tokens are kept)


@pytest.fixture(scope="module")
def llm(refs):
    model_dir, *_ = refs("llama-gqa")
    return LLM(model_dir, kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)


def words(token_ids) -> str:
    """What the tiny tokenizer decodes to, special tokens (t0 bos, t1 eos) skipped."""
    return "".join(f" t{t}" for t in token_ids if t not in (0, 1))


def one(llm, prompt, params):
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert_no_leaks(llm.engine)
    return out


def streamed(llm, prompt, params):
    """(the DELTA outputs of sequence 0, put together: token ids, text, finish reasons seen)."""
    engine = llm.engine
    engine.add_request("s", prompt, params)
    tokens, text, reasons = [], "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for comp in out.outputs:
                tokens += comp.token_ids
                text += comp.text
                if comp.finish_reason is not None:
                    reasons.append((comp.finish_reason, comp.stop_reason))
    assert_no_leaks(engine)
    return tokens, text, reasons


def test_a_stop_string_completed_by_the_last_allowed_token_is_the_reason(llm):
    prompt = random_prompts([12], seed=46)[0]
    full = one(llm, prompt, greedy(20))
    stop = f" t{full.token_ids[7]}"
    j = next(k for k in range(20) if stop in words(full.token_ids[: k + 1]))
    cut = full.text.index(stop)
    out = one(llm, prompt, greedy(j + 1, stop=[stop]))
    assert out.token_ids == full.token_ids[: j + 1]
    assert out.text == full.text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    params = greedy(j + 1, stop=[stop], output_kind=RequestOutputKind.DELTA)
    tokens, text, reasons = streamed(llm, prompt, params)
    assert (tokens, text) == (full.token_ids[: j + 1], full.text[:cut])
    assert reasons == [("stop", stop)]  # one end, and the string's
    kept = one(llm, prompt, greedy(j + 1, stop=[stop], include_stop_str_in_output=True))
    assert kept.text == full.text[: cut + len(stop)]
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)
    # a string completed before the last allowed token: as before
    early = one(llm, prompt, greedy(j + 3, stop=[stop]))
    assert early.token_ids == full.token_ids[: j + 1]
    assert (early.finish_reason, early.stop_reason) == ("stop", stop)


def test_a_stop_token_ids_text_is_left_out_unless_asked_for(llm):
    prompt = random_prompts([12], seed=45)[0]
    full = one(llm, prompt, greedy(20, logprobs=True))
    stop = full.token_ids[6]
    j = full.token_ids.index(stop)
    out = one(llm, prompt, greedy(20, stop_token_ids=[stop], logprobs=True))
    assert out.token_ids == full.token_ids[: j + 1]
    assert len(out.logprobs) == j + 1  # the stop token's logprob stays
    assert out.text == words(full.token_ids[:j])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = one(llm, prompt, greedy(20, stop_token_ids=[stop], include_stop_str_in_output=True))
    assert kept.token_ids == full.token_ids[: j + 1]
    assert kept.text == words(full.token_ids[: j + 1])
    params = greedy(20, stop_token_ids=[stop], output_kind=RequestOutputKind.DELTA)
    tokens, text, reasons = streamed(llm, prompt, params)
    assert (tokens, text) == (full.token_ids[: j + 1], words(full.token_ids[:j]))
    assert reasons == [("stop", stop)]


def test_an_end_of_sequence_tokens_text_is_left_out_unless_asked_for(llm):
    prompt = random_prompts([12], seed=47)[0]

    def eos_third(**kw) -> SamplingParams:
        # the end-of-sequence token is the likeliest once min_tokens allows it: the third token
        return SamplingParams(
            temperature=0, max_tokens=10, min_tokens=2, logit_bias={EOS: 100.0}, **kw
        )

    shown = one(llm, prompt, eos_third(skip_special_tokens=False))
    assert shown.token_ids[-1] == EOS and len(shown.token_ids) == 3
    assert (shown.finish_reason, shown.stop_reason) == ("stop", None)
    body = "".join(f" t{t}" for t in shown.token_ids[:2])
    assert shown.text == body  # not body + " t1": vLLM V1 leaves the stop token's text out
    kept = one(llm, prompt, eos_third(skip_special_tokens=False, include_stop_str_in_output=True))
    assert kept.token_ids == shown.token_ids
    assert kept.text.startswith(body) and kept.text != body  # the EOS token's text is there
    skipped = one(llm, prompt, eos_third())
    assert skipped.text == body
