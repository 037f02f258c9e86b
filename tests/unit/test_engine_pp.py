"""Pipeline parallelism, what needs no rank process: how the layers split into stages, and the
layouts refused before any rank starts (and without leaving a process group behind). The stages
themselves: tests/integration/test_engine_pp_ranks.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from helpers.engine import KV
from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig, _check_pipeline
from pdserve.engine.parallel import stage_layers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("layers,stages", [(30, 1), (30, 2), (30, 3), (30, 4), (30, 7), (5, 5)])
def test_stages_cover_the_layers_in_order(layers, stages):
    ranges = [stage_layers(layers, s, stages) for s in range(stages)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    sizes = [end - first for first, end in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes)  # the later stages take the extra layers


def test_thirty_layers_in_four_stages():
    assert [stage_layers(30, s, 4) for s in range(4)] == [(0, 7), (7, 14), (14, 22), (22, 30)]


def test_more_stages_than_layers_is_refused(refs):
    model_dir, *_ = refs("llama-gqa")  # 2 decoder layers
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds"):
        LLM(model_dir, kv_cache_memory=KV, pipeline_parallel_size=3)
    assert not dist.is_initialized()


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_bad_pipeline_size_is_refused(value):
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        EngineConfig(model="x", pipeline_parallel_size=value)


def test_every_family_may_run_in_stages():
    config = EngineConfig(model="x", pipeline_parallel_size=2)
    for arch in ("Gemma2ForCausalLM", "MixtralForCausalLM", "Qwen3ForCausalLM"):  # every family
        _check_pipeline(config, SimpleNamespace(num_layers=4, architecture=arch))
