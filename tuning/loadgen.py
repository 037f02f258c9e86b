"""Open-loop load generator against the public gRPC API (`pdserve.v1.PDServe`).

    card = model_card("127.0.0.1:50051")
    records, duration_s = run_load("127.0.0.1:50051", requests, build_prompts(requests, card.vocab_size))

Each request is sent at its `arrival_s` from the run's start on its own thread, whatever the
earlier ones are doing (open loop: a slow server makes requests overlap, never arrive later), as
GenerateRequest(token_ids, greedy, max_tokens=output_len, ignore_eos) so it produces exactly
output_len tokens. With max_concurrency (vLLM's --max-concurrency) a request that arrives while
that many are in flight waits for one to end, and the wait is recorded apart from its latencies. A
refused request (RESOURCE_EXHAUSTED when the router is full) or any other failure is recorded with
its status code and the run goes on. The closed-loop chat sessions of tuning/sessions.py send
their turns with the same make_request and _send; tuning/http_load.py runs drive_load with its
own request and sender, for an OpenAI-compatible HTTP server (`pdserve bench --backend openai`).

The channel is plaintext, or TLS with the --tls-* options of `pdserve generate`
(pdserve/client.py builds it: open_channel). A router that cannot be reached is told apart from
one that speaks TLS to a plaintext client, or plaintext to a TLS one (speaks_tls), because gRPC
reports all three as UNAVAILABLE.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

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


def uses_tls(tls) -> bool:
    """Whether `tls` (parsed --tls-* options, pdserve/client.add_tls_args; or None) asks for TLS."""
    return tls is not None and bool(tls.tls_ca or tls.tls_cert or tls.tls_key)


def open_channel(address: str, tls=None) -> grpc.Channel:
    """A channel to the router at `address`: plaintext, or TLS with the --tls-* options in `tls`,
    built as `pdserve generate` builds it; a bad option raises ValueError."""
    if not uses_tls(tls):
        return grpc.insecure_channel(address)
    from pdserve import client

    names = ("tls_ca", "tls_cert", "tls_key", "tls_server_name")
    return client.channel(SimpleNamespace(router=address, **{k: getattr(tls, k) for k in names}))


def speaks_tls(address: str, timeout_s: float = 3.0) -> bool | None:
    """Whether whatever listens at host:port answers a TLS handshake (None: nothing to connect
    to, no answer within `timeout_s`, or not a host:port). A TLS server that then refuses us (a
    client certificate it wants) still counts: its alert is TLS. A plaintext gRPC server closes
    the connection on the handshake instead."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError:
        return None
    with sock:
        try:
            context.wrap_socket(sock).close()
            return True
        except ssl.SSLError as e:
            return "ALERT" in (e.reason or "").upper()
        except TimeoutError:
            return None  # it never answered: nothing to tell either way
        except OSError:
            return False


def _not_reached(address: str, tls, e: grpc.RpcError) -> LoadgenError:
    """The error for a router at `address` that did not answer (`e`: UNAVAILABLE or
    DEADLINE_EXCEEDED): a TLS mismatch between it and the --tls-* options, said as such, else
    unreachable, with what to change."""
    tls_there, tls_here = speaks_tls(address), uses_tls(tls)
    if tls_there and not tls_here:
        return LoadgenError(
            f"router {address} speaks TLS (router.tls is set there) and this client does not: "
            f"pass the CA that signed its certificate with --tls-ca PEM, and --tls-cert/--tls-key "
            f"when it asks for a client certificate"
        )
    if tls_there is False and tls_here:
        return LoadgenError(
            f"router {address} does not speak TLS: leave out --tls-ca, --tls-cert and --tls-key"
        )
    if tls_there and tls_here:
        return LoadgenError(
            f"router {address}: the TLS handshake failed ({e.code().name}: {e.details()}): "
            f"--tls-ca must be the CA that signed the router's certificate, --tls-server-name a "
            f"name in it, --tls-cert/--tls-key a client certificate its router.tls.ca_file trusts"
        )
    return LoadgenError(
        f"router {address} unreachable: {e.code().name}: {e.details()} (is `pdserve up` running "
        f"there? pass its address with --router)"
    )


def model_card(address: str, model: str = "", timeout_s: float = 10.0, *, tls=None) -> pb.ModelCard:
    """The router's ModelCard for `model` ("" = its default, the first it lists); `tls`: the
    --tls-* options (open_channel)."""
    try:
        with open_channel(address, tls) as channel:
            cards = (
                pdserve_pb2_grpc.PDServeStub(channel)
                .ListModels(
                    pb.ListModelsRequest(), timeout=timeout_s, metadata=client_key_metadata()
                )
                .models
            )
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise _not_reached(address, tls, e) from None
        details = e.details()
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            details = (
                "the deployment needs one of its client API keys: pass it with --api-key or set "
                "PDSERVE_API_KEY"
            )
        raise LoadgenError(f"router {address} refused: {e.code().name}: {details}") from None
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
    tls=None,
    **kwargs,
) -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival time over a channel to the router at `address`
    (`tls`: the --tls-* options, open_channel); returns drive_load's records and duration."""
    if len(prompts) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(prompts)} prompts")
    with open_channel(address, tls) as channel:
        return drive_load(pdserve_pb2_grpc.PDServeStub(channel), requests, prompts, **kwargs)


def drive_load(
    stub,
    requests: list[RequestSpec],
    prompts: list[list[int]],
    *,
    model: str = "",
    request_timeout_s: float | None = 600.0,
    progress: bool = False,
    desc: str = "requests",
    max_concurrency: int | None = None,
    make=None,
    send=None,
) -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival time on `stub` (a PDServe stub); returns the records (in
    request order) and the run's duration: from the first send to the end of the last stream.
    max_concurrency: at most that many streams at once, as vLLM's semaphore (None: no cap).
    `make(spec, prompt, model)` builds a request and `send(stub, msg, rec, t0, timeout_s, done)`
    streams it into its record: make_request and _send by default (gRPC); tuning/http_load.py
    passes its HTTP ones, `stub` then its Target."""
    if len(prompts) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(prompts)} prompts")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    records = [
        RequestRecord(i, r.arrival_s, r.prompt_len, r.output_len) for i, r in enumerate(requests)
    ]
    make = make or make_request
    messages = [make(r, p, model) for r, p in zip(requests, prompts)]
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, dynamic_ncols=True)
    lock = threading.Lock()
    slots = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None

    def done():
        with lock:
            bar.update(1)

    threads = []
    t0 = time.perf_counter()
    for rec, msg in zip(records, messages):
        delay = t0 + rec.arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(
            target=_send_in_slot,
            args=(slots, stub, msg, rec, t0, request_timeout_s, done, send or _send),
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


def _send_in_slot(
    slots, stub, msg, rec: RequestRecord, t0: float, timeout_s, done, send=None
) -> None:
    """`send` (default _send), once one of `slots` (a semaphore; None: no cap) is free; the wait
    for it is the record's client_queue_s (vLLM's client_queue_time), and its TTFT counts from
    the send."""
    send = send or _send
    if slots is None:
        send(stub, msg, rec, t0, timeout_s, done)
        return
    waited = time.perf_counter()
    with slots:
        rec.client_queue_s = time.perf_counter() - waited
        send(stub, msg, rec, t0, timeout_s, done)


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
        rec.itl_s = [now - prev for prev, now in zip(times, times[1:])]  # vLLM's: per delta
        rec.itl_per_token_s = attribute_itl(times, counts)
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
    load=None,
    **kwargs,
) -> list[Run]:
    """The same requests re-timed to each rate (ascending), one run after the other.
    `prompts_for(k)` gives the k-th run its prompts: fresh token ids per run (same lengths and
    prefix sharing), so a run is not served from the prefix cache the previous one filled.
    `load` runs each rate (default run_load, to the router at `address`; tuning/http_load.py's
    run_load with its Target as `address`)."""
    runs = []
    for k, rate in enumerate(sorted(rates)):
        timed = retime(requests, rate, burstiness, seed)
        records, duration_s = (load or run_load)(
            address, timed, prompts_for(k), desc=f"rate {rate:g}", **kwargs
        )
        runs.append(Run(rate, records, duration_s))
    return runs
