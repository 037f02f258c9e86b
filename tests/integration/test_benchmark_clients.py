"""The benchmark clients vLLM users point at a server, run unchanged against pdserve (issue 52's
must-show 0): guidellm 0.8.1's synthetic run with its sweep profile (synchronous, throughput,
then constant rates) on the chat endpoint, and its completions and Responses formats; then
inference-perf 0.7.0's constant-rate stages (completions, random lengths) and its sweep (chat).
Every benchmark must end with no errored request; requests a client leaves unfinished as its
time runs out (guidellm's "incomplete") are allowed, and must leave the router's admission queue.

The cluster is a router (max_inflight=4, so guidellm's throughput stage, 512 requests at once,
waits in the admission queue) in front of a prefill and a decode worker on a tiny random model
with a byte-level tokenizer (any text tokenizes), which both clients also load as their
tokenizer. The clients are not project dependencies: each test is skipped, saying so, where its
client is not installed. Each client runs as a subprocess with short stages (a few seconds each).

Installing them (pyproject.toml's `clients` extra): `pip install -e '.[dev,clients]'`. On Python
3.11, inference-perf (which declares Python >= 3.12 and pins transformers==5.13.0, but runs on 3.11
and on the project's transformers) goes in by hand: `pip install --no-deps
--ignore-requires-python inference-perf==0.7.0` then `pip install aiohttp av tiktoken
google-cloud-storage` (what it imports; datasets, aiofiles and uvloop come with guidellm)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from helpers.http import Workers
from helpers.structured import byte_level_model
from helpers.threads import wait_until

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
RUN_TIMEOUT_S = 900  # a bound for a loaded machine, never a speed claim


def _needs(module: str, pin: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"{pin} is not installed (pyproject.toml's clients extra; this module's docstring)",
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


def _run(args: list[str], what: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _settled(router) -> None:
    """Every request the client left behind has left the router's admission queue and slots."""
    admission = router.servicer.admission
    wait_until(
        lambda: admission.queued() == 0 and admission.running() == 0,
        120,
        f"the router still holds requests: {admission.queued()} queued, "
        f"{admission.running()} running",
    )


def _guidellm(router, model_dir, out, profile: str, request_format=None, seconds=4) -> list:
    backend = f"kind=openai_http,target=http://{router.http_address},model=tiny"
    if request_format:
        backend += f",request_format={request_format}"
    _run(
        [
            sys.executable,
            "-m",
            "guidellm",
            "run",
            "--backend",
            backend,
            "--tokenizer",
            f"kind=hf_auto,model={model_dir}",
            "--profile",
            profile,
            "--data",
            "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
            "--constraint",
            f"kind=max_duration,seconds={seconds}",
            "--output",
            f"kind=json,path={out}",
            "--disable-console",
        ],
        f"guidellm ({profile}, {request_format or 'chat'})",
    )
    benchmarks = json.loads(out.read_text())["benchmarks"]
    for b in benchmarks:
        made = b["scheduler_metrics"]["requests_made"]
        strategy = b["config"]["strategy"]["type_"]
        assert made["errored"] == 0 and made["successful"] > 0, (strategy, made)
    return [b["config"]["strategy"]["type_"] for b in benchmarks]


@_needs("guidellm", "guidellm==0.8.1")
def test_guidellm_sweep_has_no_errored_request(cluster, tmp_path):
    router, model_dir = cluster
    kinds = _guidellm(router, model_dir, tmp_path / "sweep.json", "kind=sweep,sweep_size=3")
    assert kinds == ["synchronous", "throughput", "constant"], kinds
    _settled(router)


@_needs("guidellm", "guidellm==0.8.1")
@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/responses"])
def test_guidellm_other_formats_have_no_errored_request(cluster, tmp_path, request_format):
    router, model_dir = cluster
    out = tmp_path / "run.json"
    kinds = _guidellm(router, model_dir, out, "kind=synchronous", request_format, seconds=3)
    assert kinds == ["synchronous"]
    _settled(router)


def _inference_perf(router, model_dir, tmp_path, api: str, data: str, load: str) -> list:
    config = tmp_path / "config.yaml"
    out = tmp_path / "reports"
    config.write_text(
        f"api: {{type: {api}, streaming: true}}\n"
        f"data: {data}\n"
        f"load: {load}\n"
        f"server: {{type: vllm, model_name: tiny, base_url: 'http://{router.http_address}', "
        f"ignore_eos: {'true' if api == 'completion' else 'false'}}}\n"
        f"tokenizer: {{pretrained_model_name_or_path: '{model_dir}'}}\n"
        f"storage: {{local_storage: {{path: '{out}'}}}}\n"
    )
    code = "import sys; from inference_perf import main_cli; sys.exit(main_cli())"
    _run([sys.executable, "-c", code, "--config_file", str(config)], f"inference-perf ({api})")
    stages = sorted(out.glob("stage_*_lifecycle_metrics.json"))
    assert stages, list(out.iterdir())
    counts = []
    for path in [*stages, out / "summary_lifecycle_metrics.json"]:
        report = json.loads(path.read_text())
        assert report["failures"]["count"] == 0, (path.name, report["failures"])
        counts.append(report["successes"]["count"])
    assert all(c > 0 for c in counts), counts
    return counts


@_needs("inference_perf", "inference-perf==0.7.0")
def test_inference_perf_constant_stages_have_no_failure(cluster, tmp_path):
    router, model_dir = cluster
    data = (
        "{type: random, input_distribution: {min: 16, max: 64, mean: 32, std_dev: 8}, "
        "output_distribution: {min: 8, max: 32, mean: 16, std_dev: 4}}"
    )
    load = "{type: constant, stages: [{rate: 5, duration: 3}, {rate: 20, duration: 3}], num_workers: 2}"
    counts = _inference_perf(router, model_dir, tmp_path, "completion", data, load)
    assert len(counts) == 3  # two stages and the summary
    _settled(router)


@_needs("inference_perf", "inference-perf==0.7.0")
def test_inference_perf_sweep_has_no_failure(cluster, tmp_path):
    router, model_dir = cluster
    load = (
        "{type: constant, num_workers: 2, sweep: {type: linear, num_requests: 40, timeout: 30, "
        "num_stages: 2, stage_duration: 3}}"
    )
    counts = _inference_perf(router, model_dir, tmp_path, "chat", "{type: mock}", load)
    assert len(counts) == 3
    _settled(router)
