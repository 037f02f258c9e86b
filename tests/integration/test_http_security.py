"""The OpenAI-compatible HTTP front (router/openai/app.py) secured and under stress: API keys on
the HTTP and gRPC fronts, HTTPS (with client certificates too), a full router's 429, no workers'
503, an HTTP port in use, and the CLI sending the key from the environment. The cluster and the
helpers are in helpers/http.py.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl

import grpc
import pytest

from helpers.http import (
    GOOD,
    KEY,
    KEY2,
    MAX_MODEL_LEN,
    MODEL,
    TIMEOUT,
    WRONG,
    C,
    assert_error,
    post,
    request,
    serves,
    split,
)
from helpers.tls import tls_files
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.protos.security import TLSConfig
from pdserve.router.server import Router, RouterConfig

openai = pytest.importorskip("openai")


# ---- API keys and HTTPS ------------------------------------------------------------------------
def test_keys_on_http_over_https(secured, idle, caplog):
    caplog.set_level(logging.DEBUG)
    ca = secured.ca_pem
    assert secured.http.scheme == "https"
    cases = [
        ({}, 401),
        ({"Authorization": f"Bearer {WRONG}"}, 401),
        ({"Authorization": f"Basic {KEY}"}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": f"Bearer {KEY}"}, 200),
        ({"Authorization": f"bearer {KEY2}"}, 200),
    ]
    for headers, want in cases:
        status, resp_headers, body = post(secured, C, GOOD, headers=headers, tls_ca=ca)
        if want == 401:
            err = assert_error(status, body, 401)
            assert err["code"] == "invalid_api_key" and resp_headers["www-authenticate"] == "Bearer"
            assert KEY not in body.decode() and WRONG not in body.decode()
        else:
            assert status == 200, body
    # /health stays open; /metrics and /v1/models need a key
    assert request(secured.http_address, "GET", "/health", tls_ca=ca)[0] == 200
    for path in ("/metrics", "/v1/models"):
        status, _, body = request(secured.http_address, "GET", path, tls_ca=ca)
        assert_error(status, body, 401)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert request(secured.http_address, "GET", path, headers=auth, tls_ca=ca)[0] == 200
    # plaintext HTTP to the HTTPS port gets nowhere
    with pytest.raises((http.client.HTTPException, OSError)):
        request(secured.http_address, "GET", "/health")
    assert KEY not in caplog.text and KEY2 not in caplog.text and WRONG not in caplog.text


def test_keys_on_grpc(secured, idle, caplog):
    caplog.set_level(logging.DEBUG)
    creds = grpc.ssl_channel_credentials(root_certificates=secured.ca_pem)
    request_ = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=pdserve_pb2.SamplingParams(temperature=0, max_tokens=3),
    )
    with grpc.secure_channel(secured.address, creds) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        for metadata in ((), (("authorization", f"Bearer {WRONG}"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request_, metadata=metadata, timeout=TIMEOUT))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert KEY not in e.value.details() and WRONG not in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(pdserve_pb2.ListModelsRequest(), metadata=metadata, timeout=TIMEOUT)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for key in (KEY, KEY2):
            out = list(
                stub.Generate(
                    request_, metadata=(("authorization", f"Bearer {key}"),), timeout=TIMEOUT
                )
            )
            assert out[-1].finish.usage.completion_tokens == 3
        # health stays open without a key
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert "API key" in caplog.text  # the refusal was logged, the keys were not
    assert KEY not in caplog.text and KEY2 not in caplog.text and WRONG not in caplog.text


def test_openai_client_over_https_with_a_key(secured, idle):
    http_client = openai.DefaultHttpx2Client(
        verify=ssl.create_default_context(cafile=secured.ca_file)
    )
    c = openai.OpenAI(
        base_url=f"https://{secured.http_address}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=TIMEOUT,
        http_client=http_client,
    )
    assert [m.id for m in c.models.list()] == [MODEL]
    got = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "t5"}], max_tokens=3
    )
    assert got.usage.completion_tokens == 3
    text = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=MODEL, prompt="t5", max_tokens=3, stream=True)
        if ch.choices
    )
    assert isinstance(text, str)
    bad = openai.OpenAI(
        base_url=f"https://{secured.http_address}/v1",
        api_key=WRONG,
        max_retries=0,
        timeout=TIMEOUT,
        http_client=openai.DefaultHttpx2Client(
            verify=ssl.create_default_context(cafile=secured.ca_file)
        ),
    )
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="t5", max_tokens=2)
    assert repr(secured.config).count(KEY) == 0 and "ClientKeys(2 keys)" in repr(
        secured.http.settings.keys
    )


# ---- overload and no workers: 429 and 503 ------------------------------------------------------
def test_a_full_router_answers_429_with_retry_after(workers, idle):
    full = workers.router(max_inflight=1, max_queued=0)  # no admission queue: refused at once
    host, port = split(full.http_address)
    body = json.dumps(
        {**GOOD, "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True, "stream": True}
    ).encode()
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            got = b""
            while b"data: " not in got:  # the one admitted request is streaming
                got += s.recv(4096)
            status, headers, resp = post(full, C, GOOD)
            err = assert_error(status, resp, 429)
            assert err["code"] == "rate_limit_exceeded" and headers["retry-after"] == "1"
    finally:
        full.stop()


def test_no_workers_is_503_and_health_says_so(workers):
    empty = Router(
        RouterConfig(
            model=workers.model_dir, model_id=MODEL, max_model_len=MAX_MODEL_LEN, http_port=0
        )
    ).start()
    private_dir = empty.http._dir
    try:
        status, _, body = request(empty.http_address, "GET", "/health")
        assert "worker" in assert_error(status, body, 503)["message"]
        status, headers, body = post(empty, C, GOOD)
        assert_error(status, body, 503) and headers["retry-after"] == "1"
    finally:
        empty.stop()
    import os

    assert not os.path.exists(private_dir)  # the Unix socket's directory goes with the router
    with pytest.raises(OSError):
        request(empty.http_address, "GET", "/health")


def test_https_with_client_certificates_like_the_grpc_port(workers, tmp_path):
    """client_tls with a CA: like the gRPC port, HTTPS then needs a client certificate it
    signed (the test's certificate serves as both)."""
    files = tls_files(tmp_path)
    ca, cert, key = (files[k].read_bytes() for k in ("ca", "cert", "key"))
    mutual = workers.router(client_tls=TLSConfig(ca, cert, key))
    try:
        host, port = split(mutual.http_address)
        anonymous = ssl.create_default_context(cafile=str(files["ca"]))
        with pytest.raises((ssl.SSLError, OSError, http.client.HTTPException)):
            conn = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=anonymous)
            conn.request("GET", "/health")
            conn.getresponse().read()
        known = ssl.create_default_context(cafile=str(files["ca"]))
        known.load_cert_chain(str(files["cert"]), str(files["key"]))
        conn = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=known)
        conn.request(
            "POST",
            "/v1/completions",
            # ignore_eos: a random model may end its answer at the first token; this is about TLS
            body=json.dumps({**GOOD, "ignore_eos": True}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        assert resp.status == 200, doc
        assert doc["usage"]["completion_tokens"] == 2, doc
        assert doc["choices"][0]["finish_reason"] == "length", doc
        conn.close()
    finally:
        mutual.stop()


def test_an_http_port_in_use_fails_the_start_naming_it(workers, router):
    _, port = split(router.http_address)
    with pytest.raises(OSError, match=f"cannot listen for HTTP on 127.0.0.1:{port}"):
        workers.router(http_port=port)
    serves(router)  # the one listening there is untouched


def test_pdserve_generate_sends_the_key_from_the_environment(secured, idle, monkeypatch, capsys):
    from pdserve.cli import main

    argv = ["generate", "t5 t6", "--router", secured.address, "--tls-ca", secured.ca_file]
    argv += ["--max-tokens", "2"]
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_API_KEY", KEY2)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "2 generated" in err and KEY2 not in err
    # a `length` stop ends mid-line: the text's line ends before the summary, which starts a
    # line of its own even with stdout and stderr in one pipe (issue 28)
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pdserve", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120, env={**os.environ, "PDSERVE_API_KEY": KEY2},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    *text, summary = done.stdout.rstrip("\n").split("\n")
    assert text and summary.startswith("[") and "finish=length" in summary, done.stdout


def test_pdserve_bench_sends_the_key_from_the_environment(workers, idle, monkeypatch):
    """The load generator behind `pdserve bench` reads PDSERVE_API_KEY like `pdserve generate`."""
    from pdserve.tuning import loadgen

    keyed = workers.router(api_keys=(KEY,))
    try:
        monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
        with pytest.raises(loadgen.LoadgenError, match="UNAUTHENTICATED.*PDSERVE_API_KEY"):
            loadgen.model_card(keyed.address, MODEL)
        monkeypatch.setenv("PDSERVE_API_KEY", KEY)
        assert loadgen.model_card(keyed.address, MODEL).id == MODEL
    finally:
        keyed.stop()
