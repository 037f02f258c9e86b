"""Bodies and queries that used to escape as a 500 are a 400 that says what is wrong, and the
front keeps serving (FastAPI's test client, no router): a tool schema nested too deeply for the
JSON Schema meta-schema's check (router/openai/protocol.py _schema_error) names the tool's field
on every API that takes tools; a weight or LoRA body nested past Python's recursion limit
(router/openai/weights.py, models.py); a list's `limit`, or a Content-Length, written in digits
int() refuses ("²")."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from helpers.http_front import asgi_call, front_app
from pdserve.router.openai.errors import ApiError


def _app():
    return front_app(
        weights=SimpleNamespace(enabled=True, version="", groups=set(), ranks=lambda: 0),
        loras=SimpleNamespace(adapter_for=lambda model: None),
    )


@pytest.fixture(scope="module")
def client():
    with TestClient(_app(), raise_server_exceptions=False) as c:
        yield c


def _deep_schema(levels: int = 130) -> dict:
    schema = top = {}
    for _ in range(levels):
        schema["not"] = {}
        schema = schema["not"]
    return top


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools[0].function.parameters",
        ),
        (
            "/v1/responses",
            {"input": "hi", "tools": [{"type": "function", "name": "f"}]},
            "tools[0].parameters",
        ),
        (
            "/v1/messages",
            {"model": "org/tiny", "max_tokens": 5, "messages": USER, "tools": [{"name": "f"}]},
            "tools[0].input_schema",
        ),
    ],
)
def test_a_tool_schema_nested_too_deeply_is_a_400_naming_it(client, path, body, param):
    tool = body["tools"][0]
    schema = _deep_schema()
    if "function" in tool:
        tool["function"]["parameters"] = schema
    elif path == "/v1/responses":
        tool["parameters"] = schema
    else:
        tool["input_schema"] = schema
    got = client.post(path, json=body)
    assert got.status_code == 400, got.text
    text = json.dumps(got.json())
    assert param in text and "nested too deeply" in text
    assert client.get("/version").status_code == 200


def test_a_body_whose_checks_recurse_too_deeply_is_a_400():
    class Recursing:
        @staticmethod
        def model_validate_json(body):
            raise RecursionError("maximum recursion depth exceeded")

    front = _app().state.front
    request = SimpleNamespace(headers={}, scope={})

    async def body(_request):
        return b"{}"

    front.read_body = body
    with pytest.raises(ApiError) as e:
        asyncio.run(front.parse(request, Recursing))
    assert e.value.status == 400 and "nested too deeply" in e.value.message


@pytest.mark.parametrize(
    "path", ["/update_weights_from_disk", "/init_weights_update_group", "/v1/load_lora_adapter"]
)
def test_a_weight_or_lora_body_nested_too_deeply_is_a_400(client, path):
    deep = b"[" * 5000 + b"]" * 5000
    got = client.post(path, content=deep, headers={"content-type": "application/json"})
    assert got.status_code == 400, got.text
    assert "nested too deeply" in got.text
    assert client.get("/version").status_code == 200


def test_a_limit_in_digits_int_refuses_is_a_400(client):
    conv = client.post("/v1/conversations", json={}).json()["id"]
    store = client.app.state.front.responses
    store.put({"id": "resp_1", "output": []}, [], (0, 0), None)
    for path in (f"/v1/conversations/{conv}/items", "/v1/responses/resp_1/input_items"):
        got = client.get(f"{path}?limit=%C2%B2")
        assert got.status_code == 400, got.text
        assert got.json()["error"]["param"] == "limit"
        assert client.get(f"{path}?limit=2").status_code == 200


def test_a_content_length_in_digits_int_refuses_is_a_400():
    status, _, _ = asyncio.run(
        asgi_call(_app(), "POST", "/v1/conversations", b"{}", length=b"\xb2")
    )
    assert status == 400
