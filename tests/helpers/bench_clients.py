"""Running the benchmark clients vLLM users point at a server, guidellm and inference-perf, as
subprocesses against a pdserve HTTP front, and reading their JSON reports: what
tests/integration/test_benchmark_clients.py (an in-process cluster) and
tests/e2e/test_benchmark_clients_up.py (`pdserve up`) share.

Not a test module: imported as `from helpers.bench_clients import ...`. The clients are not
project dependencies (pyproject.toml's `clients` extra; `needs` skips a test, saying so, where
one is missing, except in the clients' lane, scripts/test_clients.sh, which CI runs: it sets
PDSERVE_REQUIRE_CLIENTS=1 and a missing client fails there). That script installs them in a venv
of its own; by hand: `pip install guidellm==0.8.1`, then inference-perf (which declares
Python >= 3.12 and pins transformers==5.13.0, but runs on 3.11 and on the project's transformers)
without its declared dependencies: `pip install --no-deps --ignore-requires-python
inference-perf==0.7.0`, then `pip install aiohttp av tiktoken google-cloud-storage` (what it
imports; datasets, aiofiles and uvloop come with guidellm). pyproject.toml's `clients` extra
holds guidellm only, for that reason."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

# A bound for a loaded machine, never a speed claim: the longest run seen took 119 s (guidellm's
# sweep through `pdserve up`, at a load average of 20 on 2 cores, 2026-11-30).
RUN_TIMEOUT_S = 420
# A client run that passes its bound is killed (with its worker processes) and run once more:
# guidellm 0.8.1 was seen to hang at the start of a synchronous run with no connection open to
# the server (so with nothing of pdserve's to wait for), once in a loaded run and not when run
# again; its upstream tracker has similar hangs (vllm-project/guidellm issues 431 and 1152).
HANG_RETRIES = 1
# guidellm's scheduler spreads its requests over worker processes, 10 by default
# (GUIDELLM__MAX_WORKER_PROCESSES). On CI's 2 cores those ten took most of the CPU in its
# throughput stage (512 requests at once) and starved the server beside them: once, under the
# suite's other test process, the stage finished 6 requests in its 4 s, guidellm's sweep measured
# a rate of 0 and ended without its constant stage. One worker process sends all 512 (each is an
# asyncio task in it).
GUIDELLM_ENV = {"GUIDELLM__MAX_WORKER_PROCESSES": "1"}


REQUIRE_ENV = "PDSERVE_REQUIRE_CLIENTS"  # set by scripts/test_clients.sh: missing fails


def needs(module: str, pin: str):
    """A test decorator: skips the test where the client's module is not installed, or, in the
    clients' lane (PDSERVE_REQUIRE_CLIENTS=1), fails it."""
    missing = importlib.util.find_spec(module) is None
    why = f"{pin} is not installed (pyproject.toml's clients extra; helpers/bench_clients.py)"
    if os.environ.get(REQUIRE_ENV) != "1":
        return pytest.mark.skipif(missing, reason=why)

    def required(test):
        if not missing:
            return test

        @functools.wraps(test)  # keeps its fixtures and marks
        def fails(*args, **kwargs):
            pytest.fail(f"{why}, and {REQUIRE_ENV}=1 (the clients' lane) requires it")

        return fails

    return required


def run(args: list[str], what: str, env: dict | None = None) -> str:
    """The client's stdout; it must exit 0. It runs (with `env` added to this process's
    environment) in a process group of its own, so that a run past RUN_TIMEOUT_S is killed with
    the worker processes it spawned (not left running)."""
    for attempt in range(1 + HANG_RETRIES):
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # before it is reaped: the group is its own
            out, err = proc.communicate()
            if attempt < HANG_RETRIES:
                print(f"{what} ran past {RUN_TIMEOUT_S} s and was killed: once more\n{err[-2000:]}")
                continue
            pytest.fail(
                f"{what} ran past {RUN_TIMEOUT_S} s, {1 + HANG_RETRIES} times:\n{err[-3000:]}"
            )
        assert proc.returncode == 0, f"{what} failed:\n{out[-3000:]}\n{err[-3000:]}"
        return out
    raise AssertionError("unreachable")


def guidellm(
    url: str,
    model: str,
    tokenizer_dir,
    out,
    profile: str,
    request_format: str | None = None,
    seconds: float = 4,
    data: str = "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
) -> list[tuple[str, dict]]:
    """guidellm's run of `profile` against `url` (http://host:port): each benchmark's strategy and
    its request counts (successful, errored, incomplete, total)."""
    backend = f"kind=openai_http,target={url},model={model}"
    if request_format:
        backend += f",request_format={request_format}"
    args = [sys.executable, "-m", "guidellm", "run", "--backend", backend]
    args += ["--tokenizer", f"kind=hf_auto,model={tokenizer_dir}", "--profile", profile]
    args += ["--data", data, "--constraint", f"kind=max_duration,seconds={seconds}"]
    args += ["--output", f"kind=json,path={out}", "--disable-console"]
    run(args, f"guidellm ({profile}, {request_format or 'chat'})", GUIDELLM_ENV)
    return [
        (b["config"]["strategy"]["type_"], b["scheduler_metrics"]["requests_made"])
        for b in json.loads(out.read_text())["benchmarks"]
    ]


def inference_perf(
    url: str, model: str, tokenizer_dir, tmp_path, api: str, data: str, load: str
) -> list[tuple[str, int, int]]:
    """inference-perf's run with this api, data and load (YAML flow mappings): each stage's and the
    summary's (report name, successes, failures)."""
    config = tmp_path / "config.yaml"
    out = tmp_path / "reports"
    config.write_text(
        f"api: {{type: {api}, streaming: true}}\n"
        f"data: {data}\n"
        f"load: {load}\n"
        f"server: {{type: vllm, model_name: {model}, base_url: '{url}', "
        f"ignore_eos: {'true' if api == 'completion' else 'false'}}}\n"
        f"tokenizer: {{pretrained_model_name_or_path: '{tokenizer_dir}'}}\n"
        f"storage: {{local_storage: {{path: '{out}'}}}}\n"
    )
    code = "import sys; from inference_perf import main_cli; sys.exit(main_cli())"
    run([sys.executable, "-c", code, "--config_file", str(config)], f"inference-perf ({api})")
    stages = sorted(out.glob("stage_*_lifecycle_metrics.json"))
    assert stages, sorted(p.name for p in out.iterdir())
    counts = []
    for path in [*stages, out / "summary_lifecycle_metrics.json"]:
        report = json.loads(path.read_text())
        counts.append((path.name, report["successes"]["count"], report["failures"]["count"]))
    return counts


# inference-perf's loads and data for the runs the two files make
RANDOM_LENGTHS = (
    "{type: random, input_distribution: {min: 16, max: 64, mean: 32, std_dev: 8}, "
    "output_distribution: {min: 4, max: 16, mean: 8, std_dev: 2}}"
)
MOCK_CHAT = "{type: mock}"  # its random and synthetic data do not serve chat


def constant_stages(rates: tuple, duration: int) -> str:
    stages = ", ".join(f"{{rate: {r}, duration: {duration}}}" for r in rates)
    return f"{{type: constant, stages: [{stages}], num_workers: 2}}"


def sweep(num_requests: int, stage_duration: int) -> str:
    return (
        f"{{type: constant, num_workers: 2, sweep: {{type: linear, num_requests: {num_requests}, "
        f"timeout: 60, num_stages: 2, stage_duration: {stage_duration}}}}}"
    )
