"""Stored responses (router/openai/responses/store.py) and the routes that read them
(router/openai/responses_api.py: GET /v1/responses/{id}, its /input_items, DELETE) in-process, on
FastAPI's test client with no workers: the store keeps at most its size (least recently used evicted
first, one larger than the store not kept), a response belongs to the key that made it, input items
page as OpenAI's list does, and bad queries get a 400 naming the parameter. A background response
(on a router whose calls never answer) is queued at once, bounded in number, and cancelled by its
route or by the front's stop, which cancels its router call. The conversation continued by
previous_response_id through a router and workers: tests/integration/test_http_other_apis.py."""

from __future__ import annotations

import hashlib
import logging
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from helpers.http_front import HangingRouter
from pdserve.protos.security import ClientKeys
from pdserve.router.openai import responses_api
from pdserve.router.openai.app import build_app
from pdserve.router.openai.responses.store import ResponseStore
from pdserve.router.openai.responses_api import ResponsesRequest, chat_messages, input_items
from pdserve.router.openai.server import HttpSettings

KEY_A, KEY_B = "sk-owner-a-0123456789", "sk-owner-b-0123456789"


def _response(rid: str, text: str = "hi") -> dict:
    return {"id": rid, "object": "response", "output": [_say("assistant", text)]}


def _say(role: str, text: str, kind: str = "input_text") -> dict:
    return {
        "type": "message",
        "id": f"msg_{text}",
        "role": role,
        "content": [{"type": kind, "text": text}],
    }


def test_the_store_keeps_its_size_and_evicts_the_least_recently_used():
    one = ResponseStore(1 << 20)
    assert one.put(_response("resp_x"), [], (0, 0), None)
    size = one.bytes
    store = ResponseStore(3 * size)
    for rid in ("resp_a", "resp_b", "resp_c"):
        assert store.put(_response(rid), [], (0, 0), None)
    assert len(store) == 3 and store.bytes == 3 * size
    assert store.get("resp_a", None) is not None  # a read makes a the most recently used
    assert store.put(_response("resp_d"), [], (0, 0), None)
    assert store.get("resp_b", None) is None  # b was the least recently used
    assert [store.get(r, None) is not None for r in ("resp_a", "resp_c", "resp_d")] == [True] * 3
    assert store.bytes == 3 * size
    # stored again under its id: replaced, not counted twice
    assert store.put(_response("resp_a"), [], (0, 0), None) and store.bytes == 3 * size
    # larger than the whole store: not kept, nothing evicted for it
    assert not store.put(_response("resp_e", "x" * 4 * size), [], (0, 0), None)
    assert len(store) == 3 and store.get("resp_e", None) is None
    assert store.delete("resp_c", None) and not store.delete("resp_c", None)
    assert store.bytes == 2 * size
    with pytest.raises(ValueError, match=">= 0"):
        ResponseStore(-1)


def test_a_response_belongs_to_its_owner():
    store = ResponseStore(1 << 20)
    store.put(_response("resp_a"), [], (0, 0), "owner-a")
    assert store.get("resp_a", "owner-b") is None and store.get("resp_a", None) is None
    assert not store.delete("resp_a", "owner-b")
    assert store.get("resp_a", "owner-a") is not None


def test_input_items_carry_ids_and_are_the_chat():
    body = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather?", "id": "msg_mine"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sun"},
                {"role": "assistant", "content": "Sunny."},
            ],
        }
    )
    items = input_items(body)
    assert [i["type"] for i in items] == [
        "message",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert items[0]["id"] == "msg_mine"
    assert [i["id"].split("_")[0] for i in items[1:]] == ["fc", "fco", "msg"]
    assert items[3]["content"] == [{"type": "output_text", "text": "Sunny.", "annotations": []}]
    # an earlier response's items first, then the input: one chat, instructions first
    earlier = [_say("user", "Hello."), _say("assistant", "Hi.", "output_text")]
    messages = chat_messages(body, earlier + items)
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert messages[4]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def _client(keys=(), stub=None, **settings) -> TestClient:
    settings = HttpSettings(
        host="127.0.0.1",
        port=0,
        model_id="org/tiny",
        tokenizer=object(),
        encoder=object(),
        keys=ClientKeys(keys),
        **settings,
    )
    return TestClient(build_app(SimpleNamespace(settings=settings, stub=stub)))


def _owner(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_get_delete_and_input_items_through_the_routes():
    with _client(keys=(KEY_A, KEY_B)) as c:
        store = c.app.state.front.responses
        items = [_say("user", f"m{i}") for i in range(5)]
        store.put(_response("resp_1"), [_say("user", "old"), *items], (1, 6), _owner(KEY_A))
        a = {"Authorization": f"Bearer {KEY_A}"}
        b = {"Authorization": f"Bearer {KEY_B}"}
        assert c.get("/v1/responses/resp_1", headers=a).json() == _response("resp_1")
        assert c.get("/v1/responses/resp_1").status_code == 401
        # another key: as if it never existed
        got = c.get("/v1/responses/resp_1", headers=b)
        assert got.status_code == 404 and "not found" in got.json()["error"]["message"]
        assert c.delete("/v1/responses/resp_1", headers=b).status_code == 404
        page = c.get("/v1/responses/resp_1/input_items?limit=2", headers=a).json()
        assert [i["id"] for i in page["data"]] == ["msg_m4", "msg_m3"]  # newest first
        assert (page["first_id"], page["last_id"], page["has_more"]) == ("msg_m4", "msg_m3", True)
        rest = c.get(
            "/v1/responses/resp_1/input_items?order=asc&after=msg_m2&limit=100", headers=a
        ).json()
        assert [i["id"] for i in rest["data"]] == ["msg_m3", "msg_m4"] and not rest["has_more"]
        for query, param in (
            ("limit=0", "limit"),
            ("limit=101", "limit"),
            ("limit=x", "limit"),
            ("order=up", "order"),
            ("after=msg_old", "after"),  # an earlier response's item, not this one's input
        ):
            got = c.get(f"/v1/responses/resp_1/input_items?{query}", headers=a)
            assert got.status_code == 400 and got.json()["error"]["param"] == param, query
        got = c.get("/v1/responses/resp_1?stream=true", headers=a)
        assert got.status_code == 400 and got.json()["error"]["param"] == "stream"
        assert c.delete("/v1/responses/resp_1", headers=a).json() == {
            "id": "resp_1",
            "object": "response",
            "deleted": True,
        }
        assert c.get("/v1/responses/resp_1", headers=a).status_code == 404
        assert len(store) == 0 and store.bytes == 0


@pytest.mark.parametrize("store_bytes, words", [(1 << 20, "not found"), (0, "not stored")])
def test_continuing_an_unknown_or_unstored_response_is_a_400(store_bytes, words):
    with _client(responses_store_bytes=store_bytes) as c:
        got = c.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
        error = got.json()["error"]
        assert got.status_code == 400 and error["param"] == "previous_response_id", error
        assert words in error["message"]
        assert (error["code"] == "previous_response_not_found") == bool(store_bytes)


def test_a_background_response_runs_apart_and_is_cancelled(monkeypatch):
    router = HangingRouter()
    monkeypatch.setattr(responses_api, "MAX_RUNNING", 1)
    with _client(stub=router) as c:
        store = c.app.state.front.responses
        queued = c.post("/v1/responses", json={"input": "hi", "background": True}).json()
        rid = queued["id"]
        assert (queued["status"], queued["background"], queued["store"]) == ("queued", True, True)
        assert c.get(f"/v1/responses/{rid}").json()["status"] in ("queued", "in_progress")
        items = c.get(f"/v1/responses/{rid}/input_items").json()["data"]
        assert [i["content"][0]["text"] for i in items] == ["hi"]
        got = c.delete(f"/v1/responses/{rid}")
        assert got.status_code == 400 and "cancel it first" in got.json()["error"]["message"]
        # one at a time here: the next is refused until this one ends
        got = c.post("/v1/responses", json={"input": "hi", "background": True})
        assert got.status_code == 429 and len(router.calls) == 1
        cancelled = c.post(f"/v1/responses/{rid}/cancel").json()
        assert cancelled["status"] == "cancelled" and router.calls[0].cancelled
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
        assert c.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
        assert not store.running and len(store) == 1
        # stopping the front cancels those still running
        rid = c.post("/v1/responses", json={"input": "hi", "background": True}).json()["id"]
        c.portal.call(store.stop)
        assert router.calls[-1].cancelled and store.get(rid, None) is not None
        assert c.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"


@pytest.mark.parametrize(
    "fields, param",
    [({"store": False}, "background"), ({"stream": True}, "stream")],
)
def test_a_background_response_needs_store_and_no_stream(fields, param):
    with _client(stub=HangingRouter()) as c:
        got = c.post("/v1/responses", json={"input": "hi", "background": True, **fields})
        assert got.status_code == 400 and got.json()["error"]["param"] == param
        store = c.app.state.front.responses
        store.put(_response("resp_1"), [], (0, 0), None)
        got = c.post("/v1/responses/resp_1/cancel")
        assert got.status_code == 400 and got.json()["error"]["code"] == "not_background"


def test_the_store_is_on_the_metrics_scrape():
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    with _client(metrics_registry=registry) as c:
        c.app.state.front.responses.put(_response("resp_1"), [], (0, 0), None)
        text = generate_latest(registry).decode()
    size = c.app.state.front.responses.bytes
    assert 'pdserve:responses_stored{model_name="org/tiny"} 1.0' in text
    assert f'pdserve:responses_store_bytes{{model_name="org/tiny"}} {float(size)}' in text
    assert 'pdserve:responses_store_max_bytes{model_name="org/tiny"} 6.7108864e+07' in text
    assert 'pdserve:responses_background_running{model_name="org/tiny"} 0.0' in text


def test_conversations_through_the_routes():
    with _client(keys=(KEY_A, KEY_B)) as c:
        a = {"Authorization": f"Bearer {KEY_A}"}
        b = {"Authorization": f"Bearer {KEY_B}"}
        first = {"type": "message", "role": "user", "content": "Hi."}
        conv = c.post(
            "/v1/conversations", json={"items": [first], "metadata": {"k": "v"}}, headers=a
        ).json()
        cid = conv["id"]
        assert cid.startswith("conv_") and conv["object"] == "conversation"
        assert conv["metadata"] == {"k": "v"}
        assert c.get(f"/v1/conversations/{cid}", headers=b).status_code == 404  # another key's
        added = c.post(
            f"/v1/conversations/{cid}/items",
            json={"items": [{"role": "assistant", "content": "Hello."}, first]},
            headers=a,
        ).json()
        assert [i["role"] for i in added["data"]] == ["assistant", "user"]
        listed = c.get(f"/v1/conversations/{cid}/items?order=asc", headers=a).json()["data"]
        assert [i["content"][0]["text"] for i in listed] == ["Hi.", "Hello.", "Hi."]
        one = listed[1]["id"]
        assert c.get(f"/v1/conversations/{cid}/items/{one}", headers=a).json() == listed[1]
        assert c.delete(f"/v1/conversations/{cid}/items/{one}", headers=a).json()["id"] == cid
        got = c.get(f"/v1/conversations/{cid}/items/{one}", headers=a)
        assert got.status_code == 404
        new = c.post(f"/v1/conversations/{cid}", json={"metadata": {"k": "w"}}, headers=a)
        assert new.json()["metadata"] == {"k": "w"}
        store = c.app.state.front.responses
        assert len(store) == 0 and store.conversations == 1
        before = store.bytes
        for body, param in (
            ({"items": [{"type": "web_search_call"}]}, "items"),
            ({"items": [first] * 21}, "items"),
            ({"metadata": {"k": 1}}, "metadata"),
        ):
            got = c.post("/v1/conversations", json=body, headers=a)
            assert got.status_code == 400 and got.json()["error"]["param"] == param, got.json()
        assert store.bytes == before and store.conversations == 1
        gone = c.delete(f"/v1/conversations/{cid}", headers=a).json()
        assert gone == {"id": cid, "object": "conversation.deleted", "deleted": True}
        assert c.get(f"/v1/conversations/{cid}", headers=a).status_code == 404
        assert store.bytes == 0 and store.conversations == 0
        # a conversation a response names must exist, and not with previous_response_id
        for extra, status in (({}, 404), ({"previous_response_id": "resp_1"}, 400)):
            body = {"input": "hi", "conversation": cid, **extra}
            got = c.post("/v1/responses", json=body, headers=a)
            assert got.status_code == status and got.json()["error"]["param"] == "conversation"


def test_a_conversation_larger_than_the_store_is_refused():
    with _client(responses_store_bytes=512) as c:
        conv = c.post("/v1/conversations", json={}).json()
        big = {"items": [{"role": "user", "content": "x" * 600}]}
        got = c.post(f"/v1/conversations/{conv['id']}/items", json=big)
        assert got.status_code == 400 and got.json()["error"]["code"] == "conversation_too_large"
    with _client(responses_store_bytes=0) as c:
        assert c.post("/v1/conversations", json={}).status_code == 400


def test_a_response_larger_than_the_store_is_not_kept_and_its_loss_logged(caplog):
    """Its client has it already, but GET and previous_response_id will not find it: the
    operator reads why in the log, with its id and the store's bound."""
    store = ResponseStore(64)
    keep = responses_api.Keep(store, None, [_say("user", "hi")], 0)
    with caplog.at_level(logging.WARNING):
        keep.put(_response("resp_big"))
    assert len(store) == 0
    said = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    assert len(said) == 1 and "resp_big" in said[0] and "64 bytes" in said[0], said
    caplog.clear()
    roomy = ResponseStore(1 << 20)
    responses_api.Keep(roomy, None, [_say("user", "hi")], 0).put(_response("resp_small"))
    assert len(roomy) == 1 and not caplog.records
