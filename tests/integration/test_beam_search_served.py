"""use_beam_search served through a router with its HTTP front, a prefill worker and a decode
worker in this process (router/openai/beam.py: one Generate call per beam per step), on a tiny
random Llama of four tokens (EOS is "t1"; a chat template of those tokens), checked against
references that share no code with it:

- with the end-of-sequence token: nine beams of three steps hold every sequence, so the n choices
  are the best n of every sequence by vLLM's score of HF transformers' own logprobs (a
  brute-force enumeration), completions (a batch) and a streamed chat;
- with ignore_eos: HF's generate(num_beams=n, do_sample=False) with no end-of-sequence token,
  through raw HTTP and the openai SDK's extra_body;
- a field a beam search cannot apply is a 400 naming it; the pools are idle after each test.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers.beams import hf_beam_search
from helpers.http import CHAT, MODEL, C, Workers, openai_client, post, sse_events
from helpers.models import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 1
SPECIAL = (0, 1)  # the tokenizer's bos "t0" and eos "t1": a text skips them
TOL = 2e-3  # HF alone against the prefill and decode workers: the same numbers up to rounding
TEMPLATE = (
    "{% for m in messages %}t3 {{ m.content }} {% endfor %}{% if add_generation_prompt %}t2"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam-four")
    hf = make_tiny_model(path, "llama-gqa", vocab_size=4, initializer_range=0.3)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    yield str(path), hf
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", name="workers")
def fixture_workers(four, one_thread):
    w = Workers(four[0], max_model_len=32)
    yield w
    w.stop()


def hf_logprobs(hf, ctx) -> list[float]:
    with torch.inference_mode():
        logits = hf(torch.tensor([list(ctx)])).logits[0, -1].double()
    return torch.log_softmax(logits, -1).tolist()


def brute_force(hf, prompt, steps: int, width: int, lp: float):
    """The best `width` of every sequence of at most `steps` new tokens, ended by EOS, by vLLM's
    score (cum / (prompt + new tokens, a last EOS not counted) ** lp): [(new tokens, cum)]."""
    found = []

    def walk(gen, cum):
        if len(gen) == steps or (gen and gen[-1] == EOS):
            found.append((gen, cum))
            return
        lps = hf_logprobs(hf, prompt + gen)
        for t in range(4):
            walk(gen + [t], cum + lps[t])

    walk([], 0.0)

    def score(s):
        gen, cum = s
        return cum / (len(prompt) + len(gen) - (gen[-1] == EOS)) ** lp

    return sorted(found, key=score, reverse=True)[:width]


def hf_beams(hf, prompt, width: int, new: int) -> list[list[int]]:
    return [seq[len(prompt) :] for seq in hf_beam_search(hf, prompt, width, new).sequences.tolist()]


def text_of(ids) -> str:
    return " ".join(f"t{t}" for t in ids if t not in SPECIAL)


def ok(status, _headers, raw) -> dict:
    assert status == 200, raw
    return json.loads(raw)


@pytest.mark.parametrize("lp", [1.0, -1.0])
def test_completions_are_the_best_of_every_sequence(router, four, idle, lp):
    _, hf = four
    prompts = [[0, 2, 3, 2], [3, 3]]
    body = {"model": MODEL, "prompt": prompts, "use_beam_search": True, "n": 9, "max_tokens": 3}
    doc = ok(*post(router, C, {**body, "length_penalty": lp, "return_token_ids": True}))
    choices = doc["choices"]
    assert [c["index"] for c in choices] == list(range(18))
    used = 0
    for p, prompt in enumerate(prompts):
        want = brute_force(hf, prompt, 3, 9, lp)
        mine = choices[p * 9 : (p + 1) * 9]
        kept = [g[:-1] if g[-1] == EOS else g for g, _ in want]  # vLLM's: EOS not in the output
        assert [c["token_ids"] for c in mine] == kept
        assert [c["text"] for c in mine] == [text_of(g) for g in kept]
        assert [c["prompt_token_ids"] for c in mine] == [prompt] * 9
        assert [(c["finish_reason"], c["stop_reason"]) for c in mine] == [
            ("stop", EOS) if g[-1] == EOS else ("length", None) for g, _ in want
        ]
        used += sum(len(g) for g in kept)
    assert {c["finish_reason"] for c in choices} == {"stop", "length"}
    assert doc["usage"]["prompt_tokens"] == 6 and doc["usage"]["completion_tokens"] == used


def test_a_streamed_chat_is_the_best_of_every_sequence(router, four, idle):
    _, hf = four
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "t0 t2"}],
        "use_beam_search": True,
        "n": 9,
        "max_tokens": 3,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    status, _, raw = post(router, CHAT, body)
    assert status == 200, raw
    events = sse_events(raw)
    prompt = events[0]["prompt_token_ids"]
    assert prompt == [3, 0, 2, 2]  # the template's rendering
    ids = {i: [] for i in range(9)}
    lps = {i: [] for i in range(9)}
    text = {i: "" for i in range(9)}
    reasons = {}
    for e in events[:-1]:
        for c in e["choices"]:
            ids[c["index"]] += c.get("token_ids") or []
            text[c["index"]] += c["delta"].get("content") or ""
            lps[c["index"]] += [x["logprob"] for x in (c["logprobs"] or {}).get("content", [])]
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    want = brute_force(hf, prompt, 3, 9, 1.0)
    kept = [g[:-1] if g[-1] == EOS else g for g, _ in want]
    assert [ids[i] for i in range(9)] == kept
    assert [text[i] for i in range(9)] == [text_of(g) for g in kept]
    assert [reasons[i] for i in range(9)] == ["stop" if g[-1] == EOS else "length" for g, _ in want]
    for i, g in enumerate(kept):  # each token's logprob: HF's
        ref = [hf_logprobs(hf, prompt + g[:k])[t] for k, t in enumerate(g)]
        assert max((abs(a - b) for a, b in zip(lps[i], ref)), default=0) < TOL
    assert events[-1]["usage"]["completion_tokens"] == sum(len(g) for g in kept)


def test_ignore_eos_is_hf_beam_search(router, four, idle):
    _, hf = four
    body = {"model": MODEL, "prompt": "t2 t3 t0", "use_beam_search": True, "n": 3}
    body.update(max_tokens=4, ignore_eos=True, return_token_ids=True)
    doc = ok(*post(router, C, body))
    assert doc["choices"][0]["prompt_token_ids"] == [2, 3, 0]
    assert [c["token_ids"] for c in doc["choices"]] == hf_beams(hf, [2, 3, 0], 3, 4)
    assert all(c["finish_reason"] == "length" for c in doc["choices"])


def test_the_openai_sdk_asks_for_beam_search_in_extra_body(router, four, idle):
    _, hf = four
    client = openai_client(router)
    out = client.completions.create(
        model=MODEL,
        prompt=[3, 2, 2],
        n=2,
        max_tokens=4,
        extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5},
    )
    want = hf_beams(hf, [3, 2, 2], 2, 4)
    assert [c.text for c in out.choices] == [text_of(g) for g in want]
    assert out.usage.completion_tokens == 8


@pytest.mark.parametrize("field, value", [("top_p", 0.5), ("n", 11), ("stop", ["t2"])])
def test_a_field_beam_search_cannot_apply_is_a_400_naming_it(router, idle, field, value):
    body = {"model": MODEL, "prompt": "t2", "use_beam_search": True, "n": 2, "max_tokens": 2}
    status, _, raw = post(router, C, {**body, field: value})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == field, err
