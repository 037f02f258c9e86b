"""POST /sleep, POST /wake_up and GET /is_sleeping (router/sleep.py, router/openai/sleep.py,
worker_common/sleep.py) through a router in front of a prefill and a decode worker on a tiny
random model: at level 1 both workers' engines sleep (their Stats say so, and a Reserve sent
straight to the decode worker is UNAVAILABLE), a completion sent meanwhile waits at the router
(not refused) and, once /wake_up answers, completes with the greedy tokens it gave before the
sleep; at level 2 (weights dropped) a staged wake, weights then kv_cache, keeps the router
sleeping until the last tag and then serves the same greedy tokens (the weights loaded again from
the served checkpoint). The prefix-cache reset endpoints reach both pools' workers too."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers.http import post, request
from helpers.threads import wait_until
from helpers.weights import PROMPT, completion, tiny_checkpoints, weights_cluster
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2

TIMEOUT_S = 60.0  # bounds on a loaded machine, never speed claims


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, one_thread):
    checkpoints = tiny_checkpoints(tmp_path_factory, "sleep", (("A", 0, {}),))
    with weights_cluster(checkpoints["A"][0], sleep_mode=True) as out:
        yield out


def _greedy(router) -> list[int]:
    return completion(router, 8)["choices"][0]["token_ids"]


def _post(router, path: str) -> dict:
    status, _, raw = post(router, path, None)
    assert status == 200, raw
    return json.loads(raw)


def _sleeping(router) -> bool:
    status, _, raw = request(router.http_address, "GET", "/is_sleeping")
    assert status == 200, raw
    return json.loads(raw)["is_sleeping"]


def _workers_asleep(stubs) -> list[tuple[int, list[str]]]:
    out = []
    for stub in stubs:
        s = stub.Stats(worker_pb2.StatsRequest(), timeout=TIMEOUT_S)
        out.append((s.sleep_level, list(s.asleep_tags)))
    return out


def test_level_1_holds_a_request_until_the_wake_and_serves_the_same_tokens(cluster):
    router, stubs = cluster
    before = _greedy(router)
    assert _post(router, "/sleep?level=1") == {"status": "sleeping", "level": 1}
    assert _sleeping(router) is True
    assert _workers_asleep(stubs) == [(1, ["weights", "kv_cache"])] * 2
    with pytest.raises(grpc.RpcError) as e:  # a sleeping engine takes no work
        stubs[0].Reserve(
            worker_pb2.ReserveRequest(
                request_id="straight",
                prompt_token_ids=PROMPT,
                sampling=pdserve_pb2.SamplingParams(max_tokens=2),
            ),
            timeout=TIMEOUT_S,
        )
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "sleeps" in e.value.details()

    out: list = []
    held = threading.Thread(target=lambda: out.append(_greedy(router)), daemon=True)
    held.start()
    admission = router.servicer.admission
    wait_until(lambda: admission.queued() == 1, TIMEOUT_S, "the request held at the router")
    held.join(0.3)
    assert held.is_alive() and out == []  # waits, not refused
    assert _post(router, "/wake_up") == {"status": "awake", "tags_woken": None}
    held.join(TIMEOUT_S)
    assert out == [before]
    assert _workers_asleep(stubs) == [(0, [])] * 2 and _sleeping(router) is False


def _sleep_states(router) -> list[str]:
    """Each worker's vllm:engine_sleep_state at 1, as the router's /metrics has it."""
    text = generate_latest(router.metrics_registry).decode()
    return sorted(
        s.labels["sleep_state"]
        for fam in text_string_to_metric_families(text)
        if fam.name == "vllm:engine_sleep_state"
        for s in fam.samples
        if s.value == 1.0
    )


def test_level_2_and_a_staged_wake_serve_the_same_tokens(cluster):
    router, stubs = cluster
    before = _greedy(router)
    wait_until(lambda: _sleep_states(router) == ["awake"] * 2, TIMEOUT_S, "both awake")
    assert _post(router, "/sleep?level=2&mode=wait") == {"status": "sleeping", "level": 2}
    assert _workers_asleep(stubs) == [(2, ["weights", "kv_cache"])] * 2
    wait_until(  # (the router's Stats poll)
        lambda: _sleep_states(router) == ["discard_all"] * 2, TIMEOUT_S, "vLLM's sleep state"
    )
    woken = _post(router, "/wake_up?tags=weights")
    assert woken == {"status": "sleeping", "tags_woken": ["weights"]}
    assert _workers_asleep(stubs) == [(2, ["kv_cache"])] * 2 and _sleeping(router) is True
    woken = _post(router, "/wake_up?tags=kv_cache")
    assert woken == {"status": "awake", "tags_woken": ["kv_cache"]}
    assert _workers_asleep(stubs) == [(0, [])] * 2
    assert _greedy(router) == before


def test_the_prefix_cache_reset_reaches_both_pools(cluster):
    """vLLM's /reset_prefix_cache and SGLang's /flush_cache, through real workers' RPCs (the
    semantics: tests/unit/test_prefix_cache_reset.py)."""
    router, _ = cluster
    _greedy(router)
    answer = _post(router, "/reset_prefix_cache?reset_external=true")
    assert answer["status"] == "reset" and answer["workers"] == 2
    status, _, raw = request(router.http_address, "GET", "/flush_cache")
    assert status == 200 and json.loads(raw)["workers"] == 2
