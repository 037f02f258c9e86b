"""The router's tokenizer queue is bounded (router/text.py PromptEncoder): tokenizing comes before
admission, so without a bound a flood of long texts would queue seconds of work ahead of every
other client's prompt. While texts of more than MAX_QUEUED_PROMPTS of the largest prompts are
queued, a new one is refused RESOURCE_EXHAUSTED at once (the HTTP front's 429); one text alone is
always taken, and the count goes back to zero when the work is done. The tokenizer is held on an
event, so nothing here depends on timing."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from helpers.threads import wait_until
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.text import MAX_QUEUED_PROMPTS, BadRequest, PromptEncoder


class Held:
    """The encoder's own encode, each call waiting for `release` first (set it to let every call
    go)."""

    def __init__(self, encode):
        self._encode = encode
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        self.release.wait(30)
        return self._encode(*args)


@pytest.fixture
def held(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    enc = PromptEncoder(load_tokenizer(model_dir), 256)
    enc._executor.submit(lambda: None).result(30)  # its warm-up done
    hold = enc._encode = Held(enc._encode)
    yield enc, hold
    hold.release.set()
    enc.close()


def text(chars: int) -> str:
    return ("t1 " * chars)[:chars]


def test_past_the_queue_bound_a_text_is_refused_at_once_and_the_rest_is_served(held):
    enc, tok = held
    big = enc.max_prompt_bytes  # the largest text a prompt may be
    assert enc.max_queued_chars == MAX_QUEUED_PROMPTS * big
    with futures.ThreadPoolExecutor(MAX_QUEUED_PROMPTS) as pool:
        # the queue's bound, exactly: every one of them is taken (one on the thread, held)
        queued = [pool.submit(enc.tokenize_text, text(big)) for _ in range(MAX_QUEUED_PROMPTS)]
        # every text counted, and the first one on the tokenizer's thread (held there)
        wait_until(
            lambda: enc.queued_chars == enc.max_queued_chars and tok.calls == 1,
            10,
            "the texts queued",
        )
        with pytest.raises(BadRequest) as refused:
            enc.encode(pdserve_pb2.GenerateRequest(text="t1"))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in refused.value.message
        assert enc.queued_chars == enc.max_queued_chars  # the refusal queued nothing
        assert tok.calls == 1  # the first held text's: nothing else ran
        tok.release.set()
        assert all(q.result(30) for q in queued)
    assert enc.queued_chars == 0
    assert enc.encode(pdserve_pb2.GenerateRequest(text="t1"))  # served again once it drained


def test_one_text_alone_is_taken_whatever_its_size(held):
    enc, tok = held
    tok.release.set()
    assert enc.queued_chars == 0
    assert enc.tokenize_text(text(enc.max_prompt_bytes))
    assert enc.queued_chars == 0
