"""The tiny cluster behind a Router that the router's end-to-end tests and its metrics' tests
drive through the client API: one DecodeWorker, one PrefillWorker and the Router in front
(tests/integration/test_router.py, tests/integration/test_metrics_cluster.py).

Not a test module: imported as `from helpers.router_cluster import ...` (tests/helpers/ is a package on pytest's sys.path).
"""

from __future__ import annotations

import grpc

from helpers.threads import wait_until
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc

RPC_TIMEOUT = 20.0
MAX_MODEL_LEN = 256
GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class Cluster:
    ROUTER_CONFIG: dict = {}  # more RouterConfig fields (a subclass's)

    def __init__(self, model_dir):
        engine = dict(max_model_len=MAX_MODEL_LEN)
        self.decode = start_decode(model_dir, engine=engine, lease_ms=5000)
        self.prefill = start_prefill(model_dir, engine=engine)
        self.router = start_router(
            model_dir,
            self.decode,
            self.prefill,
            max_model_len=MAX_MODEL_LEN,
            max_inflight=16,
            **self.ROUTER_CONFIG,
        )
        self.channels = [
            grpc.insecure_channel(a) for a in (self.router.address, self.decode.address)
        ]
        self.api = pdserve_pb2_grpc.PDServeStub(self.channels[0])
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.channels[1])
        # a worker's id reaches the router with its first Stats answer; until then the router
        # names it by its address (in a request's timings too), which a loaded machine can delay
        pool = self.router.pool
        wait_until(
            lambda: all(w.worker_id for w in pool.members()),
            60,
            f"the router has not heard from every worker: {pool.snapshot()}",
        )

    def stop(self):
        stop_all(self.channels, self.router, self.prefill, self.decode)

    def stats(self):
        return self.d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)

    def generate(self, sampling=GREEDY, **input_):
        """(token ids, text, Finish) of a request with one of text=, token_ids=, chat= set."""
        if "token_ids" in input_:
            input_["token_ids"] = pdserve_pb2.TokenIds(ids=input_["token_ids"])
        if "chat" in input_:
            input_["chat"] = pdserve_pb2.ChatMessages(
                messages=[pdserve_pb2.ChatMessage(role=r, content=c) for r, c in input_["chat"]]
            )
        model = input_.pop("model", "")
        responses = list(
            self.api.Generate(
                pdserve_pb2.GenerateRequest(sampling=sampling, model=model, **input_),
                timeout=RPC_TIMEOUT,
            )
        )
        deltas = [r.delta for r in responses if r.HasField("delta")]
        assert [r.HasField("finish") for r in responses] == [False] * len(deltas) + [True]
        assert len({r.request_id for r in responses}) == 1 and responses[0].request_id
        return (
            [t for d in deltas for t in d.token_ids],
            "".join(d.text for d in deltas),
            responses[-1].finish,
        )


def pool_idle(cluster) -> bool:
    s = cluster.stats()
    return s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0 and s.num_running == 0
