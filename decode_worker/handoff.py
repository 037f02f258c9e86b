"""Decode-side hand-off: reservations with leases, incoming KV, the commit, and its timings.

DecodeHandoff owns each reservation from Reserve until it runs in the engine or is freed; the
service (service.py) owns the gRPC calls and the token streams. Lifecycle of one request:
  reserve (router)      -> RESERVED: the engine's Reservation, a KVReceiver, a lease deadline
  "kv" frames (channel) -> the receiver writes them into the reserved blocks (transport thread);
                           each renews the lease (its full length from that frame on), so a
                           long prefill that keeps pushing KV never loses its reservation
  "commit" frame        -> receiver DONE -> engine.commit(first tokens): RUNNING in the batch (n>1:
                           forked on copy-on-write blocks); the callback gets a CommitOutput (the
                           first tokens, HandoffTimings) at once, then the engine's outputs. A
                           commit the engine refuses frees the blocks like an abort
  "abort" frame, abort(), a bad frame, or the lease running out before the commit (the prefill
                           side silent for the lease's length, or a router that died)
                        -> engine abort: blocks freed, the callback gets a finished "abort" output
Every path ends either running in the engine or freed. Writes and aborts of one reservation take
its lock, so blocks are never freed (and handed to someone else) mid-write.

On the nixl and shm backends the prefill worker writes into the blocks itself (one-sided WRITEs,
copies into the shared pool file), so the hand-off also keeps the reservations' write grants
(kvtransfer/backends/claims.py, Grants): Reserve issues one (the KVEndpoint carries it,
`grant_for`), and a reservation that ends while a sender's claim may still write is held back:
its blocks stay the engine's reservation, never handed to another request, until the sender's
commit or abort arrives, its process is proven gone, or, past the claim's bound, its control
connection was closed from its side (a sender on another host that died); only then does the
engine free them (`_release_held`). Any other hold past the claim's bound is stuck: the blocks
stay held and `unhealthy` says why (the service's Stats fails with it, so the router takes the
worker down) until the claim ends after all.

A commit ends a claim only when it is its lone sender's last word. When the router retried the
prefill on another worker into the same reservation, both senders claimed it and the first may
still write (a stalled step that resumes): whose commit it is cannot be told, so the claim stays
open. The committed request then runs as usual, but the hand-off holds a reference of its own
on the reservation's blocks (`_pinned`), so that neither the request's end nor an engine that
refused the commit returns them to the free pool, and so to another request, until the claim is
over by the same rules as a held reservation's (the other sender's last word, its process proven
gone, past the bound its connection closed); past the bound it is stuck the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.engine_loop import EngineLoop, OutputCallback
from pdserve.engine.request import CompletionOutput, RequestOutput, Reservation
from pdserve.kvtransfer.backends import populate
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.peer import read_block
from pdserve.kvtransfer.receiver import WorkerReceiver
from pdserve.kvtransfer.state import TransferState
from pdserve.kvtransfer.wire import PAYLOAD_KINDS
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.worker_common.early_aborts import EarlyAborts

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    receiver: WorkerReceiver
    on_output: OutputCallback
    deadline: float  # time.monotonic(): the lease's end, pushed on by each KV frame
    lease_s: float = 0.0  # the lease's length
    logprobs: bool = False  # the request asked for logprobs (its outputs carry a list)
    sender_traceparent: str = ""  # the first frame's trace context (the prefill span), if any
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False  # committed or aborted: no more writes into its blocks


@dataclass(frozen=True)
class HandoffTimings:
    """The stamps of one request's hand-off, in unix ns (0: not reached, as for a colocated request
    or one freed before its commit), and the one place they and the token stream's become the
    Timings this worker reports on a sequence's last TokenEvent."""

    transfer_end_unix_ns: int = 0  # the last KV frame and the commit landed
    commit_unix_ns: int = 0  # the engine took the commit: the request is in the running batch
    # not a stamp: the sender's prefill span as its frames named it (kvtransfer/wire.py), for the
    # kv.receive span's link ("" when the request was not traced)
    sender_traceparent: str = ""

    def to_proto(
        self, decode_worker: str, first_token_unix_ns: int, last_token_unix_ns: int
    ) -> pdserve_pb2.Timings:
        return pdserve_pb2.Timings(
            first_token_unix_ns=first_token_unix_ns,
            last_token_unix_ns=last_token_unix_ns,
            decode_worker=decode_worker,
            commit_unix_ns=self.commit_unix_ns,
            transfer_end_unix_ns=self.transfer_end_unix_ns,
        )


@dataclass
class CommitOutput(RequestOutput):
    """The hand-off's first output: every sequence's first token, streamed at the commit rather
    than a decode step later, with the hand-off's timings."""

    timings: HandoffTimings = field(default_factory=HandoffTimings)


class DecodeHandoff:
    def __init__(
        self,
        loop: EngineLoop,
        layout: KVLayout,
        rank_caches: list | None = None,
        *,
        lease_s: float = 10.0,  # a reservation's life without its commit (default for reserve)
        sweep_s: float = 0.1,  # how often the engine loop frees the expired ones
        grants=None,
    ):
        """rank_caches: every TP rank's KV pool (engine.rank_kv_caches()); None: tp=1. grants:
        the write grants the nixl and shm servers share with it (claims.py); None without
        those backends."""
        self.loop = loop
        self.grants = grants
        self._held: set[str] = set()  # ended reservations whose blocks a WRITE may still reach
        # committed requests whose blocks a WRITE may still reach (another sender's open claim),
        # with the blocks the hand-off holds a reference on until that claim is over
        self._pinned: dict[str, list[int]] = {}
        self.layout = layout
        self.rank_caches = rank_caches
        # an EAGLE head's cache and layout (engine/spec/eagle.py): "draft" chunks land there
        head = loop.engine.draft_kv()
        self.draft = None if head is None else (head[0], KVLayout(**head[1]))
        self.lease_s = lease_s
        self._entries: dict[str, _Entry] = {}
        # ids aborted before this worker held them (loop thread only)
        self.aborted_early = EarlyAborts()
        self._entries_lock = threading.Lock()
        self.num_expired = 0
        self.num_unknown_frames = 0
        # WorkerStats counters: prompt tokens reserved and those the prefix cache held, hand-offs
        # committed and failed (a bad frame, a refused commit), KV bytes received
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.num_committed = self.num_failed = self.bytes_received = 0
        self._counts_lock = threading.Lock()
        # every page of the pool faulted in now, not while KV arrives during a prefill (transfers
        # into pages touched for the first time are slower); the pool is this worker's memory
        # anyway, so it is resident from the start
        for cache in rank_caches or [loop.engine.kv_cache]:
            populate(cache)
        loop.every(sweep_s, self._expire)

    # ---- control plane (router) -----------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params,
        on_output: OutputCallback,
        lease_s: float | None = None,
        priority: int = 0,
        lora_request=None,
        images=None,
    ) -> Reservation:
        """The engine's reservation, held until its commit, an abort or the lease's end. Raises the
        engine's ValueError (bad request) or NoFreeBlocks (pool full). priority: the request's,
        its order in the engine once committed (engine/scheduler.py); images: a
        vision-language model's prompt images (engine.reserve's)."""
        lease = self.lease_s if lease_s is None else lease_s

        def reserve():
            self.refuse_if_aborted(request_id)
            more = {} if lora_request is None else {"lora_request": lora_request}
            if images is not None:
                more["images"] = images
            res = self.loop.engine.reserve(
                request_id, prompt_token_ids, params, priority=priority, **more
            )
            if self.grants is not None:
                try:
                    # the cached prefix's blocks, which others may share, are no claim's to write
                    first = res.num_cached_tokens // res.block_size
                    self.grants.issue(request_id, res.block_ids, first_block=first)
                except ValueError:
                    self.loop.engine.abort(request_id)
                    raise
            receiver = WorkerReceiver(
                request_id,
                self.rank_caches or [self.loop.engine.kv_cache],
                self.layout,
                res.block_ids,
                res.num_cached_tokens,
                len(prompt_token_ids),
                # a hybrid model's slot, which the prompt's recurrent state fills
                self.loop.engine.state_views(res.state_slot) if res.state_slot >= 0 else None,
                self.draft,
            )
            deadline = time.monotonic() + lease
            self.prefix_cache_queries += len(prompt_token_ids)  # on the loop thread only
            self.prefix_cache_hits += res.num_cached_tokens
            with self._entries_lock:
                self._entries[request_id] = _Entry(
                    receiver,
                    on_output,
                    deadline,
                    lease,
                    logprobs=bool(getattr(params, "logprobs", False)),
                )
            return res

        return self.loop.call(reserve)

    def abort(self, request_id: str, reason: str = "aborted by the router") -> bool:
        """Frees a reservation or a running request; True if it was known. The router's Abort
        may overtake its own Reserve (they are separate calls, on separate threads here: a
        Reserve the router gave up on while it was under way), so an id without a reservation
        is remembered for EARLY_ABORT_TTL_S and its Reserve refused when it comes, instead of
        holding blocks for a lease that nobody will fill."""
        return self.loop.call(self._abort, request_id, reason)

    def _abort(self, request_id: str, reason: str) -> bool:
        """On the loop thread: a reservation closed, or a running request aborted, or an id
        remembered as aborted early, in one loop turn."""
        if self._close(request_id, reason) or request_id in self._held:
            # (held: ended already, its blocks kept until its KV writes are over. A second abort,
            # the router's Abort after its leg's stream went away or the other way round, must
            # not reach the engine, which would free the blocks under a WRITE still landing)
            return True
        return self.loop.abort_here(request_id, reason, on_unknown=self.aborted_early.remember)

    def refuse_if_aborted(self, request_id: str) -> None:
        """On the loop thread, before a request is taken in: raises AbortedEarly if the router
        already aborted `request_id` (`abort`)."""
        self.aborted_early.refuse(request_id)

    def grant_for(self, request_id: str) -> str:
        """The reservation's write grant for its KVEndpoint ("" without grants)."""
        return self.grants.token(request_id) if self.grants is not None else ""

    @property
    def num_reserved(self) -> int:
        """Reservations held: waiting for their KV, or ended or committed and held back while a
        claim may still write into them."""
        return len(self._entries) + self.num_held

    @property
    def num_held(self) -> int:
        return len(self._held) + len(self._pinned)

    @property
    def unhealthy(self) -> str:
        """Why this worker must not be trusted with work (held blocks that a KV write may still
        reach past its bound), "" when healthy."""
        return self.grants.stuck() if self.grants is not None else ""

    # ---- peer fetch (decode_worker/service.py FetchKV) ------------------------------------------
    def cached_prefix_blocks(self, request_id: str) -> int | None:
        """How many full cached blocks lead a live reservation (what a peer fetch may read);
        None when there is no such reservation. Any thread."""
        entry = self._entries.get(request_id)
        if entry is None or entry.closed:
            return None
        return entry.receiver.ranks[0].num_cached_tokens // self.loop.engine.config.block_size

    def read_cached(self, request_id: str, first: int, count: int) -> list | None:
        """The bytes of blocks `first`..`first + count - 1` of a live reservation's cached prefix,
        as (index, block hash, bytes), read on the engine loop (between steps; the reservation
        holds those blocks, so nothing frees or writes them meanwhile); None when the
        reservation ended. Stops early at a block without a hash (never, for cached blocks)."""
        caches = self.rank_caches or [self.loop.engine.kv_cache]

        def read():
            entry = self._entries.get(request_id)
            if entry is None or entry.closed:
                return None
            receiver, bm = entry.receiver.ranks[0], self.loop.engine.block_manager
            held = receiver.num_cached_tokens // bm.block_size
            out = []
            for i in range(first, min(first + count, held)):
                block_id = receiver.block_ids[i]
                h = bm.blocks[block_id].hash
                if h is None:
                    break
                out.append((i, h, read_block(caches, block_id)))
            return out

        return self.loop.call(read)

    def read_state(self, request_id: str, first: int, end: int) -> tuple[int, bytes] | None:
        """A hybrid's: the last of blocks `first`..`end - 1` of a live reservation's cached
        prefix after which a slot keeps a recurrent state, and that state's bytes
        (engine_core.LLMEngine.read_kept_state), read on the engine loop; None where there is
        none (a state only in the host tier is not read: it would have to come back to a slot
        first) or the reservation ended."""
        engine = self.loop.engine

        def read():
            entry = self._entries.get(request_id)
            if entry is None or entry.closed:
                return None
            receiver, bm = entry.receiver.ranks[0], engine.block_manager
            held = receiver.num_cached_tokens // bm.block_size
            for i in range(min(end, held) - 1, first - 1, -1):
                h = bm.blocks[receiver.block_ids[i]].hash
                data = None if h is None else engine.read_kept_state(h)
                if data is not None:
                    return i, data
            return None

        return self.loop.call(read)

    # ---- data plane (transport threads) ---------------------------------------------------------
    def on_frame(self, header, payload) -> None:
        entry = self._entries.get(header.request_id)
        if entry is None:  # expired or aborted already: the sender learns at its next Prefill
            self.num_unknown_frames += 1
            return
        with entry.lock:
            if entry.closed:
                return
            state = entry.receiver.on_frame(header, payload)
            if header.traceparent and not entry.sender_traceparent:
                entry.sender_traceparent = header.traceparent
            if header.kind in PAYLOAD_KINDS and state != TransferState.FAILED:
                # progress: the prefill side is alive, however long its prompt takes
                entry.deadline = max(entry.deadline, time.monotonic() + entry.lease_s)
        if header.kind in PAYLOAD_KINDS and state != TransferState.FAILED:
            with self._counts_lock:
                self.bytes_received += frame_bytes(header, payload)
        if state == TransferState.DONE:  # the last KV frame and the commit are in
            self.loop.submit(self._commit, header.request_id, time.time_ns())
        elif state == TransferState.FAILED:
            with self._counts_lock:
                self.num_failed += 1
            self.loop.submit(self._close, header.request_id, entry.receiver.error)

    # ---- on the loop thread ---------------------------------------------------------------------
    def _commit(self, request_id: str, received_ns: int = 0) -> None:
        entry = self._pop(request_id)
        if entry is None:
            return
        with entry.lock:
            entry.closed = True
        if self.grants is not None and not self.grants.close(
            request_id, lambda: self.loop.submit(self._release_pinned, request_id)
        ):
            # another sender's claim may still write (the module docstring): the blocks run in
            # the engine, and stay out of the free pool until that claim is over. Pinned before
            # the commit, so an engine that refuses it frees nothing either
            self._pin(request_id, entry.receiver.ranks[0].block_ids)
        first_tokens = list(entry.receiver.first_tokens)
        logprobs = list(entry.receiver.first_logprobs) if entry.logprobs else []
        try:
            # n>1: the engine forks the other sequences from the prompt's blocks (copy-on-write)
            self.loop.engine.commit(
                request_id, first_tokens, logprobs or None, entry.receiver.draft_complete
            )
        except (ValueError, KeyError) as e:  # popped already: freed here or never
            self.loop.engine.abort(request_id)
            log.warning("commit of %s refused: %s", request_id, e)
            with self._counts_lock:
                self.num_failed += 1
            entry.on_output(RequestOutput.aborted(request_id, f"commit refused: {e}"))
            return
        with self._counts_lock:
            self.num_committed += 1
        self.loop.watch(request_id, entry.on_output)
        # the prefill worker already sampled the first token: stream it now, not with the next
        # decode step's output (a whole step later). The engine's first output holds this token
        # too (Stream places each output where the previous one ended: decode_worker/service.py
        # _start); when the commit itself finished the request, the engine's final output
        # follows at the next step as before.
        entry.on_output(
            CommitOutput(
                request_id,
                None,
                [],
                [
                    CompletionOutput(
                        i,
                        "",
                        [token],
                        None,
                        logprobs=logprobs[i : i + 1] if entry.logprobs else None,
                    )
                    for i, token in enumerate(first_tokens)
                ],
                finished=False,
                timings=HandoffTimings(
                    received_ns, time.time_ns(), sender_traceparent=entry.sender_traceparent
                ),
            )
        )

    def _close(self, request_id: str, reason: str, expired: bool = False) -> bool:
        entry = self._pop(request_id)
        if entry is None:
            return False
        with entry.lock:  # waits out a write in progress
            entry.closed = True
        self.num_expired += expired  # before the callback: whoever it wakes sees the count
        if self.grants is None or self.grants.close(
            request_id, lambda: self.loop.submit(self._release_held, request_id)
        ):
            self.loop.engine.abort(request_id)
            log.info("reservation %s freed: %s", request_id, reason)
        else:
            self._held.add(request_id)
            log.info(
                "reservation %s ended (%s); its blocks are held until its KV writes are over",
                request_id,
                reason,
            )
        entry.on_output(RequestOutput.aborted(request_id, reason))
        return True

    def _pin(self, request_id: str, block_ids: list[int]) -> None:
        """Hold a reference on a committed request's blocks while a claim may still write into
        them (loop thread; `_release_pinned` lets go)."""
        self.loop.engine.block_manager.take(block_ids)
        self._pinned.setdefault(request_id, []).extend(block_ids)
        log.info(
            "request %s committed while another sender's claim may still write into its "
            "blocks; they are held until that claim is over",
            request_id,
        )

    def _release_pinned(self, request_id: str) -> None:
        """The claim of a committed request is over: the hand-off's hold on its blocks ends (loop
        thread); they go back to the pool once the request, too, lets go of them."""
        blocks = self._pinned.pop(request_id, None)
        if blocks is not None:
            self.loop.engine.block_manager.free(blocks)
            log.info("committed request %s: its KV writes are over, its blocks let go", request_id)

    def _release_held(self, request_id: str) -> None:
        """The held reservation's writes are over: the engine frees its blocks (loop thread)."""
        if request_id in self._held:
            self._held.discard(request_id)
            self.loop.engine.abort(request_id)
            log.info("held reservation %s freed: its KV writes are over", request_id)

    def _expire(self) -> None:
        if self.grants is not None:
            self.grants.due()
        now = time.monotonic()
        late = [rid for rid, e in list(self._entries.items()) if now > e.deadline]
        for rid in late:
            self._close(rid, "lease expired before the commit", expired=True)
        self.aborted_early.sweep()

    def _pop(self, request_id: str) -> _Entry | None:
        with self._entries_lock:
            return self._entries.pop(request_id, None)


def frame_bytes(header, payload=None) -> int:
    """The bytes a "kv" frame carries (written in place by shm senders, so from its header), or
    a "state" frame's payload (a hybrid model's recurrent state)."""
    if header.kind == "state":
        if isinstance(payload, torch.Tensor):
            return payload.numel() * payload.element_size()
        return memoryview(payload).nbytes
    size = _ITEMSIZE.get(header.dtype)
    if size is None:
        dtype = getattr(torch, header.dtype, None)
        size = _ITEMSIZE[header.dtype] = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
    return (
        2
        * (header.end - header.start)
        * (header.head_end - header.head_start)
        * (header.head_dim * size)
    )


_ITEMSIZE: dict[str, int] = {}
