"""The cluster and the raw HTTP helpers shared by the tests of the OpenAI-compatible HTTP front
(router/openai/app.py): tests/integration/test_http_*.py.

Not a test module: imported as `from helpers.http import ...` (tests/helpers/ is a package on pytest's sys.path). The
fixtures are `fixture_<name>` functions registered as `<name>` (`workers`, `router`, `colocated`,
`secured`, `llm`, `idle`), so that a test module imports the ones it uses and its tests' parameters
do not shadow the imports; the module-scoped ones then start once per test module: a DecodeWorker,
a PrefillWorker and Routers in front with http_port=0, on a tiny random model given a chat
template.
"""

from __future__ import annotations

import http.client
import json
import shutil
import ssl

import grpc

from helpers.worker import start_decode, start_prefill, stop_all
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.router.server import Router, RouterConfig

MAX_MODEL_LEN = 256
MODEL = "tiny"
KEY, KEY2, WRONG = "sk-test-0123456789abcdef", "sk-second-key-xyz", "sk-wrong-0123456789"
TIMEOUT = 30.0
# a template the word-level test tokenizer can read: role and content words, then "t7"
CHAT_TEMPLATE = (
    "{% for m in messages %}t3 {{ m.content }} t4 {% endfor %}{% if add_generation_prompt %}t7"
    "{% endif %}"
)


def chat_model(tiny_models, tmp_path_factory) -> str:
    """The tiny llama-gqa model with a chat template in its tokenizer_config.json."""
    src, _ = tiny_models("llama-gqa")
    dst = tmp_path_factory.mktemp("chat-model")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


class Workers:
    def __init__(self, model_dir, max_model_len: int = MAX_MODEL_LEN, decode_engine=None):
        """decode_engine: more engine keywords for the decode worker (speculative_config)."""
        engine = dict(max_model_len=max_model_len)
        self.model_dir, self.max_model_len = model_dir, max_model_len
        self.decode = start_decode(
            model_dir, engine={**engine, **(decode_engine or {})}, lease_ms=5000
        )
        self.prefill = start_prefill(model_dir, engine=engine)
        self.channels = [
            grpc.insecure_channel(a) for a in (self.decode.address, self.prefill.address)
        ]
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.channels[0])
        self.p = worker_pb2_grpc.PrefillWorkerStub(self.channels[1])

    def router(self, **kwargs) -> Router:
        colocated = kwargs.get("colocated", False)
        settings = dict(
            model=self.model_dir,
            model_id=MODEL,
            prefill_addresses=() if colocated else (self.prefill.address,),
            decode_addresses=(self.decode.address,),
            max_model_len=self.max_model_len,
            max_inflight=16,
            http_port=0,
        )
        return Router(RouterConfig(**{**settings, **kwargs})).start()

    def stats(self):
        return (
            self.d.Stats(worker_pb2.StatsRequest(), timeout=TIMEOUT),
            self.p.Stats(worker_pb2.StatsRequest(), timeout=TIMEOUT),
        )

    def idle(self) -> bool:
        d, p = self.stats()
        return (
            d.num_free_blocks == d.num_total_blocks
            and d.num_reserved == d.num_running == d.num_waiting == 0
            and p.num_free_blocks == p.num_total_blocks
            and p.num_running == p.num_waiting == 0
        )

    def stop(self):
        stop_all(self.channels, self.prefill, self.decode)


# ---- raw HTTP helpers --------------------------------------------------------------------------
def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def request(address, method, path, body=None, headers=None, tls_ca: bytes | None = None):
    """(status, headers, body bytes); body: bytes as they are, anything else as JSON."""
    host, port = split(address)
    if tls_ca is not None:
        ctx = ssl.create_default_context(cadata=tls_ca.decode())
        conn = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, path, body=data, headers=all_headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def openai_client(router_, key: str = "unused", timeout: float = 60, **kwargs):
    """The openai SDK's client against `router_`'s HTTP front (no retries: a test sees the first
    answer)."""
    import openai

    return openai.OpenAI(
        base_url=f"http://{router_.http_address}/v1",
        api_key=key,
        max_retries=0,
        timeout=timeout,
        **kwargs,
    )


def post(router_, path, body, **kwargs):
    return request(router_.http_address, "POST", path, body, **kwargs)


def assert_error(status, body: bytes, want_status: int, param="any") -> dict:
    """The OpenAI error object and the status; returns the error."""
    assert status == want_status, (status, body[:500])
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    return err


def serves(router_) -> None:
    """A small completion still works (after bad input). It ignores the end-of-sequence token:
    a random model samples it now and then (1 in 256 on a byte-level vocabulary)."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    status, _, body = post(router_, "/v1/completions", body)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 2


def sse_events(body: bytes) -> list:
    """The events of an SSE body, checked against OpenAI's framing: `data: <json>\\n\\n` each,
    the last one `data: [DONE]`."""
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    parts = text.split("\n\n")
    assert parts[-1] == ""
    events = []
    for part in parts[:-1]:
        assert part.startswith("data: ") and "\n" not in part, part
        payload = part.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return events[:-1]


# ---- request bodies ----------------------------------------------------------------------------
GOOD = {"model": MODEL, "prompt": "t5 t6", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2}
C, CHAT = "/v1/completions", "/v1/chat/completions"
