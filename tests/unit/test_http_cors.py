"""Browser clients (CORS): off by default, so no web page can read the HTTP front's answers; with
router.cors_allowed_origins (vLLM's --allowed-origins) the listed origins' preflights are answered
without a key and their pages may read the answers, errors included (router/openai/app.py). The
key's checks (deploy/config/schema.py), `pdserve up --allowed-origins`, and its way from the YAML
through RouterConfig to the front's settings (deploy/launcher.py, router/server.py). In-process:
FastAPI's test client on the front's app, no socket."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from helpers.deploy_config import router_config_of
from helpers.http_front import FakeRouter, front_app, one_token
from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.deploy.config.schema import DeployConfig
from pdserve.protos.security import INSECURE, ClientKeys
from pdserve.up_flags import add_up_flags, up_config

KEY = "sk-cors-test-0123456789"
UI = "http://localhost:3000"
# what the openai JS SDK's preflight asks for, with dangerouslyAllowBrowser
PREFLIGHT = {
    "Origin": UI,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type,x-stainless-lang,"
    "x-stainless-retry-count,openai-organization",
}
BODY = {"model": "org/tiny", "prompt": [1, 2], "max_tokens": 1}


def _client(origins=(), keys=(KEY,)) -> TestClient:
    router = FakeRouter(lambda gen: one_token(2))
    app = front_app(router, keys=ClientKeys(keys), cors_allowed_origins=tuple(origins))
    return TestClient(app)


def test_off_by_default_a_preflight_is_a_405_and_no_answer_is_readable():
    client = _client()
    got = client.options("/v1/completions", headers=PREFLIGHT)
    assert got.status_code == 405 and got.headers["allow"] == "POST"
    assert not any(h.startswith("access-control-") for h in got.headers)
    got = client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"})
    assert got.status_code == 200 and "access-control-allow-origin" not in got.headers


def _bodyless_cancel(client, headers) -> tuple[int, dict]:
    """POST /v1/responses/{id}/cancel with no body and no Content-Type: what a web page of any
    origin may send without a preflight."""
    got = client.post("/v1/responses/resp_0123/cancel", headers=headers)
    return got.status_code, got.json()


@pytest.mark.parametrize("origins", [(), (UI,)])
def test_a_foreign_pages_post_is_a_403_before_any_handler(origins):
    """A POST naming an Origin neither listed nor the front's own is refused whatever its path,
    bodyless ones (/pause, a response's cancel) included (router/openai/origins.py); without
    an Origin (the SDKs, curl) or from the front's own /docs page it reaches its handler."""
    client = _client(origins, keys=())
    for origin in ("http://evil.example", "null", "http://testserver.evil.example"):
        status, doc = _bodyless_cancel(client, {"Origin": origin})
        assert status == 403, doc
        assert doc["error"]["code"] == "forbidden_origin", doc
        assert repr(origin) in doc["error"]["message"], doc
        assert "router.cors_allowed_origins" in doc["error"]["message"], doc
        got = client.post("/v1/completions", json=BODY, headers={"Origin": origin})
        assert got.status_code == 403 and "x-request-id" in got.headers, got.text
    # no Origin, or the front's own (TestClient's Host is "testserver"): the handler answers
    # (404: no stored response of that id)
    for headers in ({}, {"Origin": "http://testserver"}):
        status, doc = _bodyless_cancel(client, headers)
        assert status == 404 and "resp_0123" in doc["error"]["message"], doc
    # GETs are a page's to send (it cannot read the answer): no Origin check
    assert client.get("/version", headers={"Origin": "http://evil.example"}).status_code == 200


def test_a_listed_or_starred_origin_may_post():
    for origins, origin in (((UI,), UI), (("*",), "https://chat.example.org")):
        client = _client(origins, keys=())
        status, doc = _bodyless_cancel(client, {"Origin": origin})
        assert status == 404, doc
        got = client.post("/v1/completions", json=BODY, headers={"Origin": origin})
        assert got.status_code == 200, got.text


def test_a_listed_origins_preflight_is_answered_without_a_key():
    client = _client([UI])
    got = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert got.status_code == 200, got.text
    assert got.headers["access-control-allow-origin"] == UI
    assert "POST" in got.headers["access-control-allow-methods"]
    # any header the page's client sends: the requested ones are allowed back
    allowed = got.headers["access-control-allow-headers"]
    assert allowed == PREFLIGHT["Access-Control-Request-Headers"]
    # Anthropic's browser client: its key header and version
    anthropic = {**PREFLIGHT, "Access-Control-Request-Headers": "x-api-key,anthropic-version"}
    assert client.options("/v1/messages", headers=anthropic).status_code == 200


def test_a_listed_origins_page_may_read_answers_and_errors():
    client = _client([UI])
    key = {"Origin": UI, "Authorization": f"Bearer {KEY}"}
    got = client.post("/v1/completions", json=BODY, headers=key)
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == UI
    assert "x-request-id" in got.headers["access-control-expose-headers"]
    # the key is still checked on the request itself, and the refusal is readable by the page
    got = client.post("/v1/completions", json=BODY, headers={"Origin": UI})
    assert got.status_code == 401 and got.headers["access-control-allow-origin"] == UI
    got = client.post(
        "/v1/completions", content=b"{}", headers={**key, "Content-Type": "text/plain"}
    )
    assert got.status_code == 415 and got.headers["access-control-allow-origin"] == UI


def test_another_origin_is_refused_and_gets_nothing_readable():
    client = _client([UI])
    evil = {**PREFLIGHT, "Origin": "http://evil.example"}
    got = client.options("/v1/completions", headers=evil)
    assert got.status_code == 400 and "access-control-allow-origin" not in got.headers
    got = client.post(
        "/v1/completions",
        json=BODY,
        headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"},
    )
    assert "access-control-allow-origin" not in got.headers


def test_any_origin_with_a_star():
    got = _client(["*"], keys=()).options(
        "/v1/completions", headers={**PREFLIGHT, "Origin": "https://chat.example.org"}
    )
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == "*"


# ---- the YAML key, the flag and the way to the front -------------------------------------------
def test_cors_allowed_origins_default_and_checks():
    assert DeployConfig().router.cors_allowed_origins == []
    # lowercased, as browsers send an origin
    ok = validate_config({"router": {"cors_allowed_origins": [UI, "HTTPS://Chat.Example.org"]}})
    assert ok.router.cors_allowed_origins == [UI, "https://chat.example.org"]
    assert validate_config({"router": {"cors_allowed_origins": ["*"]}}).router.cors_allowed_origins
    for bad, words in (
        (UI, "Input should be a valid list"),
        ([f"{UI}/"], "no trailing slash"),
        ([f"{UI}/chat"], "is not an origin"),
        (["localhost:3000"], "is not an origin"),
        (["null"], "is not an origin"),
        ([""], "is not an origin"),
        (["*", UI], "'*' allows every origin: give it alone"),
        ([3000], "Input should be a valid string"),
    ):
        with pytest.raises(ConfigError) as e:
            validate_config({"router": {"cors_allowed_origins": bad}})
        assert "router.cors_allowed_origins" in str(e.value) and words in str(e.value), e.value


def _with_flag(value: str) -> DeployConfig:
    """The default deployment with `pdserve up --allowed-origins value` (pdserve/up_flags.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_up_flags(parser)
    return up_config(parser.parse_args(["--allowed-origins", value]))[0]


def test_allowed_origins_flag_is_vllms_json_list_or_commas():
    assert _with_flag(f'["{UI}"]').router.cors_allowed_origins == [UI]
    assert _with_flag('["*"]').router.cors_allowed_origins == ["*"]
    assert _with_flag(f"{UI}, https://a.example").router.cors_allowed_origins == [
        UI,
        "https://a.example",
    ]
    for bad in ("", f'["{UI}"', f'["{UI}/"]'):
        with pytest.raises(ConfigError) as e:
            _with_flag(bad)
        assert str(e.value).startswith("--allowed-origins: "), e.value


def test_the_key_reaches_the_fronts_settings(monkeypatch):
    """deploy/launcher.py passes the key to RouterConfig, and the router (router/server.py) to
    the HTTP front's settings, which build_app reads."""
    from pdserve.router import server

    cfg = validate_config({"router": {"cors_allowed_origins": [UI]}})
    config = router_config_of(cfg, monkeypatch, INSECURE)
    assert config.http_cors_allowed_origins == (UI,)
    # the real Router, not started: only its HTTP front's settings are made
    real = object.__new__(server.Router)
    real.config = config
    encoder = SimpleNamespace(max_prompt_bytes=1 << 16)
    real.servicer = SimpleNamespace(tokenizer=None, encoder=encoder, loras=None)
    real.servicer.pause = real.servicer.weights = real.servicer.sleep = None
    real.pool = None
    real.metrics_registry = None
    real.metrics = SimpleNamespace(observe_http_error=lambda status: None)
    options = SimpleNamespace(
        model_id="m", max_model_len=64, labels=(), pair_encoding=True, image_token_id=None
    )
    front = real._http_front(options)
    try:
        assert front.settings.cors_allowed_origins == (UI,)
    finally:
        front.stop()  # removes its private folder
