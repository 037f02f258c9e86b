"""Pieces shared by the end-to-end tests that deploy SmolLM2 through `up()` on one local Ray
(tests/e2e/test_cluster_backends.py, test_openai_up.py): a pool's YAML section sized for a 2-CPU
machine, and the check that every worker's KV pool is back to fully free. The module-scoped Ray
session they run in is a fixture of tests/e2e/conftest.py."""

from __future__ import annotations

KV_BYTES = 128 << 20  # decode holds all 32 streams at once


def pool_spec(tp: int) -> dict:
    # 2 CPUs for the whole deployment: a TP group's bundles share them; threads are set explicitly
    return {
        "replicas": 1,
        "tp": tp,
        "resources": {"num_cpus": 0.25},
        "num_threads": 1,
        "kv_cache_memory": KV_BYTES,
        "max_model_len": 1024,
    }


def all_free(cluster) -> bool:
    from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

    for role, stub_cls in (
        ("decode", worker_pb2_grpc.DecodeWorkerStub),
        ("prefill", worker_pb2_grpc.PrefillWorkerStub),
    ):
        for address in cluster.addresses(role):
            with cluster.security.channel(address) as ch:
                s = stub_cls(ch).Stats(worker_pb2.StatsRequest(), timeout=10)
            # prefill pools keep finished prompts as evictable prefix-cache blocks: free counts them
            if s.num_free_blocks != s.num_total_blocks or s.num_running or s.num_reserved:
                return False
    return True
