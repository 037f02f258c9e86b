"""The public PDServe gRPC service: Generate, Abort, ListModels.

Lifecycle of one Generate call (docs/architecture.md section 1):
  admit (at most max_inflight) -> tokenize and validate
  -> DecodeWorker.Reserve on the decode worker with the most free blocks (the next one when full;
     when all are full, the request waits for blocks in the router's first-come-first-served
     decode queue, up to decode_queue_timeout_s, then RESOURCE_EXHAUSTED)
  -> DecodeWorker.Stream opened (the worker queues tokens from the Reserve on, so none is missed)
  -> PrefillWorker.Prefill in a background thread; UNAVAILABLE retries once on another prefill
     worker into the same reservation; any other failure aborts the reservation, which ends the
     stream, and the client gets the prefill's status
  -> token events detokenized and forwarded as TokenDelta, the last one as Finish
  decode worker dies (its stream fails, not by the client, an abort or the deadline) -> the
     request resumes on another decode worker: Reserve there with the prompt plus the tokens
     already streamed, prefill again, keep streaming (at most max_resumes times; the steps above
     are a "leg", router/legs.py). After a resume seeded sampling continues from a new generator
     and presence/frequency penalties see the earlier output as prompt (details in router/legs.py)
  n>1: one leg for all n sequences (prefilled once; the decode worker forks them) and one text
     stream per sequence here; each sequence's Finish goes out when it ends, the call ends after
     the n-th. A decode worker that dies before any token: the request restarts as for n=1.
     Once tokens were streamed, each sequence still open needs its own prompt (the client's plus
     its own tokens): they resume one after another, each alone on a leg (n=1), and their events
     keep the client's indexes
  client gone (context callback) or deadline_ms exceeded -> Abort on both workers, sent from the
     router's abort threads: gRPC runs the callback on its polling thread, which must never wait
     on a worker (it would stall every call of the router, health checks and heartbeats included)
A role with no worker in the pool -> UNAVAILABLE before anything is reserved.

Ids: the client's request_id is only a label for its own responses and its own Abort calls, which
find requests started on the same connection only (another client cannot abort them). The workers
see ids the router mints (router/legs.py), so nothing a client chooses reaches a worker.
Every field is checked before any work (protos/limits.py, router/text.py): sizes, counts, and
numbers a wrapped -1 would make enormous.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass

import grpc

from pdserve.protos.convert import unix_ns
from pdserve.protos.limits import check_id, check_sampling
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2
from pdserve.router.legs import (
    Inflight,
    Leg,
    LegFailed,
    Legs,
    RouterStatus,
    decode_died,
    resume_sampling,
)
from pdserve.router.pool import ROLES, NoWorker, WorkerPool
from pdserve.router.text import BadRequest, PromptEncoder, TextStream

log = logging.getLogger(__name__)
# worker statuses that describe the client's request: passed on unchanged
_CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
}


@dataclass(frozen=True)
class ServiceOptions:
    model_id: str
    max_model_len: int
    vocab_size: int
    dtype: str
    max_inflight: int = 64
    lease_ms: int = 10_000
    prefill_timeout_s: float = 60.0
    rpc_timeout_s: float = 10.0  # Reserve
    abort_timeout_s: float = 0.5  # best-effort Abort calls
    request_timeout_s: float = 3600.0  # the whole stream when the client sets no deadline_ms
    prefill_result_wait_s: float = 5.0  # Prefill's reply may trail its committed first token
    max_resumes: int = 2  # new decode workers one request may move to
    decode_queue_timeout_s: float = 120.0  # disaggregated: longest wait for decode KV blocks
    colocated: bool = False  # workers prefill and decode themselves (no prefill pool)


def request_finish(last: pdserve_pb2.Finish, earlier: list[pdserve_pb2.Finish]):
    """The request's figures for the metrics: `last` (the sequence that ended the request) with
    the completion tokens of all its sequences (n>1: each Finish counts its own, pdserve.proto)."""
    if not earlier:
        return last
    total = pdserve_pb2.Finish()
    total.CopyFrom(last)
    total.usage.completion_tokens += sum(f.usage.completion_tokens for f in earlier)
    return total


class PDServeServicer(pdserve_pb2_grpc.PDServeServicer):
    def __init__(
        self,
        pool: WorkerPool,
        tokenizer,
        options: ServiceOptions,
        executor: futures.ThreadPoolExecutor,
        metrics=None,
    ):
        self.pool = pool
        self.tokenizer = tokenizer
        self.options = options
        self.encoder = PromptEncoder(tokenizer, options.max_model_len, options.vocab_size)
        self.legs = Legs(pool, executor, options)
        self.metrics = metrics  # router/metrics.py RouterMetrics: every request's figures
        if metrics is not None:
            self.legs.on_tokens = metrics.on_tokens
        self._inflight: dict[tuple[str, str], Inflight] = {}  # (client peer, request_id) ->
        self._lock = threading.Lock()

    def close(self) -> None:
        self.encoder.close()
        self.legs.close()

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    # ---- Generate -------------------------------------------------------------------------------
    def Generate(self, request, context):
        try:
            yield from self._admit_and_generate(request, context)
        except Exception:
            code = context.code()  # set by context.abort; None for an unexpected exception
            if self.metrics is not None:
                self.metrics.observe_error(code or grpc.StatusCode.UNKNOWN)
            raise

    def _admit_and_generate(self, request, context):
        queued_ns, start = unix_ns(), time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        opts = self.options
        refusal = check_id("request_id", rid) or check_sampling(
            request.sampling, opts.max_model_len, opts.vocab_size
        )
        if refusal:
            refusal.abort(context)
        if request.model and request.model != opts.model_id:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model {request.model[:200]} is not served; served: {opts.model_id}",
            )
        try:
            prompt = self.encoder.encode(request)
        except BadRequest as e:
            context.abort(e.code, e.message)
        for role in ("decode",) if opts.colocated else ROLES:
            if not self.pool.num_workers(role):
                context.abort(grpc.StatusCode.UNAVAILABLE, str(NoWorker(role)))
        budget_s = min(
            request.deadline_ms / 1000 if request.deadline_ms else opts.request_timeout_s,
            opts.request_timeout_s,
        )
        deadline = start + budget_s
        key = (context.peer(), rid)
        req = self._admit(key, context)
        context.add_callback(lambda: self._on_rpc_end(req))
        try:
            yield from self._generate(req, request, prompt, deadline, queued_ns, context)
        finally:
            with self._lock:
                if self._inflight.get(key) is req:
                    del self._inflight[key]

    def _admit(self, key: tuple[str, str], context) -> Inflight:
        rid = key[1]
        req = Inflight(rid)
        with self._lock:
            num = len(self._inflight)
            full, taken = num >= self.options.max_inflight, key in self._inflight
            if not full and not taken:
                self._inflight[key] = req
        if full:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router queue full ({num} in flight), retry later",
            )
        if taken:
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight"
            )
        return req

    def _generate(self, req: Inflight, request, prompt, deadline, queued_ns, context):
        sampling = request.sampling
        n = sampling.n if sampling.HasField("n") else 1
        texts = [
            TextStream(
                self.tokenizer,
                prompt,
                sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
                tuple(sampling.stop),
                sampling.include_stop_str_in_output,
            )
            for _ in range(n)
        ]
        sent: list[list[int]] = [[] for _ in range(n)]  # token ids the client got, per sequence
        legs: list[Leg] = []
        finishes: list[pdserve_pb2.Finish] = []  # n>1: the sequences that ended before the last

        def finish_of(event) -> pdserve_pb2.GenerateResponse:
            """A sequence's Finish while others still run (n>1)."""
            leg = legs[-1]
            self._prefill_result(leg.prefill_future)
            if (
                event.finish_reason == "abort"
                and leg.prefill_error is not None
                and not req.abort_requested
            ):  # the failed prefill aborted the reservation: the call ends with its status, as n=1
                self._fail(req, context, leg.prefill_error, "prefill worker", request.deadline_ms)
            finish = self._finish(event, len(prompt), len(sent[event.index]), legs, queued_ns, req)
            finishes.append(finish)
            return pdserve_pb2.GenerateResponse(request_id=req.request_id, finish=finish)

        # n>1 whose decode worker died after tokens were streamed: the sequences still open, each
        # resumed on a leg of its own (the client's prompt plus its own tokens), one after another
        reopened: list[int] | None = None
        num_resumes = 0
        while True:
            if reopened is None:
                seqs, streamed = None, sent[0] if n == 1 else []  # n>1 restarts before any token
                leg_sampling = resume_sampling(sampling, len(streamed))
            else:
                seqs, streamed = reopened[:1], sent[reopened[0]]
                alone = pdserve_pb2.SamplingParams()
                alone.CopyFrom(sampling)
                alone.n = 1
                leg_sampling = resume_sampling(alone, len(streamed))
            if leg_sampling is None or len(prompt) + len(streamed) >= self.options.max_model_len:
                # the dead leg had got there
                final = worker_pb2.TokenEvent(index=seqs[0] if seqs else 0, finish_reason="length")
            elif reopened is not None and req.abort_requested:  # no new leg for an aborted call
                final = worker_pb2.TokenEvent(
                    index=seqs[0], finish_reason="abort", stop_str="aborted by the router"
                )
            else:
                try:
                    leg = self.legs.start(req, prompt + streamed, leg_sampling, deadline, len(legs))
                except LegFailed as e:
                    self._fail(req, context, e.error, e.who, 0)
                if leg is None:
                    return
                legs.append(leg)
                final, error = yield from self.legs.stream(req, leg, texts, sent, finish_of, seqs)
                if req.cancelled:
                    return
                if decode_died(leg, final, error, req.abort_requested, deadline):
                    num_resumes += 1
                    self._resume_or_fail(req, leg, error, sum(map(len, sent)), context, num_resumes)
                    if reopened is None and n > 1 and any(sent):
                        ended = {f.index for f in finishes}
                        reopened = [i for i in range(n) if i not in ended]
                    continue
                self._prefill_result(leg.prefill_future)
                if (
                    leg.prefill_error is not None
                    and (final is None or final.finish_reason == "abort")
                    and not req.abort_requested
                ):
                    self._fail(
                        req, context, leg.prefill_error, "prefill worker", request.deadline_ms
                    )
                if final is None:
                    self._fail(req, context, error, "decode worker", request.deadline_ms)
            if reopened is not None and len(reopened) > 1:  # the next open sequence's turn
                yield finish_of(final)
                reopened.pop(0)
                continue
            break
        req.finished = True
        finish = self._finish(final, len(prompt), len(sent[final.index]), legs, queued_ns, req)
        if self.metrics is not None:
            self.metrics.observe_finish(request_finish(finish, finishes), req, legs[0], unix_ns())
        yield pdserve_pb2.GenerateResponse(request_id=req.request_id, finish=finish)

    def _resume_or_fail(
        self, req: Inflight, leg: Leg, error, num_sent: int, context, num_resumes: int
    ) -> None:
        """After a leg's decode worker died (the request's num_resumes-th death): returns so the
        caller starts the next leg, or ends the call when no resume is left."""
        self.legs.retire(req, leg)
        why = (
            f"{error.code().name}: {error.details()}"
            if error is not None
            else "its stream ended without a final event"
        )
        name = self.pool.name(leg.decode)
        if num_resumes > self.options.max_resumes:
            self._fail(
                req,
                context,
                RouterStatus(
                    grpc.StatusCode.UNAVAILABLE,
                    f"decode worker {name} failed ({why}) and request {req.request_id!r} was "
                    f"already resumed {num_resumes - 1} times (max_resumes="
                    f"{self.options.max_resumes}); "
                    f"retry the request",
                ),
                "decode worker",
                0,
            )
        log.warning(
            "decode worker %s failed for %s after %d tokens (%s); resuming on another",
            name,
            req.request_id,
            num_sent,
            why,
        )

    def _prefill_result(self, prefill: futures.Future | None):
        if prefill is None:  # colocated: there is no prefill leg
            return None
        try:
            return prefill.result(timeout=self.options.prefill_result_wait_s)
        except futures.TimeoutError:
            return None

    def _finish(
        self, final, num_prompt_tokens, num_tokens, legs: list[Leg], queued_ns, req
    ) -> pdserve_pb2.Finish:
        first, last = legs[0], legs[-1]
        usage = pdserve_pb2.Usage(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_tokens,
            cached_prompt_tokens=first.reservation.num_cached_tokens,
        )
        finish = pdserve_pb2.Finish(
            index=final.index, finish_reason=final.finish_reason, usage=usage
        )
        kind = final.WhichOneof("stop_reason")
        if final.finish_reason in ("abort", "error"):
            finish.message = final.stop_str  # the decode worker's reason rides in stop_str
        elif kind == "stop_str":
            finish.stop_str = final.stop_str
        elif kind == "stop_token":
            finish.stop_token = final.stop_token
        timings = finish.timings
        timings.CopyFrom(final.timings)  # the decode worker's: transfer_end, commit, tokens
        timings.queued_unix_ns = queued_ns
        timings.reserved_unix_ns = first.reserved_ns
        if (
            len(legs) > 1 and req.first_token_ns
        ):  # the client's first token came from an earlier leg
            timings.first_token_unix_ns = req.first_token_ns
        prefill_leg = first if first.prefill_reply() is not None else last
        prefill_reply = prefill_leg.prefill_reply()
        if prefill_reply is not None:
            timings.prefill_dispatch_unix_ns = prefill_leg.prefill_dispatch_ns
            stamps = prefill_reply.timings
            timings.prefill_arrival_unix_ns = stamps.prefill_arrival_unix_ns
            timings.prefill_start_unix_ns = stamps.prefill_start_unix_ns
            timings.prefill_end_unix_ns = stamps.prefill_end_unix_ns
            timings.transfer_start_unix_ns = stamps.transfer_start_unix_ns
            if prefill_leg is not last or not timings.transfer_end_unix_ns:
                # the decode side's arrival of the last KV frame when it has it, else the
                # prefill side's flush
                timings.transfer_end_unix_ns = stamps.transfer_end_unix_ns
            finish.usage.kv_transfer_bytes = prefill_reply.bytes_sent
        if prefill_leg.prefill is not None:
            timings.prefill_worker = self.pool.name(prefill_leg.prefill)
        if not timings.decode_worker and last.decode is not None:
            timings.decode_worker = self.pool.name(last.decode)
        return finish

    def _fail(self, req: Inflight, context, error, who: str, deadline_ms: int):
        """Frees the request on both workers and ends the call with the worker's status."""
        req.finished = True
        self._abort_workers(req)
        if self.metrics is not None:
            self.metrics.observe_unfinished("error")
        if error is None:
            context.abort(grpc.StatusCode.INTERNAL, f"the {who} stream ended without a final event")
        if isinstance(error, RouterStatus):  # already says what happened
            context.abort(error.code(), error.details())
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            context.abort(
                code,
                f"request {req.request_id!r} did not finish within deadline_ms="
                f"{deadline_ms or 'unset'} (at the {who})",
            )
        if code in _CLIENT_CODES:
            context.abort(code, error.details())
        if code == grpc.StatusCode.CANCELLED:
            code = grpc.StatusCode.ABORTED
        context.abort(code, f"{who} failed: {error.details()}")

    # ---- cancellation ---------------------------------------------------------------------------
    def _on_rpc_end(self, req: Inflight) -> None:
        """gRPC calls this on its polling thread when the call ends for any reason; only an
        unfinished one needs work, and that work (worker Abort calls) goes to the abort threads."""
        with req.lock:
            if req.finished:
                return
            req.cancelled = True
            leg = req.leg
        if self.metrics is not None:
            self.metrics.observe_unfinished("abort")
        if leg is not None:
            self.legs.abort_later(leg, cancel_stream=True)

    def _abort_workers(self, req: Inflight) -> bool:
        """Aborts the request's running leg from the abort threads; whether there was one."""
        with req.lock:
            leg = req.leg
        if leg is None:
            return False
        self.legs.abort_later(leg)
        return True

    # ---- Abort, ListModels ----------------------------------------------------------------------
    def Abort(self, request, context):
        refusal = check_id("request_id", request.request_id)
        if refusal:
            refusal.abort(context)
        with self._lock:  # only the caller's own requests: those its connection started
            req = self._inflight.get((context.peer(), request.request_id))
        if req is None:
            return pdserve_pb2.AbortResponse(found=False)
        with req.lock:
            req.abort_requested = True
        self._abort_workers(req)  # the decode stream then ends with finish_reason "abort"
        return pdserve_pb2.AbortResponse(found=True)

    def ListModels(self, request, context):
        opts = self.options
        return pdserve_pb2.ListModelsResponse(
            models=[
                pdserve_pb2.ModelCard(
                    id=opts.model_id,
                    max_model_len=opts.max_model_len,
                    vocab_size=opts.vocab_size,
                    dtype=opts.dtype,
                )
            ]
        )
