"""LoRA adapters through an in-process 1P+1D cluster (router/lora.py, worker_common/lora.py):
two random PEFT adapters and the base model, requested concurrently by `model`, give HF +
PEFT's greedy tokens; the prefix caches of both workers show no hit across adapters; /v1/models
lists the adapters with their parent; run-time load and unload work with the key, and are
refused without it (401) and where not enabled (404); an unknown model is 404 / NOT_FOUND; a
worker refuses a Reserve for an adapter it lacks, and a Prefill whose adapter's weights differ
from the decode worker's."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from helpers.http import KEY, assert_error, post, request
from helpers.lora import ADAPTERS, LORA_NEW, lora_engine, lora_family, lora_prompts, lora_refs
from helpers.worker import start_decode, start_prefill, stop_all
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.server import Router, RouterConfig

pytestmark = pytest.mark.usefixtures("one_thread")
BASE = "tiny"
TIMEOUT = 60.0
GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=LORA_NEW, ignore_eos=True)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base, dirs, models = lora_family(tmp_path_factory.mktemp("lora-cluster"), "llama")
    prompts = lora_prompts()
    want = lora_refs(models, prompts)
    engine = lora_engine(dirs, max_loras=2, max_model_len=256)
    decode = start_decode(base, engine=engine, lease_ms=5000)
    prefill = start_prefill(base, engine=engine)
    common = dict(
        model=base,
        model_id=BASE,
        prefill_addresses=(prefill.address,),
        decode_addresses=(decode.address,),
        max_model_len=256,
        http_port=0,
        api_keys=(KEY,),
        lora_enabled=True,
        lora_modules=tuple(dirs.items()),
    )
    router = Router(RouterConfig(**common, lora_allow_runtime_updates=True)).start()
    fixed = Router(RouterConfig(**common)).start()  # no run-time updates
    channel = grpc.insecure_channel(router.address)
    api = pdserve_pb2_grpc.PDServeStub(channel)
    worker_channels = [grpc.insecure_channel(w.address) for w in (decode, prefill)]
    ns = dict(
        base=base,
        dirs=dirs,
        prompts=prompts,
        want=want,
        decode=decode,
        prefill=prefill,
        router=router,
        fixed=fixed,
        api=api,
        d=worker_pb2_grpc.DecodeWorkerStub(worker_channels[0]),
        p=worker_pb2_grpc.PrefillWorkerStub(worker_channels[1]),
    )
    yield type("Cluster", (), ns)
    stop_all([channel, *worker_channels], fixed, router, prefill, decode)


def _generate(api, prompt, model=""):
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


def test_adapters_and_base_mixed_match_hf_peft(cluster):
    jobs = [(k, i) for k in ("base", *ADAPTERS) for i in range(len(cluster.prompts))]
    got, errors = {}, []

    def run(k, i):
        try:
            model = "" if k == "base" else k
            got[(k, i)] = _generate(cluster.api, cluster.prompts[i], model)[0]
        except Exception as e:  # reported below, with the others
            errors.append(e)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert not errors, errors
    for k, i in jobs:
        assert got[(k, i)] == cluster.want[k][i], (k, i)


def test_no_prefix_cache_hit_across_adapters(cluster):
    prompt = [7, 9] + cluster.prompts[2]  # a prompt of its own: nothing cached before
    _, first = _generate(cluster.api, prompt)
    assert first.usage.cached_prompt_tokens == 0
    _, again = _generate(cluster.api, prompt)
    assert again.usage.cached_prompt_tokens > 0  # the base's own blocks
    for name in ADAPTERS:
        tokens, fin = _generate(cluster.api, prompt, name)
        assert fin.usage.cached_prompt_tokens == 0, name
        assert fin.usage.cache_hits.decode_worker == 0, name
        tokens2, fin2 = _generate(cluster.api, prompt, name)
        assert fin2.usage.cached_prompt_tokens > 0 and tokens2 == tokens, name


def test_models_list_adapters_and_unknown_is_404(cluster):
    status, _, body = request(cluster.router.http_address, "GET", "/v1/models", headers=AUTH)
    assert status == 200, body
    cards = {c["id"]: c for c in json.loads(body)["data"]}
    assert set(cards) == {BASE, *ADAPTERS}
    assert cards[BASE]["parent"] is None
    assert all(cards[a]["parent"] == BASE for a in ADAPTERS)
    status, _, body = post(
        cluster.router,
        "/v1/completions",
        {"model": "nope", "prompt": [5, 6], "max_tokens": 2},
        headers=AUTH,
    )
    assert_error(status, body, 404)
    with pytest.raises(grpc.RpcError) as e:
        _generate(cluster.api, [5, 6], "nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    status, _, body = post(
        cluster.router,
        "/v1/completions",
        {
            "model": "sql",
            "prompt": cluster.prompts[0],
            "max_tokens": LORA_NEW,
            "temperature": 0,
            "ignore_eos": True,
        },
        headers=AUTH,
    )
    assert status == 200, body
    assert json.loads(body)["model"] == "sql"


def test_load_and_unload_at_run_time(cluster):
    router, poem = cluster.router, cluster.dirs["poem"]
    load = {"lora_name": "verse", "lora_path": poem}
    status, _, body = post(router, "/v1/load_lora_adapter", load)
    assert_error(status, body, 401)
    status, _, body = post(cluster.fixed, "/v1/load_lora_adapter", load, headers=AUTH)
    assert_error(status, body, 404)
    status, _, body = post(router, "/v1/load_lora_adapter", {"lora_name": "v"}, headers=AUTH)
    assert_error(status, body, 400, param="lora_path")
    status, _, body = post(
        router,
        "/v1/load_lora_adapter",
        {"lora_name": "v", "lora_path": "/nonexistent/adapter"},
        headers=AUTH,
    )
    assert_error(status, body, 400, param="lora_path")
    status, _, body = post(router, "/v1/load_lora_adapter", load, headers=AUTH)
    assert status == 200, body
    assert b"verse" in body
    tokens, _ = _generate(cluster.api, cluster.prompts[1], "verse")
    assert tokens == cluster.want["poem"][1]
    status, _, body = request(router.http_address, "GET", "/v1/models", headers=AUTH)
    assert "verse" in {c["id"] for c in json.loads(body)["data"]}
    unload = {"lora_name": "verse"}
    status, _, body = post(router, "/v1/unload_lora_adapter", unload)
    assert_error(status, body, 401)
    status, _, body = post(router, "/v1/unload_lora_adapter", unload, headers=AUTH)
    assert status == 200, body
    status, _, body = post(router, "/v1/unload_lora_adapter", unload, headers=AUTH)
    assert_error(status, body, 404, param="lora_name")
    with pytest.raises(grpc.RpcError) as e:
        _generate(cluster.api, cluster.prompts[1], "verse")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # the workers forgot it too
    for stub in (cluster.d, cluster.p):
        names = stub.UnloadLoRA(worker_pb2.UnloadLoRARequest(lora_name="x"), timeout=TIMEOUT)
        assert {a.name for a in names.adapters} == set(ADAPTERS)


def test_workers_refuse_unknown_or_mismatched_adapters(cluster):
    prompt = cluster.prompts[0]
    with pytest.raises(grpc.RpcError) as e:
        cluster.d.Reserve(
            worker_pb2.ReserveRequest(
                request_id="r-unknown", prompt_token_ids=prompt, sampling=GREEDY, lora_name="zz"
            ),
            timeout=TIMEOUT,
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "zz" in e.value.details()
    res = cluster.d.Reserve(
        worker_pb2.ReserveRequest(
            request_id="r-mismatch", prompt_token_ids=prompt, sampling=GREEDY, lora_name="sql"
        ),
        timeout=TIMEOUT,
    )
    assert len(res.lora_hash) == 16
    try:
        with pytest.raises(grpc.RpcError) as e:  # the prefill worker's "sql" is not "poem"
            cluster.p.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="r-mismatch",
                    prompt_token_ids=prompt,
                    sampling=GREEDY,
                    reservation=res,
                    lora_name="poem",
                ),
                timeout=TIMEOUT,
            )
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        cluster.d.Abort(worker_pb2.WorkerAbortRequest(request_id="r-mismatch"), timeout=TIMEOUT)
