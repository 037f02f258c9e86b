"""logit_bias, allowed_token_ids, bad_words and cache_salt on the wire: an OpenAI body becomes
pdserve.v1.SamplingParams (router/openai/protocol.py), every RPC edge refuses what is out of
bounds before any work (protos/limits.py: a stranger may call a worker directly), a worker turns
the message into the engine's SamplingParams (protos/convert.py), and a cache salt is a prefix
affinity namespace of its own (router/affinity.py)."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from pdserve.engine import SamplingParams
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_CHARS,
    check_sampling,
)
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.protocol import ChatCompletionRequest, sampling_params

VOCAB = 1000


def _body(**fields) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": messages, **fields}))


def test_an_openai_body_reaches_the_engine_s_params():
    body = _body(
        logit_bias={"17": -100, "3": 2.5},
        allowed_token_ids=[3, 17, 99],
        bad_words=["Paris", "the capital"],
        max_tokens=4,
    )
    msg = sampling_params(body, body.max_new_tokens())
    assert dict(msg.logit_bias) == {17: -100.0, 3: 2.5}
    assert list(msg.allowed_token_ids) == [3, 17, 99]
    assert list(msg.bad_words) == ["Paris", "the capital"]
    assert check_sampling(msg, 4096, VOCAB) is None
    params = SamplingParams(**sampling_kwargs(msg))
    assert params.logit_bias == ((3, 2.5), (17, -100.0))
    assert params.allowed_token_ids == (3, 17, 99)
    assert params.bad_words == ("Paris", "the capital")


def test_unset_fields_stay_off_the_wire_and_off_the_engine():
    msg = sampling_params(_body(), None)
    assert not msg.logit_bias and not msg.allowed_token_ids
    assert "logit_bias" not in sampling_kwargs(msg) and "allowed_token_ids" not in sampling_kwargs(
        msg
    )


def _refusal(**fields):
    msg = pdserve_pb2.SamplingParams()
    for token, bias in fields.pop("logit_bias", {}).items():
        msg.logit_bias[token] = bias
    msg.allowed_token_ids.extend(fields.pop("allowed_token_ids", []))
    msg.bad_words.extend(fields.pop("bad_words", []))
    return check_sampling(msg, 4096, VOCAB)


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias[5]=100.5"),
        ({"logit_bias": {5: -math.inf}}, "logit_bias[5]=-inf"),
        ({"logit_bias": {5: math.nan}}, "logit_bias[5]=nan"),
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias token ids must be below the vocabulary"),
        ({"allowed_token_ids": [1, VOCAB + 5]}, "allowed_token_ids token ids must be below"),
        (
            {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
            f"at most {MAX_LOGIT_BIAS_ENTRIES}",
        ),
        ({"allowed_token_ids": [1] * (MAX_ALLOWED_TOKEN_IDS + 1)}, "ids; at most"),
        ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, f"at most {MAX_BAD_WORDS} are allowed"),
        ({"bad_words": ["ok", ""]}, f"1 to {MAX_STOP_CHARS} characters"),
        ({"bad_words": ["x" * (MAX_STOP_CHARS + 1)]}, f"1 to {MAX_STOP_CHARS} characters"),
    ],
)
def test_every_rpc_edge_refuses_what_is_out_of_bounds(fields, says):
    refusal = _refusal(**fields)
    assert refusal is not None and refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert says in refusal.message


def test_a_cache_salt_is_a_namespace_of_its_own_for_prefix_affinity():
    """router/affinity.py: a salted request's prefix hashes differ from the unsalted ones, from
    another salt's and from an adapter's, and its namespace is never empty (so the router does
    not read the block index's unsalted chains for it)."""
    from pdserve.router.affinity import cache_namespace, prefix_hashes

    prompt = list(range(300))
    spaces = [
        "",
        "ad",
        cache_namespace("", "a"),
        cache_namespace("", "b"),
        cache_namespace("ad", "a"),
    ]
    assert cache_namespace("ad", "") == "ad" and all(spaces[1:])
    firsts = {prefix_hashes(prompt, adapter=ns)[0] for ns in spaces}
    assert len(firsts) == len(spaces)
    msg = sampling_params(_body(cache_salt="tenant-7"), None)
    assert SamplingParams(**sampling_kwargs(msg)).cache_salt == "tenant-7"


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"max_repetition_pattern_size": 257}, "at most 256"),
        ({"max_repetition_pattern_size": 2, "min_repetition_pattern_size": 3}, "is more than"),
        ({"max_repetition_pattern_size": 256, "repetition_min_count": 9}, "at most 2048 tokens"),
    ],
)
def test_repetition_detection_past_its_bounds_is_refused_at_the_edge(fields, words):
    """(a stranger may call a worker directly: the engine's bounds, checked before any work)"""
    refusal = check_sampling(pdserve_pb2.SamplingParams(**fields), 512, VOCAB)
    assert refusal is not None and refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refusal.message


def test_repetition_detection_within_its_bounds_passes_the_edge():
    fields = {"max_repetition_pattern_size": 256, "repetition_min_count": 8}
    assert check_sampling(pdserve_pb2.SamplingParams(**fields), 512, VOCAB) is None
