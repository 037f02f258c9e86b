"""`pdserve bench` with `vllm bench serve`'s command line against an in-process tiny-model cluster
(router + one prefill + one decode worker): the router sends 4 tokens a message
(router.stream_interval), so vLLM's ITL (one gap per message) and pdserve's per-token split differ,
and the result file has vLLM's flat keys. And against routers with and without router.tls: the
--tls-* options reach a TLS router, and a TLS mismatch either way is said as such. The same on a
fake stub: tests/unit/test_bench_vllm.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.tls import tls_files
from helpers.worker import start_decode, start_prefill, start_router
from pdserve.cli import main

MAX_MODEL_LEN = 256
OUTPUT = 13


@pytest.fixture(scope="module")
def interval4(tiny_models, one_thread):
    """A router that holds a stream's tokens until 4 are new (then one message)."""
    model = tiny_models("llama-gqa")[0]
    engine = dict(max_model_len=MAX_MODEL_LEN)
    decode = start_decode(model, engine=engine, lease_ms=5000)
    prefill = start_prefill(model, engine=engine)
    router = start_router(
        model, decode, prefill, max_model_len=MAX_MODEL_LEN, max_inflight=16, stream_interval=4
    )
    yield router
    router.stop()
    prefill.stop()
    decode.stop()


def test_a_vllm_bench_serve_command_line_runs_and_writes_vllms_keys(
    interval4, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("PDSERVE_NO_PROGRESS", "1")
    out = tmp_path / "vllm.json"
    rc = main(
        ["bench", "--router", interval4.address, "--dataset-name", "random",
         "--random-input-len", "8", "--random-output-len", str(OUTPUT), "--num-prompts", "4",
         "--request-rate", "inf", "--max-concurrency", "2", "--ignore-eos",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
         "--save-result", "--save-detailed", "--result-filename", str(out)]
    )  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "P50 ITL (ms):" in table
    result = json.loads(out.read_text())
    reqs, s = result["requests"], result["summary"]
    assert [r["error"] for r in reqs] == [""] * 4
    gaps, per_token = [], []
    for r in reqs:
        assert r["output_tokens"] == OUTPUT
        # vLLM's ITL: a gap per message after the first; 4 tokens a message leave fewer gaps
        # than tokens, while the per-token split keeps one per token after the first (on a busy
        # host a request's tokens may all come in one message: no gap at all)
        assert len(r["itl_s"]) < OUTPUT - 1 and len(r["itl_per_token_s"]) == OUTPUT - 1
        assert sum(r["itl_s"]) == pytest.approx(sum(r["itl_per_token_s"]))
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (OUTPUT - 1))
        gaps += r["itl_s"]
        per_token += r["itl_per_token_s"]
    assert gaps, "no request's tokens came in more than one message"
    assert s["mean_itl_ms"] == pytest.approx(np.mean(gaps) * 1e3)
    assert s["mean_itl_per_token_ms"] == pytest.approx(np.mean(per_token) * 1e3)
    assert s["max_concurrent_requests"] <= 2
    # the flat keys a script written for vLLM's result file reads
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert result[f"{stat}_{name}_ms"] == s[f"{stat}_{name}_ms"] >= 0
    for key in ("completed", "request_throughput", "output_throughput", "total_token_throughput"):
        assert result[key] == s[key]
    assert result["max_concurrency"] == 2 and result["num_prompts"] == 4
    assert [len(i) for i in result["itls"]] == [len(r["itl_s"]) for r in reqs]


# ---- TLS ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def routers(tiny_models, tmp_path_factory):
    """A router with router.tls and one without, neither with a worker (ListModels answers)."""
    from pdserve.protos.security import TLSConfig
    from pdserve.router.server import Router, RouterConfig

    files = tls_files(tmp_path_factory.mktemp("tls"))
    other = tls_files(tmp_path_factory.mktemp("other-ca"))
    model = tiny_models("llama-gqa")[0]
    tls = TLSConfig(b"", files["cert"].read_bytes(), files["key"].read_bytes())
    secured = Router(RouterConfig(model=model, port=0, client_tls=tls)).start()
    plain = Router(RouterConfig(model=model, port=0)).start()
    yield secured, plain, str(files["ca"]), str(other["ca"])
    secured.stop()
    plain.stop()


BENCH = ["--prompt-len", "4", "--output-len", "2", "--num-requests", "1", "--request-timeout", "5"]


def test_bench_reaches_a_tls_router_with_tls_ca_and_says_what_a_mismatch_is(routers, capsys):
    secured, plain, ca, other_ca = routers
    capsys.readouterr()
    # through TLS the router answers ListModels; the request fails: it has no worker
    assert main(["bench", "--router", secured.address, "--tls-ca", ca, *BENCH]) == 1
    assert "Failed requests:" in capsys.readouterr().out
    # plaintext to the TLS port: said as TLS, not as an unreachable router
    assert main(["bench", "--router", secured.address, *BENCH]) == 2
    err = capsys.readouterr().err
    assert "speaks TLS" in err and "--tls-ca" in err and "unreachable" not in err
    # TLS to a plaintext router
    assert main(["bench", "--router", plain.address, "--tls-ca", ca, *BENCH]) == 2
    err = capsys.readouterr().err
    assert "does not speak TLS" in err and "unreachable" not in err
    # a CA that did not sign the router's certificate
    assert main(["bench", "--router", secured.address, "--tls-ca", other_ca, *BENCH]) == 2
    assert "the TLS handshake failed" in capsys.readouterr().err
