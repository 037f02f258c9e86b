"""Image links (router/openai/media.py) without a network: which hosts a deployment's
router.allowed_media_domains lets the router fetch from (protos/media_domains.py), the YAML key's
check, an image_url link kept unfetched by the body's validation, and the refusals made before any
fetch: no host allowed, a host not allowed, a user name in the link, and a link on an API that
does not fetch. Fetching itself, from a local server: tests/integration/test_llava_cluster.py."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.protos.media_domains import check_media_domain, media_host_allowed
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.media import fetch_images
from pdserve.router.openai.protocol import ChatCompletionRequest, chat_messages


def test_a_listed_domain_takes_its_hosts_and_an_address_only_itself():
    domains = tuple(check_media_domain(d) for d in ("Example.COM", "[::1]", "10.0.0.7"))
    assert domains == ("example.com", "::1", "10.0.0.7")
    for host in ("example.com", "img.example.com", "a.b.example.com", "::1", "10.0.0.7"):
        assert media_host_allowed(host, domains), host
    for host in ("badexample.com", "example.com.evil.org", "10.0.0.8", "127.0.0.1", "com"):
        assert not media_host_allowed(host, domains), host
    for bad in ("https://example.com", "example.com:8080", "example.com/img", "", "a..b", "-a.com"):
        with pytest.raises(ValueError, match="host name"):
            check_media_domain(bad)


def test_the_yaml_key_is_checked_and_kept_lowercased():
    cfg = validate_config({"router": {"allowed_media_domains": ["Images.Example.com"]}})
    assert cfg.router.allowed_media_domains == ["images.example.com"]
    with pytest.raises(ConfigError, match="host name"):
        validate_config({"router": {"allowed_media_domains": ["https://example.com/"]}})


def _chat(url: str) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ]
        }
    )


def test_a_link_is_kept_for_the_chat_route_and_refused_before_any_fetch():
    body = _chat("https://img.example.com/cat.png")
    part = body.messages[0].content[1]
    assert part.image_url.link == "https://img.example.com/cat.png" and part.image() == b""
    cases = {
        (): "allowed_media_domains is empty",
        ("example.org",): "not from img.example.com",
    }
    for domains, said in cases.items():
        with pytest.raises(ApiError, match=said) as refused:
            asyncio.run(fetch_images(body.messages, domains))
        assert refused.value.status == 400
    with pytest.raises(ApiError, match="no user name or password"):
        asyncio.run(fetch_images(_chat("https://u:p@example.com/a.png").messages, ("example.com",)))
    # a route that does not fetch (here the conversion itself) refuses an unfetched link
    with pytest.raises(ApiError, match="fetched for /v1/chat/completions only"):
        chat_messages(body)
    # any other scheme is no link: a data URL or nothing
    with pytest.raises(ValueError, match="base64 data URL"):
        _chat("ftp://example.com/a.png")


def test_the_up_flag_is_vllms_and_reaches_the_router(monkeypatch):
    import argparse

    from helpers.deploy_config import router_config_of
    from pdserve.protos.security import INSECURE
    from pdserve.up_flags import add_up_flags, up_config

    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_up_flags(parser)
    args = parser.parse_args(["--allowed-media-domains", "Example.com, cdn.example.org"])
    cfg = up_config(args)[0]
    assert cfg.router.allowed_media_domains == ["example.com", "cdn.example.org"]
    router = router_config_of(cfg, monkeypatch, INSECURE)  # (what `up` starts the router with)
    assert router.http_allowed_media_domains == ("example.com", "cdn.example.org")
    with pytest.raises(ConfigError, match="--allowed-media-domains"):
        up_config(parser.parse_args(["--allowed-media-domains", " , "]))
