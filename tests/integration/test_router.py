"""The router end to end in one process over 127.0.0.1: one DecodeWorker, one PrefillWorker and
the Router in front. Streams match the engine's greedy output (ids and text), bad requests get
specific statuses, concurrency and client cancellation leave the decode pool fully free.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.models import random_prompts
from helpers.router_cluster import GREEDY, MAX_MODEL_LEN, RPC_TIMEOUT, Cluster, pool_idle
from helpers.threads import leaves_no_threads, run_in_threads, wait_until
from helpers.worker import record_aborts, start_prefill, start_router
from pdserve.decode_worker.streams import Interval
from pdserve.engine import LLM, SamplingParams
from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router import stepping
from pdserve.router.server import Router, RouterConfig


@pytest.fixture(scope="module")
def cluster(tiny_models, one_thread):
    with leaves_no_threads():
        c = Cluster(tiny_models("llama-gqa")[0])
        yield c
        c.stop()


def dead_address() -> str:
    """A 127.0.0.1 port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def idle(cluster):
    """Each test leaves the decode pool as it found it: every block free, nothing reserved."""
    yield cluster
    wait_until(lambda: pool_idle(cluster), 5, f"decode pool not back to idle: {cluster.stats()}")


@pytest.fixture(scope="module")
def greedy(tiny_models):
    """prompt ids -> the engine's own greedy (token ids, text)."""
    llm = LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20)

    def run(prompt):
        out = llm.generate([prompt], SamplingParams(**sampling_kwargs(GREEDY)), use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.outputs[0].text

    return run


@pytest.fixture(scope="module")
def expected(greedy):
    prompts = random_prompts([30, 7, 21, 1], seed=5)
    return prompts, [greedy(p) for p in prompts]


def test_token_ids_stream_matches_engine(idle, expected):
    prompts, want = expected
    for prompt, (want_ids, want_text) in zip(prompts, want):
        before_ns = time.time_ns()
        ids, text, finish = idle.generate(token_ids=prompt)
        assert ids == want_ids and text == want_text and text
        assert finish.finish_reason == "length"
        assert finish.usage.prompt_tokens == len(prompt) and finish.usage.completion_tokens == 8
        t = finish.timings
        assert before_ns <= t.queued_unix_ns <= t.prefill_start_unix_ns <= t.prefill_end_unix_ns
        assert t.prefill_end_unix_ns <= t.transfer_end_unix_ns
        assert 0 < t.first_token_unix_ns <= t.last_token_unix_ns
        assert t.prefill_worker == "p0" and t.decode_worker == "d0"


def test_a_calls_token_steps_run_on_the_event_loop(idle, monkeypatch):
    """Between its start and its last event a call is stepped on the router's event loop, a
    step a response with no thread woken; only the start (admission, Reserve, Prefill) and the
    end run on the thread pool (router/stepping.py)."""
    steps = []  # (on the loop, yielded a response)
    real = stepping.step

    def recorded(gen, loop_side, driven=True):
        item = real(gen, loop_side, driven)
        steps.append((loop_side, item is not stepping.DONE and not stepping.is_pause(item)))
        return item

    monkeypatch.setattr(stepping, "step", recorded)
    sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids, _, finish = idle.generate(sampling=sampling, token_ids=[5, 9, 200])
    assert len(ids) == 40 and finish.finish_reason == "length"
    written = [loop for loop, response in steps if response]
    assert sum(written) >= len(written) - 3, steps  # all but the first, the last and the Finish
    assert sum(1 for loop, _ in steps if not loop) <= 5, steps


def test_stop_string_text_matches_engine(idle, expected, tiny_models):
    prompts, want = expected
    words = want[0][1].split()
    stop = f"{words[3]} {words[4]}"  # cut mid-stream: the engine drops it from its text
    sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=8, stop=[stop])
    llm_out = (
        LLM(tiny_models("llama-gqa")[0], kv_cache_memory=1 << 20)
        .generate([prompts[0]], SamplingParams(**sampling_kwargs(sampling)), use_tqdm=False)[0]
        .outputs[0]
    )
    ids, text, finish = idle.generate(sampling=sampling, token_ids=prompts[0])
    assert (ids, text) == (llm_out.token_ids, llm_out.text) and stop not in text
    assert finish.finish_reason == "stop" and finish.stop_str == stop


def test_text_and_chat_inputs(idle, greedy):
    tokenizer = idle.router.servicer.tokenizer
    prompt = tokenizer.encode("t5 t9 t200", add_special_tokens=True)
    assert prompt[-3:] == [5, 9, 200]
    ids, text, finish = idle.generate(text="t5 t9 t200")
    assert (ids, text) == greedy(prompt) and finish.usage.prompt_tokens == len(prompt)
    if tokenizer.chat_template:
        ids, _, finish = idle.generate(chat=[("user", "t5 t9")])
        assert ids and finish.finish_reason == "length"
    else:
        with pytest.raises(grpc.RpcError) as err:
            idle.generate(chat=[("user", "t5 t9")])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat template" in err.value.details()
    # a chat template set at run time is rendered, then tokenized without special tokens
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}t7"
    try:
        ids, text, finish = idle.generate(chat=[("user", "t5 t9"), ("user", "t3")])
    finally:
        tokenizer.chat_template = None
    assert (ids, text) == greedy([5, 9, 3, 7]) and finish.usage.prompt_tokens == 4


def test_concurrent_streams_complete_and_free_the_pool(idle, expected):
    prompts, want = expected
    results = run_in_threads(lambda i: idle.generate(token_ids=prompts[i % len(prompts)])[:2], 8)
    assert [results.get(i) for i in range(8)] == [want[i % len(prompts)] for i in range(8)]
    wait_until(lambda: pool_idle(idle), 15, f"blocks still held after 8 streams: {idle.stats()}")


@pytest.mark.parametrize("colocated", [False, True], ids=["handoff", "colocated"])
def test_a_stream_interval_sends_the_same_tokens_in_groups(
    idle, tiny_models, colocated, monkeypatch
):
    """router.stream_interval 4: the decode worker sends the first token alone (the hand-off's
    commit, or the colocated prompt's step), then at least four at a time, the rest with the
    end; ids, text, logprobs and alternatives as with each token sent as it comes."""
    released = []  # the tokens in each group the worker let go (the workers run in-process)
    take = Interval.take

    def recording(interval, out):
        due = take(interval, out)
        if due:
            released.append(sum(max(len(c.token_ids) for c in o.outputs) for o in due))
        return due

    monkeypatch.setattr(Interval, "take", recording)
    router = start_router(
        tiny_models("llama-gqa")[0],
        idle.decode,
        None if colocated else idle.prefill,
        max_model_len=MAX_MODEL_LEN,
        colocated=colocated,
        stream_interval=4,
    )
    sampling = pdserve_pb2.SamplingParams(
        temperature=0, max_tokens=11, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=[5, 9, 200, 17]), sampling=sampling
    )

    def deltas(address):
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            return [
                r.delta for r in stub.Generate(request, timeout=RPC_TIMEOUT) if r.HasField("delta")
            ]

    try:
        grouped, each = deltas(router.address), deltas(idle.router.address)
    finally:
        router.stop()
    # a step may make several tokens (prompt lookup's), so a group holds at least four; the
    # hand-off's first token comes again in the engine's first output (the worker's reader
    # sends it once)
    assert released[0] == 1 and all(n >= 4 for n in released[1:-1]), released
    assert sum(released) == 11 + (not colocated), released
    # the router may join groups that queued while it was busy, never split them
    sizes = [len(d.token_ids) for d in grouped]
    assert all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 11, sizes

    def joined(ds):
        tops = [(list(t.token_ids), list(t.logprobs)) for d in ds for t in d.top_logprobs]
        ids = [t for d in ds for t in d.token_ids]
        return ids, "".join(d.text for d in ds), [lp for d in ds for lp in d.logprobs], tops

    assert joined(grouped) == joined(each)
    assert all(len(d.top_logprobs) == len(d.logprobs) == len(d.token_ids) for d in grouped)
    wait_until(lambda: pool_idle(idle), 15, f"blocks still held: {idle.stats()}")


def test_bad_requests_name_the_problem_and_the_router_keeps_serving(idle, expected):
    tokens = dict(token_ids=[5, 6, 7])
    too_long = dict(token_ids=list(range(2, 2 + MAX_MODEL_LEN)))
    params = pdserve_pb2.SamplingParams
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (dict(text=""), GREEDY, invalid, "prompt is empty"),
        (too_long, GREEDY, grpc.StatusCode.OUT_OF_RANGE, "max_model_len"),
        (tokens, params(top_p=1.5), invalid, "top_p"),
        (dict(tokens, model="nope"), GREEDY, grpc.StatusCode.NOT_FOUND, "nope"),
        (tokens, params(n=65), invalid, "at most 64"),
        (tokens, params(n=0), invalid, "sampling.n=0"),
    ]
    for input_, sampling, code, named in cases:
        with pytest.raises(grpc.RpcError) as err:
            idle.generate(sampling=sampling, **input_)
        assert err.value.code() == code and named in err.value.details(), err.value
    # a message over the router's limit (64 MiB) is refused by gRPC itself, naming both sizes
    with pytest.raises(grpc.RpcError) as err:
        idle.generate(text="a" * (65 << 20))
    assert (
        err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "larger than max" in err.value.details()
    )
    prompts, want = expected
    model_id = (
        idle.api.ListModels(pdserve_pb2.ListModelsRequest(), timeout=RPC_TIMEOUT).models[0].id
    )
    assert idle.generate(token_ids=prompts[1], model=model_id)[:2] == want[1]


def test_list_models_health_and_abort_of_unknown(idle, tiny_models):
    (card,) = idle.api.ListModels(pdserve_pb2.ListModelsRequest(), timeout=RPC_TIMEOUT).models
    assert card.max_model_len == MAX_MODEL_LEN and card.vocab_size == 256 and card.dtype and card.id
    assert card.root == str(tiny_models("llama-gqa")[0])  # the model as the router was given it
    health = health_pb2_grpc.HealthStub(idle.channels[0])
    reply = health.Check(
        health_pb2.HealthCheckRequest(service="pdserve.v1.PDServe"), timeout=RPC_TIMEOUT
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert not idle.api.Abort(
        pdserve_pb2.AbortRequest(request_id="nobody"), timeout=RPC_TIMEOUT
    ).found


LONG = pdserve_pb2.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def start_long(cluster, request_id: str, prompt_len: int, seed: int):
    """The response stream of a LONG request of a random prompt, started and not yet read."""
    return cluster.api.Generate(
        pdserve_pb2.GenerateRequest(
            request_id=request_id,
            token_ids=pdserve_pb2.TokenIds(ids=random_prompts([prompt_len], seed=seed)[0]),
            sampling=LONG,
        ),
        timeout=RPC_TIMEOUT,
    )


def test_client_cancel_frees_the_decode_pool(idle, monkeypatch):
    aborted = record_aborts(idle.decode, monkeypatch)
    call = start_long(idle, "cancel-me", 8, seed=8)
    first = next(call)
    assert first.HasField("delta") and first.delta.token_ids
    call.cancel()
    # the router aborts explicitly, not only by dropping its decode stream, under an id it minted
    wait_until(
        lambda: any(reason == "aborted by the router" for _, reason in aborted) and pool_idle(idle),
        15,
        f"the cancelled request still holds decode blocks: {idle.stats()}",
    )
    assert all(rid != "cancel-me" for rid, _ in aborted), "the client's id reached a worker"


def test_router_abort_ends_the_stream_with_abort(idle, monkeypatch):
    # decode steps slowed: the stream must still run when the Abort lands (with the worker's Abort
    # handler delayed by up to 250 ms, all 200 tokens were out first)
    engine = idle.decode.loop.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])
    call = start_long(idle, "abort-me", 8, seed=9)
    assert next(call).HasField("delta")
    assert idle.api.Abort(
        pdserve_pb2.AbortRequest(request_id="abort-me"), timeout=RPC_TIMEOUT
    ).found
    last = list(call)[-1]
    assert last.HasField("finish") and last.finish.finish_reason == "abort"
    assert last.finish.usage.completion_tokens < 200


def test_deadline_exceeded(idle):
    with pytest.raises(grpc.RpcError) as err:
        idle.generate(token_ids=random_prompts([8], seed=10)[0], deadline_ms=1, sampling=LONG)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline_ms" in err.value.details()


def test_a_deadline_mid_prefill_frees_the_decode_side_after_the_prefill_let_go(idle, monkeypatch):
    """The deadline passes while a prefill step runs, which pushes KV into the reservation as it
    goes (in place on shm): the decode side must free the reservation only after the prefill
    worker's engine let go of the request (its abort runs between steps). Before, the leg's
    decode stream detached at the deadline, and the decode worker freed the blocks while the
    step was still writing into them."""
    order = []
    engine = idle.prefill.loop.engine
    step, abort = engine.step, engine.abort
    stepped = threading.Event()

    def slow_step():  # the deadline passes during the first step
        if engine._requests:
            stepped.set()
            time.sleep(0.5)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    monkeypatch.setattr(engine, "abort", lambda rid: order.append(("prefill", rid)) or abort(rid))
    handoff = idle.decode.handoff
    decode_abort = handoff.abort
    monkeypatch.setattr(
        handoff,
        "abort",
        lambda rid, reason="": order.append(("decode", rid)) or decode_abort(rid, reason),
    )
    with pytest.raises(grpc.RpcError) as err:
        idle.generate(
            request_id="late-prefill",
            token_ids=random_prompts([40], seed=11)[0],
            deadline_ms=250,
            sampling=LONG,
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stepped.is_set(), "the prompt was not prefilled on the prefill worker"
    wait_until(lambda: any(who == "decode" for who, _ in order), 10, f"no decode abort: {order}")
    assert order[0][0] == "prefill", order


def test_unreachable_prefill_worker_is_retried_on_another(idle, expected, caplog):
    """Requests that first pick a prefill worker that stopped since the pool last heard from it get
    UNAVAILABLE, then succeed on the live one into the same reservation; a dead decode worker
    ranks last (its Stats fail). The pool sweeps once, at the start (a sweep would mark the
    stopped worker down, and the pickers would skip it)."""
    gone = start_prefill(
        idle.router.config.model, "p-gone", engine=dict(max_model_len=MAX_MODEL_LEN)
    )
    router = Router(
        RouterConfig(
            model=idle.router.config.model,
            prefill_addresses=(gone.address, idle.prefill.address),
            decode_addresses=(dead_address(), idle.decode.address),
            max_model_len=MAX_MODEL_LEN,
            stats_interval_s=3600,
            worker_down_s=7200,
            worker_silence_s=7200,
            # the shared decode worker holds these prompts from earlier tests: its KV events
            # would send them to it as conversation turns, and this test is the prefill pool's
            local_prefill=LocalPrefill(reuse_max_new_tokens=0),
        )
    ).start()
    try:
        wait_until(lambda: all(w.stats for w in router.pool.prefill), 15, "the first sweep")
    finally:
        gone.stop()
    prompts, want = expected
    try:
        with grpc.insecure_channel(router.address) as channel:
            api = pdserve_pb2_grpc.PDServeStub(channel)
            for i in range(4):  # round-robin: half of them try the dead prefill worker first
                responses = list(
                    api.Generate(
                        pdserve_pb2.GenerateRequest(
                            token_ids=pdserve_pb2.TokenIds(ids=prompts[i]), sampling=GREEDY
                        ),
                        timeout=RPC_TIMEOUT,
                    )
                )
                ids = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
                assert ids == want[i][0]
                assert responses[-1].finish.timings.prefill_worker == "p0"
    finally:
        router.stop()
    retried = [r for r in caplog.records if "failed: StatusCode.UNAVAILABLE" in r.getMessage()]
    assert retried, "no request picked the dead prefill worker first"


def test_client_cancel_during_prefill_frees_both_sides_within_a_second(idle, monkeypatch):
    """The client leaves while its prompt is still prefilling: the prefill worker drops it and the
    decode reservation is freed, both soon after the cancel."""
    engine = idle.prefill.loop.engine
    real_step = engine.step
    prefilling = threading.Event()

    def slow_step():  # every prefill step takes 0.3 s, so the cancel lands mid-prefill
        prefilling.set()
        time.sleep(0.3)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    with grpc.insecure_channel(idle.prefill.address) as channel:
        p = worker_pb2_grpc.PrefillWorkerStub(channel)

        def prefill_stats():
            return p.Stats(worker_pb2.StatsRequest(), timeout=RPC_TIMEOUT)

        # a response-streaming call starts at once; nobody needs to read it
        call = start_long(idle, "cancel-in-prefill", 40, seed=12)
        assert prefilling.wait(5), "the prefill never started"
        call.cancel()

        def both_free():
            s = prefill_stats()
            return s.num_running == 0 and s.num_waiting == 0 and pool_idle(idle)

        wait_until(both_free, 15, f"not freed after the cancel: decode {idle.stats()}")


def concurrent_requests(cluster, prefix: str, length: int, max_tokens: int, n: int):
    """n threads, each to send one request of a `length`-token prompt; (threads, results, errors)."""
    results, errors = {}, {}
    prompts = random_prompts([length] * n, seed=40)

    def run(i):
        try:
            responses = list(
                cluster.api.Generate(
                    pdserve_pb2.GenerateRequest(
                        request_id=f"{prefix}-{i}",
                        token_ids=pdserve_pb2.TokenIds(ids=prompts[i]),
                        sampling=pdserve_pb2.SamplingParams(
                            temperature=0, max_tokens=max_tokens, ignore_eos=True
                        ),
                    ),
                    timeout=60,
                )
            )
            results[i] = responses[-1].finish.usage.completion_tokens
        except grpc.RpcError as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    return threads, results, errors


def test_a_full_decode_pool_queues_requests_in_the_router_until_blocks_free(idle):
    """More prompts at once than the decode worker's KV holds: none fails with "decode pool
    full"; the ones that do not fit wait in the router's queue and run as blocks free."""
    total = idle.stats().num_total_blocks
    per_request = -(-(200 + 30) // 16)  # blocks one request holds at its end
    n = total // per_request + 3  # at least 3 have to wait
    threads, results, errors = concurrent_requests(idle, "full", 200, 30, n)
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, {i: (e.code(), e.details()) for i, e in errors.items()}
    assert [results.get(i) for i in range(n)] == [30] * n


def test_the_decode_queue_gives_up_after_its_timeout_and_on_cancel(idle, tiny_models, monkeypatch):
    """A router whose decode queue waits at most 1 s, in front of a decode worker that is full
    until told otherwise: a request fails after the wait with RESOURCE_EXHAUSTED saying what to do;
    one cancelled or aborted while it waits leaves the queue; one that waits while blocks free
    succeeds."""
    from pdserve.engine.block_manager import NoFreeBlocks

    full = threading.Event()
    full.set()
    real_reserve = idle.decode.handoff.reserve

    def reserve(*args, **kwargs):
        if full.is_set():
            raise NoFreeBlocks("need 1 KV blocks, 0 free")
        return real_reserve(*args, **kwargs)

    monkeypatch.setattr(idle.decode.handoff, "reserve", reserve)
    router = Router(
        RouterConfig(
            model=tiny_models("llama-gqa")[0],
            prefill_addresses=(idle.prefill.address,),
            decode_addresses=(idle.decode.address,),
            max_model_len=MAX_MODEL_LEN,
            decode_queue_timeout_s=1.0,
        )
    ).start()
    prompts = random_prompts([20, 21, 22], seed=60)
    try:
        with grpc.insecure_channel(router.address) as channel:
            api = pdserve_pb2_grpc.PDServeStub(channel)
            queue = router.servicer.legs.decode_queue

            def generate(i, **kwargs):
                return api.Generate(
                    pdserve_pb2.GenerateRequest(
                        token_ids=pdserve_pb2.TokenIds(ids=prompts[i]), sampling=GREEDY, **kwargs
                    ),
                    timeout=RPC_TIMEOUT,
                )

            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(generate(0))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (
                "decode pool full: waited" in err.value.details()
                and "add decode workers" in err.value.details()
            )
            assert 0.95 < time.monotonic() - start < 5
            waiting = generate(1)
            wait_until(lambda: queue.waiting() == 1, 15, "the request never queued")
            waiting.cancel()
            wait_until(lambda: queue.waiting() == 0, 15, "the cancelled request is still queued")
            aborted = generate(1, request_id="abort-while-queued")
            wait_until(lambda: queue.waiting() == 1, 15, "the request never queued")
            assert api.Abort(
                pdserve_pb2.AbortRequest(request_id="abort-while-queued"), timeout=RPC_TIMEOUT
            ).found
            with pytest.raises(grpc.RpcError) as err:
                list(aborted)
            assert (
                err.value.code() == grpc.StatusCode.ABORTED
                and "PDServe.Abort" in err.value.details()
            )
            assert queue.waiting() == 0
            later = generate(2)
            wait_until(lambda: queue.waiting() == 1, 15, "the request never queued")
            full.clear()  # blocks freed: it goes on
            assert (
                sum(len(r.delta.token_ids) for r in later if r.HasField("delta"))
                == GREEDY.max_tokens
            )
    finally:
        router.stop()
