"""The router's view of its workers: channels, stubs, health, cached load, membership, and who
gets the next request.

The router creates one WorkerPool as it starts and keeps it until it stops. A background thread
sweeps every `stats_ttl_s`: it polls each worker's Stats (never more than one poll outstanding per
worker, each with the silence bound as its deadline) and judges each worker's health; requests
never wait on a Stats call: they read what the last sweep left. Decode picks prefer the fewest KV
blocks in use, counting the blocks of the Reserves sent there and not yet answered (the pick
charges them at once, under the pool's lock, so a burst of picks made before any Reserve answers
spreads out, even from a view a sweep old); prefill picks prefer the worker that finishes the
prompt soonest, counting the prefix it probably caches (router/affinity.py). Ties go round-robin.
What each decode worker holds (a conversation's earlier turns, prompt and answer, which it keeps
in its prefix cache after the request ends) is read from a block index (router/kv_index.py) that
the sweep feeds: each decode worker's Stats poll asks for the KV events after the index's place
in that worker's stream, and the answer is applied before anything else of it. What the router
sends a worker (`remember_decoded`, from router/legs.py) is expected there until a later poll
answers, and recorded in a second affinity view that stands in for the index until the worker's
events are synced. Decode picks count a worker's match as blocks it need not take
(`decode_matches`), and router/legs.py may let that worker prefill the rest itself.

LoRA adapters (as llm-d's LoRA-aware scorer): a request under an adapter goes only to the
workers whose last WorkerStats list it (lora_adapters), unless none does (then to any, which
refuses it if it lacks it too: router/lora.py loads what a worker lacks as its reports show it),
so a worker that joined after a run-time load gets none of its requests before it has it; among
those, a worker where the adapter's weights are resident (lora_resident) counts as less loaded
by RESIDENT_DECODE_BONUS of its KV blocks (decode picks) or RESIDENT_PREFILL_BONUS prompt tokens
(prefill picks): an adapter's requests stay where it is loaded until that worker is that much
busier, then spread, and the next worker loads it too. Its prefix affinity keys on the adapter
(router/affinity.py), so its cached blocks draw its requests as the base model's do.

Health has two levels, and only the second costs a request anything:
  down  the pickers skip it for new work (unless every worker of its role is down: then they try
        them all, since a wrong guess costs one failed RPC and refusing costs the request). A
        cheap, soft signal: set when the worker has been silent for `down_s`, when a Stats
        call fails outright (nothing listens), or while it is dead; one answer clears it.
  dead  its open calls are dropped and resume elsewhere (router/open_legs.py, through every
        `on_drop` listener). A worker is dead when it has been silent -- no Stats answer and no
        heartbeat, the last answer of either kind counting -- for `silence_s`, or when its Stats
        say its engine is stuck in one loop turn: the turn has used the CPU for its stall bound
        (a spinning hang: WorkerStats.engine_turn_cpu_ms) or gone that long without using it
        (a blocked one: engine_idle_ms). The bound is max(`stall_s`, `stall_factor` x the CPU
        time of the costliest turn it reported finishing recently (engine_turn_ms_max),
        `stall_factor` x what the step running now should cost at its most CPU time per token
        of late (engine_turn_tokens x engine_us_per_token_max)): a hung GPU or a deadlock,
        where the server answers and the engine computes nothing. The figures count CPU time,
        so a worker that is slow because the machine is busy is not dead, however long its
        step takes by the wall clock. A late or failed poll alone never drops a call.
Silence is measured on the sweep's clock (an answer counts when the sweep sees it, within one
`stats_ttl_s`) and on heartbeats as they arrive. Workers from the config are static: a dead one
stays a member and is dropped again each sweep while it stays dead (calls not heard from for
`silence_s`). Workers that Register (router/registry.py) leave the pool when they die of
silence (every call open on them is dropped); they come back by registering again.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.protos import keepalive
from pdserve.protos.limits import MAX_PIXEL_VALUE_BYTES
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity
from pdserve.router.affinity import PrefixAffinity, prefix_hashes
from pdserve.router.kv_index import KVIndex, chain_hashes

log = logging.getLogger(__name__)
# long prompts' token id lists, and a vision-language model's pixel values beside them
MAX_MESSAGE_BYTES = (64 << 20) + MAX_PIXEL_VALUE_BYTES
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# gRPC's default reconnect backoff grows to 120 s: a worker back after a long outage would stay
# "down" that long after it answers again. Keepalive (protos/keepalive.py): a worker that stops
# answering fails every call open on its channel UNAVAILABLE within about 20 s, so its streams
# resume elsewhere even where the pool has not dropped it.
WORKER_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    *keepalive.CLIENT_OPTIONS,
]
ROLES = ("prefill", "decode")
# a prompt token a decode worker holds only in its host tier (engine/kv_host_tier.py) counts this
# much of one held in its KV cache in the decode picks and the local-prefill rule: restoring it is
# a copy of its block, cheaper than recomputing it and dearer than a device hit (decode_matches)
HOST_HIT_WEIGHT = 0.9
# a worker where a request's LoRA adapter is resident counts as less loaded by this fraction of
# its KV blocks (decode picks), or by this many prompt tokens (prefill picks): the disk read and
# the eviction of another adapter that a pick elsewhere costs (module docstring)
RESIDENT_DECODE_BONUS = 0.1
RESIDENT_PREFILL_BONUS = 256
_STUBS = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub}


class NoWorker(Exception):
    """No worker of `role` to send a request to."""

    def __init__(self, role: str, why: str = ""):
        super().__init__(
            why
            or f"no {role} worker is registered with the router: start one (or wait "
            f"for one to register), then retry"
        )
        self.role = role


@dataclass(eq=False)  # identity: two workers may share an address across a re-registration
class _Worker:
    role: str
    address: str
    channel: grpc.Channel
    stub: object
    worker_id: str = ""
    static: bool = True
    heard_at: float = 0.0  # the pool's clock at its last answer (a Stats reply or a heartbeat)
    num_free_blocks: int = -1  # -1: unknown (new, unreachable, its last poll late)
    num_used_blocks: int = 0  # the decode worker's KV in use: its load (decode_order)
    # (when, blocks) of the streams this router saw end there since the Stats poll that last
    # counted them (note_freed): a poll asked before one ended still counts its blocks in use
    ended: list = field(default_factory=list)
    poll_sent: float = 0.0  # when the outstanding Stats poll was asked (time.monotonic)
    # prompt tokens of the Reserves this router sent it that have not ended (decode_order charges
    # them, end_reserve releases them): their blocks count as in use until the worker's own count
    # has them; no sweep overwrites this
    reserving_tokens: int = 0
    num_inflight: int = 0  # prefills this router has running there
    queued_tokens: int = 0  # their prompt tokens not expected in that worker's cache
    num_failures: int = 0  # Stats failures in a row
    failed: bool = False  # its last Stats call failed outright (not late): down until one answers
    down: bool = False  # skipped for new work (module docstring)
    dead: str = ""  # why it is dead ("silent" or "stalled"), "" while alive
    poll: object = None  # the Stats call outstanding, if any (one at most)
    stuck_since: float = 0.0  # dead "stalled": the pool's clock when its stuck turn began
    # "serving", or a role flip's "draining" | "switching" (router/flips.py): no new work then
    state: str = "serving"
    stats: object = None  # the last WorkerStats (a sweep's or a heartbeat's): router/metrics.py
    # KV events (router/kv_index.py): Stats polls sent, and the outstanding one's number and
    # the place in the worker's event stream it asked from
    kv_polls: int = 0
    kv_asked: tuple = (0, 0, 0)


class WorkerPool:
    def __init__(
        self,
        prefill_addresses=(),
        decode_addresses=(),
        stats_ttl_s: float = 0.5,
        down_s: float = 2.0,
        silence_s: float = 4.0,
        security: ClusterSecurity = INSECURE,
        stall_s: float = 5.0,
        stall_factor: float = 4.0,
        clock=time.monotonic,
    ):
        if not 0 < down_s <= silence_s:
            raise ValueError(f"need 0 < down_s <= silence_s, got {down_s} and {silence_s}")
        if stall_s <= 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s}")
        if stall_factor < 1:
            raise ValueError(f"stall_factor must be >= 1, got {stall_factor}")
        self.stats_ttl_s = stats_ttl_s
        self.down_s, self.silence_s = down_s, silence_s
        self.stall_s, self.stall_factor = stall_s, stall_factor
        self._clock = clock  # time.monotonic; tests pass a fake one
        self.security = security
        self.deaths = {"silent": 0, "stalled": 0}  # workers that died, by cause, ever
        # once a weight update set it (router/weights.py): whether a worker serves the weights
        # every request must run on; None: any worker may be picked
        self.serves_weights: Callable[[_Worker], bool] | None = None
        self._workers = {
            "prefill": [self._connect("prefill", a) for a in prefill_addresses],
            "decode": [self._connect("decode", a) for a in decode_addresses],
        }
        self._registered: dict[str, _Worker] = {}  # worker_id -> worker, for heartbeats
        self._affinity = PrefixAffinity()  # prefill workers' prefix caches
        # decode workers': earlier turns, answers too, as this router sent them; what a decode
        # worker holds is read from kv_index once its KV events are synced, and from this
        # record only until then (or for a worker that reports no events)
        self._decode_affinity = PrefixAffinity()
        self.kv_index = KVIndex()  # block hash -> decode workers holding it, from their events
        self._lock = threading.Lock()
        self.prefill_tokens_started = 0  # of the legs started for the prefill pool, ever
        self._rr = {role: itertools.count() for role in ROLES}
        self._stop = threading.Event()
        self._drop_listeners: list = []  # (worker, why, silent_since): on the health thread
        self._report_listeners: list = []  # (worker, stats): router/reconcile.py
        self.num_sweeps = 0
        self._thread = threading.Thread(target=self._run, name="router-health", daemon=True)

    def _connect(self, role: str, address: str, **fields) -> _Worker:
        channel = self.security.channel(address, WORKER_CHANNEL_OPTIONS)
        fields.setdefault("heard_at", self._clock())  # silence counts from its arrival
        return _Worker(role, address, channel, _STUBS[role](channel), **fields)

    def start(self, first_wait_s: float = 2.0) -> WorkerPool:
        """Runs the first sweep here, waiting up to min(first_wait_s, silence_s) for the static
        workers' answers, so that a request right after the start finds each one named (a
        Finish's timings carry the names) and its blocks known even on a loaded machine; then
        starts the health thread. A worker that refuses the connection answers at once; only a
        hung one costs the wait."""
        self.sweep(wait_s=min(first_wait_s, self.silence_s))
        self._thread.start()
        return self

    def num_workers(self, role: str) -> int:
        with self._lock:
            return len(self._workers[role])

    @property
    def prefill(self) -> list[_Worker]:
        with self._lock:
            return list(self._workers["prefill"])

    @property
    def decode(self) -> list[_Worker]:
        with self._lock:
            return list(self._workers["decode"])

    # ---- picking --------------------------------------------------------------------------------
    def decode_order(
        self,
        exclude=(),
        charge_tokens: int | None = None,
        reserve_tokens: int = 0,
        matched: dict | None = None,
        adapter: str = "",
    ) -> list[_Worker]:
        """Decode workers other than `exclude`, the preferred one first; the rest are fallbacks
        for a full pool. Raises NoWorker when there is none.

        Preferred: the fewest KV blocks in use, which is the work of its decode steps (the
        sequences and the context they attend over); then the most free blocks. A full worker
        ranks last. One whose blocks are unknown while it is up (just registered, a new entry
        after a role change, until its first Stats answer; or its last poll was late) ranks by
        its last count in use (0 when new), after a known worker with as many: ranked last, a
        worker that re-registered as it resumed got none of a burst sent as it converged, every
        pick made before its first Stats answer (tests/chaos/test_interrupted_flips.py); one
        unreachable is down. In use, not free: the workers' caches differ
        in size (a worker flipped from the prefill pool keeps that pool's smaller cache), and
        ranking by free blocks kept the bigger cache's worker that many blocks busier, its TPOT
        over the SLO while the other idled. With charge_tokens (colocated workers, which prefill
        too): the fewest prompt tokens charged to it first, and the first is charged
        `charge_tokens` before the lock is let go, so that concurrent arrivals see each other
        (the caller moves the charge with charge_queued when it settles elsewhere, and releases
        it at the first token). Blocks alone are read every health sweep and a colocated Reserve
        holds no blocks yet: a burst went to one worker. With reserve_tokens (a disaggregated
        Reserve of a prompt that long), the first is charged that prompt's blocks before the
        lock is let go, until the caller's end_reserve: blocks in use were raised only when a
        Reserve answered (note_reserved), after a burst of 16 concurrent picks had all been made
        on the view of the last sweep, and a view taken while earlier streams still ran (its
        blocks freed since) sent the whole burst to the other worker. Workers that are down come
        last, after every worker that is up (down is a soft signal: a late Stats, not a death).
        matched (decode_matches): the prompt tokens each worker probably holds already; its
        blocks count as not needed there, and the charges shrink by them (the caller charged
        with the whole prompt's figures), so a conversation's next turn goes back to the
        worker that has its earlier turns unless that worker is busier than the match saves.
        adapter: the request's LoRA adapter (module docstring: only the workers that have it,
        those where it is resident first unless busier)."""
        matched = matched or {}
        with self._lock:
            workers = _with_adapter(self._candidates("decode", exclude, fallback=True), adapter)
            start = next(self._rr["decode"]) % len(workers)
            rotated = workers[start:] + workers[:start]

            def held(w: _Worker) -> int:
                return matched.get(w, 0)

            def load(w: _Worker) -> tuple:
                room = 1 if w.num_free_blocks == 0 else 0  # -1, unknown: -free ranks it after
                in_use = w.num_used_blocks + _reserving_blocks(w) - held(w) / _block_size(w)
                if _resident(w, adapter):
                    in_use -= RESIDENT_DECODE_BONUS * w.stats.num_total_blocks
                return w.down, room, in_use, -w.num_free_blocks

            if charge_tokens is None:  # stable sorts: ties keep the rotation
                ordered = sorted(rotated, key=load)
                ordered[0].reserving_tokens += max(0, reserve_tokens - held(ordered[0]))
                return ordered
            ordered = sorted(rotated, key=lambda w: (w.down, w.queued_tokens - held(w), *load(w)))
            ordered[0].queued_tokens += max(0, charge_tokens - held(ordered[0]))
            return ordered

    def decode_matches(self, prompt: list[int], adapter: str = "") -> dict:
        """Decode worker -> the leading prompt tokens it holds: from the block index (its KV
        events, and what this router sent it since its last poll: router/kv_index.py) once that
        is synced for the worker; before (or for a worker that reports no events) from this
        router's own record of what it sent there (remember_decoded), a guess. Under a LoRA
        adapter or a cache salt (`adapter` is then router/affinity.py's cache_namespace) only the
        record counts: the block index holds the base model's unsalted chains. A token
        held only in a worker's host tier counts HOST_HIT_WEIGHT of one in its KV cache (its
        restore is a copy: cheaper than recomputing, dearer than a device hit), in the picks and
        in the local-prefill rule alike; the Reserve's min_cached_tokens is then a little lower
        than what the worker holds, which it always satisfies."""
        hashes = prefix_hashes(list(prompt), adapter=adapter)
        with self._lock:
            sizes = {w: _block_size(w) for w in self._workers["decode"]}
            record = self._decode_affinity.matched_tokens(hashes)
        indexed = (
            {}
            if adapter
            else {
                w: n - int((1.0 - HOST_HIT_WEIGHT) * host)
                for w, (n, host) in self.kv_index.matched_by_tier(prompt, sizes).items()
            }
        )
        out = {w: n for w, n in record.items() if w not in indexed}
        out.update((w, n) for w, n in indexed.items() if n)
        return out

    def decode_usable(self, prompt: list[int], adapter: str = "") -> dict:
        """decode_matches, but only what a worker's engine would take from its cache: the whole
        blocks before the prompt's last token, which it always computes (a prompt of exactly its
        cached blocks would count as all held, with nothing of it usable)."""
        held = self.decode_matches(prompt, adapter)
        usable = max(0, len(prompt) - 1)
        with self._lock:
            out = {w: min(n, usable - usable % _block_size(w)) for w, n in held.items()}
        return {w: n for w, n in out.items() if n}

    def remember_decoded(
        self,
        worker: _Worker,
        tokens: list[int],
        adapter: str = "",
        prompt_len: int | None = None,
        local: bool = False,
    ) -> None:
        """`worker` computed the KV of `tokens` (a prompt, or with `prompt_len` a finished
        request's prompt of that length and its answer but the last token) and keeps it in its
        prefix cache once the request ends, until evicted: recorded, and expected in the block
        index until the worker's next poll says what it stored. A hybrid's worker keeps the
        state where a finished sequence's computed tokens last passed a block boundary (the end
        of `tokens`' last full block) when it computed that boundary itself: any past its
        prompt's last boundary if it prefilled the prompt (`local`), else only one past the
        prompt's end (the state arrived there with the prompt's KV); expected there too."""
        hashes = prefix_hashes(list(tokens), adapter=adapter)
        with self._lock:
            if worker not in self._workers["decode"]:
                return
            self._decode_affinity.record(hashes, worker)
            size, poll = _block_size(worker), worker.kv_polls
        if not adapter:  # (the block index holds the base model's chains only)
            end = len(tokens) // size * size  # (where the last full block ends)
            state = prompt_len is not None and end > 0 and (local or end > prompt_len)
            self.kv_index.expect(worker, chain_hashes(list(tokens), size), poll, state=state)

    def forget_decoded(self, worker: _Worker) -> None:
        """`worker` refused a Reserve for holding less than the router expected (router/legs.py):
        what the router believed it holds was stale. Its block index entries are dropped and
        resynced from a snapshot at its next poll, and its record goes."""
        with self._lock:
            self._decode_affinity.forget(worker)
        self.kv_index.forget(worker)

    def note_started(self, prompt_tokens: int) -> None:
        """A leg for the prefill pool started (router/legs.py): the planner's prefill demand."""
        with self._lock:
            self.prefill_tokens_started += prompt_tokens

    def charge_queued(self, worker: _Worker, num_tokens: int) -> None:
        """Count `num_tokens` (negative: release them) against a worker's queued prompt tokens."""
        with self._lock:
            worker.queued_tokens += num_tokens

    def end_reserve(self, worker: _Worker, reserve_tokens: int) -> None:
        """The Reserve that decode_order charged `reserve_tokens` to `worker` ended (answered,
        failed, or settled on another worker): release the charge. Called after note_reserved
        when it succeeded, so that the blocks are never counted as free in between."""
        with self._lock:
            worker.reserving_tokens = max(0, worker.reserving_tokens - reserve_tokens)

    def note_freed(self, worker: _Worker, num_blocks: int) -> None:
        """A stream on `worker` ended, freeing about `num_blocks` (its blocks stay in the worker's
        prefix cache, which counts them free): counted free at once, and taken off any Stats
        answer to a poll asked before now. Without it the worker's last count kept a finished
        turn's blocks in use until the next sweep, and a conversation's next turn sent at once
        ranked its holder busier than the worker with nothing, by about what it held."""
        with self._lock:
            if worker.num_free_blocks < 0 or num_blocks <= 0:
                return
            worker.num_free_blocks += num_blocks
            worker.num_used_blocks = max(0, worker.num_used_blocks - num_blocks)
            worker.ended.append((time.monotonic(), num_blocks))

    def note_reserved(self, worker: _Worker, num_blocks: int) -> None:
        """A Reserve on `worker` holds `num_blocks`: counted in use until a sweep or heartbeat
        brings the worker's own count (which then has them)."""
        with self._lock:
            if worker.num_free_blocks >= 0:
                worker.num_free_blocks = max(0, worker.num_free_blocks - num_blocks)
                worker.num_used_blocks += num_blocks

    def pick_prefill(
        self, prompt: list[int] = (), exclude: _Worker | None = None, adapter: str = ""
    ) -> tuple[_Worker, int]:
        """The prefill worker other than `exclude` (or `exclude` when it is the only one) that
        finishes `prompt` soonest, and the tokens charged to it until end_prefill(worker, charge).
        Raises NoWorker when there is none. A worker's work before this prompt is done, in
        tokens: the prompt tokens this router has in flight there, plus this prompt's tokens that
        it probably does not hold in its prefix cache, so a shared prefix goes back to the worker
        that has it unless that worker is busier than the cache hit saves. `adapter`: the LoRA
        adapter the prompt runs under (its own affinity; only the workers that have it, those
        where it is resident first unless busier: module docstring)."""
        hashes = prefix_hashes(list(prompt), adapter=adapter)
        with self._lock:
            try:
                workers = self._candidates("prefill", (exclude,))
            except NoWorker:
                if exclude is None or exclude not in self._workers["prefill"]:
                    raise
                workers = [exclude]
            workers = _with_adapter(workers, adapter)
            start = next(self._rr["prefill"]) % len(workers)
            rotated = workers[start:] + workers[:start]
            matched = self._affinity.matched_tokens(hashes)
            charges = {id(w): len(prompt) - matched.get(w, 0) for w in rotated}

            def work(w: _Worker) -> tuple:
                bonus = RESIDENT_PREFILL_BONUS if _resident(w, adapter) else 0
                return w.queued_tokens + charges[id(w)] - bonus, w.num_inflight

            worker = min(rotated, key=work)
            charge = charges[id(worker)]
            worker.num_inflight += 1
            worker.queued_tokens += charge
            self._affinity.record(hashes, worker)
            return worker, charge

    def prefill_backlog(self, prompt: list[int], adapter: str = "", held: int = 0) -> int | None:
        """The prompt tokens the least loaded prefill worker would compute before `prompt`'s
        first token, this prompt's uncached ones included (as pick_prefill counts, without
        charging); None when no prefill worker serves (planner/local_prefill.py). held: leading
        tokens any prefill worker would have without computing them (a peer fetch's)."""
        hashes = prefix_hashes(list(prompt), adapter=adapter)
        with self._lock:
            try:
                workers = self._candidates("prefill", ())
            except NoWorker:
                return None
            matched = self._affinity.matched_tokens(hashes)
            return min(
                w.queued_tokens + len(prompt) - max(held, matched.get(w, 0)) for w in workers
            )

    def handoff_bandwidth(self) -> float:
        """The prefill workers' KV hand-off bandwidth as they served it, bytes per second over
        every backend (their WorkerStats push bytes over push seconds); 0.0 before any push."""
        with self._lock:
            stats = [w.stats for w in self._workers["prefill"] if w.stats is not None]
        sent = sum(sum(s.kv_push_bytes_by_backend.values()) for s in stats)
        seconds = sum(sum(s.kv_push_seconds_by_backend.values()) for s in stats)
        return sent / seconds if seconds > 0 else 0.0

    def queued_tokens(self, role: str) -> int:
        """The prompt tokens this router has in flight on the serving workers of `role`."""
        with self._lock:
            return sum(w.queued_tokens for w in self._workers[role] if w.state == "serving")

    def decode_backlog(self, worker: _Worker | None = None) -> int:
        """The prompt tokens the least loaded decode worker (or `worker`) is prefilling itself."""
        with self._lock:
            if worker is not None:
                return worker.queued_tokens
            try:
                return min(w.queued_tokens for w in self._candidates("decode", ()))
            except NoWorker:
                return 0

    def end_prefill(self, worker: _Worker, charge: int = 0) -> None:
        with self._lock:
            worker.num_inflight -= 1
            worker.queued_tokens -= charge

    def _candidates(self, role: str, exclude, fallback: bool = False) -> list[_Worker]:
        """The serving workers of `role` but `exclude` that are up (all of them when none is);
        fallback: those that are down but not dead as well, after them."""
        workers = [w for w in self._workers[role] if w not in exclude and w.state == "serving"]
        serves = self.serves_weights
        if serves is not None and workers:  # after a weight update: those that serve its weights
            workers = [w for w in workers if serves(w)]
            if not workers:
                raise NoWorker(
                    role,
                    f"no {role} worker serves the weights of the last update yet (the router "
                    "is bringing them up to date: router/weights.py); retry",
                )
        if not workers:
            raise NoWorker(role)
        up = [w for w in workers if not w.down]
        if not up:
            return workers
        return up + [w for w in workers if w.down and not w.dead] if fallback else up

    def is_member(self, worker: _Worker) -> bool:
        """False once `worker` left the pool (its heartbeats stopped, or it re-registered)."""
        with self._lock:
            return worker in self._workers[worker.role]

    def on_drop(self, listener) -> None:
        """Calls `listener(worker, why, silent_since)` when a worker is dead (module docstring):
        silent_since None when it left the pool (every call on it is lost), else the pool's
        clock (time.monotonic()) since which a call not heard from is lost: `silence_s` ago for a
        silent worker, the start of the stuck turn for a stalled engine. It runs on the health
        thread (or a heartbeat's) and must return at once (no worker calls)."""
        self._drop_listeners.append(listener)

    def on_report(self, listener) -> None:
        """Calls `listener(worker, stats)` after a heartbeat's or a health sweep's WorkerStats of
        `worker` are stored (router/reconcile.py compares the role and state they report). It
        runs on the health thread or a Registry handler thread and must return at once."""
        self._report_listeners.append(listener)

    def _reported(self, worker: _Worker, stats) -> None:
        for listener in list(self._report_listeners):
            try:
                listener(worker, stats)
            except Exception:  # one listener's bug must not stop the health sweeps
                log.exception("report listener failed for %s", self.name(worker))

    def _dropped(self, worker: _Worker, why: str, silent_since: float | None = None) -> None:
        # a dead worker's cache may be gone (a restart keeps the address): its matches with it
        with self._lock:
            self._forget(worker)
        for listener in list(self._drop_listeners):
            try:
                listener(worker, why, silent_since)
            except Exception:  # one listener's bug must not stop the health sweeps
                log.exception("drop listener failed for %s", self.name(worker))

    def name(self, worker: _Worker) -> str:
        return worker.worker_id or worker.address

    def _forget(self, worker: _Worker) -> None:
        """`worker` left, died or changed role: what the affinity views say it holds goes (under
        the pool's lock)."""
        self._affinity.forget(worker)
        self._decode_affinity.forget(worker)
        self.kv_index.forget(worker)

    def snapshot(self) -> list[tuple[str, str, object, bool, str]]:
        """(role, name, last WorkerStats or None, down, state) of every member, without waiting
        on any worker: what the last health sweep or heartbeat left (the metrics read it per
        scrape)."""
        with self._lock:
            workers = self._workers["prefill"] + self._workers["decode"]
            return [(w.role, self.name(w), w.stats, w.down, w.state) for w in workers]

    def members(self) -> list[_Worker]:
        with self._lock:
            return self._workers["prefill"] + self._workers["decode"]

    def registered(self, worker_id: str) -> _Worker | None:
        """The member that registered as `worker_id`, or the static one it names by address."""
        with self._lock:
            worker = self._registered.get(worker_id)
            if worker is not None:
                return worker
            return next(
                (w for role in ROLES for w in self._workers[role] if w.address == worker_id), None
            )

    def begin_drain(self, worker: _Worker) -> str | None:
        """Marks `worker` draining (no new work: the pickers skip it) unless that would leave its
        role with no worker that is up and serving; then says why not, and changes nothing."""
        with self._lock:
            if worker not in self._workers[worker.role]:
                return f"{worker.role} worker {self.name(worker)} left the pool"
            others = [
                w
                for w in self._workers[worker.role]
                if w is not worker and w.state == "serving" and not w.down
            ]
            if not others:
                return (
                    f"it is the last {worker.role} worker that is up and serving: flipping it "
                    f"would leave the {worker.role} pool empty"
                )
            worker.state = "draining"
        return None

    def set_state(self, worker: _Worker, state: str) -> None:
        with self._lock:
            worker.state = state

    # ---- membership -----------------------------------------------------------------------------
    def register(self, role: str, worker_id: str, address: str) -> _Worker:
        """Adds a worker, or refreshes it; a new address or role replaces the old entry. A
        Register is an answer: the worker is not silent."""
        with self._lock:
            old = self._registered.get(worker_id)
            if old is not None and not old.static and (old.role, old.address) == (role, address):
                old.heard_at = self._clock()
                return old
            if old is not None and not old.static:
                # not closed here: streams still on its channel end on their own, and gRPC frees
                # the channel with its last reference
                self._workers[old.role].remove(old)
                del self._registered[worker_id]
                self._forget(old)
            static = next(
                (w for w in self._workers[role] if w.static and w.address == address), None
            )
            if static is not None:  # already configured: learn its id; it stays a member
                static.worker_id = worker_id
                static.heard_at = self._clock()
                self._registered[worker_id] = static
                return static
            worker = self._connect(role, address, worker_id=worker_id, static=False)
            self._workers[role].append(worker)
            self._registered[worker_id] = worker
        log.info(
            "%s worker %s registered at %s%s",
            role,
            worker_id,
            address,
            f" (was {old.role} at {old.address})" if old is not None and not old.static else "",
        )
        return worker

    def heartbeat(self, worker_id: str, stats=None) -> bool:
        """A registered worker's heartbeat, with its WorkerStats when it could read them: an
        answer, so the worker is not silent. False when `worker_id` is not a member (never
        registered, or dropped out): it must Register again."""
        with self._lock:
            worker = self._registered.get(worker_id)
            if worker is None:
                return False
            worker.heard_at = max(worker.heard_at, self._clock())
            if stats is not None and stats.worker_id:
                worker.stats = stats
        if stats is not None and stats.worker_id:
            self._reported(worker, stats)
        if stats is None or not self._check_stall(worker, stats):
            self._alive(worker, stats, blocks=worker.role == "decode")
        return True

    # ---- health ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.stats_ttl_s):  # start() ran the first sweep
            try:
                # the answers of workers that answer at once are used by the sweep that asked; a
                # late one is taken by a later sweep
                self.sweep(wait_s=self.stats_ttl_s)
            except Exception:  # a dead health thread would freeze every worker's state
                log.exception("worker health sweep failed")

    def sweep(self, wait_s: float = 0.0) -> None:
        """One health check of every worker (the thread runs one every stats_ttl_s): takes the
        answers to the Stats polls that came back, sends a new poll to each worker with none
        outstanding (its deadline the silence bound: a late answer is still an answer), then
        judges each worker's silence. wait_s: first wait up to that long for the polls
        outstanding (tests that want one sweep to see the answers)."""
        with self._lock:
            workers = self._workers["prefill"] + self._workers["decode"]
        self._take_answers(workers)
        for worker in workers:
            if worker.poll is None:
                worker.poll_sent = time.monotonic()
                worker.poll = worker.stub.Stats.future(
                    self._stats_request(worker), timeout=self.silence_s
                )
        if wait_s > 0:
            deadline = time.monotonic() + wait_s
            for worker in workers:
                try:
                    worker.poll.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - taken below, or still outstanding
                    pass
            self._take_answers(workers)
        self._expire()
        with self._lock:
            decode_blocks = sum(  # the host tiers' blocks too (engine/kv_host_tier.py)
                w.stats.num_total_blocks + w.stats.kv_host_tier_capacity_blocks
                for w in self._workers["decode"]
                if w.stats
            )
        self.kv_index.fit_to_blocks(decode_blocks)
        with self._lock:  # each affinity view holds no more than its role's caches can
            for view, role in ((self._affinity, "prefill"), (self._decode_affinity, "decode")):
                view.fit_to_tokens(
                    sum(
                        w.stats.num_total_blocks * w.stats.block_size
                        for w in self._workers[role]
                        if w.stats
                    )
                )
        self.num_sweeps += 1

    def _stats_request(self, worker: _Worker):
        """A Stats poll of `worker` (health thread only); a decode worker's asks for its KV
        events from the index's place in its stream (router/kv_index.py)."""
        if worker.role != "decode":
            return worker_pb2.StatsRequest()
        epoch, after = self.kv_index.position(worker)
        worker.kv_polls += 1
        worker.kv_asked = (epoch, after, worker.kv_polls)
        return worker_pb2.StatsRequest(
            want_kv_events=True, kv_events_epoch=epoch, kv_events_after=after
        )

    def _take_kv_events(self, worker: _Worker, stats) -> None:
        """Applies a Stats answer's KV events to the index (health thread), and takes them off
        the stats the pool keeps (the metrics and ListWorkers read those)."""
        if not stats.HasField("kv_events"):
            return
        events = stats.kv_events
        stats.ClearField("kv_events")
        if worker.role != "decode" or not self.is_member(worker):
            return
        epoch, after, poll = worker.kv_asked
        done = self.kv_index.apply(worker, (epoch, after), events, poll)
        if done == "broken":
            log.warning(
                "decode worker %s: its KV event stream broke (asked after %d of epoch %d, got "
                "up to %d of epoch %d): its blocks are dropped from the index until it resyncs",
                self.name(worker),
                after,
                epoch,
                events.last_seq,
                events.epoch,
            )

    def _take_answers(self, workers: list[_Worker]) -> None:
        """Notes each poll of `workers` that has ended (health thread only)."""
        for worker in workers:
            poll = worker.poll
            if poll is None or not poll.done():
                continue
            worker.poll = None
            try:
                stats = poll.result()
            except grpc.RpcError as e:
                self._note_failure(worker, e)
            except Exception as e:  # noqa: BLE001 - a cancelled poll (the pool is closing)
                log.debug("Stats poll of %s ended: %r", self.name(worker), e)
            else:
                self._note_stats(worker, stats, asked_at=worker.poll_sent)

    def _note_stats(self, worker: _Worker, stats, asked_at: float) -> None:
        """A Stats answer: the worker is not silent, its last call did not fail, and unless its
        engine is stuck (_check_stall) it is alive and up, with these figures."""
        self._take_kv_events(worker, stats)
        with self._lock:
            worker.heard_at = max(worker.heard_at, self._clock())
            worker.num_failures, worker.failed = 0, False
            worker.worker_id = worker.worker_id or stats.worker_id
            worker.stats = stats
        self._reported(worker, stats)
        if not self._check_stall(worker, stats):
            self._alive(worker, stats, asked_at=asked_at)

    def _alive(
        self, worker: _Worker, stats, blocks: bool = True, asked_at: float | None = None
    ) -> None:
        """`worker` answered, with `stats` that show no stuck engine (None: a heartbeat without
        figures, which clears silence but cannot clear a stall): no longer dead of that, and up
        unless its last Stats call failed outright (only a Stats answer clears that). blocks:
        take its KV blocks from `stats`, which the worker counted at `asked_at` (time.monotonic;
        None: now)."""
        with self._lock:
            was = worker.down
            if stats is not None or worker.dead == "silent":
                worker.dead = ""
            worker.down = worker.failed or bool(worker.dead)
            if stats is not None and blocks and not worker.down:
                _note_blocks(worker, stats, time.monotonic() if asked_at is None else asked_at)
            back = was and not worker.down
        if back:
            log.info("%s worker %s is back up", worker.role, self.name(worker))

    def stall_bound_s(self, stats) -> float:
        """How long one turn of the worker's engine may compute, or go without computing,
        before it is dead: stall_s, or stall_factor times the CPU time of the costliest turn it
        reported finishing recently, or stall_factor times what its running step should cost
        (its tokens at the most CPU time per token of late), whichever is more."""
        expected = stats.engine_turn_tokens * stats.engine_us_per_token_max / 1e6
        return max(
            self.stall_s,
            self.stall_factor * stats.engine_turn_ms_max / 1000,
            self.stall_factor * expected,
        )

    def _check_stall(self, worker: _Worker, stats) -> bool:
        """True when `stats` says the worker's engine has computed in one turn, or gone without
        computing, for its stall bound or more: it answers, but its engine is stuck. It is dead:
        down (no new requests), and its calls silent since the turn began are dropped, as for a
        worker that stopped."""
        if stats.engine_loading_weights:
            # a weight update's load (UpdateWeights, which the router itself called, bounded by
            # its timeout there): a long turn that is not a hang
            return False
        stalled_s = stats.engine_stalled_ms / 1000  # the turn's wall time: names the turn
        busy_s, idle_s = stats.engine_turn_cpu_ms / 1000, stats.engine_idle_ms / 1000
        bound = self.stall_bound_s(stats)
        now = self._clock()
        if max(busy_s, idle_s) < bound:
            # an older report of the same stuck turn (a heartbeat's figures can arrive after a
            # later poll's) does not bring it back: only a turn that ended does
            return (
                worker.dead == "stalled"
                and stalled_s > 0
                and abs(now - stalled_s - worker.stuck_since) < 1.0
            )
        how = (
            f"used {busy_s:.1f} s of CPU"
            if busy_s >= bound
            else f"gone {idle_s:.1f} s without using the CPU"
        )
        why = f"{worker.role} worker {self.name(worker)} is dead: its engine is stuck in a turn "
        why += f"of {stalled_s:.1f} s that has {how} (stall bound {bound:.1f} s: worker_stall_s="
        why += f"{self.stall_s:g}, costliest recent turn {stats.engine_turn_ms_max} ms of CPU, "
        why += f"a step of {stats.engine_turn_tokens} tokens at up to "
        why += f"{stats.engine_us_per_token_max} us of CPU each)"
        with self._lock:
            died = worker.dead != "stalled"
            worker.dead, worker.down = "stalled", True
            worker.stuck_since = now - stalled_s
            worker.num_free_blocks = -1
            worker.stats = stats
            if died:
                self.deaths["stalled"] += 1
        if died:
            log.warning("%s", why)
        self._dropped(worker, why, now - stalled_s)
        return True

    def _note_failure(self, worker: _Worker, error: grpc.RpcError) -> None:
        """A Stats poll that ended without an answer. Past its deadline (the silence bound) it
        only says what the silence says already; any other failure (nothing listens, the call
        was refused) marks the worker down until a Stats answers. Neither drops a call."""
        late = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with self._lock:
            worker.num_failures += 1
            worker.num_free_blocks = -1
            worker.failed = worker.failed or not late
            went_down = worker.failed and not worker.down
            worker.down = worker.down or worker.failed
        if went_down:
            log.warning(
                "%s worker %s is down (skipped for new work): its Stats call failed (%s %s)",
                worker.role,
                self.name(worker),
                error.code(),
                error.details(),
            )

    def _expire(self) -> None:
        """Judges every worker's silence (on the health thread): silent for down_s, down; for
        silence_s, dead: a registered worker leaves the pool, a static one stays, marked dead,
        and each sweep drops its calls not heard from for silence_s."""
        now = self._clock()
        went_down, died, left, silent = [], [], [], []
        with self._lock:
            for worker in self._workers["prefill"] + self._workers["decode"]:
                quiet = now - worker.heard_at
                if quiet >= self.down_s and not worker.down:
                    worker.down = True
                    went_down.append((worker, quiet))
                if quiet < self.silence_s:
                    continue
                worker.num_free_blocks = -1
                if worker.dead != "silent":
                    worker.dead = "silent"
                    self.deaths["silent"] += 1
                    died.append(worker)
                if worker.static:
                    silent.append((worker, quiet))
                else:
                    left.append((worker, quiet))
            for worker, _ in left:
                self._workers[worker.role].remove(worker)
                del self._registered[worker.worker_id]
                self._forget(worker)
        for worker, quiet in went_down:
            log.warning(
                "%s worker %s is down (skipped for new work): silent for %.1f s",
                worker.role,
                self.name(worker),
                quiet,
            )
        for worker, quiet in silent + left:
            why = (
                f"{worker.role} worker {self.name(worker)} is dead: silent (no Stats answer, no "
                f"heartbeat) for {quiet:.1f} s (worker_silence_s={self.silence_s:g})"
            )
            if worker in died:
                log.warning("%s%s", why, "" if worker.static else "; it left the pool")
            self._dropped(worker, why, None if not worker.static else now - self.silence_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.stats_ttl_s + 5)
        with self._lock:
            workers = self._workers["prefill"] + self._workers["decode"]
        for worker in workers:
            if worker.poll is not None:
                worker.poll.cancel()
            worker.channel.close()


def has_adapter(worker: _Worker, adapter: str) -> bool:
    """Whether `worker`'s last WorkerStats say it serves LoRA adapter `adapter` (a cut list
    counts as maybe: true); false before its first Stats."""
    stats = worker.stats
    if stats is None:
        return False
    return adapter in stats.lora_adapters or stats.lora_adapters_count > len(stats.lora_adapters)


def _with_adapter(workers: list[_Worker], adapter: str) -> list[_Worker]:
    """The workers that have `adapter` (all of them for the base model, or when none has it),
    in their order (under the pool's lock)."""
    if not adapter:
        return workers
    having = [w for w in workers if has_adapter(w, adapter)]
    return having or workers


def _resident(worker: _Worker, adapter: str) -> bool:
    """Whether `adapter`'s weights are resident on `worker` by its last Stats."""
    return bool(adapter) and worker.stats is not None and adapter in worker.stats.lora_resident


def _block_size(worker: _Worker) -> int:
    """The worker's tokens per KV block (16 until its Stats tell; under the pool's lock)."""
    return worker.stats.block_size if worker.stats and worker.stats.block_size else 16


def _reserving_blocks(worker: _Worker) -> float:
    """The blocks its unanswered Reserves will take (under the pool's lock): their prompt tokens
    over the worker's block size (16 until its Stats tell), a ranking figure."""
    if not worker.reserving_tokens:
        return 0
    block_size = worker.stats.block_size if worker.stats and worker.stats.block_size else 16
    return worker.reserving_tokens / block_size


def _note_blocks(worker: _Worker, stats, asked_at: float) -> None:
    """A worker's KV blocks from its Stats, counted at `asked_at`, less those of the streams
    that ended after that (note_freed; under the pool's lock)."""
    worker.ended = [(when, n) for when, n in worker.ended if when > asked_at]
    freed = min(sum(n for _, n in worker.ended), stats.num_total_blocks - stats.num_free_blocks)
    worker.num_free_blocks = stats.num_free_blocks + freed
    worker.num_used_blocks = max(0, stats.num_total_blocks - stats.num_free_blocks - freed)
