"""Requests that outlive their decode worker: the stream resumes on another decode worker (or
fails UNAVAILABLE when none is left, or for n>1 once tokens were streamed).

Real workers and the router run in this process over 127.0.0.1 (as in test_router.py); pool
membership and health are in test_router_membership.py; the pieces of a resume, without a worker,
in tests/unit/test_router_failover.py.
"""

from __future__ import annotations

import contextlib
import logging
import time

import grpc
import pytest

from helpers.models import random_prompts
from helpers.router import (
    LONG_GREEDY,
    MAX_MODEL_LEN,
    RPC_TIMEOUT,
    generate_call,
    start_router,
    stop_router,
)
from helpers.threads import wait_until
from pdserve.decode_worker.server import DecodeWorker, DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.prefill_worker.server import PrefillWorker, PrefillWorkerConfig
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker_common.registration import Registration

ENGINE = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 20)
STEP_DELAY_S = 0.02  # decode steps slowed so a test can stop the worker mid-stream


# ---- real workers -------------------------------------------------------------------------------
def start_decode(model_dir, worker_id: str) -> DecodeWorker:
    worker = DecodeWorker(
        DecodeWorkerConfig(
            model=model_dir,
            worker_id=worker_id,
            lease_ms=5000,
            stop_grace_s=0,  # stop = sudden death
            engine_kwargs=dict(block_size=16, **ENGINE),
        )
    ).start()
    step = worker.loop.engine.step
    worker.loop.engine.step = lambda: (time.sleep(STEP_DELAY_S), step())[1]
    worker.channel = grpc.insecure_channel(worker.address)
    worker.stub = worker_pb2_grpc.DecodeWorkerStub(worker.channel)
    return worker


def stop_worker(worker) -> None:
    worker.channel.close()
    worker.stop()


def stats(worker):
    return worker.stub.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)


def all_blocks_free(worker) -> bool:
    s = stats(worker)
    return s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_reserved == 0


@pytest.fixture(scope="module")
def prefill(model_dir):
    worker = PrefillWorker(
        PrefillWorkerConfig(
            model=model_dir, worker_id="p0", engine_kwargs=dict(block_size=4, **ENGINE)
        )
    ).start()
    worker.channel = grpc.insecure_channel(worker.address)
    worker.stub = worker_pb2_grpc.PrefillWorkerStub(worker.channel)
    yield worker
    stop_worker(worker)


@pytest.fixture(scope="module")
def expected(model_dir):
    """The engine's own greedy continuation of the prompt the failover tests send."""
    prompt = random_prompts([20], seed=21)[0]
    llm = LLM(model_dir, **ENGINE)
    out = llm.generate([prompt], SamplingParams(**sampling_kwargs(LONG_GREEDY)), use_tqdm=False)[0]
    return prompt, out.outputs[0].token_ids, out.outputs[0].text


@contextlib.contextmanager
def two_decode_workers(model_dir, prefill):
    """(router, [d0, d1]): two decode workers behind a router with `prefill`; stopped after."""
    decodes = [start_decode(model_dir, "d0"), start_decode(model_dir, "d1")]
    router = start_router(model_dir, [prefill.address], [d.address for d in decodes])
    try:
        yield router, decodes
    finally:
        stop_router(router)
        for d in decodes:
            stop_worker(d)


def slow_prefill(monkeypatch, prefill) -> None:
    """The prefill waits, so the reservation is the only thing on the decode worker when it
    dies (monkeypatch.undo() ends it)."""
    step = prefill.loop.engine.step
    monkeypatch.setattr(prefill.loop.engine, "step", lambda: (time.sleep(0.3), step())[1])


def stop_reservation_holder(decodes):
    """Stops the decode worker holding the reservation once one does; returns the other one."""
    holders = []
    wait_until(
        lambda: holders.extend(d for d in decodes if stats(d).num_reserved == 1) or holders,
        5,
        "a decode worker holds the reservation",
    )
    holders[0].stop()
    (survivor,) = [d for d in decodes if d is not holders[0]]
    return survivor


def wait_blocks_free(survivor, prefill) -> None:
    wait_until(
        lambda: all_blocks_free(survivor) and all_blocks_free(prefill),
        5,
        f"blocks still held: {stats(survivor)} {stats(prefill)}",
    )


def stream_killing_holder(router, prompt, decodes, kill_after: int):
    """Streams a request and stops the decode worker running it once `kill_after` tokens arrived.
    Returns (token ids, text, the last response, the stopped worker, tokens before the stop)."""
    call = generate_call(router, prompt, LONG_GREEDY)
    ids, text, last, victim, num_before = [], "", None, None, 0
    for response in call:
        last = response
        if response.HasField("delta"):
            ids += response.delta.token_ids
            text += response.delta.text
        if victim is None and len(ids) >= kill_after:
            holders = [d for d in decodes if stats(d).num_running == 1]
            assert len(holders) == 1, "exactly one decode worker should run the request"
            victim, num_before = holders[0], len(ids)
            victim.stop()
    return ids, text, last, victim, num_before


def test_stream_resumes_on_another_decode_worker_when_its_worker_dies(
    model_dir, prefill, expected, caplog
):
    prompt, want_ids, want_text = expected
    with two_decode_workers(model_dir, prefill) as (router, decodes):
        with caplog.at_level(logging.WARNING, logger="pdserve.router.call"):
            ids, text, last, victim, num_before = stream_killing_holder(router, prompt, decodes, 5)
        assert 5 <= num_before < len(want_ids), (
            "the worker was stopped after the stream had finished"
        )
        assert ids == want_ids and text == want_text  # nothing repeated, nothing lost
        finish = last.finish
        assert finish.finish_reason == "length" and finish.usage.completion_tokens == len(want_ids)
        assert finish.usage.prompt_tokens == len(prompt)
        (survivor,) = [d for d in decodes if d is not victim]
        assert finish.timings.decode_worker == survivor.config.worker_id
        assert 0 < finish.timings.first_token_unix_ns <= finish.timings.last_token_unix_ns
        assert any("resuming on another" in r.getMessage() for r in caplog.records)
        wait_blocks_free(survivor, prefill)


def test_decode_death_before_the_first_token_resumes_with_the_prompt_unchanged(
    model_dir, prefill, expected, monkeypatch
):
    prompt, want_ids, want_text = expected
    slow_prefill(monkeypatch, prefill)
    with two_decode_workers(model_dir, prefill) as (router, decodes):
        call = generate_call(router, prompt, LONG_GREEDY)
        survivor = stop_reservation_holder(decodes)
        responses = list(call)
        assert [t for r in responses if r.HasField("delta") for t in r.delta.token_ids] == want_ids
        assert "".join(r.delta.text for r in responses if r.HasField("delta")) == want_text
        assert responses[-1].finish.timings.decode_worker == survivor.config.worker_id
        monkeypatch.undo()
        wait_blocks_free(survivor, prefill)


def test_no_other_decode_worker_fails_unavailable_until_a_replacement_registers(
    model_dir, prefill, expected
):
    prompt, want_ids, want_text = expected
    only = start_decode(model_dir, "d-only")
    router = start_router(model_dir, [prefill.address], [only.address], heartbeat_ms=100)
    replacement, registration = None, None
    try:
        with pytest.raises(grpc.RpcError) as err:
            stream_killing_holder(router, prompt, [only], 3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no other decode worker is available" in err.value.details()
        assert "d-only" in err.value.details()
        wait_until(lambda: all_blocks_free(prefill), 5, f"prefill blocks held: {stats(prefill)}")

        replacement = start_decode(model_dir, "d-new")
        registration = Registration(
            router.address,
            worker_pb2.RegisterRequest(
                worker_id="d-new",
                role="decode",
                address=replacement.address,
                model=pdserve_pb2.ModelCard(id=router.servicer.options.model_id),
            ),
            lambda: stats(replacement),
        ).start()
        assert registration.wait_registered(5)
        responses = list(generate_call(router, prompt, LONG_GREEDY))
        assert [t for r in responses if r.HasField("delta") for t in r.delta.token_ids] == want_ids
        assert responses[-1].finish.timings.decode_worker == "d-new"
        wait_until(lambda: all_blocks_free(replacement), 5, f"blocks held: {stats(replacement)}")
    finally:
        if registration is not None:
            registration.stop()
        stop_router(router)
        for d in (only, replacement):
            if d is not None:
                stop_worker(d)


def test_decode_death_of_an_n_request_resumes_each_open_sequence_on_its_own_leg(
    model_dir, prefill, expected
):
    """n>1 once tokens were streamed: each sequence still open resumes alone on a leg (the prompt
    plus its own tokens) on the survivor, one after another, under its own index: greedy, every
    sequence ends with the engine's tokens, none repeated or lost, and both sides free their
    blocks."""
    prompt, want_ids, want_text = expected
    sampling = pdserve_pb2.SamplingParams()
    sampling.CopyFrom(LONG_GREEDY)
    sampling.n = 2
    with two_decode_workers(model_dir, prefill) as (router, decodes):
        call = generate_call(router, prompt, sampling)
        got, texts, finishes, victim = {0: [], 1: []}, {0: "", 1: ""}, {}, None
        for response in call:
            if response.HasField("delta"):
                got[response.delta.index] += response.delta.token_ids
                texts[response.delta.index] += response.delta.text
            else:
                finishes[response.finish.index] = response.finish
            if victim is None and len(got[0]) + len(got[1]) >= 8:
                (victim,) = [d for d in decodes if stats(d).num_running == 2]
                victim.stop()
                at_kill = len(got[0]) + len(got[1])
        assert victim is not None and at_kill < 2 * len(want_ids), "stopped after the end"
        assert got == {0: want_ids, 1: want_ids} and texts == {0: want_text, 1: want_text}
        assert sorted(finishes) == [0, 1]
        (survivor,) = [d for d in decodes if d is not victim]
        for f in finishes.values():
            assert f.finish_reason == "length" and f.usage.completion_tokens == len(want_ids)
            assert f.timings.decode_worker == survivor.config.worker_id
        wait_blocks_free(survivor, prefill)


def test_a_death_past_max_resumes_fails_unavailable_saying_so(model_dir, prefill, expected):
    prompt = expected[0]
    decodes = [start_decode(model_dir, "d0"), start_decode(model_dir, "d1")]
    addresses = [d.address for d in decodes]
    router = start_router(model_dir, [prefill.address], addresses, max_resumes=0)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stream_killing_holder(router, prompt, decodes, 5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "already resumed 0 times (max_resumes=0)" in err.value.details()
    finally:
        stop_router(router)
        for d in decodes:
            stop_worker(d)


def test_decode_death_of_an_n_request_before_any_token_starts_it_over(
    model_dir, prefill, monkeypatch
):
    prompt = random_prompts([20], seed=24)[0]
    sampling = pdserve_pb2.SamplingParams(
        temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, n=3
    )
    llm = LLM(model_dir, **ENGINE)
    out = llm.generate([prompt], SamplingParams(**sampling_kwargs(sampling)), use_tqdm=False)[0]
    want = {c.index: c.token_ids for c in out.outputs}
    slow_prefill(monkeypatch, prefill)
    with two_decode_workers(model_dir, prefill) as (router, decodes):
        call = generate_call(router, prompt, sampling)
        survivor = stop_reservation_holder(decodes)
        got = {i: [] for i in range(3)}
        finishes = {}
        for r in call:
            if r.HasField("delta"):
                got[r.delta.index] += r.delta.token_ids
            else:
                finishes[r.finish.index] = r.finish
        assert got == want and sorted(finishes) == [0, 1, 2]
        assert {f.timings.decode_worker for f in finishes.values()} == {survivor.config.worker_id}
        monkeypatch.undo()
        wait_blocks_free(survivor, prefill)
