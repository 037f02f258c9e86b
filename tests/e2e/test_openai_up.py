"""The official `openai` client against `up()` (the `pdserve up` code path) on a local Ray with the
real SmolLM2: chat and completions, streaming and not, stop, seed, usage, greedy text equal to
`engine.LLM`'s in one process; API keys on both fronts; a client that disconnects mid-stream has
its KV freed on both pools within ten of its steps (at least 1 s); a trainer's pause (the YAML's
router.pause_endpoints): a running stream aborted with what it had, a request held until
/resume; a weight update through the Ray workers (router.weight_updates). One deployment for the module (the Ray session and the pool helpers are
test_cluster_backends.py's)."""

from __future__ import annotations

import json
import socket
import time

import grpc
import pytest

from helpers.ray_cluster import assert_released, kv_free_probe, pool_spec

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

KEY = "sk-e2e-openai-0123456789"
MAX_TOKENS = 12
STEPS_TIMED = 4  # a disconnecting stream's steps timed before it goes, for the release's bound
KV_BYTES = 128 << 20
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def reference():
    """The engine's greedy texts in this process (float32: the cluster's workers use it too)."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM("smollm2", dtype="float32", kv_cache_memory=KV_BYTES, max_model_len=1024)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chat = llm.chat(MESSAGES, greedy, use_tqdm=False)[0]
    completion = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    llm.shutdown()
    return {
        "chat": (chat.outputs[0].text, len(chat.prompt_token_ids)),
        "completion": (completion.outputs[0].text, len(completion.prompt_token_ids)),
    }


@pytest.fixture(scope="module")
def deployment(ray_session, reference):
    from pdserve.deploy.config.load import validate_config
    from pdserve.deploy.launcher import up

    config = validate_config(
        {
            "model": "smollm2",
            "dtype": "float32",
            "pools": {"prefill": pool_spec(1), "decode": pool_spec(1)},
            "router": {
                "port": 0,
                "http_port": 0,
                "pause_endpoints": True,
                "weight_updates": True,
            },
        }
    )
    cluster = up(config, block=False, environ={"PDSERVE_API_KEYS": KEY})
    try:
        assert cluster.http_url and cluster.http_url.startswith("http://")
        yield cluster
    finally:
        cluster.stop()


def client(cluster, key=KEY):
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=key, max_retries=0, timeout=120)


def model_id(cluster) -> str:
    return client(cluster).models.list().data[0].id


def eos_ignored(model, temperature: float = 0, **kwargs) -> dict:
    """create()'s arguments for `model` with EOS ignored (a request runs to its token limit),
    greedy unless `temperature` says otherwise, and `kwargs`."""
    return dict(model=model, temperature=temperature, extra_body={"ignore_eos": True}, **kwargs)


def test_chat_and_completions_greedy_equal_the_engine(deployment, reference):
    c, model = client(deployment), model_id(deployment)
    want_chat, chat_prompt_tokens = reference["chat"]
    chat = eos_ignored(model, messages=MESSAGES, max_tokens=MAX_TOKENS)
    got = c.chat.completions.create(**chat)
    assert got.choices[0].message.content == want_chat
    assert got.usage.prompt_tokens == chat_prompt_tokens
    assert got.usage.completion_tokens == MAX_TOKENS
    assert got.model_extra["pdserve"]["decode_worker"] == "decode-0"
    stream = c.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want_chat
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].model_extra["pdserve"]["timings"]["ttft_s"] > 0

    want_text, prompt_tokens = reference["completion"]
    completion = eos_ignored(model, prompt=PROMPT, max_tokens=MAX_TOKENS)
    got = c.completions.create(**completion)
    assert got.choices[0].text == want_text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_tokens, MAX_TOKENS)
    pieces = [ch.choices[0].text for ch in c.completions.create(**completion, stream=True)]
    assert "".join(pieces) == want_text


def test_stop_and_seed(deployment, reference):
    c, model = client(deployment), model_id(deployment)
    want_text, _ = reference["completion"]
    stop = want_text.strip().split()[1]  # a word the greedy text has, not at its start
    got = c.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert got.choices[0].finish_reason == "stop"
    assert want_text.startswith(got.choices[0].text) and stop not in got.choices[0].text

    def sample(seed):  # an open prompt, sampled: only the seed makes two runs agree
        got = c.chat.completions.create(
            messages=[{"role": "user", "content": "Tell me a story about a dragon."}],
            **eos_ignored(model, max_tokens=MAX_TOKENS, temperature=1.5, seed=seed),
        )
        return got.choices[0].message.content

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first


def test_logprobs(deployment):
    c, model = client(deployment), model_id(deployment)
    got = c.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True
    )
    assert len(got.choices[0].logprobs.content) == got.usage.completion_tokens


def test_n_2(deployment):
    c, model = client(deployment), model_id(deployment)
    got = c.completions.create(
        prompt=PROMPT, n=2, **eos_ignored(model, max_tokens=6, temperature=1.0, seed=3)
    )
    assert sorted(ch.index for ch in got.choices) == [0, 1]
    assert got.usage.completion_tokens == 12 and all(ch.text for ch in got.choices)


def test_keys_are_required_on_both_fronts(deployment):
    from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

    with pytest.raises(openai.AuthenticationError):
        client(deployment, key="sk-not-the-key-000").models.list()
    with grpc.insecure_channel(deployment.router_address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ListModels(pdserve_pb2.ListModelsRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.ListModels(
            pdserve_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {KEY}"),)
        )
        assert reply.models


def test_a_client_that_disconnects_mid_stream_frees_kv_on_both_pools_promptly(deployment):
    host, _, port = deployment.http_url.removeprefix("http://").rpartition(":")
    body = json.dumps(
        {
            "model": model_id(deployment),
            "messages": MESSAGES,
            "max_tokens": 500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    # (channels to the workers opened once, before the clock starts: tests/helpers/ray_cluster.py)
    chunk = b'"content":"'  # what opens one chunk's text
    with kv_free_probe(deployment) as free:
        with socket.create_connection((host, int(port)), timeout=120) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                + b"Content-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            # its steps timed for the release's bound (helpers/ray_cluster.py assert_released)
            got, start, timed_from = b"", None, 0
            while start is None or got.count(chunk) < timed_from + STEPS_TIMED:
                more = s.recv(4096)
                assert more, got
                got += more
                if start is None and got.count(chunk) >= 3:  # the role chunk, two tokens
                    start, timed_from = time.monotonic(), got.count(chunk)
            step_s = (time.monotonic() - start) / (got.count(chunk) - timed_from)
            assert not free()  # the stream holds KV now
        assert_released(free, step_s, "a disconnected stream")


def _control(cluster, method: str, path: str) -> dict:
    import urllib.request

    req = urllib.request.Request(
        cluster.http_url + path, method=method, headers={"Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(req, timeout=120) as reply:
        return json.loads(reply.read())


def test_a_trainers_pause_aborts_the_rollout_and_holds_the_next(deployment):
    """RL's weight sync through `up()`: /pause?mode=abort ends a running stream with
    finish_reason "abort" after the tokens it had, frees its KV on both pools, and a request
    sent while paused waits, then completes after /resume."""
    import threading

    c, model = client(deployment), model_id(deployment)
    stream = c.completions.create(stream=True, prompt=PROMPT, **eos_ignored(model, max_tokens=500))
    text, reason = "", None
    with kv_free_probe(deployment) as free:
        for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if reason is None and len(text) > 8:  # running: now the trainer pauses
                paused = _control(deployment, "POST", "/pause?mode=abort")
                assert paused == {"status": "paused", "aborted": 1}, paused
                reason = "paused"
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        assert reason == "abort" and text, (reason, text)
        assert _control(deployment, "GET", "/is_paused") == {"is_paused": True}
        assert_released(free, 1.0, "an aborted rollout")
    held: list = []
    t = threading.Thread(
        target=lambda: held.append(
            c.completions.create(prompt=PROMPT, **eos_ignored(model, max_tokens=MAX_TOKENS))
        ),
        daemon=True,
    )
    t.start()
    t.join(1.0)
    assert t.is_alive() and not held  # held at the router while paused
    assert _control(deployment, "POST", "/resume") == {"status": "resumed"}
    t.join(120)
    assert held and held[0].usage.completion_tokens == MAX_TOKENS
    assert _control(deployment, "GET", "/is_paused") == {"is_paused": False}


def test_a_weight_update_reaches_every_ray_worker(deployment, reference):
    """/update_weights_from_disk through `up()`: both Ray workers load the checkpoint again (the
    same SmolLM2 files, as a new version), report it, and answer as before; then the same
    tensors sent by a trainer over a weight group (WeightSender), with the same outcome."""
    import urllib.request

    from pdserve.engine.loader import resolve_model

    path = str(resolve_model("smollm2"))
    req = urllib.request.Request(
        deployment.http_url + "/update_weights_from_disk",
        data=json.dumps({"model_path": path, "weight_version": "v2"}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as reply:
        out = json.loads(reply.read())
    assert out["success"] is True and "2 worker(s)" in out["message"], out
    assert _control(deployment, "GET", "/get_weight_version") == {"weight_version": "v2"}
    text, _ = reference["completion"]
    got = client(deployment).completions.create(
        prompt=PROMPT, **eos_ignored(model_id(deployment), max_tokens=MAX_TOKENS)
    )
    assert got.choices[0].text == text
    # the same weights again from a trainer's group: every Ray worker's engine rank joins it
    from helpers.ports import free_ports
    from pdserve.engine.loader.safetensors_io import iter_safetensors
    from pdserve.engine.weight_sync import WeightSender

    sender = WeightSender(deployment.http_url, "127.0.0.1", free_ports(1)[0], api_key=KEY)
    sender.init()
    assert sender.world_size == 3
    out = sender.update(iter_safetensors(path), version="g1")
    assert out["success"] is True and "2 worker(s)" in out["message"], out
    sender.destroy()
    assert _control(deployment, "GET", "/get_weight_version") == {"weight_version": "g1"}
    got = client(deployment).completions.create(
        prompt=PROMPT, **eos_ignored(model_id(deployment), max_tokens=MAX_TOKENS)
    )
    assert got.choices[0].text == text


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    }
]


def _tool_chat(c, model, stream: bool, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, tool_calls as dicts, finish_reason) of a greedy chat, streamed or not."""
    args = {"model": model, "max_tokens": 64, "temperature": 0, "tools": TOOLS, **kwargs}
    if not stream:
        choice = c.chat.completions.create(**args).choices[0]
        calls = [t.model_dump() for t in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in c.chat.completions.create(stream=True, **args):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"type": "function", "function": {}})
                if t.id:
                    call["id"], call["function"]["name"] = t.id, t.function.name
                f = call["function"]
                f["arguments"] = f.get("arguments", "") + (t.function.arguments or "")
            reason = ch.finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(deployment, stream):
    """SmolLM2's template ignores tools: they reach it in Hermes' system message. A forced call's
    arguments validate against the schema; the tool's result then gets a final answer."""
    jsonschema = pytest.importorskip("jsonschema")
    c, model = client(deployment), model_id(deployment)
    user = {"role": "user", "content": "What is the weather in Paris?"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, reason = _tool_chat(c, model, stream, messages=[user], tool_choice=named)
    assert (content, reason, len(calls)) == (None, "tool_calls", 1), (content, calls)
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    args = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(args, WEATHER)
    messages = [
        user,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"sky": "sunny", "c": 21}'},
    ]
    content, calls, reason = _tool_chat(c, model, stream, messages=messages)
    assert reason in ("stop", "tool_calls") and (content or calls), (content, calls, reason)
