"""Pieces shared by the end-to-end tests that deploy SmolLM2 through `up()` on one local Ray
(tests/e2e/test_cluster_backends.py, test_openai_up.py): a pool's YAML section sized for a 2-CPU
machine, and the check that every worker's KV pool is back to fully free (once: all_free; in a
polling loop: kv_free_probe; after a stream left: assert_released). The module-scoped Ray session they run in is a fixture of
tests/e2e/conftest.py."""

from __future__ import annotations

import contextlib
import time

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
    with kv_free_probe(cluster) as free:
        return free()


@contextlib.contextmanager
def kv_free_probe(cluster):
    """A callable that says whether every worker's KV pool is fully free (no running or reserved
    sequence, every block free), over channels opened once: each call costs one Stats call per
    worker, not a connection, so a test that times how soon KV is freed measures the workers and
    not its own polling."""
    from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

    channels, stubs = [], []
    try:
        for role, stub_cls in (
            ("decode", worker_pb2_grpc.DecodeWorkerStub),
            ("prefill", worker_pb2_grpc.PrefillWorkerStub),
        ):
            for address in cluster.addresses(role):
                channels.append(cluster.security.channel(address))
                stubs.append(stub_cls(channels[-1]))

        def free() -> bool:
            for stub in stubs:
                s = stub.Stats(worker_pb2.StatsRequest(), timeout=10)
                # prefill pools keep finished prompts as evictable prefix-cache blocks: free
                # counts them
                if s.num_free_blocks != s.num_total_blocks or s.num_running or s.num_reserved:
                    return False
            return True

        yield free
    finally:
        for channel in channels:
            channel.close()


RELEASE_STEPS = 10  # a stream's KV is freed within this many of its steps once it is gone


def assert_released(free, steps_s: float, what: str) -> None:
    """Polls `free` (kv_free_probe's) until every KV pool is free, failing past RELEASE_STEPS of
    the gone stream's steps (`steps_s`: one step's seconds as timed just before it went), at least
    1 s. The bound tells a release by the abort from one by the stream running out its tokens (a
    test gives it hundreds); it is not a speed claim: a loaded machine's steps are slower, and a
    fixed 1 s bound was missed in a loaded CI run."""
    bound = max(1.0, RELEASE_STEPS * steps_s)
    gone = time.monotonic()
    while not free():
        assert time.monotonic() - gone < bound, (
            f"{what} still holds KV after {bound:.1f} s ({RELEASE_STEPS} of its steps)"
        )
        time.sleep(0.02)
