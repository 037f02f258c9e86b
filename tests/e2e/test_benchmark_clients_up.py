"""The benchmark clients vLLM users point at a server against `up()` (the `pdserve up` code path)
on a local Ray with the real SmolLM2, 1P+1D (issue 52's must-show 0): guidellm 0.8.1's synthetic
sweep (synchronous, throughput at 512 requests at once, which wait in the router's admission
queue, then a constant rate) and inference-perf 0.7.0's constant-rate stages and its sweep, each
with no errored request. The in-process lane with a tiny model, and guidellm's completions and
Responses formats, are tests/integration/test_benchmark_clients.py's; how to install the clients
is helpers/bench_clients.py's docstring.

The clients run on the deployment's own CPUs (2 for Ray here), so a saturated machine can hold an
engine inside one turn for longer than the router's default stall bound (5 s), which would take
a live worker for a hung one: the deployment raises that bound (and the silence bounds) so that
what is measured is the clients' requests, not the failure detector, which the chaos lane tests."""

from __future__ import annotations

import pytest

from helpers.bench_clients import (
    MOCK_CHAT,
    RANDOM_LENGTHS,
    constant_stages,
    guidellm,
    inference_perf,
    needs,
    sweep,
)
from helpers.ray_cluster import pool_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(ray_session):
    from pdserve.deploy.config.load import validate_config
    from pdserve.deploy.launcher import up
    from pdserve.engine.loader import resolve_model

    config = validate_config(
        {
            "model": "smollm2",
            "dtype": "float32",
            "pools": {"prefill": pool_spec(1), "decode": pool_spec(1)},
            "router": {
                "port": 0,
                "http_port": 0,
                "worker_stall_s": 60,
                "worker_down_s": 10,
                "worker_silence_s": 30,
            },
        }
    )
    cluster = up(config, block=False)
    try:
        yield cluster, str(resolve_model("smollm2"))
    finally:
        cluster.stop()


@needs("guidellm", "guidellm==0.8.1")
def test_guidellm_sweep_through_up_has_no_errored_request(deployment, tmp_path):
    cluster, model_dir = deployment
    runs = guidellm(
        cluster.http_url,
        "smollm2",
        model_dir,
        tmp_path / "sweep.json",
        "kind=sweep,sweep_size=3",
        seconds=15,
        data="kind=synthetic_text,prompt_tokens=32,output_tokens=8",
    )
    assert [s for s, _ in runs] == ["synchronous", "throughput", "constant"], runs
    assert all(made["errored"] == 0 for _, made in runs), runs
    assert all(made["successful"] > 0 for _, made in runs), runs


@needs("inference_perf", "inference-perf==0.7.0")
@pytest.mark.parametrize(
    "api, data, load",
    [
        ("completion", RANDOM_LENGTHS, constant_stages((1, 4), 10)),
        ("chat", MOCK_CHAT, sweep(20, 10)),
    ],
    ids=["constant-stages", "sweep"],
)
def test_inference_perf_through_up_has_no_failure(deployment, tmp_path, api, data, load):
    cluster, model_dir = deployment
    reports = inference_perf(cluster.http_url, "smollm2", model_dir, tmp_path, api, data, load)
    assert len(reports) == 3, reports
    assert all(ok > 0 and failed == 0 for _, ok, failed in reports), reports
