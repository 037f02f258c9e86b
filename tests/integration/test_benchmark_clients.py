"""The benchmark clients vLLM users point at a server, run unchanged against pdserve (issue 52's
must-show 0) on an in-process cluster: guidellm 0.8.1's synthetic run with its sweep profile
(synchronous, throughput, then constant rates) on the chat endpoint, and its completions and
Responses formats; then inference-perf 0.7.0's constant-rate stages (completions, random
lengths). Every benchmark must end with no errored request; requests a client leaves unfinished
as its time runs out (guidellm's "incomplete") are allowed, and must leave the router's admission
queue. `pdserve up` with the real SmolLM2, and inference-perf's sweep (chat), are
tests/e2e/test_benchmark_clients_up.py's; scripts/test_clients.sh runs the two files one test at
a time.

The cluster is a router (max_inflight=4, so guidellm's throughput stage, 512 requests at once,
waits in the admission queue) in front of a prefill and a decode worker on a tiny random model
with a byte-level tokenizer (any text tokenizes), which both clients also load as their
tokenizer. Each test is skipped, saying so, where its client is not installed
(helpers/bench_clients.py says how to install them); each client runs as a subprocess with short
stages (a few seconds each)."""

from __future__ import annotations

import pytest

from helpers.bench_clients import RANDOM_LENGTHS, constant_stages, guidellm, inference_perf, needs
from helpers.http import Workers
from helpers.structured import byte_level_model
from helpers.threads import wait_until

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory, one_thread):
    src, _ = tiny_models("llama-gqa")
    model_dir = byte_level_model(src, tmp_path_factory.mktemp("byte-bench"), TEMPLATE)
    w = Workers(model_dir, max_model_len=512)
    r = w.router(max_inflight=4, max_queued=1024, max_queue_wait_s=120.0)
    yield r, model_dir
    r.stop()
    w.stop()


def _settled(router) -> None:
    """Every request the client left behind has left the router's admission queue and slots."""
    admission = router.servicer.admission
    wait_until(
        lambda: admission.queued() == 0 and admission.running() == 0,
        120,
        f"the router still holds requests: {admission.queued()} queued, "
        f"{admission.running()} running",
    )


def _no_errors(runs: list[tuple[str, dict]]) -> list[str]:
    for strategy, made in runs:
        assert made["errored"] == 0 and made["successful"] > 0, (strategy, made)
    return [strategy for strategy, _ in runs]


@needs("guidellm", "guidellm==0.8.1")
def test_guidellm_sweep_has_no_errored_request(cluster, tmp_path):
    router, model_dir = cluster
    url = f"http://{router.http_address}"
    runs = guidellm(url, "tiny", model_dir, tmp_path / "sweep.json", "kind=sweep,sweep_size=3")
    assert _no_errors(runs) == ["synchronous", "throughput", "constant"], runs
    _settled(router)


@needs("guidellm", "guidellm==0.8.1")
@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/responses"])
def test_guidellm_other_formats_have_no_errored_request(cluster, tmp_path, request_format):
    router, model_dir = cluster
    url = f"http://{router.http_address}"
    out = tmp_path / "run.json"
    runs = guidellm(url, "tiny", model_dir, out, "kind=synchronous", request_format, seconds=3)
    assert _no_errors(runs) == ["synchronous"]
    _settled(router)


@needs("inference_perf", "inference-perf==0.7.0")
def test_inference_perf_stages_have_no_failure(cluster, tmp_path):
    router, model_dir = cluster
    url = f"http://{router.http_address}"
    load = constant_stages((5, 20), 3)
    reports = inference_perf(url, "tiny", model_dir, tmp_path, "completion", RANDOM_LENGTHS, load)
    assert len(reports) == 3, reports  # two stages and the summary
    assert all(ok > 0 and failed == 0 for _, ok, failed in reports), reports
    _settled(router)
