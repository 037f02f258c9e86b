"""vLLM's repetition detection (engine/sampling_params.py `repetition_detected`, checked by the
scheduler after each token): a sequence whose output ends with a pattern of
min..max_repetition_pattern_size tokens repeated repetition_min_count times ends with
finish_reason "repetition" and stop reason "repetition_detected", not before min_tokens, never
counting the prompt; the bounds that keep a step's check small are refused past."""

from __future__ import annotations

import pytest

from helpers.engine import KV
from helpers.structured import byte_level_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import InvalidRequest

pytestmark = pytest.mark.usefixtures("one_thread")


def _params(most=4, least=0, count=3, **kw) -> SamplingParams:
    return SamplingParams(
        max_repetition_pattern_size=most,
        min_repetition_pattern_size=least,
        repetition_min_count=count,
        **kw,
    )


@pytest.mark.parametrize(
    "tokens,num_output,kw,want",
    [
        ([1, 2, 7, 7, 7], 3, {}, True),  # one token three times
        ([1, 2, 7, 7, 7], 2, {}, False),  # the third 7 is the prompt's
        ([9, 1, 2, 1, 2, 1, 2], 6, {}, True),  # a pair three times
        ([9, 1, 2, 1, 2, 1, 2], 6, {"least": 3}, False),  # patterns of 3 or more only
        ([9, 1, 2, 1, 2, 1, 2], 6, {"count": 4}, False),  # four times asked, three there
        ([1, 2, 3, 1, 2, 3, 1, 2, 3], 9, {"most": 2}, False),  # a triple, patterns up to 2
        ([1, 2, 3, 1, 2, 3, 1, 2, 3], 9, {}, True),
        ([1, 2, 3, 1, 2, 4, 1, 2, 3], 9, {}, False),  # not the same each time
        ([5, 5, 5, 5], 4, {"most": 0}, False),  # off
        ([5, 5, 5, 5], 4, {"count": 1}, False),  # a count below 2: off
    ],
)
def test_the_check_reads_the_output_s_end(tokens, num_output, kw, want):
    p = _params(**kw)
    assert p.repetition_detected(tokens, num_output) is want


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"most": 2, "least": 3}, "min_repetition_pattern_size=3 is more than"),
        ({"most": 257}, "max_repetition_pattern_size must be at most 256"),
        ({"most": 200, "count": 11}, "at most 2048 tokens"),
        ({"count": -1}, "repetition_min_count must be >= 0"),
    ],
)
def test_bounds_are_refused_naming_the_field(kw, match):
    with pytest.raises(InvalidRequest, match=match):
        _params(**kw)


@pytest.fixture(scope="module")
def llm(tiny_models, tmp_path_factory):
    src, _ = tiny_models("llama-gqa")
    engine = LLM(byte_level_model(src, tmp_path_factory.mktemp("rep")), kv_cache_memory=KV)
    yield engine
    engine.shutdown()


def _run(llm, **kw):
    # a grammar makes the random model write "ab" over and over (and not end before 40 tokens)
    kw.setdefault("structured", {"regex": "(ab){20}"})
    params = _params(temperature=0, max_tokens=30, **kw)
    return llm.generate([[72, 105]], params, use_tqdm=False)[0].outputs[0]


def test_a_repeating_output_ends_as_repetition(llm):
    out = _run(llm)
    assert out.finish_reason == "repetition" and out.stop_reason == "repetition_detected"
    assert out.text == "ababab"


def test_not_before_min_tokens(llm):
    # at 9 tokens the output ends with "ba" three times
    out = _run(llm, min_tokens=9)
    assert out.finish_reason == "repetition" and out.text == "ababababa"


def test_without_it_the_output_runs_to_max_tokens(llm):
    out = _run(llm, most=0)
    assert out.finish_reason == "length" and len(out.token_ids) == 30
