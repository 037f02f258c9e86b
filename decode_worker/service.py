"""The DecodeWorker gRPC service: Reserve, Stream, Streams, Embed, Abort, Stats, FetchKV.

Lifecycle of one request as this service sees it (colocated serving: Reserve with run_prefill adds
an ordinary engine request instead, and the rest is the same from Stream on):
  Reserve  -> (run_prefill with min_cached_tokens: refused FAILED_PRECONDITION, before any work,
              when the prefix cache holds fewer of the prompt's leading tokens: a stale hint)
              engine blocks reserved (DecodeHandoff, with a lease) and a per-request queue that
              receives the engine's outputs (the hand-off's on_output callback puts into it)
  KV frames + commit arrive on the kvtransfer channel (not here) -> the request decodes
  Stream   -> drains the queue, sending only the tokens that are new since the last event (the
              engine's outputs carry only what is new: SamplingParams.output_kind DELTA; what
              queued up while the stream was behind goes out as one event per sequence), and
              ends with the finished output ("stop" | "length" | "abort"). n>1: per sequence
              (TokenEvent.index); each sequence's final event goes out when it ends, and a request
              that ends as a whole (an abort) ends every sequence still open with its reason;
              with sampling.top_logprobs each token's alternatives ride beside its logprob
              (worker_common/logprobs.py), and a colocated request's prompt logprobs on each
              sequence's final event
  (or Streams: the router's one call to this worker, which attaches the request and carries its
              events with every other attached request's, a message a round: streams.py)
  Abort, lease expiry, or a Stream client going away -> handoff.abort: blocks freed, the queue
              gets a final "abort" output. An Abort for an id not held here is remembered a
              while (the router's Abort may overtake a Reserve it gave up on): that Reserve then
              ends CANCELLED with nothing reserved
The request's priority (ReserveRequest.priority, then its share_tag within equal priorities:
protos/convert.py engine_priority) is its engine request's: the order of the engine's waiting
queue and of its preemptions (engine/scheduler.py). Embed serves colocated
deployments' embeddings on this worker's engine (worker_common/embed.py; the router sends it
only where there is no prefill pool). A finished request nobody streams is forgotten after
`finished_ttl_s`. Stats answers the prefix
cache's KV events when asked (worker_common/kv_events.py: the router's block index). FetchKV
serves the cached prefix blocks a live reservation holds to the prefill worker that fills it
(peer fetch: kvtransfer/peer.py, prefill_worker/peer_fetch.py), read on the engine loop a few
blocks at a time.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.decode_worker.handoff import DecodeHandoff
from pdserve.decode_worker.streams import Connection, EventReader, Interval, drain
from pdserve.engine.block_manager import chain_root
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.request import RequestOutput
from pdserve.engine.sampling_params import RequestOutputKind
from pdserve.kvtransfer.backends.claims import CLAIMING
from pdserve.kvtransfer.peer import digest, hash_bytes
from pdserve.protos import tracing
from pdserve.protos.convert import engine_priority, unix_ns
from pdserve.protos.limits import (
    MAX_ID_CHARS,
    check_context,
    check_id,
    check_pixel_values,
    check_sampling,
    check_stream_interval,
    check_token_ids,
)
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_common import (
    lora as worker_lora,
    prefix_cache as worker_prefix_cache,
    sleep as worker_sleep,
    weights as worker_weights,
)
from pdserve.worker_common.early_aborts import refuse_aborted
from pdserve.worker_common.embed import run_embed
from pdserve.worker_common.errors import (
    abort_for_engine_error,
    build_params,
    grammar_stats as _grammar_stats,
    refuse_if_broken,
    spec_stats as _spec_stats,
)
from pdserve.worker_common.images import pixel_values
from pdserve.worker_common.kv_events import (
    engine_fingerprint,
    fetch_supported,
    kv_events,
    tier_stats,
)
from pdserve.worker_common.lora import adapter_of
from pdserve.worker_common.role import RoleGate

log = logging.getLogger(__name__)
# FetchKV: at most this many blocks a call, read this many at a time on the engine loop (one
# loop call copies them; the stream sends them while the engine steps on)
MAX_FETCH_BLOCKS, FETCH_BATCH = 65536, 8
# Streams: at most this many request ids in one StreamsRequest
MAX_STREAMS_IDS = 4096


@dataclass
class _Stream:
    """Outputs of one reserved request, waiting for (or being drained by) a Stream call."""

    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    finished_at: float | None = None  # time.monotonic() of the final output
    attached: bool = False  # a Stream call is draining it
    colocated: bool = False  # this worker runs the prompt too (Reserve with run_prefill)
    n: int = 1  # sequences of the request (sampling.n)
    prompt_logprobs: int | None = None  # sampling.prompt_logprobs (colocated: this worker's)
    reserved_ns: int = 0  # unix ns of its Reserve (the start of its KV receipt)
    trace: object | None = None  # the router's trace context for it (protos/tracing.py)
    # a Streams call's reader: called after outputs are queued (None: a Stream call's, or
    # nobody's yet)
    notify: Callable[[], None] | None = None
    # which outputs are queued when (ReserveRequest.stream_interval > 1), None: each at once
    interval: Interval | None = None


@dataclass(frozen=True)
class DecodeServiceOptions:
    worker_id: str = "decode"
    kv_backend: str = "grpc"
    kv_address: str = ""
    # kvtransfer.backend "auto": (backend, address, locality, host, cross-host rank) of each
    # backend served, in the same-host order (kvtransfer/choose.py);
    # every reservation offers them all (KVEndpoint.offers), () on one named backend
    kv_offers: tuple = ()
    # on one named backend, its locality (decode_worker/server.py _locality; "" for grpc, torch
    # and nixl): a sender compares it as it does an offer's (kvtransfer/choose.py)
    kv_locality: str = ""
    default_lease_ms: int = 10_000
    max_lease_ms: int = 120_000  # a Reserve's lease_ms is cut to this
    tp_size: int = 1
    poll_s: float = 0.1  # every queue wait is this long, then the client is checked
    finished_ttl_s: float = 60.0  # how long a finished, never-streamed request is kept


class DecodeWorkerServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        loop: EngineLoop,
        handoff: DecodeHandoff,
        options: DecodeServiceOptions,
        gate: RoleGate | None = None,
    ):
        """gate: the worker's role (worker_common/role.py), None for a worker that only decodes."""
        self.gate = gate
        self.loop = loop
        self.handoff = handoff
        self.options = options
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._colocated_queries = self._colocated_hits = 0  # prefix cache, colocated requests
        # run_prefill Reserves refused for holding fewer cached tokens than min_cached_tokens
        self.stale_hints = 0
        self.embed_calls = 0  # Embed calls served (colocated embeddings)
        self.fetch_served_blocks = self.fetch_served_bytes = 0  # FetchKV: what it served
        self._fingerprint: str | None = None  # kvtransfer/peer.py engine_fingerprint, once
        self.tracing = None  # protos/tracing.py Tracing: this worker's spans (None: off)
        loop.every(1.0, self._forget_finished)

    # ---- Reserve --------------------------------------------------------------------------------
    def Reserve(self, request, context):
        """Refused UNAVAILABLE while this worker does not serve decode (a role flip)."""
        gate = self.gate
        with gate.admitted("decode", context) if gate else contextlib.nullcontext():
            return self._reserve(request, context)

    def _reserve(self, request, context):
        rid = request.request_id
        config = self.loop.engine.config
        vocab = self.loop.engine.model_config.vocab_size
        refusal = (
            check_id("request_id", rid)
            or check_token_ids(
                "prompt_token_ids", request.prompt_token_ids, config.max_model_len, vocab
            )
            or check_sampling(request.sampling, config.max_model_len, vocab)
            or check_context(len(request.prompt_token_ids), request.sampling, config.max_model_len)
            or check_stream_interval(request.stream_interval)
            or check_pixel_values(request.images)
        )
        if refusal:
            refusal.abort(context)
        params = build_params(
            request.sampling, context, getattr(self.loop.engine, "grammars", None)
        )
        # each output carries only what is new (a long stream's would copy every token so far
        # each step); the router detokenizes, so text is made here only for stop strings
        params = params.with_output(RequestOutputKind.DELTA, detokenize=bool(params.stop))
        lora = adapter_of(self.loop.engine, request.lora_name, context)
        stream = _Stream(n=params.n, prompt_logprobs=params.prompt_logprobs, reserved_ns=unix_ns())
        if request.stream_interval > 1:
            stream.interval = Interval(request.stream_interval)
        if self.tracing is not None:
            stream.trace = tracing.extract(context.invocation_metadata())
        with self._lock:
            if rid in self._streams:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in use"
                )
            self._streams[rid] = stream
        if request.run_prefill:
            return self._run_here(rid, request, params, stream, context, lora)
        # capped: a stranger's (or a bug's) 49-day lease would hold blocks that long
        lease_ms = min(request.lease_ms or self.options.default_lease_ms, self.options.max_lease_ms)
        try:
            reserved = self.handoff.reserve(
                rid,
                list(request.prompt_token_ids),
                params,
                self._on_output(stream),
                lease_s=lease_ms / 1000,
                priority=engine_priority(request.priority, request.share_tag),
                images=pixel_values(request.images),
                **({} if lora is None else {"lora_request": lora}),
            )
        except BaseException as e:
            with self._lock:
                self._streams.pop(rid, None)
            refuse_aborted(context, e)
            abort_for_engine_error(context, e)
            raise
        return worker_pb2.ReserveResponse(
            request_id=rid,
            block_ids=reserved.block_ids,
            block_size=reserved.block_size,
            num_cached_tokens=reserved.num_cached_tokens,
            endpoint=self._endpoint(rid),
            lease_deadline_unix_ns=unix_ns() + lease_ms * 1_000_000,
            lora_hash=lora.content_hash if lora is not None else b"",
        )

    def _endpoint(self, rid: str) -> worker_pb2.KVEndpoint:
        """Where a prefill worker pushes the reservation of `rid`: this worker's KV channel, or
        on "auto" each backend it offers, with the reservation's write grant."""
        endpoint = worker_pb2.KVEndpoint(
            backend=self.options.kv_backend,
            address=self.options.kv_address,
            layout_fingerprint=self.handoff.layout.fingerprint,
            tp_size=self.options.tp_size,
            write_grant=self.handoff.grant_for(rid),
            locality=self.options.kv_locality,
        )
        for backend, address, where, host, cross_host_rank in self.options.kv_offers:
            endpoint.offers.add(
                backend=backend,
                address=address,
                layout_fingerprint=endpoint.layout_fingerprint,
                tp_size=endpoint.tp_size,
                locality=where,
                host=host,
                cross_host_rank=cross_host_rank,
                write_grant=endpoint.write_grant if backend in CLAIMING else "",
            )
        return endpoint

    def _run_here(self, rid: str, request, params, stream: _Stream, context, lora=None):
        """Colocated serving: the engine runs the prompt and the decode (chunked prefill inside
        continuous batching); the Stream call carries every token. With min_cached_tokens (the
        router sent the prompt here for the KV this worker holds), refused FAILED_PRECONDITION,
        before any work, when its prefix cache holds fewer of the prompt's leading tokens."""
        prompt, on_output = list(request.prompt_token_ids), self._on_output(stream)
        try:
            held = self.loop.call(
                self._add_if_held,
                rid,
                prompt,
                params,
                on_output,
                request.min_cached_tokens,
                engine_priority(request.priority, request.share_tag),
                lora,
                pixel_values(request.images),
            )
        except BaseException as e:
            with self._lock:
                self._streams.pop(rid, None)
            refuse_aborted(context, e)
            abort_for_engine_error(context, e)
            raise
        if held is not None:
            with self._lock:
                self._streams.pop(rid, None)
                self.stale_hints += 1
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale cache hint: this worker holds {held[0]} of the {held[1]} leading prompt "
                f"tokens the router expected (evicted since); nothing was computed",
            )
        stream.colocated = True
        with self._lock:
            self._colocated_queries += len(request.prompt_token_ids)
        # no blocks are reserved ahead, but the router charges the prompt's blocks to this worker
        # until its next health check reads the real count: it needs the block size for that
        return worker_pb2.ReserveResponse(
            request_id=rid, block_size=self.loop.engine.block_manager.block_size
        )

    def _add_if_held(
        self,
        rid: str,
        prompt: list[int],
        params,
        on_output,
        want: int,
        priority: int = 0,
        lora=None,
        images=None,
    ):
        """On the loop thread, so that no step evicts between the look and the add: adds the
        request when the prefix cache (or its host tier) holds at least `want` of its leading
        tokens (at most what the engine would take from it: all but the last prompt token, in
        whole blocks; want 0: always), else returns (held, wanted) and adds nothing. images: a
        vision-language prompt's, which key its cached blocks (engine.cache_ids). Raises
        AbortedEarly for an id the router aborted already (worker_common/early_aborts.py)."""
        if self.handoff is not None:
            self.handoff.refuse_if_aborted(rid)
        engine = self.loop.engine
        if want:
            bm = engine.block_manager
            usable = len(prompt) - 1
            wanted = min(want, usable - usable % bm.block_size)
            # in the cache or its host tier: a tier block is restored at the admission, which
            # may have to wait for a free block (engine/kv_host_tier.py)
            salt = "" if params is None else params.cache_salt  # as the engine roots it
            root = chain_root(None if lora is None else lora.cache_root, salt)
            keyed = prompt if images is None else engine.cache_ids(prompt, images)
            held = bm.held_prefix_tokens(keyed, usable, root)
            if held < wanted:
                return held, wanted
        engine.add_request(
            rid,
            prompt,
            params,
            priority=priority,
            images=images,
            **({} if lora is None else {"lora_request": lora}),
        )
        self.loop.watch(rid, on_output)
        return None

    @staticmethod
    def _on_output(stream: _Stream):
        def on_output(out: RequestOutput) -> None:  # on the loop thread: cheap
            if out.finished:
                stream.finished_at = time.monotonic()
            if stream.interval is None:
                stream.outputs.put(out)
            else:
                due = stream.interval.take(out)
                if not due:
                    return
                for held in due:
                    stream.outputs.put(held)
            notify = stream.notify
            if notify is not None:  # read by a Streams call
                notify()

        return on_output

    # ---- Stream, Streams ------------------------------------------------------------------------
    def _attach(self, rid: str) -> tuple[_Stream | None, grpc.StatusCode | None, str]:
        """The reserved request `rid`'s queue, now read by the caller; else why not."""
        refusal = check_id("request_id", rid)
        if refusal:
            return None, refusal.code, refusal.message
        with self._lock:
            stream = self._streams.get(rid)
            if stream is None:
                return (
                    None,
                    grpc.StatusCode.NOT_FOUND,
                    f"no request {rid!r} on this decode worker (never reserved, or forgotten)",
                )
            if stream.attached:
                return (
                    None,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"request {rid!r} is already being streamed by another call",
                )
            stream.attached = True
        return stream, None, ""

    def _reader(self, stream: _Stream) -> EventReader:
        return EventReader(
            stream.n, stream.colocated, stream.prompt_logprobs, self.options.worker_id
        )

    def _take(self, reader: EventReader, outs) -> list[worker_pb2.TokenEvent]:
        events = reader.take(outs)  # (ValueError: the caller's to report)
        if reader.finished and reader.colocated:
            with self._lock:
                self._colocated_hits += reader.cached_tokens
        return events

    def _release(self, rid: str, stream: _Stream, reader: EventReader) -> None:
        """The request is no longer read: forgotten here, traced, and aborted when its events
        did not all go out (its reader went away)."""
        stream.notify = None
        with self._lock:
            self._streams.pop(rid, None)
        if self.tracing is not None and stream.trace is not None:
            self._trace(rid, stream, reader)
        if not reader.finished:  # the client went away: free the request now, not at its end
            log.info("stream of %s ended early; aborting it", rid)
            try:
                self.handoff.abort(rid, "the stream client went away")
            except Exception:
                log.exception("abort of %s after its stream ended failed", rid)

    def Stream(self, request, context):
        rid = request.request_id
        stream, code, details = self._attach(rid)
        if stream is None:
            context.abort(code, details)
        reader = self._reader(stream)
        try:
            while not reader.finished:
                if not context.is_active():
                    return
                try:
                    outs = drain(stream.outputs, stream.outputs.get(timeout=self.options.poll_s))
                except queue.Empty:
                    continue
                try:
                    events = self._take(reader, outs)
                except ValueError as e:
                    context.abort(grpc.StatusCode.INTERNAL, f"prompt logprobs: {e}")
                yield from events
        finally:
            self._release(rid, stream, reader)

    def Streams(self, request_iterator, context):
        """Many requests' events on one call (DecodeWorker.Streams): a round per wake-up of
        its connection, each ready request's news in one StreamsResponse (decode_worker/
        streams.py)."""
        conn = Connection()
        threading.Thread(
            target=self._read_requests,
            args=(request_iterator, conn),
            name=f"{self.options.worker_id}-streams-in",
            daemon=True,
        ).start()
        readers: dict[str, tuple[_Stream, EventReader]] = {}
        input_done = False
        try:
            while context.is_active() and not (input_done and not readers):
                news, ready = conn.wait(self.options.poll_s)
                response = worker_pb2.StreamsResponse()
                for kind, rid, what in news:
                    input_done |= kind == "input_done"
                    self._apply_news(kind, rid, what, conn, readers, response)
                    if kind == "attach":
                        ready.add(rid)  # what queued before it was attached goes this round
                for rid in ready:
                    self._send_ready(rid, conn, readers, response)
                if response.requests:
                    yield response
        finally:
            for kind, rid, what in conn.close():  # attached, and never read
                if kind == "attach":
                    readers[rid] = (what, self._reader(what))
            for rid, (stream, reader) in readers.items():
                self._release(rid, stream, reader)

    def _read_requests(self, request_iterator, conn: Connection) -> None:
        """A Streams call's requests, on a thread of its own: each named request attached (or
        refused) and detached, as news for the handler; at most MAX_STREAMS_IDS a message. The
        news waiting for the handler is bounded (Connection.note waits past its bound), and a
        refused id is echoed cut to MAX_ID_CHARS; a detach of a longer id names no request."""
        try:
            for request in request_iterator:
                ids = len(request.attach) + len(request.detach)
                if ids > MAX_STREAMS_IDS:
                    conn.note(
                        "refuse",
                        "",
                        (
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"{ids} ids in one message; at most {MAX_STREAMS_IDS}",
                        ),
                    )
                    continue
                for rid in request.attach:
                    stream, code, details = self._attach(rid)
                    if stream is None:
                        conn.note("refuse", rid[:MAX_ID_CHARS], (code, details))
                    elif not conn.note("attach", rid, stream):  # the call ended meanwhile
                        self._release(rid, stream, self._reader(stream))
                for rid in request.detach:
                    if len(rid) <= MAX_ID_CHARS:  # a longer one was never attached
                        conn.note("detach", rid)
        except grpc.RpcError:
            pass  # the call ended; the handler sees it too
        except Exception as e:  # a message that does not parse: no more are read
            log.info("a Streams call's requests ended: %s", e)
        finally:
            conn.note("input_done", "")

    def _apply_news(self, kind, rid, what, conn, readers, response) -> None:
        if kind == "attach":
            stream = what
            readers[rid] = (stream, self._reader(stream))
            stream.notify = conn.notifier(rid)
        elif kind == "refuse":
            code, details = what
            response.requests.add(request_id=rid, end=True, error_code=code.value[0], error=details)
        elif kind == "detach" and rid in readers:
            stream, reader = readers.pop(rid)
            self._release(rid, stream, reader)

    def _send_ready(self, rid: str, conn: Connection, readers, response) -> None:
        """A ready request's news into `response`; one whose events are all out, or that
        failed, leaves the call."""
        entry = readers.get(rid)
        if entry is None:
            return  # detached, or done already
        stream, reader = entry
        outs = drain(stream.outputs)
        if not outs:
            return
        item = response.requests.add(request_id=rid)
        try:
            item.events.extend(self._take(reader, outs))
        except ValueError as e:
            item.error_code = grpc.StatusCode.INTERNAL.value[0]
            item.error = f"prompt logprobs: {e}"
            reader.finished = False  # its events did not all go out: _release aborts it
        if reader.finished or item.error:
            item.end = True
            del readers[rid]
            self._release(rid, stream, reader)
        elif not stream.outputs.empty():  # more than one round's worth was queued
            conn.ready(rid)

    def _trace(self, rid, stream: _Stream, reader: EventReader) -> None:
        """This worker's spans of the request, from its stamps, under the router's span: the
        decode (commit, or the stream's first token, to now, with the commit as an event)
        and, for a hand-off, the KV receipt (Reserve to the last frame), linked to the prefill
        span its frames named."""
        t, now = self.tracing, unix_ns()
        timings, first_token_ns = reader.timings, reader.first_token_ns
        colocated = stream.colocated
        start = (
            stream.reserved_ns if colocated else (timings.commit_unix_ns or first_token_ns or now)
        )
        span = t.emit(
            "decode (local prefill)" if colocated else "decode",
            stream.trace,
            start,
            now,
            {
                "pdserve.request_id": rid,
                "pdserve.decode_worker": self.options.worker_id,
                "gen_ai.usage.completion_tokens": sum(reader.sent.values()),
                "pdserve.finished": reader.finished,
            },
            # the engine took the first tokens: the request runs in the batch from there
            events=(("commit", timings.commit_unix_ns),),
        )
        if span is not None and timings.transfer_end_unix_ns:
            t.emit(
                "kv.receive",
                stream.trace,
                stream.reserved_ns,
                timings.transfer_end_unix_ns,
                {"pdserve.kv_backend": self.options.kv_backend},
                links=(tracing.context_of(timings.sender_traceparent),),
            )

    # ---- Abort, Stats ---------------------------------------------------------------------------
    # ---- Embed (colocated) ----------------------------------------------------------------------
    def Embed(self, request, context):
        """Refused UNAVAILABLE while this worker does not serve decode (a role flip)."""
        gate = self.gate
        with gate.admitted("decode", context) if gate else contextlib.nullcontext():
            remaining = context.time_remaining()
            budget = 60.0 if remaining is None else max(0.0, remaining - 0.05)
            reply = run_embed(self.loop, request, context, budget)
        with self._lock:
            self.embed_calls += 1
            self._colocated_queries += sum(len(p.ids) for p in request.prompts)
            self._colocated_hits += reply.num_cached_tokens
        return reply

    # ---- LoRA adapters at run time (worker_common/lora.py) ---------------------------------------
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
        return worker_pb2.WorkerAbortResponse(
            found=self.handoff.abort(request.request_id, "aborted by the router")
        )

    # ---- peer fetch ---------------------------------------------------------------------------
    def FetchKV(self, request, context):
        """The KV of a live reservation's cached prefix blocks, for the prefill worker that fills
        it (kvtransfer/peer.py). Every field is checked before any work; the reservation must
        still be live and the range inside its cached prefix. Blocks are read FETCH_BATCH at a
        time on the engine loop, and the stream stops before passing max_bytes. A hybrid model's
        blocks go only through the last one a kept state follows, that state on the last
        (FetchKVBlock.state): none at all where no state follows any."""
        refuse_if_broken(self.loop, context)
        rid = request.request_id
        refusal = check_id("request_id", rid)
        if refusal:
            refusal.abort(context)
        if not fetch_supported(self.loop.engine):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "peer fetch is not served by a worker with pipeline stages",
            )
        if not 1 <= request.num_blocks <= MAX_FETCH_BLOCKS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_blocks must be in [1, {MAX_FETCH_BLOCKS}], got {request.num_blocks}",
            )
        if request.max_bytes < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_bytes must be >= 1")
        held = self.handoff.cached_prefix_blocks(rid)
        if held is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no live reservation {rid!r} here (committed, aborted or expired)",
            )
        if request.first_block + request.num_blocks > held:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {request.first_block}..{request.first_block + request.num_blocks - 1} "
                f"are not all in reservation {rid!r}'s cached prefix of {held} blocks",
            )
        fp = self._fingerprint
        if fp is None:
            fp = self._fingerprint = engine_fingerprint(self.loop.engine)
        sent, end = 0, request.first_block + request.num_blocks
        state = None  # a hybrid's: (the block it follows, its bytes)
        if self.loop.engine.block_manager.kept_states is not None:
            state = self.handoff.read_state(rid, request.first_block, end)
            if state is None:  # (its blocks would be of no use without one)
                return
            end = state[0] + 1
        for first in range(request.first_block, end, FETCH_BATCH):
            blocks = self.handoff.read_cached(rid, first, min(FETCH_BATCH, end - first))
            if blocks is None:  # the reservation ended meanwhile: the receiver computes the rest
                context.abort(grpc.StatusCode.NOT_FOUND, f"reservation {rid!r} ended")
            for index, h, data in blocks:
                if sent + len(data) > request.max_bytes or not context.is_active():
                    return
                key = hash_bytes(h)
                sent += len(data)
                with self._lock:
                    self.fetch_served_blocks += 1
                    self.fetch_served_bytes += len(data)
                block = worker_pb2.FetchKVBlock(
                    index=index,
                    block_hash=key,
                    data=data,
                    digest=digest(key, data),
                    layout_fingerprint=fp,
                )
                if state is not None and index == state[0]:
                    block.state, block.state_digest = state[1], digest(key, state[1])
                yield block
            if len(blocks) < min(FETCH_BATCH, end - first):
                return

    def Stats(self, request, context):
        refuse_if_broken(self.loop, context)  # the router takes it down; work goes elsewhere
        h = self.handoff
        unhealthy = h.unhealthy
        if unhealthy and context is not None:  # the same, while a KV write may land past its bound
            context.abort(grpc.StatusCode.UNAVAILABLE, f"this worker is unhealthy: {unhealthy}")
        stats = worker_pb2.WorkerStats(
            worker_id=self.options.worker_id,
            **self.loop.load(),
            num_reserved=h.num_reserved,
            prefix_cache_queries=h.prefix_cache_queries + self._colocated_queries,
            prefix_cache_hits=h.prefix_cache_hits + self._colocated_hits,
            num_preemptions=getattr(self.loop.engine.scheduler, "num_preemptions", 0),
            **_grammar_stats(self.loop.engine),
            **_spec_stats(self.loop.engine),
            kv_transfers=h.num_committed,
            kv_transfer_failures=h.num_failed,
            kv_transfer_bytes=h.bytes_received,
            leases_expired=h.num_expired,
            **tier_stats(self.loop.engine.block_manager),
            **worker_lora.stats(self.loop.engine),
            **worker_weights.stats(self.loop.engine),
            **worker_sleep.stats(self.loop.engine),
            peer_fetch_served_blocks=self.fetch_served_blocks,
            peer_fetch_served_bytes=self.fetch_served_bytes,
        )
        events = kv_events(self.loop.engine.block_manager, request)
        if events is not None:  # the router's block index (router/kv_index.py)
            stats.kv_events.CopyFrom(events)
        return self.gate.stamp(stats) if self.gate else stats

    def _forget_finished(self) -> None:
        cutoff = time.monotonic() - self.options.finished_ttl_s
        with self._lock:
            stale = [
                rid
                for rid, s in self._streams.items()
                if not s.attached and s.finished_at is not None and s.finished_at < cutoff
            ]
            for rid in stale:
                del self._streams[rid]
