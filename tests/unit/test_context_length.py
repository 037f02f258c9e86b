"""A prompt plus the completion it asks for, against max_model_len: the router's admission
(router/service.fit_to_context) and the check the router and both workers share
(protos/limits.check_context). Over gRPC and HTTP, with real workers:
tests/integration/test_context_length_cluster.py."""

from __future__ import annotations

import grpc

from pdserve.protos.limits import Refusal, check_context
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.call import DEFAULT_MAX_TOKENS
from pdserve.router.service import fit_to_context

LEN = 256
Params = pdserve_pb2.SamplingParams


def test_an_explicit_max_tokens_past_the_context_is_refused_with_the_numbers():
    refusal = check_context(200, Params(max_tokens=100), LEN)
    assert refusal.code == grpc.StatusCode.OUT_OF_RANGE
    assert refusal.message.startswith(
        "This model's maximum context length is 256 tokens. However, you requested 300 tokens "
        "(200 in the prompt, 100 in the completion). Please reduce the length of the prompt or "
        "the completion"
    )
    assert "max_tokens can be at most 56" in refusal.message
    assert "max_model_len=256" in refusal.message  # the HTTP front's context_length_exceeded
    chat = check_context(200, Params(max_tokens=100), LEN, "messages")
    assert "(200 in the messages, 100 in the completion)" in chat.message


def test_what_fits_exactly_passes_and_n_does_not_multiply_the_count():
    assert check_context(200, Params(max_tokens=56), LEN) is None
    assert check_context(200, Params(max_tokens=56, n=8), LEN) is None  # a context each
    assert check_context(200, Params(max_tokens=57, n=8), LEN).code == grpc.StatusCode.OUT_OF_RANGE
    # stop strings and stop tokens only end a sequence sooner: the budget still counts
    stopped = Params(max_tokens=57, stop=["t5"], stop_token_ids=[5])
    assert check_context(200, stopped, LEN) is not None


def test_unset_max_tokens_is_never_refused_but_an_explicit_min_tokens_is():
    assert check_context(255, Params(), LEN) is None  # the default ends where the context does
    assert check_context(255, None, LEN) is None
    refusal = check_context(250, Params(min_tokens=7), LEN)
    assert "6" in refusal.message and "min_tokens can be at most 6" in refusal.message
    assert check_context(250, Params(min_tokens=6), LEN) is None


def test_the_router_keeps_an_explicit_max_tokens_that_fits_and_refuses_one_that_does_not():
    fits = Params(max_tokens=56, temperature=0)
    assert fit_to_context(fits, 200, LEN, "prompt") is fits
    refusal = fit_to_context(Params(max_tokens=57), 200, LEN, "messages")
    assert isinstance(refusal, Refusal) and "(200 in the messages, 57" in refusal.message


def test_the_router_caps_the_default_only_where_the_context_ends_first():
    unset = Params(temperature=0.5)
    assert fit_to_context(unset, 10, LEN, "prompt") is unset  # 16 fits: sent unset, as before
    capped = fit_to_context(unset, LEN - 5, LEN, "prompt")
    assert capped is not unset and not unset.HasField("max_tokens")  # the client's is untouched
    assert capped.max_tokens == 5 and capped.temperature == 0.5
    assert DEFAULT_MAX_TOKENS > 5


def test_max_tokens_max_model_len_asks_for_all_the_room_the_prompt_leaves():
    # what the HTTP front sends for a chat without max_tokens (OpenAI's "until the context is full")
    fitted = fit_to_context(Params(max_tokens=LEN, min_tokens=3), 100, LEN, "messages")
    assert (fitted.max_tokens, fitted.min_tokens) == (LEN - 100, 3)
    # a min_tokens the prompt leaves no room for is refused, whatever max_tokens asked
    for sampling in (Params(max_tokens=LEN, min_tokens=10), Params(min_tokens=10)):
        refusal = fit_to_context(sampling, 250, LEN, "messages")
        assert isinstance(refusal, Refusal) and "min_tokens can be at most 6" in refusal.message


def test_max_tokens_up_to_context_reads_max_tokens_as_a_cap():
    """GenerateRequest.max_tokens_up_to_context (Anthropic's reading, /v1/messages): a max_tokens
    the prompt leaves no room for ends where the context does; one that fits is kept."""
    fitted = fit_to_context(Params(max_tokens=57), 200, LEN, "messages", up_to_context=True)
    assert not isinstance(fitted, Refusal) and fitted.max_tokens == LEN - 200
    fits = Params(max_tokens=20)
    assert fit_to_context(fits, 200, LEN, "messages", up_to_context=True) is fits
    refusal = fit_to_context(Params(max_tokens=57, min_tokens=60), 200, LEN, "messages", True)
    assert isinstance(refusal, Refusal)  # a min_tokens that does not fit is still refused
