"""Request ids on the HTTP front (router/openai/generate.py's RequestId and RequestIdHeaders), on
its ASGI app with a fake router: a client's X-Request-Id (else the body's request_id) is the
response's id as vLLM forms it (chatcmpl-<id>, cmpl-<id>; /v1/messages: msg_<id>) and comes back
in the x-request-id and request-id headers (the SDKs' `_request_id`:
tests/integration/test_request_id_sdks.py); the router's request id carries it, with a suffix
that keeps two clients' same id apart; an id pdserve minted is in the headers too; a bad id is a
400 naming the header or the field; every other answer carries an id too (build_app's
RequestIdHeaders middleware)."""

from __future__ import annotations

import asyncio
import json

import grpc
import grpc.aio
import pytest

from helpers.http_front import FakeCall, FakeRouter, front_app, one_token
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.generate import MAX_REQUEST_ID_CHARS

httpx = pytest.importorskip("httpx2")

CHAT = {"messages": [{"role": "user", "content": "t1"}]}


class _Stub(FakeRouter):
    """A router whose Generate answers one token, and whose ListModels lists the base model."""

    def __init__(self):
        super().__init__(lambda gen: one_token(2))

    async def ListModels(self, request, metadata=(), timeout=None):
        return pdserve_pb2.ListModelsResponse(models=[pdserve_pb2.ModelCard(id="org/tiny")])


def _app(stub):
    return front_app(stub=stub)  # build_app adds RequestIdHeaders


def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def _post(app, path: str, body: dict, **headers):
    async with _client(app) as c:
        return await c.post(path, json=body, headers=headers)


def _ids(r) -> tuple[str | None, str | None]:
    return r.headers.get("x-request-id"), r.headers.get("request-id")


def test_the_clients_header_is_the_chat_completions_id_and_comes_back():
    stub = _Stub()
    headers = {"X-Request-Id": "my-req-123"}
    r = asyncio.run(_post(_app(stub), "/v1/chat/completions", CHAT, **headers))
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "chatcmpl-my-req-123"
    assert _ids(r) == ("my-req-123", "my-req-123")
    # the router's id carries it (its logs and traces), and the extension names the router's
    router_id = stub.gens[0].request_id
    assert router_id.startswith("http-my-req-123-") and len(router_id) > len("http-my-req-123-")
    assert r.json()["pdserve"]["request_id"] == router_id


def test_a_stream_carries_the_id_on_every_chunk_and_in_its_headers():
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r = asyncio.run(_post(_app(_Stub()), "/v1/chat/completions", body, **{"X-Request-Id": "s-1"}))
    assert _ids(r) == ("s-1", "s-1")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert {json.loads(e)["id"] for e in events[:-1]} == {"chatcmpl-s-1"}


def test_messages_and_responses_answer_with_the_id_in_their_headers():
    app = _app(_Stub())
    message = {"model": "org/tiny", "max_tokens": 5, **CHAT}
    r = asyncio.run(_post(app, "/v1/messages", message, **{"X-Request-Id": "a-1"}))
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "msg_a-1" and _ids(r) == ("a-1", "a-1")
    # a Response's id stays its own (previous_response_id names it in the store)
    r = asyncio.run(_post(app, "/v1/responses", {"input": "t1"}, **{"X-Request-Id": "r-1"}))
    assert r.status_code == 200, r.text
    assert r.json()["id"].startswith("resp_") and _ids(r) == ("r-1", "r-1")


def test_the_bodys_request_id_is_used_when_no_header_names_one():
    stub = _Stub()
    body = {"prompt": ["t1", "t2"], "max_tokens": 1, "request_id": "body-req-9"}
    r = asyncio.run(_post(_app(stub), "/v1/completions", body))
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-body-req-9" and _ids(r) == ("body-req-9", "body-req-9")
    # a batch: one router id per prompt, each carrying the client's id
    ids = [g.request_id for g in stub.gens]
    assert len(ids) == 2 and all(i.startswith("http-body-req-9-") for i in ids)
    assert ids[0].endswith("-0") and ids[1].endswith("-1") and ids[0][:-2] == ids[1][:-2]
    # the header wins over the body
    r = asyncio.run(_post(_app(_Stub()), "/v1/completions", body, **{"X-Request-Id": "h"}))
    assert r.json()["id"] == "cmpl-h" and _ids(r) == ("h", "h")


def test_two_clients_sending_the_same_id_do_not_meet_in_the_router():
    """The router refuses a request_id already in flight on a channel (ALREADY_EXISTS), and the
    front has one channel: the same client id must give two router ids."""
    stub = _Stub()
    app = _app(stub)

    async def both():
        return await asyncio.gather(
            *(_post(app, "/v1/chat/completions", CHAT, **{"X-Request-Id": "same"}) for _ in "ab")
        )

    answers = asyncio.run(both())
    assert [r.json()["id"] for r in answers] == ["chatcmpl-same"] * 2
    first, second = (g.request_id for g in stub.gens)
    assert first != second and first.startswith("http-same-") and second.startswith("http-same-")


def test_without_a_client_id_the_minted_one_is_the_headers_and_the_ids():
    stub = _Stub()
    r = asyncio.run(_post(_app(stub), "/v1/chat/completions", CHAT))
    minted, again = _ids(r)
    assert minted and minted == again
    assert r.json()["id"] == f"chatcmpl-{minted}" and stub.gens[0].request_id == f"http-{minted}"


@pytest.mark.parametrize(
    "value",
    ["x" * (MAX_REQUEST_ID_CHARS + 1), "two words", "tab\there", "caf\u00e9"],
    ids=["too-long", "space", "control", "non-ascii"],
)
def test_a_bad_header_is_a_400_naming_it(value):
    stub = _Stub()
    headers = [("x-request-id", value.encode())]

    async def call():
        async with _client(_app(stub)) as c:
            return await c.post("/v1/chat/completions", json=CHAT, headers=headers)

    r = asyncio.run(call())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "X-Request-Id" and "X-Request-Id must be" in error["message"]
    assert not stub.gens  # nothing reached the router
    assert _ids(r)[0] and _ids(r)[0] != value  # the answer still has an id, a new one


def test_a_bad_body_request_id_is_a_400_naming_the_field():
    stub = _Stub()
    body = {**CHAT, "request_id": "has spaces"}
    r = asyncio.run(_post(_app(stub), "/v1/chat/completions", body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert not stub.gens


class _Refusing(_Stub):
    """A router that refuses every Generate call (INVALID_ARGUMENT) at its first read."""

    def Generate(self, gen, metadata=(), timeout=None):
        self.gens.append(gen)
        return _RefusedCall()


class _RefusedCall(FakeCall):
    def __init__(self):
        super().__init__([])

    async def read(self):
        none = grpc.aio.Metadata()
        raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, none, none, "no")


def test_every_other_answer_carries_an_id_too():
    app = _app(_Refusing())

    async def calls():
        async with _client(app) as c:
            return (
                await c.get("/v1/models", headers={"X-Request-Id": "m-1"}),
                await c.get("/v1/models"),
                await c.get("/nowhere", headers={"X-Request-Id": "n-1"}),
                # the router's refusal, after the id was taken from the body: the body's id
                await c.post("/v1/chat/completions", json={**CHAT, "request_id": "b"}),
            )

    listed, minted, missing, refused = asyncio.run(calls())
    assert listed.status_code == 200 and _ids(listed) == ("m-1", "m-1")
    assert minted.status_code == 200 and _ids(minted)[0]
    assert missing.status_code == 404 and _ids(missing) == ("n-1", "n-1")
    assert refused.status_code == 400 and _ids(refused) == ("b", "b")
