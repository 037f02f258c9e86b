"""The PrefillWorker gRPC service: Prefill, Abort, Stats.

Lifecycle of one Prefill call:
  check the reservation (layout fingerprint) -> open or reuse the KV channel to its endpoint
  -> engine prefill-only request with a PushSink: each finished layer's KV is pushed while the
     next layer computes
  -> finished output ("prefill_done"): commit(first_token) on the same channel -> flush the
     channel (every frame handed to the decode side) -> reply with the first token and timings
  n>1: the prompt runs and its KV is pushed once; each of the n sequences samples its first token
     from the prompt's last logits with its own generator (the engine's n>1), and the commit and
     the reply carry all n (the decode worker forks the sequences)
  timeout, Abort, client gone or a transport error -> engine request aborted, "abort" frame sent
     (so the decode side frees the reservation at once instead of at lease expiry)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import grpc

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.request import RequestOutput
from pdserve.kvtransfer.backends import BACKENDS, connect
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.transport import Destination, Transport
from pdserve.prefill_worker.handoff import PushSink
from pdserve.protos.convert import unix_ns
from pdserve.protos.limits import (
    MAX_ADDRESS_CHARS,
    Refusal,
    check_id,
    check_sampling,
    check_token_ids,
    invalid,
)
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity
from pdserve.worker_common.errors import abort_for_engine_error, build_params

log = logging.getLogger(__name__)


class GuardedSink:
    """A PushSink whose send errors are recorded instead of raised: raised inside an engine step
    they would fail the whole batch, every other request on this worker with it."""

    def __init__(self, sink: PushSink, num_layers: int = 1):
        self.sink = sink
        self.error: Exception | None = None
        self.num_layers = max(1, num_layers)
        # unix ns: the first step's first and last layer done, the first KV handed to the transport
        self.first_layer_ns = self.first_step_end_ns = self.transfer_start_ns = 0

    def on_layer(self, layer: int, *args) -> None:
        now = unix_ns()
        if not self.first_layer_ns:
            self.first_layer_ns = now
        if not self.first_step_end_ns and layer == self.num_layers - 1:
            self.first_step_end_ns = now
        if self.error is None:
            sent = self.sink.bytes_sent
            try:
                self.sink.on_layer(layer, *args)
            except Exception as e:
                self.error = e
            if not self.transfer_start_ns and self.sink.bytes_sent > sent:
                self.transfer_start_ns = now

    def compute_start_ns(self) -> int:
        """When the engine step that began this prompt started: the first layer's end less one
        layer's share of that step (the engine reports layers as they end, not the step's start);
        0 when no layer ran."""
        if not self.first_layer_ns:
            return 0
        if not self.first_step_end_ns or self.num_layers == 1:
            return self.first_layer_ns
        per_layer = (self.first_step_end_ns - self.first_layer_ns) / (self.num_layers - 1)
        return int(self.first_layer_ns - per_layer)

    def commit(self, first_token: int | list[int], logprobs: list[float] | None = None) -> None:
        if self.error is None:
            try:
                self.sink.commit(first_token, logprobs)
            except Exception as e:
                self.error = e

    def abort(self) -> None:
        try:
            self.sink.abort()
        except Exception as e:  # the channel is gone: the decode side's lease frees the blocks
            log.debug("abort frame for %s not sent: %r", self.sink.request_id, e)


def prefill_done(out: RequestOutput) -> bool:
    """Whether every sequence of a finished prefill-only request sampled its first token."""
    return bool(out.outputs) and all(
        c.finish_reason == "prefill_done" and c.token_ids for c in out.outputs
    )


def first_tokens(out: RequestOutput) -> list[int]:
    """Each sequence's first token, in index order."""
    return [c.token_ids[0] for c in sorted(out.outputs, key=lambda c: c.index)]


def first_logprobs(out: RequestOutput) -> list[float] | None:
    """Each sequence's first token's logprob, in index order; None without logprobs."""
    comps = sorted(out.outputs, key=lambda c: c.index)
    if not all(c.logprobs for c in comps):
        return None
    return [c.logprobs[0] for c in comps]


class _Waiter:
    """The finished output of one prefill-only request, handed from the loop thread."""

    def __init__(self, sink: GuardedSink):
        self.sink = sink
        self.done = threading.Event()
        self.output: RequestOutput | None = None
        self.end_ns = 0

    def __call__(self, out: RequestOutput) -> None:  # on the loop thread
        if not out.finished:
            return
        self.end_ns = unix_ns()  # before the commit: the decode side may stamp its arrival first
        if prefill_done(out):
            self.sink.commit(first_tokens(out), first_logprobs(out))
        self.output = out
        self.done.set()


@dataclass(frozen=True)
class PrefillServiceOptions:
    worker_id: str = "prefill"
    prefill_timeout_s: float = 60.0  # when the client gives no deadline (and at most this)
    flush_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    poll_s: float = 0.1
    security: ClusterSecurity = INSECURE  # KV channels carry the cluster secret
    max_block_size: int = 1024
    max_tp_size: int = 64


class PrefillWorkerServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        loop: EngineLoop,
        layout: KVLayout,
        options: PrefillServiceOptions,
        rank_caches: list | None = None,
    ):
        """rank_caches: every TP rank's KV pool when this worker is tensor parallel."""
        self.loop = loop
        self.layout = layout
        self.rank_caches = rank_caches
        self.options = options
        self._transports: dict[tuple[str, str], Transport] = {}
        self._transports_lock = threading.Lock()
        self._counts_lock = threading.Lock()  # the counters WorkerStats reports
        self.counts = dict(
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            kv_transfers=0,
            kv_transfer_failures=0,
            kv_transfer_bytes=0,
        )

    def _count(self, **deltas) -> None:
        with self._counts_lock:
            for name, delta in deltas.items():
                self.counts[name] += delta

    def Prefill(self, request, context):
        arrival_ns = unix_ns()
        rid = request.request_id
        refusal = self._check_fields(request)
        if refusal:
            refusal.abort(context)
        params = build_params(request.sampling, context)
        if not request.HasField("reservation"):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "reservation must be set: call DecodeWorker.Reserve first",
            )
        refusal = self._check_reservation(request)
        if refusal:
            refusal.abort(context)
        res = request.reservation
        endpoint = res.endpoint
        if endpoint.layout_fingerprint != self.layout.fingerprint:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the decode worker's KV layout ({endpoint.layout_fingerprint or 'unset'}) "
                f"differs from this prefill worker's ({self.layout.fingerprint}: "
                f"model={self.layout.model}, dtype={self.layout.dtype}): both sides must "
                f"serve the same model in the same dtype",
            )
        if endpoint.rank_addresses:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "endpoint.rank_addresses is not supported: a tensor-parallel decode worker "
                "takes every rank's KV at endpoint.address",
            )
        if res.block_size < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reservation.block_size must be >= 1")
        try:
            transport = self._transport(endpoint.backend, endpoint.address)
        except (ConnectionError, OSError, ValueError) as e:
            self._count(kv_transfer_failures=1)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot open the KV channel: {e}")

        # the receiver's layout: its block size and TP split (head ranges travel in each frame)
        dest = Destination(
            list(res.block_ids),
            dataclasses.replace(
                self.layout, block_size=res.block_size, tp_size=max(1, endpoint.tp_size)
            ),
        )
        sink = GuardedSink(
            PushSink(rid, self.layout, transport, dest, res.num_cached_tokens, self.rank_caches),
            self.layout.num_layers,
        )
        waiter = _Waiter(sink)
        try:
            self.loop.add_request(
                rid, list(request.prompt_token_ids), params, waiter, prefill_only=True, kv_sink=sink
            )
        except Exception as e:
            sink.abort()
            abort_for_engine_error(context, e)
            raise

        deadline = time.monotonic() + self._budget(context)
        while not waiter.done.wait(self.options.poll_s):
            if time.monotonic() > deadline or not context.is_active():
                self.loop.abort(rid, "prefill deadline exceeded")
                sink.abort()
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"prefill of {rid!r} did not finish in time; raise the deadline",
                )
        comp = waiter.output.outputs[0]
        if not prefill_done(waiter.output):
            sink.abort()
            context.abort(
                grpc.StatusCode.ABORTED,
                f"prefill of {rid!r} ended: {comp.stop_reason or comp.finish_reason}",
            )
        self._count(
            prefix_cache_queries=len(request.prompt_token_ids),
            prefix_cache_hits=waiter.output.num_cached_tokens,
        )
        if sink.error is not None:
            self._fail_transport(endpoint, transport, sink, context, sink.error)
        try:
            transport.flush(
                max(0.1, min(self.options.flush_timeout_s, deadline - time.monotonic()))
            )
        except TimeoutError as e:
            self._count(kv_transfer_failures=1)
            sink.abort()
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"KV transfer of {rid!r} did not finish: {e}"
            )
        except Exception as e:
            self._fail_transport(endpoint, transport, sink, context, e)
        transfer_end_ns = unix_ns()
        self._count(kv_transfers=1, kv_transfer_bytes=sink.sink.bytes_sent)
        comps = sorted(waiter.output.outputs, key=lambda c: c.index)
        return worker_pb2.PrefillResponse(
            request_id=rid,
            first_token=comp.token_ids[0],
            first_token_logprob=comp.logprobs[0] if comp.logprobs else 0.0,
            first_tokens=[c.token_ids[0] for c in comps] if len(comps) > 1 else [],
            first_token_logprobs=(
                [c.logprobs[0] for c in comps] if len(comps) > 1 and comp.logprobs else []
            ),
            num_cached_tokens=waiter.output.num_cached_tokens,
            bytes_sent=sink.sink.bytes_sent,
            timings=pdserve_pb2.Timings(
                prefill_arrival_unix_ns=arrival_ns,
                prefill_start_unix_ns=max(arrival_ns, sink.compute_start_ns()),
                transfer_start_unix_ns=sink.transfer_start_ns,
                prefill_end_unix_ns=waiter.end_ns,
                transfer_end_unix_ns=transfer_end_ns,
            ),
        )

    def _check_fields(self, request) -> Refusal | None:
        """What is wrong with a PrefillRequest's id, prompt or sampling sizes, before any work."""
        config = self.loop.engine.config
        vocab = self.loop.engine.model_config.vocab_size
        return (
            check_id("request_id", request.request_id)
            or check_token_ids(
                "prompt_token_ids", request.prompt_token_ids, config.max_model_len, vocab
            )
            or check_sampling(request.sampling, config.max_model_len, vocab)
        )

    def _check_reservation(self, request) -> Refusal | None:
        """Whether the reservation's numbers fit the prompt and the limits of this worker."""
        prompt = request.prompt_token_ids
        res, opts = request.reservation, self.options
        if not 1 <= res.block_size <= opts.max_block_size:
            return invalid(
                f"reservation.block_size must be in [1, {opts.max_block_size}], got "
                f"{res.block_size}"
            )
        needed = -(-len(prompt) // res.block_size)
        if not needed <= len(res.block_ids) <= needed + 1:
            return invalid(
                f"reservation.block_ids has {len(res.block_ids)} blocks; a prompt of "
                f"{len(prompt)} tokens in blocks of {res.block_size} needs {needed}"
            )
        if res.num_cached_tokens > len(prompt):
            return invalid(
                f"reservation.num_cached_tokens={res.num_cached_tokens} exceeds the "
                f"prompt's {len(prompt)} tokens"
            )
        endpoint = res.endpoint
        if endpoint.backend not in BACKENDS:
            return invalid(
                f"reservation.endpoint.backend must be one of {BACKENDS}, got "
                f"{endpoint.backend[:40]!r}"
            )
        if not endpoint.address or len(endpoint.address) > MAX_ADDRESS_CHARS:
            return invalid(
                f"reservation.endpoint.address must have 1 to {MAX_ADDRESS_CHARS} characters"
            )
        if endpoint.tp_size > opts.max_tp_size:
            return invalid(
                f"reservation.endpoint.tp_size must be at most {opts.max_tp_size}, got "
                f"{endpoint.tp_size}"
            )
        return None

    def _budget(self, context) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            return self.options.prefill_timeout_s
        return max(0.0, min(remaining - 0.05, self.options.prefill_timeout_s))

    def _transport(self, backend: str, address: str) -> Transport:
        """One long-lived channel per decode endpoint, shared by all requests going there."""
        key = (backend, address)
        with self._transports_lock:
            transport = self._transports.get(key)
            if transport is None:
                transport = connect(
                    backend,
                    address,
                    timeout=self.options.connect_timeout_s,
                    security=self.options.security,
                )
                self._transports[key] = transport
            return transport

    def _fail_transport(self, endpoint, transport, sink: GuardedSink, context, err: Exception):
        self._count(kv_transfer_failures=1)
        sink.abort()
        with self._transports_lock:  # the next request to this endpoint opens a fresh channel
            if self._transports.get((endpoint.backend, endpoint.address)) is transport:
                del self._transports[(endpoint.backend, endpoint.address)]
        threading.Thread(target=transport.close, daemon=True).start()
        context.abort(
            grpc.StatusCode.UNAVAILABLE, f"KV transfer to {endpoint.address} failed: {err}"
        )

    def Abort(self, request, context):
        refusal = check_id("request_id", request.request_id)
        if refusal:
            refusal.abort(context)
        found = self.loop.abort(request.request_id, "aborted by the router")
        return worker_pb2.WorkerAbortResponse(found=found)

    def Stats(self, request, context):
        with self._counts_lock:
            counts = dict(self.counts)
        return worker_pb2.WorkerStats(
            worker_id=self.options.worker_id,
            **self.loop.load(),
            **counts,
            num_preemptions=getattr(self.loop.engine.scheduler, "num_preemptions", 0),
        )

    def close(self) -> None:
        with self._transports_lock:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()
