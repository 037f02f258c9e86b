"""The router's Prometheus metrics (router/metrics.py) and stage timings (protos/timings.py)
through a real router with an in-process prefill and decode worker on a tiny model: every name
with its type and labels, counts and sums that match what the requests did, worker counters from
WorkerStats, and stages that are non-negative and add up to the end-to-end time.
"""

from __future__ import annotations

import math
import threading

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers.models import random_prompts
from helpers.router_cluster import RPC_TIMEOUT, Cluster, pool_idle
from helpers.threads import wait_until
from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.protos.timings import STAGES, stage_durations

MODEL = "model_name"
ROUTER_METRICS = {  # name -> type
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "pdserve:request_stage_seconds": "histogram",
    "pdserve:request_kv_transfer_seconds": "histogram",
    "pdserve:request_kv_transfer_bytes": "histogram",
    "pdserve:request_kv_transfer_exposed_seconds": "histogram",
    "pdserve:request_kv_transfer_exposed_ratio": "histogram",
    "pdserve:request_reservation_wait_seconds": "histogram",
    "pdserve:router_requests_inflight": "gauge",
    "pdserve:router_decode_queue_waiting": "gauge",
    "pdserve:router_paused": "gauge",
    "pdserve:router_admission_tenants_waiting": "gauge",
    "pdserve:router_admission_shed": "counter",
    "pdserve:request_errors": "counter",
    "pdserve:http_errors": "counter",
}
ROUTER_LABELS = {  # the labels besides model_name, of the router metrics that have any
    "pdserve:request_errors": {"code"},
    "pdserve:http_errors": {"status"},
    "vllm:request_success": {"finished_reason"},
    "pdserve:request_stage_seconds": {"stage"},
}
WORKER_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "pdserve:kv_transfers": "counter",
    "pdserve:kv_transfer_failures": "counter",
    "pdserve:kv_transfer_bytes": "counter",
    "pdserve:leases_expired": "counter",
    "pdserve:num_requests_reserved": "gauge",
    "pdserve:worker_up": "gauge",
}


@pytest.fixture(scope="module")
def cluster(tiny_models, one_thread):
    c = Cluster(tiny_models("llama-gqa")[0])
    c.p = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(c.prefill.address))
    yield c
    c.stop()


@pytest.fixture
def idle(cluster):
    yield cluster
    wait_until(lambda: pool_idle(cluster), 5, f"decode pool not back to idle: {cluster.stats()}")


def scrape(cluster) -> dict:
    """{family name: family} of one render of the router's registry."""
    text = generate_latest(cluster.router.metrics_registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(cluster, name: str, **labels) -> float:
    got = cluster.router.metrics_registry.get_sample_value(name, {MODEL: _model(cluster), **labels})
    return got or 0.0


def _model(cluster) -> str:
    return cluster.router.servicer.options.model_id


def exported(cluster, role: str, worker: str, name: str):
    """The router's exported value of the per-worker counter `name` of one worker."""
    return cluster.router.metrics_registry.get_sample_value(
        name, {MODEL: _model(cluster), "role": role, "worker": worker}
    )


def wait_exported(cluster, want: dict) -> None:
    """Waits (5 s at most) until the router exports each (role, worker, name) of `want` with its
    value: the workers' WorkerStats, one health sweep later."""
    wait_until(
        lambda: all(exported(cluster, *key) == value for key, value in want.items()),
        5,
        f"the router's copy of the workers' counters: {want}",
    )


def worker_stats(cluster) -> dict[str, worker_pb2.WorkerStats]:
    req = worker_pb2.StatsRequest()
    return {
        "prefill": cluster.p.Stats(req, timeout=RPC_TIMEOUT),
        "decode": cluster.d.Stats(req, timeout=RPC_TIMEOUT),
    }


def run(cluster, prompts, max_tokens: int) -> list[pdserve_pb2.Finish]:
    """The prompts sent at once (one thread each); their Finish messages in prompt order."""
    finishes: list = [None] * len(prompts)

    def one(i):
        _, _, finishes[i] = cluster.generate(
            pdserve_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            token_ids=prompts[i],
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(finishes), "a request did not finish"
    return finishes


def test_every_metric_has_its_name_type_and_labels(idle):
    run(idle, random_prompts([12], seed=1), 3)
    wait_until(
        lambda: all(row[2] is not None for row in idle.router.pool.snapshot()),
        5,
        "both workers' Stats",
    )
    families = scrape(idle)
    for name, kind in ROUTER_METRICS.items():
        assert name in families, f"{name} missing"
        fam = families[name]
        assert fam.type == kind, (name, fam.type)
        extra = ROUTER_LABELS.get(name, set())
        for sample in fam.samples:
            assert set(sample.labels) - {"le"} == {MODEL} | extra, (name, sample.labels)
            assert sample.labels[MODEL] == _model(idle)
    assert {s.labels["stage"] for s in families["pdserve:request_stage_seconds"].samples} == set(
        STAGES
    )
    for name, kind in WORKER_METRICS.items():
        fam = families[name]
        assert fam.type == kind, (name, fam.type)
        seen = {(s.labels["role"], s.labels["worker"]) for s in fam.samples}
        assert seen == {("prefill", "p0"), ("decode", "d0")}, (name, seen)
        assert all(set(s.labels) == {MODEL, "role", "worker"} for s in fam.samples)
    stats = worker_stats(idle)
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    assert sorted(
        (s.labels["role"], s.labels["block_size"], s.labels["num_gpu_blocks"], s.value)
        for s in info.samples
    ) == sorted(
        (role, str(st.block_size), str(st.num_total_blocks), 1.0) for role, st in stats.items()
    )
    usage = [s.value for s in families["vllm:kv_cache_usage_perc"].samples]
    assert all(0.0 <= u <= 1.0 for u in usage)
    assert [s.value for s in families["pdserve:worker_up"].samples] == [1.0, 1.0]
    # the counters are exposed as NAME_total, as vLLM's are
    text = generate_latest(idle.router.metrics_registry).decode()
    for name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total"):
        assert f"\n{name}{{" in text


def test_counts_and_sums_match_the_requests(idle):
    lengths, max_tokens = [9, 23, 40, 17], 5
    prompts = random_prompts(lengths, seed=2)
    names = [
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_prompt_tokens_sum",
        "pdserve:request_kv_transfer_bytes_sum",
        "pdserve:request_kv_transfer_bytes_count",
        "pdserve:request_reservation_wait_seconds_count",
    ]
    before = {n: value(idle, n) for n in names}
    length_before = value(idle, "vllm:request_success_total", finished_reason="length")
    stages_before = {s: value(idle, "pdserve:request_stage_seconds_count", stage=s) for s in STAGES}
    stats_before = worker_stats(idle)
    finishes = run(idle, prompts, max_tokens)
    delta = {n: value(idle, n) - before[n] for n in names}
    n = len(prompts)
    assert delta["vllm:prompt_tokens_total"] == sum(lengths)
    assert delta["vllm:request_prompt_tokens_sum"] == sum(lengths)
    assert delta["vllm:generation_tokens_total"] == n * max_tokens
    for name in names[2:5] + names[7:]:
        if name != "vllm:inter_token_latency_seconds_count":
            assert delta[name] == n, name
    assert delta["vllm:inter_token_latency_seconds_count"] == n * (max_tokens - 1)
    assert value(idle, "vllm:request_success_total", finished_reason="length") - length_before == n
    for s in STAGES:
        assert value(idle, "pdserve:request_stage_seconds_count", stage=s) - stages_before[s] == n

    # KV bytes: the router's histogram, the prefill worker's pushes and the decode worker's
    # frames all count the same bytes: those of the prompt tokens the decode side did not hold
    layout = idle.prefill.layout
    per_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 4  # float32
    assert layout.dtype == "float32"
    expected = sum(
        (len(p) - f.usage.cache_hits.decode_worker) * per_token for p, f in zip(prompts, finishes)
    )
    assert [f.usage.kv_transfer_bytes for f in finishes] == [
        (len(p) - f.usage.cache_hits.decode_worker) * per_token for p, f in zip(prompts, finishes)
    ]
    assert delta["pdserve:request_kv_transfer_bytes_sum"] == expected > 0
    stats = worker_stats(idle)
    for role in ("prefill", "decode"):
        got, was = stats[role], stats_before[role]
        assert got.kv_transfer_bytes - was.kv_transfer_bytes == expected, role
        assert got.kv_transfers - was.kv_transfers == n, role
        assert got.kv_transfer_failures == was.kv_transfer_failures, role
        assert got.prefix_cache_queries - was.prefix_cache_queries == sum(lengths), role
    decode_hits = stats["decode"].prefix_cache_hits - stats_before["decode"].prefix_cache_hits
    assert decode_hits == sum(f.usage.cache_hits.decode_worker for f in finishes)
    # per backend (this cluster's decode worker serves grpc alone): the same bytes, and time
    pushed = stats["prefill"].kv_push_bytes_by_backend
    assert set(pushed) == {"grpc"}
    assert pushed["grpc"] - stats_before["prefill"].kv_push_bytes_by_backend["grpc"] == expected
    seconds = stats["prefill"].kv_push_seconds_by_backend
    assert seconds["grpc"] > stats_before["prefill"].kv_push_seconds_by_backend["grpc"]

    # what the router exports per worker is that worker's WorkerStats, one health sweep later
    prefill, decode = stats["prefill"], stats["decode"]
    wait_exported(
        idle,
        {
            ("prefill", "p0", "pdserve:kv_transfer_bytes_total"): prefill.kv_transfer_bytes,
            ("decode", "d0", "vllm:prefix_cache_queries_total"): decode.prefix_cache_queries,
        },
    )
    by_backend = {MODEL: _model(idle), "role": "prefill", "worker": "p0", "backend": "grpc"}
    wait_until(
        lambda: (
            idle.router.metrics_registry.get_sample_value("pdserve:kv_push_bytes_total", by_backend)
            == prefill.kv_push_bytes_by_backend["grpc"]
        ),
        5,
        "the router's copy of the prefill worker's bytes per backend",
    )
    assert idle.router.metrics_registry.get_sample_value(
        "pdserve:kv_push_seconds_total", by_backend
    ) == pytest.approx(prefill.kv_push_seconds_by_backend["grpc"])


def test_per_request_tpot_and_parameters_as_vllm_counts_them(idle):
    """vLLM's per-request histograms: the mean time per output token (decode time over the
    tokens after the first; 0 for a one-token answer), n, max_tokens and the longest of the
    request's sequences."""
    names = (
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_params_n",
        "vllm:request_params_max_tokens",
        "vllm:request_max_num_generation_tokens",
    )

    def now():
        return {(n, s): value(idle, n + s) for n in names for s in ("_sum", "_count")}

    before = now()
    sampling = pdserve_pb2.SamplingParams(
        temperature=1.0, max_tokens=6, ignore_eos=True, n=2, seed=3
    )
    call = pdserve_pb2.GenerateRequest(
        sampling=sampling, token_ids=pdserve_pb2.TokenIds(ids=[5, 6])
    )
    finishes = [
        r.finish for r in idle.api.Generate(call, timeout=RPC_TIMEOUT) if r.HasField("finish")
    ]
    assert [f.usage.completion_tokens for f in finishes] == [6, 6]
    finish = finishes[-1]  # the sequence that ended the request: its timings are the metrics'
    one = run(idle, random_prompts([11], seed=4), 1)[0]
    after = now()
    delta = {k: after[k] - before[k] for k in after}
    for name in names:
        assert delta[(name, "_count")] == 2, name
    assert delta[("vllm:request_params_n", "_sum")] == 3
    assert delta[("vllm:request_params_max_tokens", "_sum")] == 7
    assert delta[("vllm:request_max_num_generation_tokens", "_sum")] == 7
    decode_s = stage_durations(finish.timings)["decode_s"]
    assert one.usage.completion_tokens == 1  # its TPOT is 0: the sum is the n=2 request's alone
    tpot = delta[("vllm:request_time_per_output_token_seconds", "_sum")]
    assert tpot == pytest.approx(decode_s / 5, rel=1e-6), (tpot, decode_s)


def test_stage_durations_are_non_negative_and_add_up(idle):
    finishes = run(idle, random_prompts([30, 7, 44], seed=3), 4)
    for finish in finishes:
        t = finish.timings
        stamps = [
            t.queued_unix_ns,
            t.reserved_unix_ns,
            t.prefill_dispatch_unix_ns,
            t.prefill_arrival_unix_ns,
            t.prefill_start_unix_ns,
            t.prefill_end_unix_ns,
            t.transfer_end_unix_ns,
            t.commit_unix_ns,
            t.first_token_unix_ns,
            t.last_token_unix_ns,
        ]
        assert all(stamps), t
        assert stamps == sorted(stamps), t  # one machine, one clock: stage by stage in order
        assert t.prefill_start_unix_ns <= t.transfer_start_unix_ns <= t.transfer_end_unix_ns
        d = stage_durations(t)
        parts = [d[f"{s}_s"] for s in STAGES]
        assert all(p is not None and p >= 0 for p in parts), d
        assert math.isclose(sum(parts), d["e2e_s"], rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(sum(parts[:5]), d["ttft_s"], rel_tol=1e-9, abs_tol=1e-9)
        assert t.prefill_worker == "p0" and t.decode_worker == "d0"


def test_prefix_cache_hits_on_a_repeated_prompt(idle, monkeypatch):
    """A repeated prompt goes back to the decode worker that holds it and runs there from its
    prefix cache (router/legs.py); with that reuse off, the prefill worker's cache serves it.
    Each worker counts its own hits, and the router counts them by source."""
    prompt = random_prompts([40], seed=4)[0]
    model = idle.router.servicer.options.model_id

    def router_hits(source):
        return idle.router.metrics_registry.get_sample_value(
            "pdserve:prompt_cache_hit_tokens_total", {"model_name": model, "source": source}
        )

    run(idle, [prompt], 2)
    before, hits_before = worker_stats(idle), router_hits("decode_worker")
    run(idle, [prompt], 2)
    after = worker_stats(idle)
    assert after["prefill"].prefix_cache_queries == before["prefill"].prefix_cache_queries
    assert after["decode"].prefix_cache_queries - before["decode"].prefix_cache_queries == 40
    hits = after["decode"].prefix_cache_hits - before["decode"].prefix_cache_hits
    assert 0 < hits < 40  # the last prompt token is always computed
    assert router_hits("decode_worker") - hits_before == hits
    legs = idle.router.servicer.legs
    monkeypatch.setattr(legs, "local_prefill", LocalPrefill(reuse_max_new_tokens=0))
    before, hits_before = after["prefill"], router_hits("prefill_worker")
    run(idle, [prompt], 2)
    after = worker_stats(idle)["prefill"]
    assert after.prefix_cache_queries - before.prefix_cache_queries == 40
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert 0 < hits < 40
    assert router_hits("prefill_worker") - hits_before == hits


def test_expired_leases_and_failed_transfers_are_counted_and_exported(idle):
    before = worker_stats(idle)
    prompt = random_prompts([8], seed=5)[0]
    idle.d.Reserve(
        worker_pb2.ReserveRequest(request_id="lapses", prompt_token_ids=prompt, lease_ms=50),
        timeout=RPC_TIMEOUT,
    )
    wait_until(
        lambda: worker_stats(idle)["decode"].leases_expired == before["decode"].leases_expired + 1,
        5,
        "the lease to run out",
    )
    # a Prefill into a reservation whose KV endpoint does not answer
    res = idle.d.Reserve(
        worker_pb2.ReserveRequest(request_id="nowhere", prompt_token_ids=prompt, lease_ms=5000),
        timeout=RPC_TIMEOUT,
    )
    res.endpoint.address = "127.0.0.1:1"
    with pytest.raises(grpc.RpcError) as err:
        idle.p.Prefill(
            worker_pb2.PrefillRequest(
                request_id="nowhere", prompt_token_ids=prompt, reservation=res
            ),
            timeout=RPC_TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    idle.d.Abort(worker_pb2.WorkerAbortRequest(request_id="nowhere"), timeout=RPC_TIMEOUT)
    after = worker_stats(idle)
    assert after["prefill"].kv_transfer_failures == before["prefill"].kv_transfer_failures + 1

    failures = after["prefill"].kv_transfer_failures
    wait_exported(
        idle,
        {
            ("decode", "d0", "pdserve:leases_expired_total"): after["decode"].leases_expired,
            ("prefill", "p0", "pdserve:kv_transfer_failures_total"): failures,
        },
    )


def test_a_colocated_cluster_labels_its_pool_and_has_no_hand_off(tiny_models, one_thread):
    from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc
    from pdserve.router.server import Router, RouterConfig

    model_dir = tiny_models("llama-gqa")[0]
    worker = DecodeWorker(
        DecodeWorkerConfig(
            model=model_dir, worker_id="c0", engine_kwargs=dict(kv_cache_memory=1 << 20)
        )
    ).start()
    router = Router(
        RouterConfig(model=model_dir, decode_addresses=(worker.address,), colocated=True)
    ).start()
    channel = grpc.insecure_channel(router.address)
    try:
        api = pdserve_pb2_grpc.PDServeStub(channel)
        prompt = random_prompts([40], seed=6)[0]
        for _ in range(2):  # the second finds the first's blocks in the prefix cache
            finish = list(
                api.Generate(
                    pdserve_pb2.GenerateRequest(
                        token_ids=pdserve_pb2.TokenIds(ids=prompt),
                        sampling=pdserve_pb2.SamplingParams(
                            temperature=0, max_tokens=3, ignore_eos=True
                        ),
                    ),
                    timeout=RPC_TIMEOUT,
                )
            )[-1].finish
        d = stage_durations(finish.timings)
        assert d["router_queue_s"] is not None and d["decode_s"] is not None
        assert [d[f"{s}_s"] for s in STAGES[1:5]] == [None] * 4
        assert finish.usage.kv_transfer_bytes == 0
        reg, model = router.metrics_registry, router.servicer.options.model_id
        assert reg.get_sample_value("vllm:time_to_first_token_seconds_count", {MODEL: model}) == 2
        assert not reg.get_sample_value("pdserve:request_kv_transfer_bytes_count", {MODEL: model})
        labels = {MODEL: model, "role": "colocated", "worker": "c0"}

        def counter(name):
            return reg.get_sample_value(name, labels)

        wait_until(
            lambda: counter("vllm:prefix_cache_queries_total") == 80,
            5,
            "the worker's prefix cache queries in the router's metrics",
        )
        assert 0 < counter("vllm:prefix_cache_hits_total") < 40
        assert counter("pdserve:kv_transfers_total") == 0
    finally:
        channel.close()
        router.stop()
        worker.stop()


def test_a_cancelled_request_counts_as_an_abort(idle):
    """A request that ends without a Finish is counted too, as vLLM counts its aborts."""
    before = value(idle, "vllm:request_success_total", finished_reason="abort")
    stopped = value(idle, "vllm:request_success_total", finished_reason="stop")
    call = idle.api.Generate(
        pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=random_prompts([8], seed=5)[0]),
            sampling=pdserve_pb2.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
        ),
        timeout=RPC_TIMEOUT,
    )
    assert next(call).HasField("delta")
    call.cancel()
    wait_until(
        lambda: value(idle, "vllm:request_success_total", finished_reason="abort") == before + 1,
        5,
        "the cancelled request was not counted as an abort",
    )
    assert value(idle, "vllm:request_success_total", finished_reason="stop") == stopped


def test_failed_calls_are_counted_by_status_and_a_cancel_is_not_an_error(idle):
    """pdserve:request_errors_total{code}: every Generate call that ends with an error status,
    refusals before admission included; a client's cancel is an abort, not an error."""
    errors = lambda code: value(idle, "pdserve:request_errors_total", code=code)  # noqa: E731
    invalid, missing = errors("INVALID_ARGUMENT"), errors("NOT_FOUND")
    bad = [
        (dict(sampling=pdserve_pb2.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(sampling=pdserve_pb2.SamplingParams(n=0)), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(model="no-such-model"), grpc.StatusCode.NOT_FOUND),
    ]
    for fields, code in bad:
        with pytest.raises(grpc.RpcError) as err:
            list(
                idle.api.Generate(
                    pdserve_pb2.GenerateRequest(
                        token_ids=pdserve_pb2.TokenIds(ids=[5, 6]), **fields
                    ),
                    timeout=RPC_TIMEOUT,
                )
            )
        assert err.value.code() == code
    assert (errors("INVALID_ARGUMENT"), errors("NOT_FOUND")) == (invalid + 2, missing + 1)
    run(idle, random_prompts([6], seed=3), 2)  # a served request counts nowhere here
    test_a_cancelled_request_counts_as_an_abort(idle)
    assert (errors("INVALID_ARGUMENT"), errors("NOT_FOUND")) == (invalid + 2, missing + 1)
    assert errors("CANCELLED") == errors("UNKNOWN") == 0
