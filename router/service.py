"""The public PDServe gRPC service: Generate, Abort, ListModels.

Lifecycle of one Generate call (DESIGN.md section 1):
  admit (at most max_inflight) -> tokenize and validate
  -> DecodeWorker.Reserve on the decode worker with the most free blocks (the next one when full)
  -> DecodeWorker.Stream opened (the worker queues tokens from the Reserve on, so none is missed)
  -> PrefillWorker.Prefill in a background thread; UNAVAILABLE retries once on another prefill
     worker into the same reservation; any other failure aborts the reservation, which ends the
     stream, and the client gets the prefill's status
  -> token events detokenized and forwarded as TokenDelta, the last one as Finish
  client gone (context callback) or deadline_ms exceeded -> Abort on both workers
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass

import grpc

from protos.convert import unix_ns
from protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2
from router.pool import WorkerPool
from router.text import BadRequest, PromptEncoder, TextStream

log = logging.getLogger(__name__)
# worker statuses that describe the client's request: passed on unchanged
_CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(frozen=True)
class ServiceOptions:
    model_id: str
    max_model_len: int
    vocab_size: int
    dtype: str
    max_inflight: int = 64
    lease_ms: int = 10_000
    prefill_timeout_s: float = 60.0
    rpc_timeout_s: float = 10.0          # Reserve
    abort_timeout_s: float = 0.5         # best-effort Abort calls
    request_timeout_s: float = 3600.0    # the whole stream when the client sets no deadline_ms
    prefill_result_wait_s: float = 5.0   # Prefill's reply may trail its committed first token


class _Inflight:
    """One Generate call as the router tracks it; fields shared with the cancel callback and the
    prefill thread are read and written under `lock`."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.lock = threading.Lock()
        self.decode = None                # pool worker holding the reservation
        self.prefill = None               # pool worker running (or last running) the prefill
        self.stream_call = None
        self.cancelled = False            # the client went away
        self.abort_requested = False      # PDServe.Abort for this id
        self.finished = False             # ended normally or already cleaned up
        self.prefill_error: grpc.RpcError | None = None


class PDServeServicer(pdserve_pb2_grpc.PDServeServicer):
    def __init__(self, pool: WorkerPool, tokenizer, options: ServiceOptions,
                 executor: futures.ThreadPoolExecutor):
        self.pool = pool
        self.tokenizer = tokenizer
        self.options = options
        self.encoder = PromptEncoder(tokenizer, options.max_model_len)
        self.executor = executor          # Prefill calls
        self._inflight: dict[str, _Inflight] = {}
        self._lock = threading.Lock()

    # ---- Generate -------------------------------------------------------------------------------
    def Generate(self, request, context):
        queued_ns, start = unix_ns(), time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        opts = self.options
        if request.model and request.model != opts.model_id:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"model {request.model} is not served; served: {opts.model_id}")
        if request.sampling.HasField("n") and request.sampling.n > 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "n>1 is not supported by the disaggregated router yet")
        try:
            prompt = self.encoder.encode(request)
        except BadRequest as e:
            context.abort(e.code, e.message)
        budget_s = request.deadline_ms / 1000 if request.deadline_ms else opts.request_timeout_s
        deadline = start + budget_s
        req = self._admit(rid, context)
        context.add_callback(lambda: self._on_rpc_end(req))
        try:
            yield from self._generate(req, request, prompt, deadline, queued_ns, context)
        finally:
            with self._lock:
                if self._inflight.get(rid) is req:
                    del self._inflight[rid]

    def _admit(self, rid: str, context) -> _Inflight:
        req = _Inflight(rid)
        with self._lock:
            num = len(self._inflight)
            full, taken = num >= self.options.max_inflight, rid in self._inflight
            if not full and not taken:
                self._inflight[rid] = req
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"router queue full ({num} in flight), retry later")
        if taken:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        return req

    def _generate(self, req: _Inflight, request, prompt, deadline, queued_ns, context):
        rid, sampling = req.request_id, request.sampling
        decode, reservation = self._reserve(req, prompt, sampling, deadline, context)
        call = decode.stub.Stream(worker_pb2.StreamRequest(request_id=rid), timeout=_left(deadline))
        with req.lock:
            req.decode, req.stream_call = decode, call
            cancelled, abort_requested = req.cancelled, req.abort_requested
        if cancelled:   # the client left during Reserve: the callback did not know the worker yet
            call.cancel()
            self._abort_workers(req)
            return
        if abort_requested:
            self._abort_workers(req)   # the stream ends with finish_reason "abort"
        prefill = self.executor.submit(self._prefill, req, prompt, sampling, reservation, deadline)
        text = TextStream(self.tokenizer, prompt,
                          sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
                          tuple(sampling.stop), sampling.include_stop_str_in_output)
        num_tokens, final, error = 0, None, None
        try:
            for event in call:
                num_tokens += len(event.token_ids)
                is_final = event.HasField("finish_reason")
                piece = text.add(event.token_ids) + (text.flush() if is_final else "")
                if event.token_ids or piece:
                    yield pdserve_pb2.GenerateResponse(request_id=rid, delta=pdserve_pb2.TokenDelta(
                        index=event.index, token_ids=event.token_ids, text=piece, logprobs=event.logprobs))
                if is_final:
                    final = event
                    break
        except grpc.RpcError as e:
            error = e
        if req.cancelled:
            return
        prefill_reply = self._prefill_result(prefill)
        if req.prefill_error is not None and (final is None or final.finish_reason == "abort") \
                and not req.abort_requested:
            self._fail(req, context, req.prefill_error, "prefill worker", request.deadline_ms)
        if final is None:
            self._fail(req, context, error, "decode worker", request.deadline_ms)
        req.finished = True
        yield pdserve_pb2.GenerateResponse(request_id=rid, finish=self._finish(
            final, len(prompt), num_tokens, reservation, prefill_reply, queued_ns, req))

    def _reserve(self, req: _Inflight, prompt, sampling, deadline, context):
        error = None
        for worker in self.pool.decode_order():
            try:
                reservation = worker.stub.Reserve(worker_pb2.ReserveRequest(
                    request_id=req.request_id, prompt_token_ids=prompt, sampling=sampling,
                    lease_ms=self.options.lease_ms), timeout=min(self.options.rpc_timeout_s, _left(deadline)))
                self.pool.note_reserved(worker, len(reservation.block_ids))
                return worker, reservation
            except grpc.RpcError as e:
                error = e
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:   # it may have reserved anyway
                    _call_abort(worker.stub, req.request_id, self.options.abort_timeout_s)
                if e.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    break
        self._fail(req, context, error, "decode worker", 0)

    def _prefill(self, req: _Inflight, prompt, sampling, reservation, deadline):
        """On an executor thread. Returns the PrefillResponse, or None after recording the error
        and aborting the reservation (which ends the decode stream)."""
        error, excluded = None, None
        for _ in range(2):
            if req.cancelled or req.abort_requested:
                return None
            worker = self.pool.pick_prefill(exclude=excluded)
            with req.lock:
                req.prefill = worker
            try:
                return worker.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=req.request_id, prompt_token_ids=prompt, sampling=sampling,
                    reservation=reservation),
                    timeout=min(self.options.prefill_timeout_s, _left(deadline)))
            except grpc.RpcError as e:
                error, excluded = e, worker
                log.warning("prefill of %s on %s failed: %s %s", req.request_id, worker.address,
                            e.code(), e.details())
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    break
            finally:
                self.pool.end_prefill(worker)
        if req.cancelled or req.abort_requested:   # the failure is the abort itself
            return None
        req.prefill_error = error
        if not _call_abort(req.decode.stub, req.request_id, self.options.abort_timeout_s):
            req.stream_call.cancel()   # decode unreachable or the request already gone
        return None

    def _prefill_result(self, prefill: futures.Future):
        try:
            return prefill.result(timeout=self.options.prefill_result_wait_s)
        except futures.TimeoutError:
            return None

    def _finish(self, final, num_prompt_tokens, num_tokens, reservation, prefill_reply, queued_ns,
                req) -> pdserve_pb2.Finish:
        usage = pdserve_pb2.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_tokens,
                                  cached_prompt_tokens=reservation.num_cached_tokens)
        finish = pdserve_pb2.Finish(index=final.index, finish_reason=final.finish_reason, usage=usage)
        kind = final.WhichOneof("stop_reason")
        if final.finish_reason in ("abort", "error"):
            finish.message = final.stop_str   # the decode worker's reason rides in stop_str
        elif kind == "stop_str":
            finish.stop_str = final.stop_str
        elif kind == "stop_token":
            finish.stop_token = final.stop_token
        timings = finish.timings
        timings.CopyFrom(final.timings)
        timings.queued_unix_ns = queued_ns
        if prefill_reply is not None:
            timings.prefill_start_unix_ns = prefill_reply.prefill_start_unix_ns
            timings.prefill_end_unix_ns = prefill_reply.prefill_end_unix_ns
            timings.transfer_end_unix_ns = prefill_reply.transfer_end_unix_ns
        if req.prefill is not None:
            timings.prefill_worker = self.pool.name(req.prefill)
        if not timings.decode_worker and req.decode is not None:
            timings.decode_worker = self.pool.name(req.decode)
        return finish

    def _fail(self, req: _Inflight, context, error, who: str, deadline_ms: int):
        """Frees the request on both workers and ends the call with the worker's status."""
        req.finished = True
        self._abort_workers(req)
        if error is None:
            context.abort(grpc.StatusCode.INTERNAL, f"the {who} stream ended without a final event")
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            context.abort(code, f"request {req.request_id!r} did not finish within deadline_ms="
                                f"{deadline_ms or 'unset'} (at the {who})")
        if code in _CLIENT_CODES:
            context.abort(code, error.details())
        if code == grpc.StatusCode.CANCELLED:
            code = grpc.StatusCode.ABORTED
        context.abort(code, f"{who} failed: {error.details()}")

    # ---- cancellation ---------------------------------------------------------------------------
    def _on_rpc_end(self, req: _Inflight) -> None:
        """gRPC calls this when the call ends for any reason; only an unfinished one needs work."""
        with req.lock:
            if req.finished:
                return
            req.cancelled = True
            call = req.stream_call
        if call is not None:
            call.cancel()
        self._abort_workers(req)

    def _abort_workers(self, req: _Inflight) -> bool:
        with req.lock:
            workers = [w for w in (req.decode, req.prefill) if w is not None]
        found = False
        for worker in workers:
            found |= _call_abort(worker.stub, req.request_id, self.options.abort_timeout_s)
        return found

    # ---- Abort, ListModels ----------------------------------------------------------------------
    def Abort(self, request, context):
        with self._lock:
            req = self._inflight.get(request.request_id)
        if req is None:
            return pdserve_pb2.AbortResponse(found=False)
        with req.lock:
            req.abort_requested = True
        self._abort_workers(req)   # the decode stream then ends with finish_reason "abort"
        return pdserve_pb2.AbortResponse(found=True)

    def ListModels(self, request, context):
        opts = self.options
        return pdserve_pb2.ListModelsResponse(models=[pdserve_pb2.ModelCard(
            id=opts.model_id, max_model_len=opts.max_model_len, vocab_size=opts.vocab_size,
            dtype=opts.dtype)])


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _call_abort(stub, request_id: str, timeout: float) -> bool:
    """Best effort: a worker that is gone frees the request by its lease or stream end."""
    try:
        return stub.Abort(worker_pb2.WorkerAbortRequest(request_id=request_id), timeout=timeout).found
    except grpc.RpcError as e:
        log.debug("Abort of %s failed: %s", request_id, e.code())
        return False
