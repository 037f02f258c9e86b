"""Open-loop load generator against the public gRPC API (`pdserve.v1.PDServe`).

    card = model_card("127.0.0.1:50051")
    records, duration_s = run_load("127.0.0.1:50051", requests, build_prompts(requests, card.vocab_size))

Each request is sent at its `arrival_s` from the run's start on its own thread, whatever the
earlier ones are doing (open loop: a slow server makes requests overlap, never arrive later), as
GenerateRequest(token_ids, greedy, max_tokens=output_len, ignore_eos) so it produces exactly
output_len tokens. A refused request (RESOURCE_EXHAUSTED when the router is full) or any other
failure is recorded with its status code and the run goes on. The closed-loop chat sessions of
tuning/sessions.py send their turns with the same make_request and _send.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc
from pdserve.protos.security import client_key_metadata
from pdserve.tuning.metrics import RequestRecord, attribute_itl
from pdserve.tuning.workload import RequestSpec, retime

# Finish.timings' stamps along a request's path, in order (benchmarks/cluster/ttft.py reads these)
PATH_STAMPS = (
    "queued_unix_ns",
    "prefill_start_unix_ns",
    "prefill_end_unix_ns",
    "transfer_end_unix_ns",
    "first_token_unix_ns",
    "last_token_unix_ns",
)
TIMINGS_FIELDS = PATH_STAMPS + (
    "prefill_worker",
    "decode_worker",
    "reserved_unix_ns",
    "prefill_dispatch_unix_ns",
    "prefill_arrival_unix_ns",
    "transfer_start_unix_ns",
    "commit_unix_ns",
)


class LoadgenError(Exception):
    """Something the user changes an argument for: unreachable router, unknown model, too long."""


@dataclass
class Run:
    rate: float | None  # req/s it was re-timed to; None = the trace's own arrival times
    records: list[RequestRecord]
    duration_s: float


def model_card(address: str, model: str = "", timeout_s: float = 10.0) -> pb.ModelCard:
    """The router's ModelCard for `model` ("" = its default, the first it lists)."""
    try:
        with grpc.insecure_channel(address) as channel:
            cards = (
                pdserve_pb2_grpc.PDServeStub(channel)
                .ListModels(
                    pb.ListModelsRequest(), timeout=timeout_s, metadata=client_key_metadata()
                )
                .models
            )
    except grpc.RpcError as e:
        down = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        details = e.details()
        if down:
            details += " (is `pdserve up` running there? pass its address with --router)"
        elif e.code() == grpc.StatusCode.UNAUTHENTICATED:
            details = (
                "the deployment needs one of its client API keys: pass it with --api-key or set "
                "PDSERVE_API_KEY"
            )
        raise LoadgenError(
            f"router {address} {'unreachable' if down else 'refused'}: {e.code().name}: {details}"
        ) from None
    if not cards:
        raise LoadgenError(f"router {address} serves no model")
    if not model:
        return cards[0]
    for card in cards:
        if card.id == model:
            return card
    raise LoadgenError(
        f"router {address} does not serve model {model!r}; it serves "
        f"{', '.join(c.id for c in cards)}"
    )


def check_fits(requests: list[RequestSpec], max_model_len: int) -> None:
    """Every prompt + output must fit the model's context, or the server cuts or refuses it."""
    over = [r for r in requests if r.prompt_len + r.output_len > max_model_len]
    if over:
        worst = max(over, key=lambda r: r.prompt_len + r.output_len)
        raise LoadgenError(
            f"{len(over)} of {len(requests)} requests do not fit max_model_len "
            f"{max_model_len} (longest: {worst.prompt_len} prompt + {worst.output_len} "
            f"output tokens): lower --scale or cap with --max-prompt/--max-output"
        )


def make_request(spec: RequestSpec, prompt: list[int], model: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
    return pb.GenerateRequest(model=model, token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def run_load(
    address: str,
    requests: list[RequestSpec],
    prompts: list[list[int]],
    *,
    model: str = "",
    request_timeout_s: float | None = 600.0,
    progress: bool = False,
    desc: str = "requests",
) -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival time; returns the records (in request order) and the
    run's duration: from the first send to the end of the last stream."""
    if len(prompts) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(prompts)} prompts")
    records = [
        RequestRecord(i, r.arrival_s, r.prompt_len, r.output_len) for i, r in enumerate(requests)
    ]
    messages = [make_request(r, p, model) for r, p in zip(requests, prompts)]
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, dynamic_ncols=True)
    lock = threading.Lock()

    def done():
        with lock:
            bar.update(1)

    threads = []
    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        t0 = time.perf_counter()
        for rec, msg in zip(records, messages):
            delay = t0 + rec.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            thread = threading.Thread(
                target=_send,
                args=(stub, msg, rec, t0, request_timeout_s, done),
                name=f"loadgen-{rec.index}",
                daemon=True,
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        duration_s = time.perf_counter() - t0
    bar.close()
    return records, duration_s


def _send(
    stub,
    msg: pb.GenerateRequest,
    rec: RequestRecord,
    t0: float,
    timeout_s: float | None,
    done,
    answer: list[int] | None = None,
):
    """Streams one request into `rec`; returns its Finish (None when none came). `answer`, when
    given, gets the token ids the stream returned (tuning/sessions.py sends them back)."""
    times: list[float] = []
    counts: list[int] = []
    finish = None
    start = time.perf_counter()
    rec.send_s, rec.send_unix_ns = start - t0, time.time_ns()
    try:
        for resp in stub.Generate(msg, timeout=timeout_s, metadata=client_key_metadata()):
            if resp.HasField("delta"):
                if resp.delta.token_ids:
                    times.append(time.perf_counter())
                    counts.append(len(resp.delta.token_ids))
                    if answer is not None:
                        answer.extend(resp.delta.token_ids)
            elif resp.HasField("finish"):
                finish = resp.finish
        rec.e2e_s = time.perf_counter() - start
    except grpc.RpcError as e:
        rec.error, rec.error_message = e.code().name, e.details() or ""
    except Exception as e:  # recorded, so one odd stream cannot end the whole run
        rec.error, rec.error_message = type(e).__name__, str(e)
    rec.output_tokens = sum(counts)
    if times:
        rec.ttft_s = times[0] - start
        rec.itl_s = attribute_itl(times, counts)
    if finish is not None:
        rec.finish_reason = finish.finish_reason
        rec.cached_prompt_tokens = finish.usage.cached_prompt_tokens
        rec.kv_transfer_bytes = finish.usage.kv_transfer_bytes
        rec.timings = {k: getattr(finish.timings, k) for k in TIMINGS_FIELDS}
        if finish.finish_reason in ("error", "abort") and not rec.error:
            rec.error, rec.error_message = finish.finish_reason, finish.message
    elif not rec.error:
        rec.error, rec.error_message = "NO_FINISH", "the stream ended without a Finish"
    done()
    return finish


def run_sweep(
    address: str,
    requests: list[RequestSpec],
    prompts_for,
    rates: list[float],
    *,
    burstiness: float = 1.0,
    seed: int = 0,
    **kwargs,
) -> list[Run]:
    """The same requests re-timed to each rate (ascending), one run after the other.
    `prompts_for(k)` gives the k-th run its prompts: fresh token ids per run (same lengths and
    prefix sharing), so a run is not served from the prefix cache the previous one filled."""
    runs = []
    for k, rate in enumerate(sorted(rates)):
        timed = retime(requests, rate, burstiness, seed)
        records, duration_s = run_load(
            address, timed, prompts_for(k), desc=f"rate {rate:g}", **kwargs
        )
        runs.append(Run(rate, records, duration_s))
    return runs
