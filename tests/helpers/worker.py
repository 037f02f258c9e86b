"""The tiny cluster's processes as the tests start them: a decode worker, a prefill worker and a
Router in front, with the settings most tests share (1 MiB of KV each; blocks of 16 on the decode
worker, 4 on the prefill worker, so a hand-off re-blocks), and `Cluster`: a decode worker and a
prefill worker with a stub for each, which the worker services' tests drive through Reserve ->
Prefill -> Stream (`BackendCluster`: the same over a given KV backend and TP sizes)."""

from __future__ import annotations

import threading

import grpc

from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.router.server import Router, RouterConfig

DECODE_ENGINE = dict(kv_cache_memory=1 << 20, block_size=16)
PREFILL_ENGINE = dict(kv_cache_memory=1 << 20, block_size=4)


def start_decode(model_dir, worker_id: str = "d0", engine: dict | None = None, **config):
    """A started DecodeWorker; engine: its engine_kwargs over DECODE_ENGINE; config: more
    DecodeWorkerConfig fields."""
    return _start(
        DecodeWorker, DecodeWorkerConfig, DECODE_ENGINE, model_dir, worker_id, engine, config
    )


def start_prefill(model_dir, worker_id: str = "p0", engine: dict | None = None, **config):
    """A started PrefillWorker; engine: its engine_kwargs over PREFILL_ENGINE."""
    return _start(
        PrefillWorker, PrefillWorkerConfig, PREFILL_ENGINE, model_dir, worker_id, engine, config
    )


def _start(worker, worker_config, base_engine, model_dir, worker_id, engine, config):
    engine_kwargs = {**base_engine, **(engine or {})}
    return worker(
        worker_config(model=model_dir, worker_id=worker_id, engine_kwargs=engine_kwargs, **config)
    ).start()


def start_router(model_dir, decode, prefill=None, **config) -> Router:
    """A started Router in front of the worker(s) `decode` (one or a list) and `prefill` (None:
    no prefill pool, as colocated=True wants)."""
    decodes = decode if isinstance(decode, list) else [decode]
    return Router(
        RouterConfig(
            model=model_dir,
            prefill_addresses=() if prefill is None else (prefill.address,),
            decode_addresses=tuple(w.address for w in decodes),
            **config,
        )
    ).start()


def stop_all(channels, *processes) -> None:
    """Closes the channels, then stops the processes in the order given (router first)."""
    for ch in channels:
        ch.close()
    for p in processes:
        p.stop()


def record_aborts(decode, monkeypatch) -> list:
    """The (request id, reason) of each abort of `decode`'s hand-off from now on, as they come."""
    aborted = []
    real_abort = decode.handoff.abort
    monkeypatch.setattr(
        decode.handoff,
        "abort",
        lambda rid, reason="": aborted.append((rid, reason)) or real_abort(rid, reason),
    )
    return aborted


# ---- a decode worker and a prefill worker, with their stubs: the worker services' tests
# (tests/integration/test_worker_services_cluster.py), tests/integration/test_worker_backends_tp.py
RPC_TIMEOUT = 20.0
MAX_MODEL_LEN = 64
GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def staged_reference(path: str, lengths, seed: int, max_model_len: int, layers: int = 5):
    """A tiny Llama (GQA) of `layers` layers saved to `path`, prompts of `lengths`, and one
    engine's greedy tokens for them (GREEDY): what a hand-off from a prefill worker in stages
    must give (tests/integration/test_pp_handoff*.py). Returns (path, prompts, tokens)."""
    from helpers.models import make_tiny_model, random_prompts
    from pdserve.engine import LLM, SamplingParams
    from pdserve.protos.convert import sampling_kwargs

    make_tiny_model(path, "llama-gqa", seed=5, num_hidden_layers=layers)
    prompts = random_prompts(lengths, seed=seed)
    llm = LLM(path, kv_cache_memory=1 << 20, max_model_len=max_model_len)
    outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)
    llm.shutdown()
    return path, prompts, [o.outputs[0].token_ids for o in outs]


class Cluster:
    def __init__(self, model_dir):
        engine = dict(kv_cache_memory=1 << 17, max_model_len=MAX_MODEL_LEN)
        self.decode = start_decode(model_dir, engine=engine, lease_ms=5000)
        self.prefill = start_prefill(model_dir)
        self.connect()

    def add_prefill(self, model_dir, **kwargs) -> None:
        """Starts the prefill worker (start_prefill's arguments) beside self.decode, which is
        stopped if it fails, then connects to both."""
        try:
            self.prefill = start_prefill(model_dir, **kwargs)
        except BaseException:
            self.decode.stop()
            raise
        self.connect()

    def connect(self) -> None:
        """Channels and stubs to self.decode and self.prefill, once both are up."""
        self.channels = [grpc.insecure_channel(w.address) for w in (self.decode, self.prefill)]
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.channels[0])
        self.p = worker_pb2_grpc.PrefillWorkerStub(self.channels[1])

    def stop(self):
        stop_all(self.channels, self.prefill, self.decode)

    def stats(self):
        return self.d.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)

    def reserve(self, rid, prompt, sampling=GREEDY, lease_ms=0):
        return self.d.Reserve(
            worker_pb2.ReserveRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling, lease_ms=lease_ms
            ),
            timeout=RPC_TIMEOUT,
        )

    def prefill_req(self, rid, prompt, reservation, sampling=GREEDY):
        return self.p.Prefill(
            worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling, reservation=reservation
            ),
            timeout=RPC_TIMEOUT,
        )

    def stream(self, rid):
        return list(self.d.Stream(worker_pb2.StreamRequest(request_id=rid), timeout=RPC_TIMEOUT))

    def generate(self, rid, prompt, sampling=GREEDY):
        reservation = self.reserve(rid, prompt, sampling)
        first = self.prefill_req(rid, prompt, reservation, sampling)
        events = self.stream(rid)
        tokens = [t for e in events for t in e.token_ids]
        assert tokens[0] == first.first_tokens[0]
        assert events[-1].HasField("finish_reason") and events[-1].finish_reason == "length"
        assert all(not e.HasField("finish_reason") for e in events[:-1])
        assert first.bytes_sent > 0
        assert first.timings.transfer_end_unix_ns >= first.timings.prefill_end_unix_ns > 0
        return tokens


def generate_concurrently(cluster, prompts, timeout=120) -> list:
    """Every prompt through Reserve -> Prefill -> Stream at once; the tokens in prompt order."""
    results, errors = {}, []

    def run(i):
        try:
            results[i] = cluster.generate(f"par-{i}", prompts[i])
        except Exception as e:  # surfaced below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return [results.get(i) for i in range(len(prompts))]


# ---- the same pair over a given KV backend and TP sizes (test_worker_backends_tp.py and
# test_n_sequences.py in tests/integration)
class BackendCluster(Cluster):
    def __init__(self, model_dir, backend: str, prefill_tp: int, decode_tp: int, **engine):
        # its own workers; `engine`: more engine settings for both (e.g. kv_cache_dtype)
        self.decode = start_decode(
            model_dir,
            engine=dict(
                kv_cache_memory=1 << 17,
                max_model_len=MAX_MODEL_LEN,
                tensor_parallel_size=decode_tp,
                **engine,
            ),
            lease_ms=10_000,
            kv_backend=backend,
        )
        self.add_prefill(model_dir, engine=dict(tensor_parallel_size=prefill_tp, **engine))


# ---- the prefill worker's KV channels in a Cluster (tests/integration/test_kv_auto.py,
# tests/integration/test_auto_rank_nixl_cluster.py)
def used_backends(cluster) -> set[str]:
    """The backends the prefill worker holds channels of."""
    return {backend for backend, _ in cluster.prefill.parts["prefill"].servicer._transports}


def forget_channels(cluster) -> None:
    """Closes and forgets the prefill worker's channels: the next hand-off picks afresh."""
    servicer = cluster.prefill.parts["prefill"].servicer
    with servicer._transports_lock:
        for transport in servicer._transports.values():
            transport.close()
        servicer._transports.clear()
        servicer._transport_used.clear()


def idle(cluster) -> bool:
    """The decode worker holds nothing: every block free, nothing reserved or running."""
    s = cluster.stats()
    return s.num_free_blocks == s.num_total_blocks and s.num_reserved == s.num_running == 0
