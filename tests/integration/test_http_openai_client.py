"""The OpenAI-compatible HTTP front (router/openai/app.py) through the official `openai` client, as
people call it: greedy output equals engine.LLM's, stop strings, seeds, logprobs, n=2, errors as
the client's exceptions, concurrent requests; and a client that disconnects mid-request frees its
KV on both pools. The cluster and the helpers are in helpers/http.py.
"""

from __future__ import annotations

import json
import socket

import pytest

from helpers.http import (
    MAX_MODEL_LEN,
    MODEL,
    TIMEOUT,
    split,
)
from helpers.models import random_prompts
from helpers.threads import run_in_threads, wait_until
from helpers.worker import record_aborts
from pdserve.engine import SamplingParams

openai = pytest.importorskip("openai")


# ---- the openai client -------------------------------------------------------------------------
def client(router_, key="unused", **kwargs):
    return openai.OpenAI(
        base_url=f"http://{router_.http_address}/v1",
        api_key=key,
        max_retries=0,
        timeout=TIMEOUT,
        **kwargs,
    )


def eos_ignored(temperature: float = 0, **kwargs) -> dict:
    """create()'s arguments for MODEL with EOS ignored (a request runs to its token limit), greedy
    unless `temperature` says otherwise, and `kwargs`."""
    return dict(model=MODEL, temperature=temperature, extra_body={"ignore_eos": True}, **kwargs)


def test_openai_completions_greedy_equals_engine_llm(router, idle, llm):
    prompt = random_prompts([11], seed=21)[0]
    want = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    c = client(router)
    greedy = eos_ignored(prompt=prompt, max_tokens=10)
    got = c.completions.create(**greedy)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (11, 10)
    pieces, usage = [], None
    for chunk in c.completions.create(
        **greedy, stream=True, stream_options={"include_usage": True}
    ):
        pieces += [ch.text for ch in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == want.text and usage.completion_tokens == 10


def test_openai_chat_greedy_equals_engine_llm(router, idle, llm):
    messages = [
        {"role": "system", "content": "t10 t11"},
        {"role": "user", "content": "t5 t9 t200"},
    ]
    want = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False
    )[0]
    c = client(router)
    greedy = eos_ignored(messages=messages)
    got = c.chat.completions.create(**greedy, max_tokens=9)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 9
    stream = c.chat.completions.create(**greedy, max_completion_tokens=9, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == want.outputs[0].text
    # without max_tokens, a chat runs until the context is full (OpenAI's and vLLM's default)
    long = c.chat.completions.create(**greedy)
    assert long.choices[0].finish_reason == "length"
    assert long.usage.prompt_tokens + long.usage.completion_tokens == MAX_MODEL_LEN


def test_openai_stop_string(router, idle, llm):
    prompt = random_prompts([8], seed=5)[0]
    base = (
        llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    words = base.split()
    stop = f"{words[2]} {words[3]}"
    c = client(router)
    got = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop, "t999"]
    )
    assert got.choices[0].finish_reason == "stop" and stop not in got.choices[0].text
    assert base.startswith(got.choices[0].text) and got.choices[0].text
    messages = [{"role": "user", "content": "t5"}]
    chat_text = (
        llm.chat(
            messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    stop = " ".join(chat_text.split()[1:3])
    chat = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True, "ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content.endswith(stop) and chat_text.startswith(
        chat.choices[0].message.content
    )


def test_openai_seed_same_seed_same_text(router, idle):
    c = client(router)

    def run(seed):
        args = eos_ignored(prompt="t5 t9", max_tokens=12, temperature=1.0, seed=seed)
        return c.completions.create(**args).choices[0].text

    first = run(1234)
    assert run(1234) == first
    assert run(4321) != first  # the seed matters: 12 tokens at temperature 1 over 256 ids


def test_openai_logprobs_through_a_colocated_router(colocated, idle, llm):
    """Sampled-token logprobs: completions (logprobs=0) and chat (logprobs=true), equal to the
    engine's own."""
    prompt = random_prompts([6], seed=8)[0]
    want = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=True),
        use_tqdm=False,
    )[0].outputs[0]
    c = client(colocated)
    got = c.completions.create(**eos_ignored(prompt=prompt, max_tokens=5, logprobs=0))
    lp = got.choices[0].logprobs
    tokenizer = colocated.servicer.tokenizer
    assert got.choices[0].text == want.text
    assert lp.tokens == [tokenizer.decode([t]) for t in want.token_ids]  # each token alone
    assert lp.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = c.chat.completions.create(
        **eos_ignored(messages=[{"role": "user", "content": "t5"}], max_tokens=4, logprobs=True)
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(t.logprob <= 0 and t.top_logprobs == [] for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_openai_logprobs_disaggregated(router, idle):
    got = client(router).completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=0
    )
    assert len(got.choices[0].logprobs.token_logprobs) == 4


def test_openai_n_2(router, idle):
    """n=2 through the cluster: two choices with their own index, in the whole response and in
    the stream; each sequence seeded differently."""
    two = eos_ignored(n=2, max_tokens=6, temperature=1.0, seed=7)
    got = client(router).completions.create(prompt="t5 t9", **two)
    assert sorted(ch.index for ch in got.choices) == [0, 1]
    assert all(ch.text and ch.finish_reason == "length" for ch in got.choices)
    want_prompt = len(router.servicer.tokenizer.encode("t5 t9"))
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == want_prompt
    assert got.choices[0].text != got.choices[1].text  # seeded per sequence, not copies
    stream = client(router).chat.completions.create(
        messages=[{"role": "user", "content": "t5"}], stream=True, **two
    )
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "length", 1: "length"} and all(texts.values())


def test_a_batch_of_prompts_gives_prompt_i_choices_i_times_n_to_plus_n(router, idle, llm):
    """prompt as a list: one Generate call per prompt; choice i * n + j is prompt i's sequence j,
    greedy text equal to engine.LLM's for that prompt; usage counts each prompt once and every
    sequence's tokens; the stream carries the same texts under the same indexes."""
    prompts = random_prompts([7, 12, 9], seed=31)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    c = client(router)
    batch = eos_ignored(prompt=prompts, n=2, max_tokens=5)
    got = c.completions.create(**batch)
    assert [ch.index for ch in got.choices] == list(range(6))
    assert [ch.text for ch in got.choices] == [w for w in want for _ in range(2)]
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (7 + 12 + 9, 6 * 5)
    texts, reasons, usage = {}, {}, None
    for chunk in c.completions.create(**batch, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert [texts[i] for i in range(6)] == [w for w in want for _ in range(2)]
    assert reasons == dict.fromkeys(range(6), "length")
    assert (usage.prompt_tokens, usage.completion_tokens) == (28, 30)


def test_a_batch_with_one_bad_prompt_fails_whole_and_aborts_the_others(router, idle, monkeypatch):
    """A prompt the router refuses (too long) fails the batch with its status at once; the other
    prompt's call is cancelled, so the router aborts it on the decode worker instead of letting it
    decode to the end for nobody."""
    aborted = record_aborts(idle.decode, monkeypatch)
    reserved = []
    real_reserve = idle.decode.handoff.reserve
    monkeypatch.setattr(
        idle.decode.handoff,
        "reserve",
        lambda rid, *a, **k: reserved.append(rid) or real_reserve(rid, *a, **k),
    )
    ok, too_long = random_prompts([8], seed=32)[0], [5] * MAX_MODEL_LEN
    until_full = eos_ignored(prompt=[ok, too_long], max_tokens=MAX_MODEL_LEN - 9)
    with pytest.raises(openai.BadRequestError) as e:
        client(router).completions.create(**until_full)
    assert "max_model_len" in str(e.value)
    # The two prompts go out at once: on a loaded machine the refusal can come before the good
    # prompt reached the decode worker, whose call is then cancelled with nothing to abort there.
    wait_until(idle.idle, 15, f"KV still held after the batch failed: {idle.stats()}")
    if reserved:
        wait_kv_freed_by_abort(idle, aborted)


def test_openai_errors_are_the_client_exceptions(router):
    c = client(router)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-5", prompt="t5")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="t5", temperature=9)
    assert e.value.body["param"] == "temperature"


# ---- a client that disconnects ---------------------------------------------------------------
def post_raw_completion(router, seed: int, **extra) -> socket.socket:
    """A raw socket that has sent a completion (a 40-token prompt, decoding until the context is
    full) and reads nothing yet."""
    host, port = split(router.http_address)
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": random_prompts([40], seed=seed)[0],
            "max_tokens": MAX_MODEL_LEN - 41,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
    ).encode()
    s = socket.create_connection((host, port), timeout=TIMEOUT)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def wait_kv_freed_by_abort(idle, aborted) -> None:
    wait_until(
        lambda: any(reason == "aborted by the router" for _, reason in aborted) and idle.idle(),
        15,
        f"KV still held after the client left: {idle.stats()}",
    )


def test_client_disconnect_mid_stream_frees_kv_on_both_pools_within_1s(router, idle, monkeypatch):
    aborted = record_aborts(idle.decode, monkeypatch)
    s = post_raw_completion(router, seed=4, stream=True)
    got = b""
    while got.count(b"data: ") < 2:  # the stream is running: two tokens arrived
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    d, _ = idle.stats()
    assert d.num_running == 1 and d.num_free_blocks < d.num_total_blocks
    s.close()
    wait_kv_freed_by_abort(idle, aborted)


def test_client_disconnect_before_a_whole_response_frees_kv_within_1s(router, idle, monkeypatch):
    """Without stream, nothing is sent until the end: the front notices the client leaving by
    the connection itself and cancels the call as well."""
    aborted = record_aborts(idle.decode, monkeypatch)
    s = post_raw_completion(router, seed=6)
    wait_until(lambda: idle.stats()[0].num_running == 1, 5, "the request is decoding")
    s.close()
    wait_kv_freed_by_abort(idle, aborted)


def test_concurrent_requests_on_one_front(router, idle, llm):
    prompts = random_prompts([5, 9, 13, 17], seed=31)
    want = [
        o.outputs[0].text
        for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )
    ]
    results = run_in_threads(
        lambda i: client(router).completions.create(
            prompt=prompts[i % 4], stream=bool(i % 2), **eos_ignored(max_tokens=6)
        ),
        8,
    )
    for i in range(8):
        r = results[i]
        text = r.choices[0].text if not i % 2 else "".join(ch.choices[0].text for ch in r)
        assert text == want[i % 4]
