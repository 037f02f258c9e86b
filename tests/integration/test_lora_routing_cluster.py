"""Adapter-aware routing and late joiners through an in-process cluster of one prefill and two
decode workers (router/pool.py, router/lora.py, worker_common/lora.py), each with max_loras=1
and the config's adapter "sql": "poem" is loaded at run time before the second decode worker
registers. That worker is caught up (the router loads "poem" on it) before any of its requests
reach it, and serves them with HF + PEFT's tokens; an adapter's requests stay on the decode
worker where it is resident; a worker that comes back after a crash with its config's adapters
only is caught up too, loads and run-time unloads alike."""

from __future__ import annotations

import grpc
import pytest

from helpers.http import KEY, post
from helpers.lora import LORA_NEW, lora_engine, lora_family, lora_prompts, lora_refs
from helpers.threads import wait_until
from helpers.worker import start_decode, start_prefill, stop_all
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.server import Router, RouterConfig

pytestmark = pytest.mark.usefixtures("one_thread")
BASE = "tiny"
TIMEOUT = 60.0
GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=LORA_NEW, ignore_eos=True)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base, dirs, models = lora_family(tmp_path_factory.mktemp("lora-routing"), "llama")
    prompts = lora_prompts()
    engine = lora_engine({"sql": dirs["sql"]}, max_loras=1, max_model_len=256)
    decode = start_decode(base, "d0", engine=engine, lease_ms=5000, model_id=BASE)
    prefill = start_prefill(base, engine=engine, model_id=BASE)
    router = Router(
        RouterConfig(
            model=base,
            model_id=BASE,
            prefill_addresses=(prefill.address,),
            decode_addresses=(decode.address,),
            max_model_len=256,
            http_port=0,
            api_keys=(KEY,),
            lora_enabled=True,
            lora_modules=(("sql", dirs["sql"]),),
            lora_allow_runtime_updates=True,
        )
    ).start()
    status, _, body = post(
        router,
        "/v1/load_lora_adapter",
        {"lora_name": "poem", "lora_path": dirs["poem"]},
        headers=AUTH,
    )
    assert status == 200, body
    late = dict(engine=engine, lease_ms=5000, model_id=BASE, registry_address=router.address)
    d1 = start_decode(base, "d1", **late)  # registers after the run-time load
    channel = grpc.insecure_channel(router.address)
    ns = dict(
        base=base,
        dirs=dirs,
        prompts=prompts,
        want=lora_refs(models, prompts),
        router=router,
        decode=decode,
        prefill=prefill,
        d1=d1,
        late=late,
        api=pdserve_pb2_grpc.PDServeStub(channel),
    )
    c = type("Cluster", (), ns)
    yield c
    stop_all([channel], router, prefill, decode, c.d1)


def _generate(api, prompt, model):
    """(tokens, Finish) of one greedy request through the router's gRPC API."""
    tokens, finish = [], None
    for msg in api.Generate(
        pdserve_pb2.GenerateRequest(
            model=model, token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=GREEDY
        ),
        metadata=(("authorization", f"Bearer {KEY}"),),
        timeout=TIMEOUT,
    ):
        if msg.HasField("delta"):
            tokens += list(msg.delta.token_ids)
        else:
            finish = msg.finish
    return tokens, finish


def _pool_worker(cluster, worker_id):
    """The router's pool entry of the decode worker named `worker_id` (a static one learns its
    name from its Stats)."""
    worker = next((w for w in cluster.router.pool.decode if w.worker_id == worker_id), None)
    assert worker is not None, f"{worker_id} is not in the router's pool"
    return worker


def _listed(cluster, worker_id) -> tuple[set, list]:
    """(adapters served, adapters resident) by the router's last view of the worker."""
    stats = _pool_worker(cluster, worker_id).stats
    if stats is None:
        return set(), []
    return set(stats.lora_adapters), list(stats.lora_resident)


def test_late_joiner_is_caught_up_before_it_gets_the_adapters_requests(cluster):
    wait_until(lambda: cluster.router.pool.registered("d1") is not None, 30, "d1 registers")
    wait_until(lambda: "poem" in _listed(cluster, "d1")[0], 30, "d1's Stats list poem")
    own = cluster.d1.stats()  # the worker's own Stats agree: the router loaded poem there
    assert set(own.lora_adapters) == {"sql", "poem"} and own.lora_adapters_count == 2
    pool, d0 = cluster.router.pool, _pool_worker(cluster, "d0")
    pool.set_state(d0, "draining")  # poem's requests must land on d1 now
    try:
        for i, prompt in enumerate(cluster.prompts):
            tokens, finish = _generate(cluster.api, prompt, "poem")
            assert finish.timings.decode_worker == "d1"
            assert tokens == cluster.want["poem"][i], i
    finally:
        pool.set_state(d0, "serving")
    assert list(cluster.d1.stats().lora_resident) == ["poem"]


def test_an_adapters_requests_stay_where_it_is_resident(cluster):
    wait_until(lambda: "poem" in _listed(cluster, "d1")[0], 30, "d1's Stats list poem")
    tokens, finish = _generate(cluster.api, cluster.prompts[0], "sql")
    assert tokens == cluster.want["sql"][0]
    home = finish.timings.decode_worker
    wait_until(lambda: _listed(cluster, home)[1] == ["sql"], 30, "the pool sees sql resident")
    for i in (1, 2, 1, 2):
        tokens, finish = _generate(cluster.api, cluster.prompts[i], "sql")
        assert tokens == cluster.want["sql"][i], i
        assert finish.timings.decode_worker == home, i


def test_a_worker_back_after_a_crash_is_caught_up(cluster):
    status, _, body = post(
        cluster.router, "/v1/unload_lora_adapter", {"lora_name": "sql"}, headers=AUTH
    )
    assert status == 200, body
    caught = cluster.router.servicer.loras.catch_ups
    cluster.d1.stop()  # as after a crash: it comes back with its config's adapters only
    cluster.d1 = start_decode(cluster.base, "d1", **cluster.late)
    wait_until(lambda: _listed(cluster, "d1")[0] == {"poem"}, 30, "d1 caught up: poem, and not sql")
    assert set(cluster.d1.stats().lora_adapters) == {"poem"}
    assert cluster.router.servicer.loras.catch_ups >= caught + 1
    tokens, _ = _generate(cluster.api, cluster.prompts[2], "poem")
    assert tokens == cluster.want["poem"][2]
    with pytest.raises(grpc.RpcError) as e:
        _generate(cluster.api, cluster.prompts[2], "sql")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
