"""Pieces shared by the weight-update tests (a trainer's sync from disk or over a weight group:
tests/integration/test_engine_update_weights.py, test_engine_weight_group.py,
test_http_update_weights.py, test_http_weight_group.py): tiny random checkpoints of one family,
a router with weight updates on in front of one prefill and one decode worker, a greedy
completion through it, and what its workers say they serve."""

from __future__ import annotations

import contextlib
import json

import grpc

from helpers.http import MODEL, post
from helpers.models import make_tiny_model
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

ENGINE = dict(max_model_len=512, dtype="float32")
PROMPT = [5, 9, 17, 33, 2, 8, 13, 21, 34, 55, 89, 144, 7, 3]
TIMEOUT_S = 60.0  # bounds on a loaded machine, never speed claims
SAME_SHAPES = (("A", 0, {}), ("B", 1, {}))  # two checkpoints of every shape alike
OTHER_SHAPES = ("C", 2, {"num_hidden_layers": 3})  # and one with a layer more


def tiny_checkpoints(tmp_path_factory, prefix: str, specs=SAME_SHAPES) -> dict:
    """{name: (model_dir, HF model)}, one qwen2-bias checkpoint per (name, seed, config) spec."""
    out = {}
    for name, seed, extra in specs:
        path = tmp_path_factory.mktemp(f"{prefix}-{name}")
        out[name] = (str(path), make_tiny_model(path, "qwen2-bias", seed=seed, **extra))
    return out


@contextlib.contextmanager
def weights_cluster(model_dir: str, **router_options):
    """(router, (decode stub, prefill stub)): a router with `weight_updates` on in front of one
    decode and one prefill worker on `model_dir`, stopped on exit."""
    decode = start_decode(model_dir, engine=ENGINE, lease_ms=5000)
    prefill = start_prefill(model_dir, engine=ENGINE)
    router = start_router(
        model_dir,
        decode,
        prefill,
        model_id=MODEL,
        max_model_len=512,
        http_port=0,
        weight_updates=True,
        **router_options,
    )
    channels = [grpc.insecure_channel(w.address) for w in (decode, prefill)]
    stubs = (
        worker_pb2_grpc.DecodeWorkerStub(channels[0]),
        worker_pb2_grpc.PrefillWorkerStub(channels[1]),
    )
    try:
        yield router, stubs
    finally:
        stop_all(channels, router, prefill, decode)


def completion(router, max_tokens: int = 10) -> dict:
    """A greedy completion of PROMPT through the router's HTTP front (its whole JSON answer)."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, _, raw = post(router, "/v1/completions", body)
    assert status == 200, raw
    return json.loads(raw)


def served(stubs) -> list[tuple[str, str]]:
    """(weights_path, weight_version) each worker's Stats say it serves."""
    out = []
    for stub in stubs:
        s = stub.Stats(worker_pb2.StatsRequest(), timeout=TIMEOUT_S)
        out.append((s.weights_path, s.weight_version))
    return out
