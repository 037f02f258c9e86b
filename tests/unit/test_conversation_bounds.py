"""A conversation of the Conversations API (router/openai/conversations_api.py) in the real store
(router/openai/responses/store.py): one deleted while a POST to it is still sending its body
leaves no bytes behind in the store's total, and the POST is a 404, not a 200 whose items went
nowhere."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from helpers.http_front import asgi_call, front_app
from pdserve.protos.security import ClientKeys
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.responses.store import (
    MAX_CONVERSATION_ITEMS,
    Conversation,
    ResponseStore,
)
from pdserve.router.openai.responses_api import Keep, MessageItem, conversation_items, items_of


def _stored_bytes(store: ResponseStore) -> int:
    return sum(entry.size for entry in store._entries.values())


def test_resizing_a_conversation_no_longer_stored_changes_nothing():
    store = ResponseStore(1 << 20)
    found = Conversation(None, 0, {}, [])
    assert store.create_conversation("conv_a", found)
    assert store.delete("conv_a", None)  # meanwhile: deleted (or evicted)
    found.add(items_of([MessageItem(role="user", content="y" * 10_000)]))
    assert store.resize("conv_a", found)
    assert store.bytes == _stored_bytes(store) == 0 and store.conversations == 0
    assert store.conversation("conv_a", None) is None


def _app(store_bytes: int):
    return front_app(keys=ClientKeys(()), responses_store_bytes=store_bytes)


async def _call_query(app, path: str, query: str):
    return await _call(app, "GET", path, query=query)


async def _call(app, method: str, path: str, body: bytes = b"", midway=None, query: str = ""):
    """(status, body) of one request sent straight to the ASGI app (asgi_call)."""
    status, _, reply = await asgi_call(app, method, path, body, query, midway)
    return status, reply


def test_a_conversation_deleted_while_items_are_posted_leaves_no_bytes():
    app = _app(1 << 20)
    store = app.state.front.responses

    async def run():
        for path_of, body in (
            (
                lambda cid: f"/v1/conversations/{cid}/items",
                {"items": [{"role": "user", "content": "x" * 9999}]},
            ),
            (lambda cid: f"/v1/conversations/{cid}", {"metadata": {"k": "v" * 200}}),
        ):
            _, conv = await _call(app, "POST", "/v1/conversations", b"{}")
            cid = conv["id"]
            status, got = await _call(
                app,
                "POST",
                path_of(cid),
                json.dumps(body).encode(),
                midway=lambda cid=cid: store.delete(cid, None),
            )
            assert status == 404 and got["error"]["code"] == "not_found", got
            assert store.bytes == _stored_bytes(store) == 0 and store.conversations == 0

    asyncio.run(run())


def _items(count: int, text: str = "hi") -> list[dict]:
    return items_of([MessageItem(role="user", content=text) for _ in range(count)])


def test_a_conversation_holds_at_most_its_items():
    store = ResponseStore(64 << 20)
    found = Conversation(None, 0, {}, [])
    assert store.create_conversation("conv_a", found)
    for _ in range(MAX_CONVERSATION_ITEMS // 20):
        assert store.extend("conv_a", found, _items(20))
    before = (len(found.items), found.size, store.bytes)
    assert before[0] == MAX_CONVERSATION_ITEMS
    assert not store.extend("conv_a", found, _items(1))
    assert (len(found.items), found.size, store.bytes) == before  # as it was
    assert store.conversation("conv_a", None) is found


def test_a_conversation_holds_at_most_its_share_of_the_store_and_evicts_no_one_past_it():
    app = _app(1 << 20)
    store = app.state.front.responses
    assert store.max_conversation_bytes == (1 << 20) // 4
    for rid in ("resp_a", "resp_b", "resp_c"):  # another client's: 600 KB in all
        store.put({"id": rid, "output": []}, _items(1, "r" * 200_000), (0, 1), "other")

    async def run():
        _, conv = await _call(app, "POST", "/v1/conversations", b"{}")
        cid = conv["id"]
        body = json.dumps({"items": [{"role": "user", "content": "x" * 12_950}] * 20}).encode()
        status, got = await _call(app, "POST", f"/v1/conversations/{cid}/items", body)
        assert status == 200, got  # 261 KB: within its 256 KiB
        held = (len(store.conversation(cid, None).items), store.bytes)
        status, got = await _call(app, "POST", f"/v1/conversations/{cid}/items", body)
        assert status == 400 and got["error"]["code"] == "conversation_too_large", got
        assert "10000 items or 262144 bytes" in got["error"]["message"]
        assert (len(store.conversation(cid, None).items), store.bytes) == held  # kept as it was
        meta = json.dumps({"metadata": {f"k{i}": "v" * 256 for i in range(16)}}).encode()
        status, got = await _call(app, "POST", f"/v1/conversations/{cid}", meta)
        assert status == 400 and got["error"]["code"] == "conversation_too_large", got
        assert store.conversation(cid, None).metadata == {} and store.bytes == held[1]
        for rid in ("resp_a", "resp_b", "resp_c"):
            assert store.get(rid, "other") is not None  # nothing evicted for it
        assert store.bytes == _stored_bytes(store)

    asyncio.run(run())


def test_a_turn_past_the_bounds_is_not_added_and_the_conversation_is_refused_after():
    store = ResponseStore(1 << 20)
    found = Conversation(None, 0, {}, [])
    assert store.create_conversation("conv_a", found)
    keep = Keep(store, None, _items(1), 0, response=False, conversation="conv_a")
    keep.put({"id": "resp_1", "status": "completed", "output": _items(1, "ok")})
    assert len(found.items) == 2 and not found.full
    before = (len(found.items), store.bytes)
    keep.put({"id": "resp_2", "status": "completed", "output": _items(1, "x" * 300_000)})
    assert (len(found.items), store.bytes) == before and found.full
    with pytest.raises(ApiError) as e:
        conversation_items(store, "conv_a", None, SimpleNamespace(previous_response_id=None))
    assert e.value.status == 400 and e.value.code == "conversation_too_large"
    assert e.value.param == "conversation" and "start a new conversation" in e.value.message


def test_reads_of_a_page_or_an_item_decode_only_those(monkeypatch):
    app = _app(1 << 20)
    store = app.state.front.responses
    decoded = []
    real = Conversation.item
    monkeypatch.setattr(Conversation, "item", lambda self, i: decoded.append(i) or real(self, i))

    async def run():
        _, conv = await _call(app, "POST", "/v1/conversations", b"{}")
        cid = conv["id"]
        for _ in range(5):
            body = json.dumps({"items": [{"role": "user", "content": "m"}] * 20}).encode()
            await _call(app, "POST", f"/v1/conversations/{cid}/items", body)
        ids = list(store.conversation(cid, None).ids)
        path = f"/v1/conversations/{cid}/items"
        status, got = await _call_query(app, path, f"limit=2&after={ids[50]}")
        assert status == 200 and [i["id"] for i in got["data"]] == [ids[49], ids[48]]
        assert (got["first_id"], got["last_id"], got["has_more"]) == (ids[49], ids[48], True)
        assert decoded == [49, 48]
        status, got = await _call_query(app, path, f"order=asc&after={ids[97]}&limit=5")
        assert [i["id"] for i in got["data"]] == ids[98:] and not got["has_more"]
        decoded.clear()
        status, got = await _call(app, "GET", f"{path}/{ids[7]}")
        assert status == 200 and got["id"] == ids[7] and decoded == [7]
        status, got = await _call(app, "DELETE", f"{path}/{ids[7]}")
        assert status == 200 and len(store.conversation(cid, None).ids) == 99
        assert ids[7] not in store.conversation(cid, None).ids
        assert store.bytes == _stored_bytes(store)

    asyncio.run(run())
