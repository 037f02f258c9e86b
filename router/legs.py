"""The worker side of a Generate call, in legs. A leg is one reservation on one decode worker, the
prefill that fills it and the token stream it produces. A call (router/call.py) runs one leg, or
more when it resumes; the resume rules: router/call.py.

A leg's lifecycle: Reserve (the decode worker with the fewest blocks in use, less the blocks of the
prompt it probably holds already: a conversation's earlier turns, router/pool.py; colocated, or a
prompt the decode worker prefills itself (planner/local_prefill.py), the fewest prompt tokens
charged to it until their first token; the next one when full; when every one is full, a
wait in the router's decode queue (router/decode_queue.py), in priority order, then by share tag
(router/admission.py: a tenant holding fewer slots first), first come first served within equal
keys, until blocks free) -> its request attached to the worker's one Streams call (router/decode_streams.py; the worker queues tokens from the Reserve on) -> Prefill on an
executor thread, which ends when the prefill worker answers, when the client's deadline passes or
it cancels, or when the pool drops the worker (router/open_legs.py cancels the call: UNAVAILABLE,
retried once on another prefill worker into the same reservation); no fixed bound cuts a long
prefill that is making progress, since the pool judges the worker by its progress. Any other
failure aborts the reservation, which ends the stream -> token events into the call's text streams until every
sequence's final event, or the stream fails (or is cancelled because the pool dropped its
worker: router/open_legs.py). A leg the call lets go of gets its Abort calls from the router's
abort threads, never from the router's event loop. Between events, a driven call's steps run on
that loop (router/stepping.py): what may block in a leg's stream first yields OFF_LOOP.
A leg sent to its decode worker for the conversation it holds says how many leading tokens the
router expects held there (ReserveRequest.min_cached_tokens); a worker that evicted them refuses
before any work (StaleHint), and the same leg reserves again for the prefill pool. A leg whose
prefill goes to the prefill pool while its decode worker holds a cached prefix asks the prefill
worker to pull it from there when that is estimated faster than recomputing it (peer fetch:
router/peer_fetch.py, PrefillRequest.peer_fetch); the trace says which.
Each leg has its own worker-side request id, minted here: the client's request_id never reaches
a worker, so no client can name another's request to one.

What a call shares with the threads that run its legs is defined here too: Inflight (the call's
state that the cancel callback, the prefill threads and the stream readers all read; a
ClientCall is one), Leg (one attempt: a Leg per start and per resume, alive until the call lets
go of it) and the two errors a leg raises, RouterStatus (a failure the router found itself,
shaped like a worker's status) and LegFailed (a leg that could not start). Fields that several
threads write are under Inflight.lock.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from concurrent import futures

import grpc

from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos import tracing
from pdserve.protos.convert import engine_priority, unix_ns
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router import stepping
from pdserve.router.affinity import cache_namespace
from pdserve.router.decode_queue import DECODE_QUEUE_POLL_S, DecodeFull, DecodeQueue
from pdserve.router.decode_streams import DecodeStreams, StatusError
from pdserve.router.open_legs import OpenLegs
from pdserve.router.peer_fetch import PeerFetch, PeerFetchCost
from pdserve.router.pool import NoWorker, WorkerPool
from pdserve.router.text import TextStream

log = logging.getLogger(__name__)


ABORT_THREADS = 4  # concurrent worker Abort calls; a burst of cancellations queues
# A prefill worker answers an Abort once its engine let go of the request, after the step under
# way: this long covers a long prompt's chunk on a small CPU; one that takes longer is presumed
# hung, and the decode side is aborted anyway (`Legs.abort`)
PREFILL_ABORT_TIMEOUT_S = 10.0
# a worker that did not answer an Abort is asked again this often, this many times (~5 minutes)
ABORT_RETRY_S, ABORT_TRIES = 5.0, 60


# ---- what a call shares with its legs' threads ---------------------------------------------
class RouterStatus(StatusError):
    """A failure the router found itself, shaped like a worker's RpcError for the same handling."""


class LegFailed(Exception):
    """A leg could not start; the call ends with `error` (a worker's or the router's status)."""

    def __init__(self, error: grpc.RpcError | None, who: str):
        super().__init__(who)
        self.error, self.who = error, who


class StaleHint(Exception):
    """A decode worker refused a Reserve to prefill a prompt itself because it holds fewer of the
    prompt's leading tokens than the router expected (min_cached_tokens): evicted since."""

    def __init__(self, worker, error: grpc.RpcError):
        super().__init__(error.details())
        self.worker, self.error = worker, error


class Inflight:
    """What a call shares with its legs' threads and the cancel callback (router/call.py's
    ClientCall is the call itself); fields shared across threads go under `lock`."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.priority = 0  # the client's (GenerateRequest.priority): every queue's order
        # its start tag in its tenant's fair share (router/admission.py Ticket.tag): every queue's
        # order within equal priorities, sent with Reserve and Prefill
        self.share_tag = 0
        self.lock = threading.Lock()
        self.leg: Leg | None = None  # the reservation and streams now running
        self.dead_decodes: list = []  # decode workers that failed this request: not again
        self.cancelled = False  # the client went away
        self.abort_requested = False  # PDServe.Abort for this id
        self.finished = False  # ended normally or already cleaned up
        self.first_token_ns = 0  # when the router got the first token
        self.token_clock: dict[int, int] = {}  # sequence index -> unix ns of its last tokens
        self.span = None  # the request's trace span, open until it ends (protos/tracing.py)
        self.lora = ""  # the LoRA adapter it runs under (router/lora.py); "": the base model
        self.images = None  # a chat's images (router/images.py PromptImages), None: text only


def keyed_ids(leg, tokens) -> list[int]:
    """`tokens` as the workers' prefix caches hash them: a chat's images key their tokens
    (router/images.py), so that the KV index and prefix affinity tell two images apart."""
    return tokens if leg.images is None else leg.images.keyed(tokens)


class Leg:
    """Leg `number` of a call, with a worker-side id of its own (the module docstring)."""

    def __init__(self, number: int):
        self.number = number
        self.request_id = uuid.uuid4().hex  # what the workers know this leg by
        self.priority = 0  # its call's (Inflight.priority), sent with Reserve and Prefill
        self.share_tag = 0  # its call's (Inflight.share_tag), sent with them too
        self.images = None  # its call's images (Inflight.images), sent with Reserve and Prefill
        self.decode = None  # pool worker holding the reservation
        self.reservation = None
        self.stream_call = self.prefill_call = None  # the calls open on the workers
        self.reserve_call = self.reserving = None  # a Reserve in flight, and its worker
        self.prefill = None  # pool worker running (or last running) the prefill
        self.charged_tokens = (
            0  # colocated: prompt tokens charged to `decode` until the first token
        )
        self.prefill_future: futures.Future | None = None
        self.prefill_error: grpc.RpcError | None = None
        self.decode_lost = False  # the prefill could not reach the decode worker to abort
        self.lost_why = self.prefill_lost = ""  # the pool dropped the decode / prefill worker
        self.moved = False  # its worker was flipped to another role (router/flips.py): no death
        self.local = False  # its decode worker prefills it too (colocated, or local_prefill.py)
        # decode worker -> the leading prompt tokens it probably holds (router/pool.py)
        self.held: dict = {}
        # local because this decode worker holds `expected` leading tokens (not colocated): its
        # Reserve says so (min_cached_tokens), and a worker holding fewer refuses (StaleHint)
        self.expect_worker, self.expected = None, 0
        # the request's trace context for its calls to workers: {"metadata": ...}, {} when off
        self.trace: dict = {}
        # time.monotonic(): the decode stream's last event (or opening), the last Prefill sent
        self.heard = self.prefill_sent = 0.0
        # unix ns: Reserve started and succeeded, the (last) Prefill call sent (Timings)
        self.reserve_start_ns = self.reserved_ns = self.prefill_dispatch_ns = 0
        self.ended = threading.Event()  # superseded by the next leg: its prefill stops retrying
        self.lora = ""  # the call's LoRA adapter (Inflight.lora), on both legs' worker calls
        # the namespace of its prefix affinity: the adapter, and the request's cache salt (its
        # KV is shared only within both: router/affinity.py cache_namespace)
        self.cache_ns = ""
        self.num_blocks = 0  # the KV blocks its Reserve holds on `decode` (pool.note_reserved)

    def unheld(self, worker, num_tokens: int) -> int:
        """Of a prompt's `num_tokens`, those `worker` probably does not hold (the charges:
        router/pool.py's decode_order)."""
        return max(0, num_tokens - self.held.get(worker, 0))

    def prefill_reply(self):
        """The PrefillResponse if the prefill already succeeded, without waiting."""
        fut = self.prefill_future
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()


class Legs:
    """Starts, streams and ends legs on the workers of `pool`; `options` is the servicer's
    ServiceOptions."""

    def __init__(self, pool: WorkerPool, executor: futures.Executor, options):
        self.pool = pool
        self.executor = executor  # Prefill calls
        self.options = options
        self.tracing = None  # protos/tracing.py Tracing: the router's spans (None: off)
        self.decode_queue = DecodeQueue()
        self.on_tokens = None  # (req, sequence index, number of tokens): router/metrics.py
        self.on_local = None  # a leg prefilled on its decode worker: router/metrics.py
        self.on_joined = None  # (events): read joined, the router behind (router/decode_streams.py)
        # a decode worker refused a local prefill for a stale cache hint: router/metrics.py
        self.on_stale_hint = None
        # which prompts go local (planner/local_prefill.py); the planner may replace it
        self.local_prefill = getattr(options, "local_prefill", LocalPrefill())
        # whether a turn's prefill worker pulls the decode worker's cached prefix (peer fetch),
        # by estimated cost (router/peer_fetch.py)
        self.peer_fetch = PeerFetchCost(getattr(options, "peer_fetch", None) or PeerFetch())
        # (path "peer_fetch" | "recompute", the PrefillResponse or None): router/metrics.py
        self.on_reuse_path = None
        # worker Abort calls that must not wait on the thread that asks for them (gRPC callbacks)
        self._aborter = futures.ThreadPoolExecutor(ABORT_THREADS, thread_name_prefix="router-abort")
        self.open = OpenLegs(pool, self._run_later)  # cancels the calls on a dropped worker
        # each decode worker's one Streams call, which carries its legs' token events
        self._streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._streams_lock = threading.Lock()

    @property
    def reuse(self) -> bool:
        """Whether a conversation's turns go back to the decode worker holding the earlier ones
        (off where the decode workers keep no prefix cache: deploy/launcher.py)."""
        return self.local_prefill.reuse_max_new_tokens > 0

    def _prefill_here(self, prompt, leg: Leg) -> bool:
        """Whether the decode worker runs this prompt itself (planner/local_prefill.py): the
        least loaded one, or the one that holds most of it (leg.held: router/pool.py); for the
        latter, leg.expect_worker and leg.expected say so."""
        policy, held = self.local_prefill, leg.held
        holder = max(held, key=held.get) if held else None
        if not policy.enabled and holder is None:
            return False
        backlog = self.pool.prefill_backlog(prompt, leg.cache_ns)
        local = policy.choose(
            len(prompt),
            backlog,
            self.pool.decode_backlog(),
            streams=all(self._streams_on(w) for w in self.pool.decode),
        )
        if not local and holder is not None:
            local = policy.choose(
                len(prompt),
                self._backlog_with_fetch(prompt, leg, held[holder], backlog),
                self.pool.decode_backlog(holder),
                held[holder],
                streams=self._streams_on(holder),
            )
            if local:
                leg.expect_worker, leg.expected = holder, held[holder]
        if local and self.on_local is not None:
            self.on_local()
        return local

    def _streams_on(self, worker) -> bool:
        """Whether decode worker `worker` has streams running that a prompt prefilled there would
        run beside, in chunks (planner/local_prefill.py): a leg of this router has a call open on
        it. (Not its WorkerStats' running count: up to a sweep old, it would still count the
        previous turn of a conversation that sends its next one at once. Another router's
        streams are not seen.)"""
        return self.open.count(worker) > 0

    def _backlog_with_fetch(self, prompt, leg: Leg, held: int, backlog: int | None):
        """The prefill pool's backlog for a turn whose decode worker holds `held` leading tokens,
        when its prefill worker may pull them instead of computing them (router/peer_fetch.py):
        the new tokens, plus the fetch's estimated time in prefill tokens; `backlog` (without a
        fetch) when that is lower, peer fetch is off, or nothing is measured yet."""
        if backlog is None or not self.peer_fetch.settings.enabled:
            return backlog
        cost = self.peer_fetch.fetch_cost_tokens(held, self.pool.handoff_bandwidth())
        if cost is None:
            return backlog
        fetched = self.pool.prefill_backlog(prompt, leg.cache_ns, held=held)
        return backlog if fetched is None else min(backlog, fetched + int(cost))

    def _fetch_for(self, req: Inflight, leg: Leg, prompt, prefill_held: int):
        """The Prefill call's PeerFetch when its prefill worker (probably holding `prefill_held`
        leading tokens) should pull the reservation's cached prefix from the decode worker, by
        estimated cost (router/peer_fetch.py); None to recompute. Says which in the trace."""
        res = leg.reservation
        if res is None or leg.decode is None or res.num_cached_tokens == 0:
            return None
        fetch, why = self.peer_fetch.choose(
            len(prompt), res, prefill_held, self.pool.handoff_bandwidth()
        )
        if why["pdserve.decode_held_tokens"] == 0:
            return None  # not a whole block to pull
        tracing.event(getattr(req, "span", None), "peer_fetch" if fetch else "recompute", why)
        if not fetch:
            if self.on_reuse_path is not None:
                self.on_reuse_path("recompute", None)
            return None
        return self.peer_fetch.request(leg.decode.address)

    def remember(self, leg: Leg, tokens: list[int], prompt_len: int | None = None) -> None:
        """`leg`'s decode worker holds the KV of `tokens` (its prompt; once it ended, its prompt
        and answer, with `prompt_len` the prompt's length) in its prefix cache: the next turn of
        the conversation may go back there."""
        if self.reuse and leg.decode is not None:
            self.pool.remember_decoded(
                leg.decode,
                keyed_ids(leg, tokens),
                leg.cache_ns,
                prompt_len=prompt_len,
                local=leg.local,
            )

    def _run_later(self, fn) -> None:
        try:
            self._aborter.submit(fn)
        except RuntimeError:  # the router is stopping
            log.debug("router stopping: %s not run", fn)

    def close(self) -> None:
        """Drops the Abort calls not yet begun and waits for those under way (each bounded by
        abort_timeout_s), so that they reach their workers before the router closes the
        channels, rather than fail on a closed one."""
        self._aborter.shutdown(wait=True, cancel_futures=True)

    def abort_later(self, leg: Leg, cancel_stream: bool = False) -> None:
        """Aborts `leg` on its workers from the abort threads (and cancels its decode stream);
        returns at once."""

        def run():
            self.abort(leg, cancel_stream)

        try:
            self._aborter.submit(run)
        except RuntimeError:  # the router is stopping; the workers' leases free the blocks
            log.debug("router stopping: %s not aborted", leg.request_id)

    def start(self, req: Inflight, prompt, sampling, deadline: float, number: int) -> Leg | None:
        """Reserve, open the decode stream, start the prefill; None when the client already left.
        Raises LegFailed."""
        stepping.off_loop("a leg's start")
        if req.cancelled:  # nothing to start for a client that is gone (not even a Reserve)
            return None
        leg = Leg(number)
        leg.priority = req.priority
        leg.share_tag = getattr(req, "share_tag", 0)
        leg.lora = getattr(req, "lora", "")
        leg.images = getattr(req, "images", None)
        leg.cache_ns = cache_namespace(leg.lora, sampling.cache_salt)
        trace = tracing.metadata(getattr(req, "span", None))  # its trace, on every worker call
        leg.trace = {"metadata": trace} if trace else {}
        keyed = keyed_ids(leg, prompt)  # what the pool's indexes hash (images keyed)
        leg.held = self.pool.decode_usable(keyed, leg.cache_ns) if self.reuse else {}
        leg.local = self.options.colocated or self._prefill_here(keyed, leg)
        if leg.local and not self.options.colocated:  # the request's trace says where it ran
            tracing.event(
                getattr(req, "span", None),
                "local_prefill",
                {"pdserve.held_tokens": leg.expected, "pdserve.prompt_tokens": len(prompt)},
            )
        self.pool.note_started(0 if leg.local else len(prompt))  # the planner's demand
        leg.reserve_start_ns = unix_ns()
        try:
            leg.decode, leg.reservation = self._reserve(req, leg, prompt, sampling, deadline)
        except StaleHint as stale:
            # the holder evicted the blocks it was chosen for: the prompt goes to the prefill
            # pool as any other, and what the router believed of that worker goes
            log.info(
                "decode worker %s no longer holds the prompt's cached prefix (%s): request %s "
                "goes to the prefill pool",
                self.pool.name(stale.worker),
                stale.error.details(),
                req.request_id,
            )
            if self.on_stale_hint is not None:
                self.on_stale_hint()
            self.pool.forget_decoded(stale.worker)
            leg.held.pop(stale.worker, None)
            leg.local, leg.expect_worker, leg.expected = False, None, 0
            self.pool.note_started(len(prompt))
            leg.decode, leg.reservation = self._reserve(req, leg, prompt, sampling, deadline)
        leg.reserved_ns = unix_ns()
        self.remember(leg, prompt)  # held there once its KV is in (or prefilled there)
        leg.stream_call = self._streams_of(leg.decode).open(leg.request_id, deadline)
        with req.lock:
            req.leg = leg
            cancelled, abort_requested = req.cancelled, req.abort_requested
        if cancelled:  # the client left during Reserve: the callback did not know this leg yet
            leg.stream_call.cancel()
            self.abort(leg)
            self.release_charge(leg)
            return None
        leg.heard = time.monotonic()
        self.open.add(leg.decode, leg)  # until stream() ends
        if abort_requested:
            self.abort(leg)  # the stream ends with finish_reason "abort"
        if not leg.local:
            leg.prefill_future = self.executor.submit(
                self._prefill, req, leg, prompt, sampling, deadline
            )
        return leg

    def _streams_of(self, worker) -> DecodeStreams:
        """The worker's DecodeStreams (router/decode_streams.py), made when first needed."""
        with self._streams_lock:
            streams = self._streams.get(worker.stub)
            if streams is None:
                streams = self._streams[worker.stub] = DecodeStreams(
                    worker.stub, self.pool.name(worker), self.on_joined
                )
            return streams

    def stream(
        self,
        req: Inflight,
        leg: Leg,
        texts: list[TextStream],
        sent: list[list[int]],
        finish_of=None,
        indexes: list[int] | None = None,
    ):
        """Yields the client's responses for one leg's token events: sequence i's (the event's
        index, or indexes[index]) go through texts[i], their ids onto sent[i]. Returns (the final
        event of the sequence that ended last, or None; the stream's error or None). n>1: a
        sequence ending before the last yields `finish_of(its final event)` in place."""
        n, ended = len(indexes or texts), set()
        decoded = -sum(len(tokens) for tokens in sent)  # (the earlier legs' tokens: not this one's)
        try:
            for event in leg.stream_call:
                if stepping.is_pause(event):  # a driven step: to the driver (router/stepping.py)
                    yield event
                    continue
                leg.heard = time.monotonic()  # the worker answers (router/open_legs.py)
                if event.index >= n:  # never sent
                    continue
                i = event.index = indexes[event.index] if indexes else event.index
                if i in ended:  # the router already ended it (below)
                    continue
                if event.token_ids and not req.first_token_ns:
                    req.first_token_ns = unix_ns()
                if event.token_ids and self.on_tokens is not None:
                    self.on_tokens(req, i, len(event.token_ids))
                if event.token_ids and leg.charged_tokens:
                    self.release_charge(leg)
                sent[i].extend(event.token_ids)
                text = texts[i]
                is_final = event.HasField("finish_reason")
                # the stop token that ended it leaves its text out (TextStream.ended_by)
                stop_token = is_final and text.ended_by(event)
                piece = text.add(event.token_ids, stop_token) + (text.flush() if is_final else "")
                if event.token_ids or piece:
                    delta = pdserve_pb2.TokenDelta(
                        index=i,
                        token_ids=event.token_ids,
                        text=piece,
                        logprobs=event.logprobs,
                        top_logprobs=event.top_logprobs,
                    )
                    yield pdserve_pb2.GenerateResponse(request_id=req.request_id, delta=delta)
                if not is_final and text.stopped:
                    # a stop string across a resume point: the worker cannot see it. The last open
                    # sequence ends the leg; another (n>1) runs on there, its events dropped
                    if stepping.on_loop():
                        yield stepping.OFF_LOOP  # the Abort call blocks
                    if len(ended) == n - 1:
                        self.abort(leg)
                        leg.stream_call.cancel()
                    is_final = True
                    event = worker_pb2.TokenEvent(
                        index=i, finish_reason="stop", stop_str=text.stop_str
                    )
                if is_final:
                    if stepping.on_loop():
                        yield stepping.OFF_LOOP  # what follows a sequence's end may block
                    ended.add(i)
                    if len(ended) == n:
                        return event, None
                    yield finish_of(event)
        except grpc.RpcError as e:
            return None, e
        finally:
            self.open.remove(leg.decode, leg)
            self.release_charge(leg)
            self._note_freed(leg, decoded + sum(len(tokens) for tokens in sent))
            self.decode_queue.freed()  # the worker freed (or will free) this leg's blocks
        return None, None

    def _note_freed(self, leg: Leg, decoded: int) -> None:
        """The leg's stream ended after `decoded` tokens: its blocks (those reserved, and about
        one more per block of tokens decoded) count free on its worker from now
        (pool.note_freed), an estimate the worker's next Stats answer replaces."""
        block_size = leg.reservation.block_size if leg.reservation is not None else 0
        if leg.num_blocks and block_size:
            self.pool.note_freed(leg.decode, leg.num_blocks + decoded // block_size)

    def release_charge(self, leg: Leg) -> None:
        charged, leg.charged_tokens = leg.charged_tokens, 0
        if charged:
            self.pool.charge_queued(leg.decode, -charged)

    def retire(self, req: Inflight, leg: Leg) -> None:
        """Lets go of a leg whose decode worker died; the next leg avoids that worker."""
        leg.ended.set()
        with req.lock:
            req.dead_decodes.append(leg.decode)
            req.leg = None
        self.abort_later(leg)  # not inline: a dead worker's Abort may take its whole timeout

    def abort(self, leg: Leg, cancel_stream: bool = False) -> bool:
        """Aborts `leg` on its workers, the prefill worker first: its Abort returns once its
        engine let go of the request, and until then a prefill step under way still pushes KV
        into the reservation (in place, on the shm and CUDA IPC backends), whose blocks the
        decode worker hands to other requests once it frees them. Then the decode stream (when
        `cancel_stream`) and the decode worker's Abort, which frees the reservation. A prefill
        worker that has not seen the request yet remembers the Abort and refuses its Prefill
        (worker_common/early_aborts.py); one the Abort cannot reach is left to its call's
        deadline."""
        stepping.off_loop("an Abort call")
        # a Prefill call that ended pushes nothing more: answered, or failed and aborted in
        # `_prefill` before it ended
        done = leg.prefill_future is not None and leg.prefill_future.done()
        found = not done and self._abort_prefill(leg)
        if cancel_stream:
            leg.stream_call.cancel()
        if leg.decode is not None:
            found |= call_abort(leg.decode.stub, leg.request_id, self.options.abort_timeout_s)
        return found

    def _abort_prefill(self, leg: Leg) -> bool:
        """Aborts `leg` on its prefill worker (if it has one), waiting out the worker's step."""
        if leg.prefill is None:
            return False
        timeout = max(self.options.abort_timeout_s, PREFILL_ABORT_TIMEOUT_S)
        return call_abort(leg.prefill.stub, leg.request_id, timeout)

    def _reserve(self, req: Inflight, leg: Leg, prompt, sampling, deadline: float):
        """(decode worker, ReserveResponse). Disaggregated, when every decode worker's KV is full
        the request waits for blocks in the router's decode queue (priority order, then first
        come), as an engine's waiting queue would hold it, until its deadline or the queue timeout; a
        request that arrives while others wait queues behind them."""
        queue = self.decode_queue
        priority = engine_priority(req.priority, getattr(req, "share_tag", 0))
        ticket = queue.join(priority=priority) if queue.waiting() and not leg.local else None
        since = time.monotonic()
        try:
            while True:
                if ticket is not None:
                    self._wait_turn(req, ticket, since, deadline)
                try:
                    return self._reserve_once(req, leg, prompt, sampling, deadline)
                except DecodeFull:
                    if ticket is None:
                        ticket = queue.join(first=True, priority=priority)
                    # blocks free as streams end (freed() wakes the head) or by a lease running out
                    queue.wait_for_blocks(min(DECODE_QUEUE_POLL_S, left(deadline)))
        finally:
            if ticket is not None:
                queue.leave(ticket)

    def _wait_turn(self, req: Inflight, ticket, since: float, deadline: float) -> None:
        """Until `ticket` heads the decode queue; LegFailed when the client left, the deadline
        passed or the wait reached options.decode_queue_timeout_s."""
        queue = self.decode_queue
        while True:
            waited = time.monotonic() - since
            if req.cancelled:
                raise LegFailed(
                    RouterStatus(
                        grpc.StatusCode.CANCELLED, "cancelled while waiting for decode KV blocks"
                    ),
                    "router",
                )
            if req.abort_requested:
                raise LegFailed(
                    RouterStatus(
                        grpc.StatusCode.ABORTED,
                        "aborted (PDServe.Abort) while waiting for decode KV blocks",
                    ),
                    "router",
                )
            if time.monotonic() >= deadline:
                raise LegFailed(
                    RouterStatus(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"deadline passed after {waited:.1f} s waiting for decode KV blocks",
                    ),
                    "router",
                )
            if waited >= self.options.decode_queue_timeout_s:
                raise LegFailed(
                    RouterStatus(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"decode pool full: waited {waited:.0f} s for KV blocks with {queue.waiting()} "
                        f"requests queued; retry later, or add decode workers or KV cache memory",
                    ),
                    "decode worker",
                )
            if queue.head(ticket, timeout=min(DECODE_QUEUE_POLL_S, left(deadline))):
                return

    def _reserve_once(self, req: Inflight, leg: Leg, prompt, sampling, deadline: float):
        """One pass over the decode workers, the least loaded first (WorkerPool.decode_order). Raises DecodeFull when every
        worker that answered had no room (and one did), LegFailed for anything else."""
        # colocated: the worker prefills the prompt itself, its load until the first token; charged
        # to the first choice at the pick (concurrent arrivals must see it), moved on a fallback
        charge = len(prompt) if leg.local else None
        # disaggregated: the prompt's blocks, charged to the first choice until its Reserve ends,
        # so that a burst of picks made before any Reserve answers spreads out
        reserving = 0 if leg.local else len(prompt)
        try:
            workers = self.pool.decode_order(
                exclude=req.dead_decodes,
                charge_tokens=charge,
                reserve_tokens=reserving,
                matched=leg.held,
                adapter=leg.cache_ns,
            )
        except NoWorker as e:
            message = str(e)
            if req.dead_decodes:
                dead = ", ".join(self.pool.name(w) for w in req.dead_decodes)
                message = (
                    f"decode worker {dead} failed while streaming request {req.request_id!r} "
                    f"and no other decode worker is available to resume it; retry when one is"
                )
            raise LegFailed(
                RouterStatus(grpc.StatusCode.UNAVAILABLE, message), "decode worker"
            ) from None
        # the reservation must outlive the wait for its prefill's first KV (queued behind other
        # prompts on a busy pool, however long the client lets it): asked for until the client's
        # deadline (the decode worker cuts it to its max_lease_ms), and renewed by every KV frame
        # (decode_worker/handoff.py), so it runs out only after the prefill side has been silent
        # for its length. A failed prefill is aborted explicitly; the lease frees what a router
        # that died itself, or a prefill worker that went silent, left behind
        lease_ms = max(self.options.lease_ms, int(left(deadline) * 1000))
        if charge:
            leg.decode, leg.charged_tokens = workers[0], leg.unheld(workers[0], charge)
        try:
            return self._reserve_pass(workers, leg, prompt, sampling, deadline, lease_ms, charge)
        finally:
            if reserving:
                self.pool.end_reserve(workers[0], leg.unheld(workers[0], reserving))

    def _reserve_pass(self, workers, leg: Leg, prompt, sampling, deadline, lease_ms, charge):
        """_reserve_once's Reserve calls, `workers` in order."""
        error, full = None, False
        for worker in workers:
            if charge and worker is not leg.decode:
                self.release_charge(leg)
                self.pool.charge_queued(worker, leg.unheld(worker, charge))
                leg.decode, leg.charged_tokens = worker, leg.unheld(worker, charge)
            try:
                reservation = self._reserve_on(
                    worker,
                    leg,
                    worker_pb2.ReserveRequest(
                        request_id=leg.request_id,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        lease_ms=lease_ms,
                        run_prefill=leg.local,
                        min_cached_tokens=leg.expected if worker is leg.expect_worker else 0,
                        priority=leg.priority,
                        share_tag=leg.share_tag,
                        lora_name=leg.lora,
                        stream_interval=self.options.stream_interval,
                        images=leg.images.pixels if leg.images is not None else None,
                    ),
                    deadline,
                )
                num_blocks = len(reservation.block_ids)
                if leg.local and reservation.block_size:  # it allocates as it prefills
                    num_blocks = -(-len(prompt) // reservation.block_size)
                n = sampling.n if sampling.HasField("n") else 1
                if n > 1 and reservation.block_size and len(prompt) % reservation.block_size:
                    num_blocks += n - 1  # each fork's copy of the partial last prompt block
                self.pool.note_reserved(worker, num_blocks)
                leg.num_blocks = num_blocks
                return worker, reservation
            except grpc.RpcError as e:
                error = e
                if e.code() not in (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNAVAILABLE,
                ):
                    break
                full |= e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        self.release_charge(leg)
        if (
            error is not None
            and error.code() == grpc.StatusCode.FAILED_PRECONDITION
            and leg.local
            and leg.expected
            and worker is leg.expect_worker
        ):
            raise StaleHint(worker, error)
        if (
            full
            and error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
            and not leg.local
        ):
            raise DecodeFull()
        raise LegFailed(error, "decode worker")

    def _reserve_on(self, worker, leg: Leg, request, deadline: float):
        """One Reserve call, cancelled when the pool drops `worker` (router/open_legs.py). A
        worker that did not answer (dropped, or no reply within rpc_timeout_s while the client's
        deadline has not passed) raises UNAVAILABLE, so the next decode worker is tried; it may
        have reserved anyway, so the reservation is aborted until the worker answers."""
        leg.reserving = worker
        leg.reserve_call = worker.stub.Reserve.future(
            request, timeout=min(self.options.rpc_timeout_s, left(deadline)), **leg.trace
        )
        self.open.add(worker, leg)
        try:
            return leg.reserve_call.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            dropped = not isinstance(e, grpc.RpcError)
            if dropped or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # it may have reserved
                rid = leg.request_id
                self._run_later(lambda: self.abort_until_answered(worker, rid))
                # an id the router aborted is never sent again: a worker refuses a Reserve whose
                # Abort came first (decode_worker/handoff.py), and the leg may yet try this worker
                leg.request_id = uuid.uuid4().hex
            if not dropped and (
                e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= deadline
            ):
                raise
            raise RouterStatus(
                grpc.StatusCode.UNAVAILABLE,
                f"decode worker {self.pool.name(worker)} did not answer Reserve",
            ) from None
        finally:
            self.open.remove(worker, leg)
            leg.reserve_call = leg.reserving = None

    def abort_until_answered(self, worker, request_id: str, tries: int = ABORT_TRIES) -> None:
        """On the abort threads: Abort `request_id` on `worker`, again every ABORT_RETRY_S while
        the worker does not answer (stopped, hung), at most `tries` times, so that what it holds
        is freed as soon as it comes back, not when a lease runs out."""
        try:
            worker.stub.Abort(
                worker_pb2.WorkerAbortRequest(request_id=request_id),
                timeout=self.options.abort_timeout_s,
            )
        except grpc.RpcError as e:
            silent = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if e.code() in silent and tries > 1:
                timer = threading.Timer(
                    ABORT_RETRY_S,
                    self._run_later,
                    args=(lambda: self.abort_until_answered(worker, request_id, tries - 1),),
                )
                timer.daemon = True
                timer.start()

    def _prefill(self, req: Inflight, leg: Leg, prompt, sampling, deadline: float):
        """On an executor thread. Returns the PrefillResponse, or None after recording the error
        and aborting the reservation (which ends the decode stream)."""
        error, excluded = None, None
        for _ in range(2):
            if req.cancelled or req.abort_requested or leg.ended.is_set():
                return None
            try:
                worker, charge = self.pool.pick_prefill(
                    keyed_ids(leg, prompt), exclude=excluded, adapter=leg.cache_ns
                )
            except NoWorker as e:
                error = RouterStatus(grpc.StatusCode.UNAVAILABLE, str(e))
                break
            if worker is excluded and isinstance(error, RouterStatus):
                # the only one, and it did not fail the call itself (dropped by the pool): it
                # may still run this id, and a second copy would be refused
                self.pool.end_prefill(worker, charge)
                break
            with req.lock:  # an abort from now on finds the worker (`abort`: prefill first)
                gone = req.cancelled or req.abort_requested or leg.ended.is_set()
                if not gone:
                    leg.prefill = worker
            if gone:
                self.pool.end_prefill(worker, charge)
                return None
            leg.prefill_dispatch_ns = unix_ns()
            span = self._prefill_span(req, worker)
            failure = "the call ended without an answer"  # its span's status, unless answered
            fetch = self._fetch_for(req, leg, prompt, len(prompt) - charge)
            try:
                reply = self._prefill_on(worker, leg, prompt, sampling, deadline, span, fetch)
                failure = None
                self.peer_fetch.observe(len(prompt), leg.reservation, reply)
                if fetch is not None and self.on_reuse_path is not None:
                    # pulled, or the prefill worker held it all already
                    path = "peer_fetch" if reply.peer_fetched_tokens else "prefill_cache"
                    self.on_reuse_path(path, reply)
                return reply
            except grpc.RpcError as e:
                failure = f"{e.code().name}: {e.details()}"
                error, excluded = e, worker
                ours = req.cancelled or req.abort_requested or leg.ended.is_set()  # we aborted it
                log.log(
                    logging.DEBUG if ours else logging.WARNING,
                    "prefill of %s on %s failed: %s %s",
                    leg.request_id,
                    worker.address,
                    e.code(),
                    e.details(),
                )
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    break
            finally:
                tracing.end(span, error=failure)
                self.pool.end_prefill(worker, charge)
        if req.cancelled or req.abort_requested or leg.ended.is_set():  # the abort's failure
            return None
        leg.prefill_error = error
        self._abort_prefill(leg)  # failed here, it may still be pushing there (`abort`)
        try:
            found = leg.decode.stub.Abort(
                worker_pb2.WorkerAbortRequest(request_id=leg.request_id),
                timeout=self.options.abort_timeout_s,
            ).found
        except grpc.RpcError as e:
            # unreachable is lost; slow (a deadline, a busy worker) is not, and must not be
            # mistaken for a death that a resume would answer with a second prefill
            leg.decode_lost |= e.code() == grpc.StatusCode.UNAVAILABLE  # before the cancel below
            found = False
        if not found:
            leg.stream_call.cancel()  # decode unreachable or the request already gone
        return None

    def _prefill_span(self, req: Inflight, worker):
        """The router's span of one Prefill call (from its dispatch to its answer), under the
        request's; the worker's prefill span goes under it. None when the request is untraced."""
        parent = getattr(req, "span", None)
        if self.tracing is None or parent is None:
            return None
        return self.tracing.start(
            "prefill call", parent, attributes={"pdserve.prefill_worker": self.pool.name(worker)}
        )

    def _prefill_on(
        self, worker, leg: Leg, prompt, sampling, deadline: float, span=None, fetch=None
    ):
        """One Prefill call on `worker`, bounded by the client's deadline alone and cancelled
        when the pool drops the worker (router/open_legs.py): a dropped worker raises
        UNAVAILABLE (the caller retries elsewhere). However long the prompt, a prefill worker
        that makes progress is never cut: the pool judges it by its progress. span: the call's
        own (`_prefill_span`), whose context the call carries instead of the request's. fetch:
        the call's PeerFetch (`_fetch_for`), None for none."""
        leg.prefill_lost, leg.prefill_sent = "", time.monotonic()
        trace = {"metadata": tracing.metadata(span)} if span is not None else leg.trace
        leg.prefill_call = worker.stub.Prefill.future(
            worker_pb2.PrefillRequest(
                request_id=leg.request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                reservation=leg.reservation,
                priority=leg.priority,
                share_tag=leg.share_tag,
                lora_name=leg.lora,
                peer_fetch=fetch,
                images=leg.images.pixels if leg.images is not None else None,
            ),
            timeout=left(deadline),
            **trace,
        )
        self.open.add(worker, leg)
        try:
            return leg.prefill_call.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            why = leg.prefill_lost or ("" if isinstance(e, grpc.RpcError) else "cancelled")
            if not why:
                raise
            # it may still hold the request when it comes back: best effort, not waited on
            self._run_later(
                lambda: call_abort(worker.stub, leg.request_id, self.options.abort_timeout_s)
            )
            raise RouterStatus(
                grpc.StatusCode.UNAVAILABLE,
                f"prefill worker {self.pool.name(worker)} failed: {why}",
            ) from None
        finally:
            self.open.remove(worker, leg)


def left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def call_abort(stub, request_id: str, timeout: float) -> bool:
    """Best effort: a worker that is gone frees the request by its lease or stream end."""
    try:
        return stub.Abort(
            worker_pb2.WorkerAbortRequest(request_id=request_id), timeout=timeout
        ).found
    except grpc.RpcError as e:
        log.debug("Abort of %s failed: %s", request_id, e.code())
        return False
