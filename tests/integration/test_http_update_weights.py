"""POST /update_weights_from_disk (router/weights.py, router/openai/weights.py, SGLang's shape)
through a router in front of a prefill and a decode worker, on two tiny random checkpoints of the
same shapes (A, B) and one of other shapes (C): after an update every greedy completion is HF's
B token for token (the prompt's KV computed by B on the prefill worker, extended by B on the
decode worker), the version is reported by the router and by both workers' Stats; a checkpoint
C is refused by the workers with nothing changed; a running request either finishes first or,
with abort_all_requests, ends with finish_reason "abort"; keep_pause leaves the router paused; a
worker found serving other weights gets no request and is brought up to date from its reports;
bad bodies are 400s in SGLang's shape; a router whose deployment did not turn it on answers 404."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from helpers.http import MODEL, assert_error, post, request, split
from helpers.models import hf_greedy
from helpers.threads import wait_until
from helpers.weights import (
    OTHER_SHAPES,
    PROMPT,
    SAME_SHAPES,
    completion,
    served,
    tiny_checkpoints,
    weights_cluster,
)
from helpers.worker import start_router
from pdserve.protos.pdserve.v1 import worker_pb2

TIMEOUT_S = 60.0  # bounds on a loaded machine, never speed claims


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, "ckpt", (*SAME_SHAPES, OTHER_SHAPES))


@pytest.fixture(scope="module")
def cluster(checkpoints, one_thread):
    with weights_cluster(checkpoints["A"][0], pause_endpoints=True) as out:
        yield out


def _greedy(router, max_tokens: int = 10) -> list[int]:
    return completion(router, max_tokens)["choices"][0]["token_ids"]


def _ran_on(router) -> str | None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    status, _, raw = post(router, "/v1/completions", body)
    assert status == 200, raw
    return json.loads(raw)["pdserve"]["weight_version"]


def _update(router, **body) -> tuple[int, dict]:
    status, _, raw = post(router, "/update_weights_from_disk", body)
    return status, json.loads(raw)


def _version(router):
    status, _, raw = request(router.http_address, "GET", "/get_weight_version")
    assert status == 200, raw
    return json.loads(raw)["weight_version"]


def test_an_update_serves_the_new_checkpoint_on_both_pools(cluster, checkpoints):
    router, stubs = cluster
    (a_dir, a_hf), (b_dir, b_hf) = checkpoints["A"], checkpoints["B"]
    assert _version(router) is None and _ran_on(router) is None
    assert _greedy(router) == hf_greedy(a_hf, PROMPT, 10)
    status, out = _update(router, model_path=b_dir, weight_version="step-1")
    assert status == 200 and out["success"] is True, out
    assert out["num_paused_requests"] == 0 and "2 worker(s)" in out["message"], out
    assert served(stubs) == [(b_dir, "step-1")] * 2
    assert _version(router) == "step-1"
    assert _greedy(router) == hf_greedy(b_hf, PROMPT, 10)
    assert not router.servicer.admission.is_paused
    assert _ran_on(router) == "step-1"  # each response names the weights it ran on
    # C has another layer count: every worker refuses it before loading anything
    status, out = _update(router, model_path=checkpoints["C"][0], weight_version="bad")
    assert status == 400 and out["success"] is False, out
    assert "num_layers" in out["message"] and "serves the weights it did before" in out["message"]
    assert served(stubs) == [(b_dir, "step-1")] * 2 and _version(router) == "step-1"
    assert _greedy(router) == hf_greedy(b_hf, PROMPT, 10)
    assert not router.servicer.admission.is_paused
    # back to A for the next tests
    status, out = _update(router, model_path=a_dir, weight_version="step-2")
    assert status == 200 and _greedy(router) == hf_greedy(a_hf, PROMPT, 10), out


def _long_completion(router, out: list) -> threading.Thread:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    t = threading.Thread(
        target=lambda: out.append(post(router, "/v1/completions", body)), daemon=True
    )
    t.start()
    admission = router.servicer.admission
    wait_until(lambda: admission.running() == 1, TIMEOUT_S, "the long request admitted")
    return t


def test_running_requests_finish_first_or_are_aborted(cluster, checkpoints):
    router, _ = cluster
    (a_dir, _), (b_dir, _) = checkpoints["A"], checkpoints["B"]
    done: list = []
    t = _long_completion(router, done)
    status, out = _update(router, model_path=b_dir, weight_version="w")
    assert status == 200 and out["num_paused_requests"] == 0, out
    t.join(TIMEOUT_S)
    doc = json.loads(done[0][2])
    assert doc["choices"][0]["finish_reason"] == "length", doc  # it ran whole, on A
    aborted: list = []
    t = _long_completion(router, aborted)
    status, out = _update(router, model_path=a_dir, weight_version="a", abort_all_requests=True)
    assert status == 200 and out["num_paused_requests"] == 1, out
    t.join(TIMEOUT_S)
    assert json.loads(aborted[0][2])["choices"][0]["finish_reason"] == "abort"


def test_keep_pause_and_a_clients_pause_outlast_the_update(cluster, checkpoints):
    router, _ = cluster
    status, out = _update(
        router, model_path=checkpoints["B"][0], weight_version="kept", keep_pause=True
    )
    assert status == 200, out
    assert router.servicer.admission.is_paused
    status, _, raw = post(router, "/resume", None)
    assert status == 200, raw
    assert not router.servicer.admission.is_paused
    # a client's /pause outlasts an update made under it
    assert post(router, "/pause", None)[0] == 200
    status, out = _update(router, model_path=checkpoints["A"][0], weight_version="under")
    assert status == 200 and router.servicer.admission.is_paused, out
    assert post(router, "/resume", None)[0] == 200
    assert not router.servicer.admission.is_paused


def test_a_worker_serving_other_weights_is_skipped_then_caught_up(
    cluster, checkpoints, monkeypatch
):
    router, (decode, prefill) = cluster
    (a_dir, _), (b_dir, b_hf) = checkpoints["A"], checkpoints["B"]
    status, out = _update(router, model_path=b_dir, weight_version="cu")
    assert status == 200, out
    weights = router.servicer.weights
    monkeypatch.setattr(weights, "_catch_up", lambda worker: None)  # held back for a while
    # the prefill worker goes back to A behind the router's back (as a restart would)
    prefill.UpdateWeights(
        worker_pb2.UpdateWeightsRequest(model_path=a_dir, weight_version=""), timeout=TIMEOUT_S
    )
    (worker,) = [w for w in router.servicer.pool.members() if w.role == "prefill"]
    wait_until(lambda: not weights.serves(worker), TIMEOUT_S, "its report shows A")
    status, _, raw = post(router, "/v1/completions", {"model": MODEL, "prompt": PROMPT})
    err = assert_error(status, raw, 503)  # never a prefill on A for a decode on B
    assert "serves the weights of the last update" in err["message"], err
    monkeypatch.undo()
    caught = weights.catch_ups
    wait_until(lambda: weights.catch_ups > caught, TIMEOUT_S, "the prefill worker caught up")
    assert served((decode, prefill)) == [(b_dir, "cu")] * 2
    assert _greedy(router) == hf_greedy(b_hf, PROMPT, 10)


def test_a_client_that_leaves_before_the_answer_leaves_no_pause_behind(cluster, checkpoints):
    router, stubs = cluster
    host, port = split(router.http_address)
    body = json.dumps({"model_path": checkpoints["B"][0], "weight_version": "left"}).encode()
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as s:
        s.sendall(
            b"POST /update_weights_from_disk HTTP/1.1\r\nHost: x\r\n"
            + b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
    # gone before the answer (the update runs in a task of its own, which the handler's
    # cancellation, where the server cancels it, does not reach): it still ends, its hold too
    admission = router.servicer.admission
    wait_until(
        lambda: router.servicer.weights.version == "left" and not admission.is_paused,
        TIMEOUT_S,
        "the update done and the router serving",
    )
    assert served(stubs) == [(checkpoints["B"][0], "left")] * 2


@pytest.mark.parametrize(
    "body, words",
    [
        ({}, "model_path must be a string"),
        ({"model_path": ""}, "model_path must be a non-empty path"),
        ({"model_path": "/x", "weight_version": 3}, "weight_version must be a string"),
        ({"model_path": "/x", "flush_cache": False}, "flush_cache=false"),
        ({"model_path": "/x", "abort_all_requests": "yes"}, "abort_all_requests must be"),
        ({"model_path": "/x", "load_format": "gguf"}, "load_format"),
        ({"model_path": "/x", "sneaky": 1}, "unknown field(s) sneaky"),
    ],
)
def test_bad_bodies_are_400_in_sglangs_shape(cluster, body, words):
    router, _ = cluster
    status, out = _update(router, **body)
    assert status == 400 and out["success"] is False and words in out["message"], out
    assert not router.servicer.admission.is_paused


def test_a_missing_checkpoint_is_refused_by_the_workers(cluster, tmp_path):
    router, stubs = cluster
    before = served(stubs)
    status, out = _update(router, model_path=str(tmp_path / "nowhere"))
    assert status == 400 and "not a checkpoint directory" in out["message"], out
    assert served(stubs) == before


def test_off_unless_the_deployment_turns_it_on(checkpoints, cluster):
    router, _ = cluster
    plain = start_router(
        checkpoints["A"][0], *_workers_of(router), model_id=MODEL, max_model_len=512, http_port=0
    )
    try:
        status, _, raw = post(plain, "/update_weights_from_disk", {"model_path": "/x"})
        err = assert_error(status, raw, 404)
        assert "router.weight_updates" in err["message"]
    finally:
        plain.stop()


def _workers_of(router):
    """(decode, prefill) objects with `.address` for another router in front of the same ones."""

    class At:
        def __init__(self, address):
            self.address = address

    cfg = router.config
    return At(cfg.decode_addresses[0]), At(cfg.prefill_addresses[0])
