"""The suite's fixtures and hooks: tiny random models built once per session, their HF greedy
references per module, one-thread torch for the engine tests, the GPU marker's skip, the fast
lane's guard, what a parallel run's processes share (tests/helpers/lanes.py: the `serial`
marker's lock and each process's torch threads) and the run's own pdserve cache
(tests/helpers/run_cache.py). Plain helpers live in tests/helpers/ (a package:
`from helpers.models import ...`); no test module imports this file."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import lanes, run_cache

# the fast lane's guard (tests/helpers/fast_lane.py): pytest finds hooks and fixtures by their
# names here
from helpers.fast_lane import (  # noqa: F401
    fast_lane_contract,
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
)
from helpers.models import (
    LENGTHS,
    NEW,
    SHARED_PREFIX,
    LazyGreedy,
    make_tiny_model,
    random_prompts,
)

# speculation's every path on tiny models (tests/helpers/spec.py), for the unit and gpu tests
from helpers.spec import always_speculate, bad_guesses  # noqa: F401

os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")


def pytest_configure(config):
    """The `serial` and `exclusive` markers and their locks under pytest-xdist
    (tests/helpers/lanes.py), and the run's own cache folder (tests/helpers/run_cache.py)."""
    for marker in lanes.MARKERS:
        config.addinivalue_line("markers", marker)
    config.pluginmanager.register(lanes, "pdserve-lanes")
    config.pluginmanager.register(run_cache, "pdserve-run-cache")


def pytest_runtest_setup(item):
    """Tests marked `gpu` (tests/gpu) need CUDA: skipped where torch sees no GPU, unless
    PDSERVE_GPU_TEST_DEVICE=cpu asks for a dry run of the ones that honour it (helpers/gpu.py)."""
    dry_run = os.environ.get("PDSERVE_GPU_TEST_DEVICE") == "cpu"
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available() and not dry_run:
        pytest.skip(
            "needs CUDA (a `gpu` test): run on a GPU machine with `pytest -m gpu tests/gpu`"
        )


torch.set_num_threads(lanes.torch_threads())


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> (model_dir, HF reference model), built once per session."""
    cache = {}

    def get(kind: str = "llama-gqa"):
        if kind not in cache:
            path = tmp_path_factory.mktemp(kind)
            cache[kind] = (str(path), make_tiny_model(path, kind))
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def one_thread():
    """A 64-wide model gains nothing from a second thread, and on a shared 2-core machine OpenMP
    spin-waiting made each step ~20x slower (58 ms vs 2 ms); restored after the module.
    The engine test modules use it for all their tests: pytestmark = usefixtures("one_thread")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def refs(tiny_models):
    """kind -> (model_dir, hf_model, prompts, HF greedy continuations, computed when a test first
    reads them); prompts end with three that share a 48-token prefix, so the prefix cache has
    something to hit."""
    cache = {}

    def get(kind):
        if kind not in cache:
            model_dir, hf = tiny_models(kind)
            prompts = random_prompts(LENGTHS, seed=11)
            prefix = random_prompts([SHARED_PREFIX], seed=12)[0]
            prompts += [prefix + tail for tail in random_prompts([3, 20, 33], seed=13)]
            cache[kind] = (model_dir, hf, prompts, LazyGreedy(hf, prompts, NEW))
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def model_dir(tiny_models, one_thread):
    """The tiny Llama (GQA) model's directory, for the router tests that start workers on it."""
    return tiny_models("llama-gqa")[0]
