"""What the worker services decide before any engine or socket is involved: the SamplingParams
fields a request sets are the ones the engine gets, and each engine refusal maps to one gRPC status
by its type (worker_common/errors.py). The services end to end over 127.0.0.1:
tests/integration/test_worker_services_cluster.py."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.errors import (
    BadSamplingParams,
    DuplicateRequestId,
    InvalidRequest,
    NoFreeBlocks,
    PromptTooLong,
)
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.worker_common.errors import abort_for_engine_error, engine_error_status


def test_sampling_kwargs_only_set_fields():
    assert sampling_kwargs(pdserve_pb2.SamplingParams()) == {}
    kw = sampling_kwargs(
        pdserve_pb2.SamplingParams(temperature=0, top_k=0, stop=["x"], ignore_eos=False)
    )
    assert kw == {"temperature": 0.0, "top_k": 0, "stop": ["x"], "ignore_eos": False}


class _Context:
    def abort(self, code, details):
        raise _Aborted(code, details)


class _Aborted(Exception):
    pass


@pytest.mark.parametrize(
    "error, code, details",
    [
        (
            PromptTooLong("prompt has 70 tokens but max_model_len is 64"),
            grpc.StatusCode.OUT_OF_RANGE,
            "prompt has 70 tokens but max_model_len is 64",
        ),
        (
            DuplicateRequestId("request_id 'a' is already in use"),
            grpc.StatusCode.ALREADY_EXISTS,
            "request_id 'a' is already in use",
        ),
        (
            BadSamplingParams("top_p must be in (0, 1], got 0"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling: top_p must be in (0, 1], got 0",
        ),
        (
            InvalidRequest("prompt must be non-empty"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt must be non-empty",
        ),
        (ValueError("any other refusal"), grpc.StatusCode.INVALID_ARGUMENT, "any other refusal"),
        (
            NoFreeBlocks("need 3 KV blocks, 1 free"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "decode pool full, retry later (need 3 KV blocks, 1 free)",
        ),
    ],
)
def test_engine_errors_map_to_statuses_by_type(error, code, details):
    """One mapping for both workers (worker_common/errors.py), chosen by the error's type; the
    wording does not matter (a PromptTooLong that never says max_model_len is still OUT_OF_RANGE)."""
    assert engine_error_status(error) == (code, details)
    assert engine_error_status(PromptTooLong("x"))[0] == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(_Aborted) as aborted:
        abort_for_engine_error(_Context(), error)
    assert aborted.value.args == (code, details)
    abort_for_engine_error(_Context(), RuntimeError("a bug"))  # not a refusal: left to the caller
    assert engine_error_status(KeyError("x")) is None
