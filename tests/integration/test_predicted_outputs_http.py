"""OpenAI's Predicted Outputs through the HTTP front and both pools: a chat's `prediction` is
tokenized by the router, checked as the decode worker's speculative guesses, and reported in
usage.completion_tokens_details (accepted and rejected prediction tokens), whole and streamed;
the answer is the same with a right, a wrong or no prediction; a bad prediction is a 400."""

from __future__ import annotations

import json
import pathlib

import pytest

from helpers.http import CHAT, MODEL, Workers, assert_error, chat_model, post, sse_events
from pdserve.engine.spec.gate import SpecGate

NEW = 12


def _whole_word_specials(model_dir: str) -> str:
    """The test tokenizer's special tokens t0 and t1 matched as whole words only, so that an
    answer's text tokenizes back to its ids (else "t12" reads as t1 and an unknown "2")."""
    path = pathlib.Path(model_dir)
    tok = json.loads((path / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        added["single_word"] = True
    (path / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    for added in cfg.get("added_tokens_decoder", {}).values():
        added["single_word"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model_dir


@pytest.fixture(scope="module", name="workers")
def fixture_workers(tiny_models, tmp_path_factory, one_thread):
    """The HTTP tests' cluster with a decode worker that speculates by prompt lookup, its gate
    offering every guess it can (a tiny model's steps are too cheap to price)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            SpecGate, "choose", lambda self, base, offers, uses_draft: [o.limit for o in offers]
        )
        spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}
        model_dir = _whole_word_specials(chat_model(tiny_models, tmp_path_factory))
        w = Workers(model_dir, decode_engine=spec)
        yield w
        w.stop()


def _chat(address_of, **fields) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "t5 t9 t12"}],
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }
    status, _, raw = post(address_of, CHAT, body)
    assert status == 200, raw
    return json.loads(raw)


@pytest.mark.parametrize("front", ["router", "colocated"])
def test_a_prediction_changes_the_speed_not_the_answer_and_usage_says_how_it_went(
    request, front, idle
):
    router = request.getfixturevalue(front)
    plain = _chat(router)
    text = plain["choices"][0]["message"]["content"]
    assert len(text.split()) == NEW and "completion_tokens_details" not in plain["usage"]
    right = _chat(router, prediction={"type": "content", "content": text})
    assert right["choices"][0]["message"]["content"] == text
    details = right["usage"]["completion_tokens_details"]
    # every token after the first (the prefill's) is a kept guess or the sample after a step's
    # last guess: with 4 guesses a step, at least 3 of every 5
    assert details["rejected_prediction_tokens"] == 0
    assert details["accepted_prediction_tokens"] >= (NEW - 1) * 3 // 5, details
    # right about the first token, then wrong: guesses refused, the same answer
    words = text.split()
    wrong = " ".join(words[:1] + ["t1"] * (NEW - 1))
    parts = [{"type": "text", "text": wrong[:3]}, {"type": "text", "text": wrong[3:]}]
    missed = _chat(router, prediction={"type": "content", "content": parts})
    assert missed["choices"][0]["message"]["content"] == text
    assert missed["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] > 0


def test_the_stream_s_usage_carries_the_prediction_s_counts(router, idle):
    text = _chat(router)["choices"][0]["message"]["content"]
    prediction = {"type": "content", "content": text}
    whole = _chat(router, prediction=prediction)
    status, _, raw = post(
        router,
        CHAT,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "t5 t9 t12"}],
            "max_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
            "prediction": prediction,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200, raw
    events = sse_events(raw)
    streamed = "".join(
        c["delta"].get("content") or "" for e in events for c in e["choices"] if "delta" in c
    )
    assert streamed == text
    assert events[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize(
    "prediction",
    [
        {"type": "image", "content": "t5"},
        {"type": "content"},
        {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]},
        "t5 t6",
    ],
    ids=["type", "no-content", "part-type", "not-an-object"],
)
def test_a_bad_prediction_is_a_400_naming_it(router, idle, prediction):
    status, _, raw = post(
        router,
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "prediction": prediction},
    )
    assert assert_error(status, raw, 400)["param"].startswith("prediction"), raw
    assert _chat(router)["choices"][0]["message"]["content"]  # and it keeps serving


def test_a_prediction_longer_than_a_prompt_may_be_is_refused_unread(router, idle):
    huge = {"type": "content", "content": "t5 " * 20_000}
    status, _, raw = post(
        router,
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "prediction": huge},
    )
    error = assert_error(status, raw, 400, "prediction")
    assert error["code"] == "context_length_exceeded"


def test_the_openai_client_sends_a_prediction_and_reads_its_counts(router, idle):
    """The `openai` package's own `prediction` argument and its usage model."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(
        base_url=f"http://{router.http_address}/v1", api_key="unused", max_retries=0, timeout=30
    )
    messages = [{"role": "user", "content": "t5 t9 t12"}]
    args = dict(model=MODEL, messages=messages, max_tokens=NEW, temperature=0)
    extra = {"ignore_eos": True}
    text = c.chat.completions.create(**args, extra_body=extra).choices[0].message.content
    got = c.chat.completions.create(
        **args, extra_body=extra, prediction={"type": "content", "content": text}
    )
    assert got.choices[0].message.content == text
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= (NEW - 1) * 3 // 5
    assert details.rejected_prediction_tokens == 0
