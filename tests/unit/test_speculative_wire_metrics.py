"""Speculative decoding on the wire and in the metrics (issue 31): a request's opt-out, the HTTP
body's `speculative` (router/openai/protocol.py) carried in pdserve.v1.SamplingParams.speculative
(router/openai/protocol.py) and built into the engine's SamplingParams on the worker
(worker_common/errors.py build_params); and each worker's counters, read from the engine's
spec_stats() into WorkerStats and exposed by the router under vLLM's names
(router/worker_metrics.py). No socket: the collector reads a stand-in pool."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.metrics import exposition
from pdserve.router.openai.errors import validation_error
from pdserve.router.openai.protocol import (
    KNOWN_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from pdserve.router.worker_metrics import WorkerCollector
from pdserve.worker_common.errors import build_params, spec_stats

MESSAGES = [{"role": "user", "content": "hi"}]
LABELS = {"model_name": "m", "role": "decode", "worker": "decode-0"}


def _body(cls, **fields):
    base = {"messages": MESSAGES} if cls is ChatCompletionRequest else {"prompt": "hi"}
    return cls.model_validate_json(json.dumps({**base, **fields}))


class _Context:
    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


# ---- the per-request opt-out ------------------------------------------------------------------
@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
def test_the_http_field_reaches_the_engine_params(cls):
    off = sampling_params(_body(cls, speculative=False), 8)
    assert off.HasField("speculative") and off.speculative is False
    assert build_params(off, _Context()).speculative is False
    on = sampling_params(_body(cls, speculative=True), 8)
    assert build_params(on, _Context()).speculative is True
    unset = sampling_params(_body(cls), 8)
    assert not unset.HasField("speculative")  # the engine's default: speculate
    assert "speculative" not in sampling_kwargs(unset)
    assert build_params(unset, _Context()).speculative is True


def test_the_http_field_takes_only_a_bool():
    with pytest.raises(ValidationError) as e:
        _body(CompletionRequest, speculative="false")
    err = validation_error(e.value, KNOWN_FIELDS)
    assert err.status == 400 and err.param == "speculative"


def test_the_grpc_field_survives_a_copy_and_maps_to_the_keyword():
    # the router copies the client's SamplingParams for each leg (router/call.py)
    leg = pdserve_pb2.SamplingParams()
    leg.CopyFrom(pdserve_pb2.SamplingParams(max_tokens=4, speculative=False))
    assert sampling_kwargs(leg) == {"max_tokens": 4, "speculative": False}
    assert SamplingParams(**sampling_kwargs(leg)).speculative is False


# ---- the worker's counters ----------------------------------------------------------------------
class _Engine:
    def __init__(self, stats):
        self._stats = stats

    def spec_stats(self):
        return self._stats


STATS = {
    "spec_drafts": 5,
    "spec_draft_tokens": 15,
    "spec_accepted_tokens": 9,
    "spec_accepted_per_pos": [5, 3, 1],
    "spec_draft_prefill_tokens": 40,
}


def test_spec_stats_fill_worker_stats_and_an_engine_without_them_fills_nothing():
    stats = worker_pb2.WorkerStats(worker_id="w", **spec_stats(_Engine(STATS)))
    assert stats.spec_drafts == 5 and stats.spec_draft_tokens == 15
    assert stats.spec_accepted_tokens == 9 and list(stats.spec_accepted_per_pos) == [5, 3, 1]
    assert stats.spec_draft_prefill_tokens == 40
    assert spec_stats(object()) == {}  # an engine before speculative decoding
    later = _Engine({**STATS, "spec_some_new_counter": 1})  # a key WorkerStats lacks is left out
    assert worker_pb2.WorkerStats(**spec_stats(later)).spec_drafts == 5


class _Pool:
    """What WorkerCollector reads at scrape time: (role, name, stats, down, state) per worker."""

    def __init__(self, *members):
        self.members = members

    def snapshot(self):
        return list(self.members)


def _registry(*members, colocated=False):
    registry = CollectorRegistry()
    registry.register(WorkerCollector(_Pool(*members), "m", colocated))
    return registry


def test_the_counters_are_exposed_under_vllms_names():
    speculating = worker_pb2.WorkerStats(**STATS)
    registry = _registry(("decode", "decode-0", speculating, False, "serving"))
    value = lambda name, **extra: registry.get_sample_value(name, {**LABELS, **extra})  # noqa: E731
    assert value("vllm:spec_decode_num_drafts_total") == 5
    assert value("vllm:spec_decode_num_draft_tokens_total") == 15
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 9
    assert value("pdserve:spec_decode_draft_prefill_tokens_total") == 40
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, position=str(i)) for i in range(4)] == [5, 3, 1, None]
    types = {f.name: f.type for f in registry.collect()}
    assert types["vllm:spec_decode_num_accepted_tokens_per_pos"] == "counter"
    assert types["vllm:spec_decode_num_drafts"] == "counter"
    text = exposition(registry).decode()
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1",'
        'role="decode",worker="decode-0"} 3.0' in text
    )


def test_a_worker_that_does_not_speculate_shows_zeros_and_no_positions():
    registry = _registry(
        ("decode", "decode-0", worker_pb2.WorkerStats(), False, "serving"),
        ("decode", "decode-1", None, False, "serving"),  # no Stats answer yet: worker_up only
        colocated=True,
    )
    labels = {**LABELS, "role": "colocated"}
    assert registry.get_sample_value("vllm:spec_decode_num_drafts_total", labels) == 0
    assert (
        registry.get_sample_value(
            "vllm:spec_decode_num_drafts_total", {**labels, "worker": "decode-1"}
        )
        is None
    )
    assert 'position="' not in exposition(registry).decode()
