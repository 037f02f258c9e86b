"""Fixtures of the integration tests' HTTP clusters: one prefill and one decode worker on the tiny
chat model per test module (`workers`), the routers in front of them (`router`, `colocated`,
`secured`), the engine alone on the same model (`llm`), and `idle`, which waits for the pools to
drain after a test. The cluster itself and the raw HTTP helpers are tests/helpers/http.py's."""

from __future__ import annotations

import pytest

from helpers.http import KEY, KEY2, MAX_MODEL_LEN, Workers, chat_model
from helpers.threads import wait_until
from helpers.tls import tls_files
from pdserve.engine import LLM
from pdserve.protos.security import TLSConfig


@pytest.fixture(scope="module", name="workers")
def fixture_workers(tiny_models, tmp_path_factory, one_thread):
    w = Workers(chat_model(tiny_models, tmp_path_factory))
    yield w
    w.stop()


@pytest.fixture(scope="module", name="router")
def fixture_router(workers):
    r = workers.router()
    yield r
    r.stop()


@pytest.fixture(scope="module", name="colocated")
def fixture_colocated(workers):
    """A colocated router on the same decode worker: it prefills there too, so every token's
    logprob comes from one engine."""
    r = workers.router(colocated=True)
    yield r
    r.stop()


@pytest.fixture(scope="module", name="secured")
def fixture_secured(workers, tmp_path_factory):
    """A router with two API keys and TLS on both fronts (the same certificate)."""
    files = tls_files(tmp_path_factory.mktemp("tls"))
    tls = TLSConfig(b"", files["cert"].read_bytes(), files["key"].read_bytes())
    r = workers.router(api_keys=(KEY, KEY2), client_tls=tls)
    r.ca_file = str(files["ca"])
    r.ca_pem = files["ca"].read_bytes()
    yield r
    r.stop()


@pytest.fixture(name="idle")
def fixture_idle(workers):
    yield workers
    wait_until(workers.idle, 5, f"the pools are not idle: {workers.stats()}")


@pytest.fixture(scope="module", name="llm")
def fixture_llm(workers):
    engine = LLM(workers.model_dir, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.shutdown()
