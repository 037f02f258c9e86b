"""sampling.prompt_logprobs with n sequences: each of the n Finishes carries the prompt's
logprobs (pdserve.proto), so a request's n x positions x (k + 1) is bounded where the router
admits it and the workers check it (protos/limits.check_prompt_logprobs, through
check_context), and the call keeps of its earlier Finishes only what is read later
(router/call.py ClientCall.finishes: the index and the usage)."""

from __future__ import annotations

import grpc

from pdserve.protos.limits import MAX_LOGPROBS, MAX_PROMPT_LOGPROB_ENTRIES, Refusal, check_context
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.call import ClientCall
from pdserve.router.legs import Leg
from pdserve.router.service import fit_to_context, request_finish

Params = pdserve_pb2.SamplingParams


def test_n_copies_of_a_long_prompts_logprobs_are_refused_saying_what_to_lower():
    # the review's case: n=64, prompt_logprobs=20, a prompt of max_model_len - 1 tokens
    refusal = check_context(8191, Params(n=64, prompt_logprobs=20), 8192)
    assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{64 * 8190 * 21} prompt logprobs" in refusal.message
    assert "lower n or prompt_logprobs, or shorten the prompt" in refusal.message
    # with max_tokens too, and as the router's admission reads it (both of its paths)
    assert check_context(8000, Params(n=64, prompt_logprobs=20, max_tokens=5), 8192) is not None
    for sampling in (
        Params(n=64, prompt_logprobs=20),
        Params(n=64, prompt_logprobs=20, max_tokens=8),
    ):
        refused = fit_to_context(sampling, 8000, 8192, "prompt")
        assert isinstance(refused, Refusal) and refused.code == grpc.StatusCode.INVALID_ARGUMENT


def test_one_sequence_with_the_most_alternatives_at_the_full_context_always_fits():
    for max_model_len in (256, 8192, 32768, 131072, 1 << 20):
        k20 = Params(prompt_logprobs=MAX_LOGPROBS)
        assert check_context(max_model_len - 1, k20, max_model_len) is None
        assert (
            check_context(max_model_len - 1, Params(n=1, prompt_logprobs=20), max_model_len) is None
        )


def test_the_bound_counts_n_positions_and_alternatives():
    positions = 4096
    fits = MAX_PROMPT_LOGPROB_ENTRIES // (positions * 21)  # sequences of k=20 that fit
    assert check_context(positions + 1, Params(n=fits, prompt_logprobs=20), 8192) is None
    assert check_context(positions + 1, Params(n=fits + 1, prompt_logprobs=20), 8192) is not None
    # no prompt logprobs, or only the sampled token's (k=0): many more sequences fit
    assert check_context(8191, Params(n=64), 8192) is None
    assert check_context(8191, Params(n=64, prompt_logprobs=0), 8192) is None


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class _Transport:
    """What a ClientCall reads of its Legs before a leg streams: the options."""

    class options:
        max_model_len = 8192


def test_earlier_finishes_keep_only_their_index_and_usage():
    prompt = list(range(40, 140))
    request = pdserve_pb2.GenerateRequest(sampling=Params(n=3, prompt_logprobs=2))
    call = ClientCall(_Transport(), CharTokenizer(), request, "r", prompt, 1e18, 0)
    leg = Leg(0)
    leg.local = True  # colocated: no prefill leg to wait for
    call.legs.append(leg)
    call.sent = [[1, 2], [3], [4, 5, 6]]

    def final(index: int) -> worker_pb2.TokenEvent:
        event = worker_pb2.TokenEvent(index=index, finish_reason="length")
        event.prompt_logprobs.extend([-1.0] * (len(prompt) - 1))
        for _ in range(len(prompt) - 1):
            event.prompt_top_logprobs.add(token_ids=[7, 8], logprobs=[-0.5, -0.9])
        return event

    sent = [call._finish_of(final(i)).finish for i in (0, 2)]
    for f in sent:  # what the client gets is whole
        assert list(f.prompt_token_ids) == prompt and len(f.prompt_top_logprobs) == len(prompt) - 1
    kept = call.finishes
    assert [f.index for f in kept] == [0, 2]
    assert [f.usage.completion_tokens for f in kept] == [2, 3]
    assert all(f.usage == s.usage for f, s in zip(kept, sent))
    for f in kept:
        assert not f.prompt_token_ids and not f.prompt_logprobs and not f.prompt_top_logprobs
    last = call._finish(final(1))
    assert request_finish(last, kept).usage.completion_tokens == 6
