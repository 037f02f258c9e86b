"""The PrefillWorker gRPC service: Prefill, Embed, Abort, Stats.

It checks every field of a call and the reservation's numbers before any work, refuses a decode
worker whose KV layout differs, keeps one long-lived KV channel per decode endpoint, bounds each
call by its deadline, and counts what WorkerStats reports (with the prefix cache's KV events when
a Stats call asks for them: worker_common/kv_events.py). The hand-off itself (the KV sink, the
commit and the hand-off's timings) is in handoff.py. Lifecycle of one Prefill call:
  checks -> open or reuse the KV channel to the reservation's endpoint -> (PrefillRequest.peer_fetch:
  pull the reservation's cached prefix from its decode worker, peer_fetch.py) -> prefill-only engine
  request with the hand-off's sink -> wait for the finished output (the hand-off sends the commit)
  -> flush the channel (every frame handed to the decode side) -> reply with the first tokens and
  the hand-off's timings (with the prompt's logprobs and the first tokens' most likely
  alternatives when the sampling asks for them: worker_common/logprobs.py).
  Timeout, Abort, client gone or a transport error -> the engine request is aborted and an
  "abort" frame sent, so the decode side frees the reservation at once, not at lease expiry.
  An Abort that came before its Prefill is remembered, and the Prefill refused CANCELLED
  (worker_common/early_aborts.py): the router aborts a prefill worker before the decode side.
  A later pipeline stage that could not push (handoff.py StagePushError) or a rank that died ->
  UNAVAILABLE with no abort frame: the reservation stays, and the router prefills the prompt
  on another worker into it (its frames cover every layer again), or aborts it; its lease
  bounds it either way. On nixl and shm this call's claim of the reservation is released then
  (its writes ended: kvtransfer/backends/claims.py), so the retry's or the abort's end of the
  reservation need not wait for it.
Under pipeline stages (stage_push.py) the first stage's layers leave through this call's sink and
each later stage's ranks push their own; `stage_bytes` counts what each stage sent.
The call's priority (PrefillRequest.priority, then its share_tag within equal priorities:
protos/convert.py engine_priority) is its engine request's: the engine's waiting queue is this
worker's queue. Embed (embeddings: pooled hidden states, no KV hand-off) is
worker_common/embed.py's, counted in the prefix-cache counters as a prefill is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.errors import EngineBroken
from pdserve.kvtransfer.backends import BACKENDS, connect
from pdserve.kvtransfer.backends.shm_backend import address_problem as shm_address_problem
from pdserve.kvtransfer.choose import MAX_LOCALITY_CHARS, MAX_OFFERS, choices
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.transport import Destination, PipelineStage, Transport
from pdserve.prefill_worker.handoff import (
    GuardedSink,
    HandoffTimings,
    PushSink,
    StagePushError,
    Waiter,
    prefill_done,
)
from pdserve.prefill_worker.peer_fetch import FetchResult, PeerFetcher, check_spec
from pdserve.protos import tracing
from pdserve.protos.convert import engine_priority, unix_ns
from pdserve.protos.limits import (
    MAX_ADDRESS_CHARS,
    Refusal,
    check_context,
    check_id,
    check_pixel_values,
    check_sampling,
    check_token_ids,
    invalid,
)
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity
from pdserve.worker_common import (
    lora as worker_lora,
    prefix_cache as worker_prefix_cache,
    sleep as worker_sleep,
    weights as worker_weights,
)
from pdserve.worker_common.early_aborts import EarlyAborts, refuse_aborted
from pdserve.worker_common.embed import run_embed
from pdserve.worker_common.errors import (
    abort_for_engine_error,
    build_params,
    grammar_stats as _grammar_stats,
    refuse_if_broken,
    spec_stats as _spec_stats,
)
from pdserve.worker_common.images import pixel_values
from pdserve.worker_common.kv_events import kv_events, tier_stats
from pdserve.worker_common.logprobs import prompt_fields, top_of
from pdserve.worker_common.lora import adapter_of
from pdserve.worker_common.role import RoleGate

# a KV channel (or mapped decode pool) unused this long is closed; far above any prefill's budget,
# so no push in progress loses its channel
TRANSPORT_IDLE_S = 300.0
EARLY_ABORT_SWEEP_S = 1.0  # how often the loop forgets early aborts past their TTL


@dataclass(frozen=True)
class PrefillServiceOptions:
    worker_id: str = "prefill"
    # a Prefill call's bound when its caller gives no deadline; a deadline given is kept whole, so
    # a long prompt is never cut by a fixed bound here (the router passes its client's deadline)
    prefill_timeout_s: float = 60.0
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
        gate: RoleGate | None = None,
    ):
        """rank_caches: every TP rank's KV pool when this worker is tensor parallel; gate: the
        worker's role (worker_common/role.py), None for a worker that only prefills."""
        self.gate = gate
        self.loop = loop
        self.layout = layout
        self.rank_caches = rank_caches
        self.options = options
        self.tracing = None  # protos/tracing.py Tracing: this worker's spans (None: off)
        self._transports: dict[tuple[str, str], Transport] = {}
        self._transport_used: dict[tuple[str, str], float] = {}  # key -> time.monotonic()
        self._transports_lock = threading.Lock()
        # key -> the Future of a channel being opened (`_transport`), while it is
        self._opening: dict[tuple[str, str], futures.Future] = {}
        self._counts_lock = threading.Lock()  # the counters WorkerStats reports
        self.counts = dict(
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            kv_transfers=0,
            kv_transfer_failures=0,
            kv_transfer_bytes=0,
            peer_fetches=0,
            peer_fetch_bytes=0,
            peer_fetch_refused_blocks=0,
            peer_fetch_failures=0,
        )
        self.fetch_seconds = 0.0  # peer fetches' (WorkerStats.peer_fetch_seconds)
        self.fetcher: PeerFetcher | None = None  # peer fetch (peer_fetch.py), made at first use
        # per backend (kvtransfer.backend "auto" mixes them): bytes pushed, seconds pushing
        self.push_bytes: dict[str, int] = {}
        self.push_seconds: dict[str, float] = {}
        # pipeline stages: KV bytes each stage's ranks pushed (stage 0: this process's sink)
        self.stage_bytes: dict[int, int] = {}
        engine = loop.engine
        self.staged = engine.config.pipeline_parallel_size > 1
        # the layers this process's hook sees (the first stage's under pipeline stages)
        self.local_layers = engine.kv_cache.shape[0] if self.staged else layout.num_layers
        # ids the router aborted before their Prefill came: refused then, since the router has
        # freed (or will free) their reservations (loop thread only)
        self.aborted_early = EarlyAborts()
        loop.every(EARLY_ABORT_SWEEP_S, self.aborted_early.sweep)

    def _count(self, **deltas) -> None:
        with self._counts_lock:
            for name, delta in deltas.items():
                self.counts[name] += delta

    def _count_push(self, backend: str, push: PushSink, flush_s: float) -> None:
        """A hand-off's bytes over `backend`, and the time its frames took: handing each to the
        transport, and the flush."""
        with self._counts_lock:
            self.push_bytes[backend] = self.push_bytes.get(backend, 0) + push.bytes_sent
            self.push_seconds[backend] = self.push_seconds.get(backend, 0.0) + push.send_s + flush_s

    def Prefill(self, request, context):
        """Refused UNAVAILABLE while this worker does not serve prefill (a role flip)."""
        gate = self.gate
        with gate.admitted("prefill", context) if gate else contextlib.nullcontext():
            return self._prefill(request, context)

    def _prefill(self, request, context):
        timings = HandoffTimings(unix_ns(), self.local_layers)
        span = self._open_span(request, timings, context)
        try:
            return self._run(request, timings, span, context)
        except BaseException as e:  # refused, timed out or failed: the span says so
            tracing.end(span, unix_ns(), error=_failure(e, context))
            raise

    def _run(self, request, timings: HandoffTimings, span, context):
        rid = request.request_id
        params = self._checked_params(request, context)
        lora = adapter_of(self.loop.engine, request.lora_name, context)
        have = b"" if lora is None else lora.content_hash
        if have != request.reservation.lora_hash:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"lora_name {request.lora_name!r}: this worker's adapter is not the one the decode "
                f"worker reserved for (their weights differ): load the same adapter on both",
            )
        endpoint, transport = self._open_channel(request.reservation.endpoint, context)
        fetched = self._peer_fetch(request, lora, context)
        sink = self._sink(request, endpoint, transport, timings, tracing.traceparent(span))
        self._claim(rid, endpoint, transport, sink, context)
        waiter = Waiter(sink)
        try:
            self.loop.add_request(
                rid,
                list(request.prompt_token_ids),
                params,
                waiter,
                prefill_only=True,
                kv_sink=sink,
                priority=engine_priority(request.priority, request.share_tag),
                images=pixel_values(request.images),
                admit=lambda: self.aborted_early.refuse(rid),
                **({} if lora is None else {"lora_request": lora}),
            )
        except Exception as e:
            if not isinstance(e, EngineBroken):  # (broken: the reservation stays, as above)
                sink.abort()
            refuse_aborted(context, e)
            abort_for_engine_error(context, e)
            raise
        if fetched is not None:
            fetched.settle()  # installed in the loop turn that added the request, before it
        deadline = time.monotonic() + self._budget(context)
        self._wait(rid, waiter, sink, deadline, context)
        self._count(
            prefix_cache_queries=len(request.prompt_token_ids),
            prefix_cache_hits=waiter.output.num_cached_tokens,
        )
        if fetched is not None:
            tracing.event(
                span,
                "peer_fetch",
                {
                    "pdserve.peer_fetched_tokens": fetched.tokens,
                    "pdserve.peer_fetch_bytes": fetched.bytes,
                    "pdserve.peer_fetch_refused_blocks": fetched.refused,
                    "pdserve.peer_fetch_failed": fetched.failed,
                    "pdserve.peer_fetch_skipped": fetched.skipped,
                },
            )
        flushed = time.perf_counter()
        self._flush(rid, endpoint, transport, sink, deadline, context)
        timings.transfer_end_unix_ns = unix_ns()
        self._count(kv_transfers=1, kv_transfer_bytes=sink.sink.bytes_sent)
        self._count_push(endpoint.backend, sink.sink, time.perf_counter() - flushed)
        if self.staged:
            with self._counts_lock:
                later = sum(sink.sink.stage_bytes.values())
                self.stage_bytes[0] = self.stage_bytes.get(0, 0) + sink.sink.bytes_sent - later
                for stage, sent in sink.sink.stage_bytes.items():
                    self.stage_bytes[stage] = self.stage_bytes.get(stage, 0) + sent
        if span is not None:
            self._trace(span, endpoint, waiter, sink, timings)
        reply = self._reply(request, params, waiter, sink, timings, context)
        if fetched is not None:
            reply.peer_fetched_tokens = fetched.tokens
            reply.peer_fetch_bytes = fetched.bytes
            reply.peer_fetch_seconds = fetched.seconds
            reply.peer_fetch_refused_blocks = fetched.refused
            reply.peer_fetch_skipped = fetched.skipped or fetched.failed
        return reply

    def _peer_fetch(self, request, lora, context) -> FetchResult | None:
        """Pulls the reservation's cached prefix from its decode worker when the call asks
        (prefill_worker/peer_fetch.py); None when it does not. Never fails the call."""
        if not request.HasField("peer_fetch"):
            return None
        with self._counts_lock:
            if self.fetcher is None:
                engine = self.loop.engine
                caches = self.rank_caches or [engine.kv_cache]
                self.fetcher = PeerFetcher(self.loop, caches, self.options.security)
        deadline = time.monotonic() + self._budget(context)
        result = self.fetcher.fetch(request, lora, deadline)
        if not context.is_active():  # the router gave up on the call meanwhile: add nothing
            context.abort(grpc.StatusCode.CANCELLED, "the call ended during its peer fetch")
        if not result.skipped:
            self._count(
                peer_fetches=1,
                peer_fetch_bytes=result.bytes,
                peer_fetch_refused_blocks=result.refused,
                peer_fetch_failures=1 if result.failed else 0,
            )
            with self._counts_lock:
                self.fetch_seconds += result.seconds
        return result

    def _open_span(self, request, timings: HandoffTimings, context):
        """The call's prefill span, open from its arrival under the router's span (None when
        tracing is off or the call carries no trace context). It is open while the KV moves, so
        every frame can carry its context (PushSink.traceparent) and the decode worker can link
        its kv.receive span to it."""
        if self.tracing is None:
            return None
        parent = tracing.extract(context.invocation_metadata())
        if parent is None:
            return None
        return self.tracing.start(
            "prefill",
            parent,
            timings.arrival_unix_ns,
            {
                "pdserve.request_id": request.request_id,
                "pdserve.prefill_worker": self.options.worker_id,
                "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids),
            },
        )

    def _trace(self, span, endpoint, waiter, sink, timings) -> None:
        """This worker's spans of a served call, from its stamps, under its prefill span (which
        this ends): its queue, its compute and its KV push (protos/tracing.py)."""
        t = self.tracing
        start = timings.compute_start_unix_ns()
        t.emit("prefill.queue", span, timings.arrival_unix_ns, start)
        t.emit("prefill.compute", span, start, timings.prefill_end_unix_ns)
        t.emit(
            "kv.push",
            span,
            timings.transfer_start_unix_ns,
            timings.transfer_end_unix_ns,
            {
                "pdserve.kv_backend": endpoint.backend,
                "pdserve.kv_bytes": sink.sink.bytes_sent,
                "pdserve.kv_layers": self.layout.num_layers,
            },
        )
        tracing.end(
            span,
            timings.transfer_end_unix_ns,
            {"pdserve.cached_prompt_tokens": waiter.output.num_cached_tokens},
        )

    def Embed(self, request, context):
        """Refused UNAVAILABLE while this worker does not serve prefill (a role flip)."""
        gate = self.gate
        with gate.admitted("prefill", context) if gate else contextlib.nullcontext():
            reply = run_embed(self.loop, request, context, self._budget(context))
        self._count(
            prefix_cache_queries=sum(len(p.ids) for p in request.prompts),
            prefix_cache_hits=reply.num_cached_tokens,
        )
        return reply

    def _checked_params(self, request, context):
        """The call's SamplingParams, once its fields, its reservation and the decode worker's
        KV layout are known good; otherwise the call is aborted with what is wrong."""
        refusal = self._check_fields(request)
        if refusal:
            refusal.abort(context)
        params = build_params(
            request.sampling, context, getattr(self.loop.engine, "grammars", None)
        )
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
                f"serve the same model in the same dtype (dtype='auto' chooses the KV cache's "
                f"dtype on each machine's CPU: set kv_cache_dtype explicitly, the same for both "
                f"pools)",
            )
        if endpoint.rank_addresses:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "endpoint.rank_addresses is not supported: a tensor-parallel decode worker "
                "takes every rank's KV at endpoint.address",
            )
        if res.block_size < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reservation.block_size must be >= 1")
        return params

    def _open_channel(self, endpoint, context) -> tuple[object, Transport]:
        """The endpoint this hand-off uses and its channel: the reservation's own, or of its
        offers (kvtransfer.backend "auto") the best one this worker can open
        (kvtransfer/choose.py), trying the next when one cannot be opened."""
        tried = choices(endpoint)
        if not tried:
            self._count(kv_transfer_failures=1)
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "no KV channel of the reservation's offers "
                f"({', '.join(o.backend for o in endpoint.offers)}) can be used from this worker",
            )
        errors = []
        for one in tried:
            try:
                return one, self._transport(one.backend, one.address)
            except (ConnectionError, OSError, ValueError) as e:
                errors.append(f"{one.backend}: {e}")
        self._count(kv_transfer_failures=1)
        context.abort(
            grpc.StatusCode.UNAVAILABLE, f"cannot open the KV channel: {'; '.join(errors)}"
        )

    def _claim(self, rid: str, endpoint, transport: Transport, sink: GuardedSink, context):
        """The reservation claimed now, on this call's thread, where the backend claims before
        it writes (shm, nixl: kvtransfer/backends/claims.py), so that the engine's step does not
        wait for the call at the request's first layer; a refusal fails the call before any
        compute."""
        claim = getattr(transport, "claim", None)
        if claim is None:
            return
        try:
            claim(rid, sink.sink.dest)
        except (PermissionError, ConnectionError, OSError, ValueError) as e:
            self._fail_transport(endpoint, transport, sink, context, e)

    def _sink(
        self, request, endpoint, transport: Transport, timings: HandoffTimings, traceparent: str
    ) -> GuardedSink:
        """The KV sink that pushes the prompt's KV into the reservation over `endpoint` (the one
        chosen), layer by layer, each frame with the call's trace context (traceparent; "" when
        it is not traced)."""
        res = request.reservation
        stage = None
        if self.staged:  # this attempt's stages claim as parts of one sender (nixl, shm)
            stage = PipelineStage(
                secrets.token_hex(16),
                0,
                self.loop.engine.config.pipeline_parallel_size,
                (0, self.local_layers),
            )
        # the receiver's layout: its block size and TP split (head ranges travel in each frame)
        dest = Destination(
            list(res.block_ids),
            dataclasses.replace(
                self.layout, block_size=res.block_size, tp_size=max(1, endpoint.tp_size)
            ),
            grant=endpoint.write_grant,
            stage=stage,
        )
        push = PushSink(
            request.request_id,
            self.layout,
            transport,
            dest,
            res.num_cached_tokens,
            self.rank_caches,
            traceparent=traceparent,
            # the later stages choose their own channel from the reservation's endpoint
            endpoint=res.endpoint.SerializeToString() if self.staged else b"",
        )
        return GuardedSink(push, timings)

    def _wait(self, rid: str, waiter: Waiter, sink: GuardedSink, deadline: float, context):
        """Until the prefill-only request finished; aborts the call on its deadline, when the
        client is gone, or when the request ended otherwise than with its first tokens."""
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
            why = f"prefill of {rid!r} ended: {comp.stop_reason or comp.finish_reason}"
            if self.loop.broken:
                # a rank died: as from a dead worker, no abort frame, so the reservation stays
                # and the router prefills the prompt on another worker into it (its frames
                # cover every layer again; coverage is per token)
                context.abort(grpc.StatusCode.UNAVAILABLE, why)
            sink.abort()
            context.abort(grpc.StatusCode.ABORTED, why)

    def _flush(self, rid, endpoint, transport, sink: GuardedSink, deadline: float, context):
        """Every frame of the hand-off (its commit included) handed to the decode side."""
        if isinstance(sink.error, StagePushError):
            # as for a dead rank: no abort frame, the reservation stays for the router's retry
            # on another worker (or its abort); this process's channel is not at fault. On nixl
            # and shm the first stage's claim ends here (its writes ended, the decode side told)
            self._count(kv_transfer_failures=1)
            release = getattr(transport, "release", None)
            if release is not None:
                with contextlib.suppress(ConnectionError, OSError):
                    release(rid)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(sink.error))
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

    def _reply(self, request, params, waiter: Waiter, sink: GuardedSink, timings, context):
        """The PrefillResponse: every sequence's first token (and what the sampling asked of
        logprobs), the prefix-cache hit and the hand-off's timings."""
        comps = sorted(waiter.output.outputs, key=lambda c: c.index)
        try:
            prompt_lps = prompt_fields(
                request.prompt_token_ids, waiter.output.prompt_logprobs, params.prompt_logprobs or 0
            )
        except ValueError as e:
            context.abort(
                grpc.StatusCode.INTERNAL, f"prompt logprobs of {request.request_id!r}: {e}"
            )
        return worker_pb2.PrefillResponse(
            request_id=request.request_id,
            first_tokens=[c.token_ids[0] for c in comps],
            first_token_logprobs=[c.logprobs[0] for c in comps] if comps[0].logprobs else [],
            num_cached_tokens=waiter.output.num_cached_tokens,
            bytes_sent=sink.sink.bytes_sent,
            timings=timings.to_proto(),
            first_token_top_logprobs=(
                [top_of(c.logprobs[0]) for c in comps] if params.top_logprobs else []
            ),
            **prompt_lps,
        )

    def _check_fields(self, request) -> Refusal | None:
        """What is wrong with a PrefillRequest's id, prompt or sampling sizes, before any work."""
        config = self.loop.engine.config
        vocab = self.loop.engine.model_config.vocab_size
        fetch = check_spec(request.peer_fetch) if request.HasField("peer_fetch") else ""
        return (
            (invalid(fetch) if fetch else None)
            or check_id("request_id", request.request_id)
            or check_token_ids(
                "prompt_token_ids", request.prompt_token_ids, config.max_model_len, vocab
            )
            or check_sampling(request.sampling, config.max_model_len, vocab)
            or check_context(len(request.prompt_token_ids), request.sampling, config.max_model_len)
            or check_pixel_values(request.images)
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
        if len(endpoint.offers) > MAX_OFFERS:
            return invalid(
                f"reservation.endpoint.offers has {len(endpoint.offers)} entries; at most "
                f"{MAX_OFFERS}"
            )
        for name, one in [("reservation.endpoint", endpoint)] + [
            (f"reservation.endpoint.offers[{i}]", offer) for i, offer in enumerate(endpoint.offers)
        ]:
            refusal = self._check_endpoint(name, one)
            if refusal:
                return refusal
        return None

    def _check_endpoint(self, name: str, endpoint) -> Refusal | None:
        """What is wrong with one endpoint of the reservation (its own, or one of its offers).
        An shm endpoint needs its write grant, and the one named without offers (used as it is)
        must name the decode worker's pool files (shm_backend.address_problem): a sender writes
        into whatever file it maps."""
        if endpoint.backend not in BACKENDS:
            return invalid(
                f"{name}.backend must be one of {BACKENDS}, got {endpoint.backend[:40]!r}"
            )
        if not endpoint.address or len(endpoint.address) > MAX_ADDRESS_CHARS:
            return invalid(f"{name}.address must have 1 to {MAX_ADDRESS_CHARS} characters")
        if endpoint.tp_size > self.options.max_tp_size:
            return invalid(
                f"{name}.tp_size must be at most {self.options.max_tp_size}, got {endpoint.tp_size}"
            )
        heads = self.layout.num_kv_heads
        if heads % max(1, endpoint.tp_size) and heads != 1:  # (one MLA latent: on every rank)
            return invalid(
                f"{name}.tp_size={endpoint.tp_size} must divide the model's {heads} KV heads (the "
                f"decode worker's tensor-parallel size)"
            )
        if len(endpoint.locality) > MAX_LOCALITY_CHARS:
            return invalid(f"{name}.locality must have at most {MAX_LOCALITY_CHARS} characters")
        if name != "reservation.endpoint" and endpoint.offers:
            return invalid(f"{name}.offers must be empty (offers do not nest)")
        if endpoint.backend == "shm":
            return self._check_shm(name, endpoint)
        return None

    @staticmethod
    def _check_shm(name: str, endpoint) -> Refusal | None:
        if not endpoint.write_grant:
            return invalid(
                f"{name}.write_grant must be set for the shm backend (DecodeWorker.Reserve "
                f"issues it): a shm sender writes nothing unclaimed"
            )
        # the reservation's own endpoint, used as it is when it has no offers (an offer that
        # names no pool file here is passed over: kvtransfer/choose.py)
        if name == "reservation.endpoint" and not endpoint.offers:
            problem = shm_address_problem(endpoint.address)
            if problem:
                return invalid(f"{name}.address: {problem}")
        return None

    def _budget(self, context) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            return self.options.prefill_timeout_s
        return max(0.0, remaining - 0.05)

    def _transport(self, backend: str, address: str) -> Transport:
        """One long-lived channel per decode endpoint, shared by all requests going there. One
        unused for TRANSPORT_IDLE_S is closed: a decode worker that died and came back on a new
        address is never sent to again, and its channel (or mapped pool) must not stay. A channel
        is opened outside the lock, so a decode endpoint that is slow to answer (or dead: up to
        connect_timeout_s) delays only the calls going there; the calls that come for it
        meanwhile wait for that one opening and share its channel, or its error."""
        key = (backend, address)
        now = time.monotonic()
        with self._transports_lock:
            idle = [k for k, t in self._transport_used.items() if now - t > TRANSPORT_IDLE_S]
            closing = [self._transports.pop(k) for k in idle if k in self._transports]
            for k in idle:
                del self._transport_used[k]
            self._transport_used[key] = now
            transport = self._transports.get(key)
            opening = self._opening.get(key) if transport is None else None
            mine = transport is None and opening is None
            if mine:
                opening = self._opening[key] = futures.Future()
        for old in closing:
            threading.Thread(target=old.close, daemon=True).start()
        if transport is not None:
            return transport
        if not mine:  # another call opens it: its connect is bounded by connect_timeout_s
            return opening.result(2 * self.options.connect_timeout_s + 5)
        try:
            transport = connect(
                backend,
                address,
                timeout=self.options.connect_timeout_s,
                security=self.options.security,
            )
        except BaseException as e:
            with self._transports_lock:
                del self._opening[key]
            opening.set_exception(e)
            raise
        with self._transports_lock:
            del self._opening[key]
            self._transports[key] = transport
        opening.set_result(transport)
        return transport

    def _fail_transport(self, endpoint, transport, sink: GuardedSink, context, err: Exception):
        self._count(kv_transfer_failures=1)
        sink.abort()
        if isinstance(err, PermissionError):
            # the decode worker refused this request's write (nixl, shm: its reservation is gone,
            # or the grant is not its): the channel and the other requests on it are fine
            context.abort(grpc.StatusCode.ABORTED, f"KV transfer to {endpoint.address}: {err}")
        with self._transports_lock:  # the next request to this endpoint opens a fresh channel
            if self._transports.get((endpoint.backend, endpoint.address)) is transport:
                del self._transports[(endpoint.backend, endpoint.address)]
                self._transport_used.pop((endpoint.backend, endpoint.address), None)
        threading.Thread(target=transport.close, daemon=True).start()
        context.abort(
            grpc.StatusCode.UNAVAILABLE, f"KV transfer to {endpoint.address} failed: {err}"
        )

    def LoadLoRA(self, request, context):
        return worker_lora.load(self.loop.engine, request, context)

    def UnloadLoRA(self, request, context):
        return worker_lora.unload(self.loop.engine, request, context)

    def UpdateWeights(self, request, context):
        return worker_weights.update(self.loop, request, context)

    def InitWeightsGroup(self, request, context):
        return worker_weights.init_group(self.loop, request, context)

    def UpdateWeightsFromGroup(self, request, context):
        return worker_weights.update_from_group(self.loop, request, context)

    def DestroyWeightsGroup(self, request, context):
        return worker_weights.destroy_group(self.loop, request, context)

    # ---- sleep mode (worker_common/sleep.py) ----------------------------------------------------
    def Sleep(self, request, context):
        return worker_sleep.sleep(self.loop, request, context)

    def WakeUp(self, request, context):
        return worker_sleep.wake_up(self.loop, request, context)

    def ResetPrefixCache(self, request, context):
        return worker_prefix_cache.reset(self.loop, request, context)

    def Abort(self, request, context):
        refusal = check_id("request_id", request.request_id)
        if refusal:
            refusal.abort(context)
        # an id not held here is remembered: its Prefill may still be on its way (early_aborts.py)
        found = self.loop.abort(
            request.request_id, "aborted by the router", on_unknown=self.aborted_early.remember
        )
        return worker_pb2.WorkerAbortResponse(found=found)

    def Stats(self, request, context):
        refuse_if_broken(self.loop, context)  # the router takes it down; work goes elsewhere
        with self._counts_lock:
            counts = dict(self.counts)
            counts["peer_fetch_seconds"] = self.fetch_seconds
            push_bytes, push_seconds = dict(self.push_bytes), dict(self.push_seconds)
        stats = worker_pb2.WorkerStats(
            worker_id=self.options.worker_id,
            **self.loop.load(),
            **counts,
            kv_push_bytes_by_backend=push_bytes,
            kv_push_seconds_by_backend=push_seconds,
            num_preemptions=getattr(self.loop.engine.scheduler, "num_preemptions", 0),
            **_grammar_stats(self.loop.engine),
            **_spec_stats(self.loop.engine),
            **tier_stats(self.loop.engine.block_manager),
            **worker_lora.stats(self.loop.engine),
            **worker_weights.stats(self.loop.engine),
            **worker_sleep.stats(self.loop.engine),
        )
        events = kv_events(self.loop.engine.block_manager, request)
        if events is not None:  # the router's block index (router/kv_index.py)
            stats.kv_events.CopyFrom(events)
        return self.gate.stamp(stats) if self.gate else stats

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
        with self._transports_lock:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()


def _failure(error: BaseException, context) -> str:
    """What ended a failed Prefill call, for its span: the status the call was aborted with
    (context.abort raises a bare Exception), else the error itself."""
    code = context.code() if hasattr(context, "code") else None
    if code is None:
        return repr(error)
    details = context.details() if hasattr(context, "details") else b""
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    return f"{code.name}: {details}" if details else code.name
