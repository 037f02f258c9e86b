"""The router and the request shared by the tests of the router's worker pool: membership that
changes at run time (tests/integration/test_router_membership.py) and requests that outlive their
decode worker (tests/integration/test_router_failover_workers.py and, without a worker,
tests/unit/test_router_failover.py).

Not a test module: imported as `from helpers.router import ...` (tests/helpers/ is a package on pytest's sys.path). The
fixture is a `fixture_<name>` function registered as `<name>` (`model_dir`, module-scoped), so that
a test module imports it and its tests' parameters do not shadow the import.
"""

from __future__ import annotations

import grpc

from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2_grpc
from pdserve.router.server import Router, RouterConfig

RPC_TIMEOUT = 20.0
MAX_MODEL_LEN = 256
LONG_GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def start_router(model_dir, prefill_addresses=(), decode_addresses=(), **kwargs) -> Router:
    kwargs.setdefault("stats_interval_s", 0.05)
    router = Router(
        RouterConfig(
            model=model_dir,
            prefill_addresses=tuple(prefill_addresses),
            decode_addresses=tuple(decode_addresses),
            max_model_len=MAX_MODEL_LEN,
            **kwargs,
        )
    ).start()
    router.channel = grpc.insecure_channel(router.address)
    router.api = pdserve_pb2_grpc.PDServeStub(router.channel)
    router.registry = worker_pb2_grpc.RegistryStub(router.channel)
    return router


def stop_router(router):
    router.channel.close()
    router.stop()


def generate_call(router, prompt, sampling):
    return router.api.Generate(
        pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling),
        timeout=RPC_TIMEOUT,
    )
