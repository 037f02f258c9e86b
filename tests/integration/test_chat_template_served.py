"""vLLM's --chat-template (`chat_template` in the deployment YAML, RouterConfig.chat_template):
the router renders chats with the given Jinja template instead of the tokenizer's, for
/tokenize and for a chat completion alike (the tiny model's word-level tokenizer: "t9" is token
9). How the YAML reads it (a file or the template itself, parsed at load) is
tests/unit/test_deploy_config.py's."""

from __future__ import annotations

import json

import pytest

from helpers.http import MODEL, Workers, post

TEMPLATE = "t9 {% for m in messages %}{{ m.content }} {% endfor %}t8"


@pytest.fixture(scope="module")
def router(tiny_models, one_thread):
    src, _ = tiny_models("llama-gqa")
    w = Workers(str(src), max_model_len=256)
    r = w.router(chat_template=TEMPLATE)
    yield r
    r.stop()
    w.stop()


def test_chats_are_rendered_with_the_given_template(router):
    messages = [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t6"}]
    status, _, raw = post(router, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, raw[:300]
    assert json.loads(raw)["tokens"] == [9, 5, 6, 8]
    chat = {"model": MODEL, "messages": messages[:1], "max_tokens": 1, "return_token_ids": True}
    status, _, raw = post(router, "/v1/chat/completions", chat)
    assert status == 200, raw[:300]
    assert json.loads(raw)["prompt_token_ids"] == [9, 5, 8]
