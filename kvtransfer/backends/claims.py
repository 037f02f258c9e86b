"""Write claims: which senders may still write into a decode worker's reservation, on the
backends whose senders write into the decode worker's KV pool themselves (nixl's one-sided
WRITEs, shm's copies into the shared pool file), where the decode side cannot see a write land.

The decode worker's hand-off issues a write grant per reservation at Reserve (Grants.issue; the
reservation's KVEndpoint carries it). Before its first write a sender claims the reservation on
the backend's control server (KVClaim: request id, grant, block ids, the sending agent and its
process); the claim is refused (PERMISSION_DENIED, with why) unless the grant is the one of a
reservation that still holds (not committed, aborted or past its lease) and the block ids are
exactly the reserved ones. A yes carries the claim's write window: the sender starts no write
after it ends (it claims again to go on); and the first block it covers (`first_block`): a claim
covers the reserved blocks from the first one past the decode side's cached prefix on
(num_cached_tokens // block_size). The blocks before it come from the decode worker's prefix
cache and other requests may share them, so no sender writes them: a sender writes no token
before that block (nixl's NixlTransport checks each chunk), and the receiver fails a request
whose frame starts before the cached tokens (kvtransfer/receiver.py). A cached prefix that
ended inside a block would leave that block covered, for the new tokens after it; the engine's
never does (it caches whole blocks only, and only full blocks are shared).

A claim is over with the sender's last word for it (its commit or abort frame; a pipelined
stage's KVRelease), once every claiming process is proven gone (same kernel and pid namespace:
process_identity, process_gone; true of a DRAM pool, which only the sender's CPU writes), or,
past its bound (window + transfer timeout + RELEASE_MARGIN_S), once each claimant's control
connection was closed from its side (peer_gone). A reservation that ends while its claim is not
over is held: its blocks stay reserved, never handed to another request, until the claim is
over, and then the hand-off frees them (decode_worker/handoff.py); one committed meanwhile (a
commit of one of two claimants) runs, and the hand-off keeps its blocks out of the free pool
until then. A hold past its bound with none of these is stuck: the worker reports itself
unhealthy (`Grants.stuck`) until the claim ends after all.

A pipelined sender (a prefill worker in pipeline stages) writes from one process per stage rank,
each a claimant of its own that says which part it is (PipelineStage); a later stage's rank
claims before each step's writes and releases after them, and rank 0's commit or abort ends the
first stage's claim (the Grants docstring). ClaimsControl is the control server's side: KVClaim,
KVRelease and the screening of every frame; the senders call `ask_claim_cover` and `tell_released`.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import msgpack

from pdserve.kvtransfer.backends.grpc_backend import GrpcServer
from pdserve.kvtransfer.backends.grpc_sender import SERVICE
from pdserve.kvtransfer.transport import FrameHandler, PipelineStage, refusal
from pdserve.kvtransfer.wire import MAX_REQUEST_ID_CHARS, ChunkHeader

log = logging.getLogger(__name__)

CLAIMING = frozenset({"nixl", "shm"})  # the backends whose senders claim before they write
CLAIM_METHOD = f"/{SERVICE}/KVClaim"
RELEASE_METHOD = f"/{SERVICE}/KVRelease"
MAX_CLAIM_BYTES = 1 << 20  # a claim is a request id, a grant and at most a few 10k block ids
MAX_BLOCKS = 1 << 20
RELEASE_MARGIN_S = 5.0  # the decode side's bound on a claim: window + xfer timeout + this
MAX_SENDER_CHARS = 64  # a pipelined sender's id (rank 0 makes 32 hex digits)
MAX_STAGE_RANKS = 1024  # the ranks of one pipeline stage (its TP size) a claim may name
# a sender claims a reservation again, its writes ended, once less than this share of its write
# window is left: a prefill that outlasts the window, or waited long after its claim, goes on
RECLAIM_SHARE = 0.25


_PROC = "/proc"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _start_time(pid: int, proc: str = _PROC) -> int | None:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22); None when no
    process has that pid or it is a zombie (its memory is gone). Other errors raise OSError."""
    try:
        stat = _read(f"{proc}/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # fields 3 onwards: the name may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


_identity: tuple[int, dict] | None = None


def process_identity() -> dict:
    """This process, as a claim names it: the kernel's boot id, its pid namespace, its pid and
    start time. A receiver on the same kernel and in the same pid namespace can tell from them
    whether this process is still alive ({} where /proc cannot say)."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:
        try:
            ident = {
                "boot": _read(f"{_PROC}/sys/kernel/random/boot_id"),
                "pidns": os.readlink(f"{_PROC}/self/ns/pid"),
                "pid": pid,
                "start": _start_time(pid),
            }
        except (OSError, ValueError, IndexError):
            ident = {}
        _identity = (pid, ident if ident.get("start") is not None else {})
    return dict(_identity[1])


def process_gone(identity: dict | None, proc: str = _PROC) -> bool:
    """True only when the process `identity` names is proven over: it ran on this kernel (the
    same boot id) in this pid namespace, and its pid is now free, a zombie, or another process
    (another start time). Anything else, another host or namespace, no identity or an
    unreadable /proc included, is not proof: False."""
    if not identity:
        return False
    try:
        if identity.get("boot") != _read(f"{proc}/sys/kernel/random/boot_id"):
            return False
        if identity.get("pidns") != os.readlink(f"{proc}/self/ns/pid"):
            return False
        return _start_time(int(identity["pid"]), proc) != identity.get("start")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def _same(token: str, given: str) -> bool:
    """Constant-time comparison of a grant with what a peer sent (any string)."""
    return hmac.compare_digest(token.encode(), given.encode("utf-8", "replace"))


class GrantRefused(Exception):
    """A claim or frame that does not match a live reservation; the message says why."""


@dataclass
class _Grant:
    token: str
    block_ids: tuple[int, ...]
    first_block: int = 0  # the first of block_ids a claim covers (those before it are cached)
    live: bool = True  # the reservation holds (not committed, aborted or expired)
    claimed_at: float | None = None  # time.monotonic() of the last claim: a transfer may write
    # the sending agents that claimed it, each with its process (process_identity(), {}: unknown)
    claimants: dict[str, dict] = field(default_factory=dict)
    # each claiming agent's control connection (the claim call's gRPC peer, "" unknown), and the
    # agents whose connection its sender ended since (its process or host gone, or its transport
    # closed after its WRITEs): past the bound, such a claim is over (Grants.due)
    peers: dict[str, str] = field(default_factory=dict)
    disconnected: set[str] = field(default_factory=set)
    over: bool = False  # the sender's commit or abort arrived: no write of it is left
    # the claimants that claimed as a stage of a pipelined sender, each with its part
    stages: dict[str, PipelineStage] = field(default_factory=dict)
    # the claimants known over by a word of their own since their last claim: a stage's release,
    # or a pipelined sender's commit or abort, its first stage's (Grants.check)
    ended: set[str] = field(default_factory=set)
    on_over: Callable[[], None] | None = None  # the reservation ended while its claim may write
    stuck: bool = False  # held past its bound: the worker reports itself unhealthy
    refused: int = 0

    def pipelined(self) -> bool:
        """Every claimant is a stage of one pipelined sender (one sender id, one stage count)."""
        if not self.stages or len(self.stages) != len(self.claimants):
            return False
        first = next(iter(self.stages.values()))
        return all(
            s.stages == first.stages and _same(first.sender, s.sender) for s in self.stages.values()
        )

    def is_over(self) -> bool:
        """No write of any claimant is left: the lone sender's last word, or every claimant's."""
        return self.over or (bool(self.claimants) and self.ended >= set(self.claimants))


class Grants:
    """One write grant per reservation of a decode worker, from Reserve until the transfer is
    known over (the module docstring says what that means).

    issue() at Reserve; claim() from the control server; check() for every frame before the
    handler sees it; close() when the reservation ends: it returns True when the blocks may be
    freed now, else it calls `on_over` once the claim is over: the sender's commit or abort, or
    (`due()`, polled by the hand-off's sweep) every claiming process proven gone. A held claim
    past `release_bound_s` with neither is stuck: still held, and `stuck()` says why the worker
    is unhealthy until it ends after all.

    `pid_proof`: a dead sending process on this host ends its claim's writes (true of a DRAM
    pool, which only the sender's CPU writes; NixlServer turns it off for a VRAM pool, whose
    copies a GPU runs). `num_layers`: the pool's decoder layers, what a pipelined claim's stages
    and layers are checked against (NixlServer sets it from the pool; None: not checked).

    A pipelined sender's claims (the module docstring): `claim` with a PipelineStage, `release`
    for a later stage's own last word; `check` takes a commit or abort as the first stage's, and
    only when every claimant is a stage of that one sender.
    """

    def __init__(
        self,
        window_s: float = 60.0,
        xfer_timeout_s: float = 30.0,
        pid_proof=True,
        num_layers: int | None = None,
    ):
        if not window_s > 0 or not xfer_timeout_s > 0:
            raise ValueError(
                f"window_s and xfer_timeout_s must be > 0, got {window_s} and {xfer_timeout_s}"
            )
        self.window_s, self.xfer_timeout_s = window_s, xfer_timeout_s
        self.release_bound_s = window_s + xfer_timeout_s + RELEASE_MARGIN_S
        self._grants: dict[str, _Grant] = {}
        self._lock = threading.Lock()
        self.pid_proof = bool(pid_proof)
        self.num_layers = num_layers
        self.num_refused = 0  # claims and frames refused
        self.num_released_sender_gone = 0  # held blocks freed as their senders were proven gone
        self.num_released_peer_gone = 0  # held blocks freed past the bound, senders disconnected
        self.num_stuck_total = 0  # held claims that went past their bound (each counted once)
        self.num_released_stages = 0  # held blocks freed by a pipelined sender's stages' words

    def issue(self, request_id: str, block_ids, first_block: int = 0) -> str:
        """A new reservation's write grant. `first_block`: how many of its leading blocks hold
        the decode side's cached prefix (num_cached_tokens // block_size), which its claims do
        not cover (the module docstring)."""
        blocks = tuple(int(b) for b in block_ids)
        if not 0 <= first_block <= len(blocks):
            raise ValueError(
                f"first_block {first_block} is not one of the reservation's {len(blocks)} blocks"
            )
        token = secrets.token_hex(16)
        with self._lock:
            if request_id in self._grants:
                raise ValueError(f"request_id {request_id!r} already holds a write grant")
            self._grants[request_id] = _Grant(token, blocks, first_block)
        return token

    def first_block(self, request_id: str) -> int:
        """The first of the reservation's blocks its claims cover (0 when it has no grant)."""
        with self._lock:
            grant = self._grants.get(request_id)
            return grant.first_block if grant is not None else 0

    def token(self, request_id: str) -> str:
        with self._lock:
            grant = self._grants.get(request_id)
            return grant.token if grant is not None else ""

    def _refuse(self, why: str) -> GrantRefused:
        self.num_refused += 1
        return GrantRefused(why)

    def claim(
        self,
        request_id: str,
        token: str,
        block_ids,
        agent: str = "",
        process: dict | None = None,
        peer: str = "",
        stage: PipelineStage | None = None,
    ) -> float:
        """The write window in seconds; GrantRefused says what does not match.

        `process`: the sending process (process_identity()), which lets a dead sender's claim end
        before its bound. `peer`: the claim's control connection (the gRPC peer), whose end by
        its sender (`peer_gone`) ends the claim once past its bound. `agent`: the sending NIXL agent. A claim while the reservation holds is taken again: the
        router retries a failed prefill once into the same reservation. From the same agent,
        that agent's earlier WRITEs are over (a sender claims a request again only after
        its earlier WRITEs ended); from another agent, the first may still be writing, so from
        then on a sender's last frame no longer ends a hold (whose it is cannot be told): only
        both senders' processes proven gone do, and past the bound of the latest claim the hold
        is stuck (the worker reports itself unhealthy until they are). A
        grant whose reservation ended is refused: the replay that matters.

        `stage`: the claim is that part of a pipelined sender (the module docstring); it must
        fit the pool's layers and agree with the other stages of its sender, and a part that
        another agent holds is refused. A claim, staged or not, means its agent may write again:
        any word of it that came before no longer counts."""
        with self._lock:
            grant = self._grants.get(request_id)
            if grant is None or not _same(grant.token, token):
                raise self._refuse(
                    f"no reservation of request {request_id[:64]!r} holds this write grant "
                    f"(forged, or its reservation is gone)"
                )
            if not grant.live:
                raise self._refuse(
                    f"the reservation of request {request_id[:64]!r} has ended (replayed grant)"
                )
            if tuple(block_ids) != grant.block_ids:
                raise self._refuse(
                    f"the claim names blocks outside the reservation of request "
                    f"{request_id[:64]!r}: {len(grant.block_ids)} blocks were reserved, the "
                    f"claim's block ids differ"
                )
            if stage is not None:
                why = self._stage_refusal(grant, agent, stage)
                if why:
                    raise self._refuse(f"request {request_id[:64]!r}: {why}")
            grant.claimed_at = time.monotonic()
            grant.claimants[agent] = dict(process or {})
            grant.peers[agent] = peer
            grant.disconnected.discard(agent)
            if stage is not None:
                grant.stages[agent] = stage
            else:
                grant.stages.pop(agent, None)
            grant.ended.discard(agent)
            grant.over = False
            return self.window_s

    def _stage_refusal(self, grant: _Grant, agent: str, stage: PipelineStage) -> str:
        """Why a pipelined claim cannot be taken ("" when it can): its fields out of range or
        the pool's layers, or at odds with its sender's other stages' claims."""
        layers = self.num_layers
        first, end = stage.layers
        if not 2 <= stage.stages <= (layers or stage.stages) or not 0 <= stage.stage < stage.stages:
            return (
                f"pipeline stage {stage.stage} of {stage.stages}: a pipelined claim has "
                f"0 <= stage < stages and 2 <= stages <= {layers or 'the layers'}"
            )
        if not 0 <= first < end <= (layers or end):
            return (
                f"layers [{first}, {end}) of pipeline stage {stage.stage} do not fit the "
                f"pool's {layers or '?'} layers"
            )
        if not 0 <= stage.rank < MAX_STAGE_RANKS or not 0 < len(stage.sender) <= MAX_SENDER_CHARS:
            return f"a pipelined claim's rank or sender id is out of range (rank {stage.rank})"
        for other, theirs in grant.stages.items():
            if other == agent or not _same(theirs.sender, stage.sender):
                continue  # the same agent claims again, or another sender (the rule of two)
            if theirs.stages != stage.stages:
                return (
                    f"pipeline stage {stage.stage} says {stage.stages} stages, another stage of "
                    f"its sender said {theirs.stages}"
                )
            if (theirs.stage, theirs.rank) == (stage.stage, stage.rank):
                return (
                    f"pipeline stage {stage.stage} rank {stage.rank} of this sender is claimed by "
                    f"another agent already"
                )
            if theirs.stage == stage.stage and theirs.layers != stage.layers:
                return (
                    f"pipeline stage {stage.stage} claims layers [{first}, {end}), another rank "
                    f"of it claimed {list(theirs.layers)}"
                )
            if theirs.stage != stage.stage and first < theirs.layers[1] and theirs.layers[0] < end:
                return (
                    f"pipeline stage {stage.stage}'s layers [{first}, {end}) overlap stage "
                    f"{theirs.stage}'s {list(theirs.layers)}"
                )
        return ""

    def release(self, request_id: str, token: str, agent: str, sender: str, peer: str = "") -> bool:
        """A pipelined claimant's own last word for its claim (KVRelease): every WRITE of it
        ended, and it claims again before it writes more. Taken only with the reservation's
        grant, from a stage claimant of that sender id, on the connection it claimed on (when
        that is known); GrantRefused otherwise. True when it freed held blocks; False when
        nothing was held or the grant is gone (its blocks freed or running already)."""
        on_over = None
        with self._lock:
            grant = self._grants.get(request_id)
            if grant is None:
                return False
            if not _same(grant.token, token):
                raise self._refuse(
                    f"a release of request {request_id[:64]!r} without its reservation's write "
                    f"grant (forged or replayed)"
                )
            stage = grant.stages.get(agent)
            if stage is None or not _same(stage.sender, sender):
                raise self._refuse(
                    f"no pipelined claim of request {request_id[:64]!r} by this agent and sender "
                    f"to release"
                )
            if grant.peers.get(agent) and grant.peers[agent] != peer:
                raise self._refuse(
                    f"the release of request {request_id[:64]!r} came on another connection than "
                    f"its claim"
                )
            grant.ended.add(agent)
            if not grant.live and grant.on_over is not None and grant.is_over():
                del self._grants[request_id]
                on_over = grant.on_over
                self.num_released_stages += 1
        if on_over is not None:
            on_over()
        return on_over is not None

    def peer_gone(self, peer: str) -> int:
        """The sender at the control connection `peer` ended it (its last stream there closed
        from its side: its process or host gone, or its transport closed once its WRITEs
        ended). Its claims' holds end at their bound (`due`) rather than staying stuck: a
        sender that is gone posts no WRITE, and the bound covers those it had posted. Returns
        how many claims it had."""
        if not peer:
            return 0
        with self._lock:
            hit = 0
            for grant in self._grants.values():
                for agent, where in grant.peers.items():
                    if where == peer:
                        grant.disconnected.add(agent)
                        hit += 1
            return hit

    def check(self, header: ChunkHeader) -> str | None:
        """Why a frame must be refused (None: hand it on). A "commit" or "abort" with the right
        grant is the sender's last word for its request: the claim is over."""
        on_over = None
        with self._lock:
            grant = self._grants.get(header.request_id)
            if grant is None:
                return None  # not (or no longer) reserved here: the hand-off drops it
            if not _same(grant.token, header.grant):
                self.num_refused += 1
                return "a KV frame without the reservation's write grant (forged or replayed)"
            if header.kind == "kv" and header.in_place and grant.claimed_at is None:
                self.num_refused += 1
                return "an in-place KV frame for a reservation no sender claimed"
            if header.kind in ("commit", "abort"):
                if grant.stages:
                    if grant.pipelined():
                        # rank 0's last word, for the first stage only: each later stage's
                        # claims end by its own release (which, before a commit, came already)
                        grant.ended.update(a for a, s in grant.stages.items() if s.stage == 0)
                    # else stages of two senders: whose word this is cannot be told
                elif len(grant.claimants) <= 1:
                    # with two claimants, whose last word this is cannot be told: only their
                    # processes' end releases the hold (due()), or the worker reports it stuck
                    grant.over = True
                if not grant.live and grant.is_over():
                    del self._grants[header.request_id]
                    on_over, grant.on_over = grant.on_over, None
        if on_over is not None:
            on_over()
        return None

    def close(self, request_id: str, on_over: Callable[[], None] | None) -> bool:
        """The reservation ended (aborted, expired or committed). True: no write of it can land
        any more, its blocks may go now; False: held, `on_over` is called once the claim is over
        (a committed request's blocks run in the engine meanwhile, and the hand-off keeps them
        from the free pool until then: decode_worker/handoff.py). `on_over` None: nothing is
        held; the grant is kept to its bound only to refuse a replayed claim."""
        with self._lock:
            grant = self._grants.get(request_id)
            if grant is None:
                return True
            grant.live = False
            if grant.claimed_at is None or grant.is_over():
                del self._grants[request_id]
                return True
            grant.on_over = on_over
            return False

    def due(self) -> int:
        """Release the held reservations whose claiming processes are all proven gone, or, past
        their bound, each proven gone or disconnected (`peer_gone`); mark the other ones past
        their bound stuck (logged once each), and drop the replay guards past theirs; returns
        how many held reservations were released."""
        now = time.monotonic()
        with self._lock:
            ended = [(rid, g, dict(g.claimants)) for rid, g in self._grants.items() if not g.live]
        proven: dict[str, set[str]] = {}
        if self.pid_proof:  # reading /proc outside the lock
            for rid, grant, claimants in ended:
                if grant.on_over is not None and claimants:
                    proven[rid] = {a for a, p in claimants.items() if process_gone(p)}
        calls, newly_stuck, freed_stuck = [], [], []
        with self._lock:
            for rid, grant, _ in ended:
                if self._grants.get(rid) is not grant:
                    continue  # its sender's last word came meanwhile
                past = now - grant.claimed_at > self.release_bound_s
                agents = set(grant.claimants)
                gone = proven.get(rid, set()) | grant.ended
                if grant.on_over is None:  # nothing held: a replay guard, kept to the bound
                    if past:
                        del self._grants[rid]
                elif agents and agents <= gone:
                    del self._grants[rid]
                    calls.append(grant.on_over)
                    self.num_released_sender_gone += 1
                elif past and agents and agents <= gone | grant.disconnected:
                    del self._grants[rid]
                    calls.append(grant.on_over)
                    self.num_released_peer_gone += 1
                    if grant.stuck:
                        freed_stuck.append(rid)
                elif past and not grant.stuck:
                    grant.stuck = True
                    newly_stuck.append(rid)
            self.num_stuck_total += len(newly_stuck)
        for rid in newly_stuck:
            log.error(
                "the KV writes of held reservation %s are past their bound of %.0f s and not known "
                "over: its blocks stay held and this worker reports itself unhealthy",
                rid[:64],
                self.release_bound_s,
            )
        for rid in freed_stuck:
            log.warning(
                "held reservation %s freed: its senders' connections closed and its bound passed",
                rid[:64],
            )
        for call in calls:
            call()
        return len(calls)

    def stuck(self) -> str:
        """Why the worker is unhealthy: held reservations that a WRITE may still reach past their
        bound ("" when none)."""
        with self._lock:
            stuck = [(rid, len(g.block_ids)) for rid, g in self._grants.items() if g.stuck]
        if not stuck:
            return ""
        return (
            f"{len(stuck)} reservation(s) ({sum(n for _, n in stuck)} KV blocks) held past the "
            f"KV write bound of {self.release_bound_s:.0f} s: a sender may still write into "
            f"them (first: {stuck[0][0][:64]!r}); end that sender or restart this worker"
        )

    @property
    def num_held(self) -> int:
        with self._lock:
            return sum(1 for g in self._grants.values() if not g.live and g.on_over is not None)


# ---- parsing claims and releases ------------------------------------------------------------


def _msgpack_map(request: bytes, what: str, shape: str) -> dict:
    """`request` (a claim or release off the control channel) as the msgpack map it must be, at
    most MAX_CLAIM_BYTES; ValueError says what is wrong, naming `what` and the `shape` to send."""
    if len(request) > MAX_CLAIM_BYTES:
        raise ValueError(f"{what} has at most {MAX_CLAIM_BYTES} bytes, got {len(request)}")
    try:
        ask = msgpack.unpackb(request)
    except Exception as e:
        raise ValueError(f"not msgpack ({e})") from None
    if not isinstance(ask, dict):
        raise ValueError(f"send a msgpack map {shape}")
    return ask


def parse_claim(
    request: bytes,
) -> tuple[str, str, list[int], str, dict, PipelineStage | None]:
    """A KVClaim's fields; ValueError says which is malformed. Its pipeline stage is None for
    a sender that is not pipelined (no "stages", or 1); Grants.claim checks the stage's ranges."""
    ask = _msgpack_map(request, "a claim", '{"request_id": str, "grant": str, "block_ids": [int]}')
    rid, token, blocks = ask.get("request_id"), ask.get("grant"), ask.get("block_ids")
    agent, process = ask.get("agent", ""), ask.get("process", {})
    if not isinstance(process, dict) or (process and not _an_identity(process)):
        raise ValueError(
            '"process" must be the sender\'s {"boot": str, "pidns": str, "pid": int, '
            '"start": int}, or {}'
        )
    if not isinstance(agent, str) or len(agent) > 256:
        raise ValueError('"agent" must be the sending NIXL agent\'s name, at most 256 characters')
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_CHARS:
        raise ValueError(f'"request_id" must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters')
    if not isinstance(token, str) or not 0 < len(token) <= 64:
        raise ValueError('"grant" must be the reservation\'s write grant, 1 to 64 characters')
    if (
        not isinstance(blocks, list)
        or len(blocks) > MAX_BLOCKS
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks)
    ):
        raise ValueError(f'"block_ids" must be a list of at most {MAX_BLOCKS} ints >= 0')
    return rid, token, blocks, agent, process, _stage_of(ask)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stage_of(ask: dict) -> PipelineStage | None:
    """A claim's pipeline stage: "stage", "stages", "rank", "layers" [first, end) and "sender"
    (types and sizes here; Grants.claim checks them against the pool and the other stages)."""
    stage, stages = ask.get("stage", 0), ask.get("stages", 1)
    rank, layers, sender = ask.get("rank", 0), ask.get("layers"), ask.get("sender", "")
    if not all(_int(v) and 0 <= v < 1 << 31 for v in (stage, stages, rank)):
        raise ValueError('"stage", "stages" and "rank" must be ints >= 0')
    if stages <= 1:
        if stage or rank or layers is not None or sender:
            raise ValueError(
                'a claim that is not one of a pipelined sender\'s ("stages" 1 or absent) has no '
                '"stage", "rank", "layers" or "sender"'
            )
        return None
    if not isinstance(sender, str) or not 0 < len(sender) <= MAX_SENDER_CHARS:
        raise ValueError(
            f'"sender" must be the pipelined sender\'s id, 1 to {MAX_SENDER_CHARS} characters'
        )
    if (
        not isinstance(layers, list)
        or len(layers) != 2
        or not all(_int(v) and 0 <= v < 1 << 31 for v in layers)
    ):
        raise ValueError('"layers" must be the stage\'s decoder layers [first, end), two ints >= 0')
    return PipelineStage(sender, stage, stages, (layers[0], layers[1]), rank)


def parse_release(request: bytes) -> tuple[str, str, str, str]:
    """A KVRelease's (request id, grant, agent, sender id); ValueError says what is wrong."""
    ask = _msgpack_map(
        request, "a release", '{"request_id": str, "grant": str, "agent": str, "sender": str}'
    )
    rid, token = ask.get("request_id"), ask.get("grant")
    agent, sender = ask.get("agent"), ask.get("sender")
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_CHARS:
        raise ValueError(f'"request_id" must be a string of 1 to {MAX_REQUEST_ID_CHARS} characters')
    if not isinstance(token, str) or not 0 < len(token) <= 64:
        raise ValueError('"grant" must be the reservation\'s write grant, 1 to 64 characters')
    if not isinstance(agent, str) or len(agent) > 256:
        raise ValueError('"agent" must be the sending NIXL agent\'s name, at most 256 characters')
    if not isinstance(sender, str) or not 0 < len(sender) <= MAX_SENDER_CHARS:
        raise ValueError(
            f'"sender" must be the pipelined sender\'s id, 1 to {MAX_SENDER_CHARS} characters'
        )
    return rid, token, agent, sender


def _an_identity(process: dict) -> bool:
    """A process_identity() as a claim carries it."""
    return (
        set(process) == {"boot", "pidns", "pid", "start"}
        and all(isinstance(process[k], str) and len(process[k]) <= 64 for k in ("boot", "pidns"))
        and all(
            isinstance(process[k], int) and not isinstance(process[k], bool) and process[k] >= 0
            for k in ("pid", "start")
        )
    )


# ---- the control server's side ----------------------------------------------------------------


class ClaimsControl(GrpcServer):
    """A backend's control server (in-place frames are valid here: the senders wrote their KV)
    with KVClaim and KVRelease; every frame passes `grants` first (Grants.check) and one that
    does not is handed on as a refusal of its request. `pool`: the identity of the KV pool the
    grants are for, which every claim's reply carries, so that a sender can tell that the pool
    it maps is this server's (the shm backend's; None: the reply does not say)."""

    accepts_in_place = True

    def __init__(
        self, handler: FrameHandler, grants: Grants, pool: list[str] | None = None, **opts
    ):
        self.grants = grants
        self._pool = pool
        self._peers_lock = threading.Lock()
        self._open_streams: dict[str, int] = {}  # gRPC peer -> its open Push streams
        super().__init__(self._screened(handler), **opts)

    def _screened(self, handler: FrameHandler) -> FrameHandler:
        grants = self.grants

        def screened(header: ChunkHeader, payload) -> None:
            why = grants.check(header)
            if why is not None:
                log.warning("refused a KV frame of %s: %s", header.request_id, why)
                header, payload = refusal(header.request_id, why)
            handler(header, payload)

        return screened

    def _stream_opened(self, context) -> None:
        with self._peers_lock:
            peer = context.peer()
            self._open_streams[peer] = self._open_streams.get(peer, 0) + 1

    def _stream_ended(self, context, by_server: bool) -> None:
        """A sender's connection whose last stream it ended itself is gone (Grants.peer_gone);
        one this server closed (evicted, idle, stopping) proves nothing of its sender."""
        peer = context.peer()
        with self._peers_lock:
            left = self._open_streams.get(peer, 1) - 1
            if left > 0:
                self._open_streams[peer] = left
            else:
                self._open_streams.pop(peer, None)
        if not by_server and left <= 0:
            self.grants.peer_gone(peer)

    def extra_methods(self) -> dict:
        return {"KVClaim": self._claim, "KVRelease": self._release}

    def _claim(self, request: bytes, context) -> bytes:
        try:
            request_id, token, block_ids, agent, process, stage = parse_claim(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KVClaim: {e}")
        try:
            window_s = self.grants.claim(
                request_id, token, block_ids, agent, process, peer=context.peer(), stage=stage
            )
        except GrantRefused as e:
            log.warning("refused a KV write claim: %s", e)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        reply = {"window_s": window_s, "first_block": self.grants.first_block(request_id)}
        if self._pool is not None:
            reply["pool"] = self._pool
        return msgpack.packb(reply)

    def _release(self, request: bytes, context) -> bytes:
        try:
            request_id, token, agent, sender = parse_release(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KVRelease: {e}")
        try:
            freed = self.grants.release(request_id, token, agent, sender, context.peer())
        except GrantRefused as e:
            log.warning("refused a KV claim's release: %s", e)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        return msgpack.packb({"freed": freed})


# ---- the senders' side ----------------------------------------------------------------------


def ask_claim_cover(
    control,
    request_id: str,
    grant: str,
    block_ids,
    agent: str,
    stage: PipelineStage | None,
    timeout: float,
    pool: list[str] | None = None,
) -> tuple[float, int]:
    """Claim the reservation of `request_id` over `control` (a GrpcTransport to the decode
    side's control server) as `agent`, from this process; returns the write window in seconds
    and the first of `block_ids` the claim covers: the sender writes no token before that
    block's first (those blocks hold the decode side's cached prefix; 0 from a decode worker
    that does not say). `pool`: the identity of the pool the sender writes into, which the
    reply must name (ClaimsControl), or the grant is another pool's. PermissionError: the decode
    side refused (why), or its pool is not `pool`; ConnectionError: it could not be asked."""
    ask = {
        "request_id": request_id,
        "grant": grant,
        "block_ids": [int(b) for b in block_ids],
        "agent": agent,
        "process": process_identity(),
    }
    if stage is not None:
        ask.update(
            stage=stage.stage, stages=stage.stages, rank=stage.rank, layers=list(stage.layers),
            sender=stage.sender,
        )  # fmt: skip
    try:
        reply = msgpack.unpackb(control.call(CLAIM_METHOD, msgpack.packb(ask), timeout))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.PERMISSION_DENIED:
            raise PermissionError(
                f"the decode worker refused the KV write: {e.details()}"
            ) from None
        raise ConnectionError(
            f"claiming the reservation of {request_id} failed: {e.code().name}: {e.details()}"
        ) from None
    if pool is not None and reply.get("pool") != pool:
        raise PermissionError(
            f"the control server that granted {request_id}'s reservation serves another KV pool "
            f"than the one its address names: the endpoint joins two decode workers' parts "
            f"(forged or stale); nothing was written"
        )
    first_block = reply.get("first_block", 0)
    if not _int(first_block) or not 0 <= first_block <= len(ask["block_ids"]):
        raise ConnectionError(
            f"the decode worker's claim reply for {request_id} names first block "
            f"{first_block!r}, not one of the {len(ask['block_ids'])} reserved blocks"
        )
    return float(reply["window_s"]), first_block


def tell_released(
    control, request_id: str, grant: str, agent: str, sender: str, timeout: float
) -> None:
    """A pipelined claimant's last word for its claim of `request_id` (KVRelease): every write of
    it ended. ConnectionError when the decode side could not be told."""
    ask = {"request_id": request_id, "grant": grant, "agent": agent, "sender": sender}
    try:
        control.call(RELEASE_METHOD, msgpack.packb(ask), timeout)
    except grpc.RpcError as e:
        raise ConnectionError(
            f"releasing the claim of {request_id} failed: {e.code().name}: {e.details()}"
        ) from None
