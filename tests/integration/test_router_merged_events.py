"""A router whose leg fell behind its decode worker answers with fewer, larger deltas and the same
stream (router/decode_streams.py, LegStream._merged): here each leg's events are held until its
last one is in, so the first read finds them all queued, and the client's token ids, text,
logprobs, alternatives and finishes must equal those of a router that reads every event alone,
and the router's metrics count what it joined.
One process over 127.0.0.1: a DecodeWorker, a PrefillWorker and the Router (helpers.router_cluster).
"""

from __future__ import annotations

import pytest

from helpers.router_cluster import RPC_TIMEOUT, Cluster
from helpers.threads import leaves_no_threads
from pdserve.decode_worker import streams as worker_streams
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router import decode_streams

PROMPT = [5, 17, 33, 2, 90, 41, 7, 12]


@pytest.fixture(scope="module")
def cluster(tiny_models, one_thread):
    with leaves_no_threads():
        c = Cluster(tiny_models("llama-gqa")[0])
        try:
            yield c
        finally:
            c.stop()


def held_until_the_end(monkeypatch):
    """Each leg's items reach its queue together, once its last event or its failure came."""
    held: dict[int, list] = {}
    deliver = decode_streams.LegStream.deliver

    def deliver_at_end(leg, item, wakers=None):
        items = held.setdefault(id(leg), [])
        items.append(item)
        if item is decode_streams._END or isinstance(item, decode_streams.LegStreamError):
            for x in held.pop(id(leg)):
                deliver(leg, x, wakers)

    monkeypatch.setattr(decode_streams.LegStream, "deliver", deliver_at_end)


def stream(cluster, sampling) -> tuple[int, dict]:
    """(the number of deltas, per sequence: ids, text, logprobs, alternatives, finish)."""
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=PROMPT), sampling=sampling
    )
    seqs: dict[int, dict] = {}
    deltas = 0
    for r in cluster.api.Generate(request, timeout=RPC_TIMEOUT):
        if r.HasField("delta"):
            deltas += 1
            d = r.delta
            s = seqs.setdefault(d.index, {"ids": [], "text": "", "lp": [], "tops": []})
            s["ids"] += d.token_ids
            s["text"] += d.text
            s["lp"] += [round(x, 4) for x in d.logprobs]
            s["tops"] += [list(t.token_ids) for t in d.top_logprobs]
        else:
            seqs.setdefault(r.finish.index, {})["finish"] = r.finish.finish_reason
    return deltas, seqs


def joined_events(cluster) -> float:
    return cluster.router.metrics_registry.get_sample_value(
        "pdserve:router_joined_token_events_total",
        {"model_name": cluster.router.servicer.options.model_id},
    )


SAMPLINGS = {
    "greedy-logprobs-alternatives": pdserve_pb2.SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2
    ),
    "two-sampled-sequences": pdserve_pb2.SamplingParams(
        n=2, temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=True
    ),
    "greedy-text": pdserve_pb2.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
}


@pytest.mark.parametrize("name", SAMPLINGS)
def test_a_leg_that_fell_behind_sends_fewer_deltas_of_the_same_stream(cluster, monkeypatch, name):
    sampling = SAMPLINGS[name]
    # the decode worker sends an event per engine output: on a loaded machine it joined what
    # queued on its side before the router saw it, leaving the router nothing to join
    monkeypatch.setattr(worker_streams, "_merge_into", lambda pending, event: pending.append(event))
    with monkeypatch.context() as alone_reader:
        # a router that reads every event alone: on a loaded machine its leg may fall behind
        # here too (a CI run's router joined 16 events into 1), leaving nothing to compare
        alone_reader.setattr(decode_streams, "_continues", lambda event, item: False)
        alone_deltas, alone = stream(cluster, sampling)
    held_until_the_end(monkeypatch)
    joined = joined_events(cluster)
    merged_deltas, merged = stream(cluster, sampling)
    assert merged == alone
    assert joined_events(cluster) > joined  # pdserve:router_joined_token_events counts them
    assert all(len(s["ids"]) == sampling.max_tokens for s in alone.values())
    assert merged_deltas < alone_deltas
    if name == "greedy-text":  # nothing keeps two events apart: the whole answer in one delta
        assert merged_deltas == 1
