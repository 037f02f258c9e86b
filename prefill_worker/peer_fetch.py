"""Peer fetch on the prefill side: before a prompt's prefill, pull the cached prefix blocks its
reservation's decode worker holds (a conversation's earlier turns, prompt and answer) and this
worker does not, install them into this worker's KV cache, and let the prefill compute only the
rest (docs/architecture.md section 11).

The router asks for it per Prefill call (PrefillRequest.peer_fetch: the decode worker's address
and the bounds) when it estimates the fetch faster than recomputing (router/peer_fetch.py). The
reservation already says how many leading prompt tokens the decode worker holds
(ReserveResponse.num_cached_tokens); it holds those blocks for the reservation's life, so they
cannot be evicted while they are read. One fetch, on the Prefill call's own thread, before the
engine request is added:

  this worker's own cached prefix (held_prefix_tokens, read from this thread: a hint, since the
  engine thread may change the cache meanwhile; the install checks again) -> the blocks after it
  that the decode worker holds, capped by the call's max_blocks and max_bytes and this worker's
  own caps -> DecodeWorker.FetchKV over the control plane (the cluster secret on the channel,
  bounded by the call's timeout and the client's deadline) -> each block checked
  (kvtransfer/peer.py: layout fingerprint, chain hash computed here from the prompt, size,
  digest); the first bad one is refused and ends the fetch -> the good ones installed on the
  engine loop (engine/block_manager.py install_fetched), submitted without waiting, so the install
  and the engine request that follows it run in the same turn of the loop, in that order, and
  the call waits on the loop once -> the prefill's admission finds them as prefix hits (counted
  by source "peer").

A hybrid model's prompt also needs the recurrent state after its last fetched block: the decode
worker sends blocks only through the last one a kept state follows, with that state on the last
(FetchKVBlock.state, its own digest and size checked here), and the install keeps it in a slot
as the prefix cache keeps states (engine_core.LLMEngine.install_state); blocks that come without
a state are not installed (they would serve nothing).

Any failure (the decode worker gone or slow, its reservation ended, a refused block) ends the
fetch where it is: what was checked is installed, the rest is computed, and the Prefill call goes
on with no error of its own. The decode side keeps the prefix blocks in its reservation either
way, and the push sends only the blocks it does not hold (PushSink's skip).

A FetchResult says what happened; the servicer counts it in WorkerStats and puts it in the reply.
Channels to decode workers are cached by address and closed after CHANNEL_IDLE_S unused.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from pdserve.engine.block_manager import chain_root
from pdserve.kvtransfer.peer import block_nbytes, check_block, check_state, write_block
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity
from pdserve.worker_common.images import pixel_values
from pdserve.worker_common.kv_events import engine_fingerprint, fetch_supported

log = logging.getLogger(__name__)
CHANNEL_IDLE_S = 300.0
MAX_MESSAGE_BYTES = 64 << 20  # one block per message; a big model's block is a few MiB
# this worker's own caps on one fetch, whatever the call asks
MAX_FETCH_BLOCKS = 65536
MAX_FETCH_TIMEOUT_MS = 600_000
MAX_ADDRESS_CHARS = 512


@dataclass
class FetchResult:
    tokens: int = 0  # prompt tokens installed from the peer (or found cached): after settle()
    bytes: int = 0  # KV bytes received
    seconds: float = 0.0  # the fetch, from the call to the install submitted (not waited on)
    refused: int = 0  # blocks that failed a check
    failed: str = ""  # why the stream ended early (the peer gone, slow, its reservation over)
    skipped: str = ""  # why nothing was asked of the peer
    block_size: int = 0
    install: object = None  # the install's Future on the engine loop, until settle()

    def settle(self, timeout: float = 30.0) -> FetchResult:
        """Waits for the install (submitted to the engine loop) and counts its tokens."""
        fut, self.install = self.install, None
        if fut is not None:
            try:
                self.tokens = fut.result(timeout) * self.block_size
            except Exception as e:  # the engine stopped or broke: nothing was installed
                self.failed = self.failed or f"install: {e!r}"
        return self


def check_spec(spec) -> str:
    """What is wrong with a PrefillRequest.peer_fetch, before any work ("" when nothing)."""
    if not spec.address or len(spec.address) > MAX_ADDRESS_CHARS:
        return f"peer_fetch.address must have 1 to {MAX_ADDRESS_CHARS} characters"
    if spec.max_blocks < 1:
        return "peer_fetch.max_blocks must be >= 1"
    if spec.max_bytes < 1:
        return "peer_fetch.max_bytes must be >= 1"
    if not 1 <= spec.timeout_ms <= MAX_FETCH_TIMEOUT_MS:
        return f"peer_fetch.timeout_ms must be in [1, {MAX_FETCH_TIMEOUT_MS}]"
    return ""


class PeerFetcher:
    """loop: the worker's EngineLoop; caches: every rank's KV pool (rank order)."""

    def __init__(self, loop, caches, security: ClusterSecurity = INSECURE):
        self.loop = loop
        self.caches = caches
        self.security = security
        self._channels: dict[str, tuple[grpc.Channel, object, float]] = {}
        self._lock = threading.Lock()
        self._fingerprint: str | None = None

    def _stub(self, address: str):
        now = time.monotonic()
        with self._lock:
            idle = [a for a, (_, _, used) in self._channels.items() if now - used > CHANNEL_IDLE_S]
            for a in idle:
                self._channels.pop(a)[0].close()
            entry = self._channels.get(address)
            if entry is None:
                channel = self.security.channel(
                    address,
                    [
                        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ],
                )
                entry = (channel, worker_pb2_grpc.DecodeWorkerStub(channel), now)
            self._channels[address] = (entry[0], entry[1], now)
            return entry[1]

    def fetch(self, request, lora, deadline: float) -> FetchResult:
        """Pulls and installs what the decode worker holds of request's prompt beyond this
        worker's own cached prefix (the module docstring). Never raises for the peer's sake."""
        started = time.perf_counter()
        out = FetchResult()
        try:
            self._fetch(request, lora, deadline, out)
        except Exception as e:  # a bug or an engine error must not fail the prefill itself
            log.warning("peer fetch for %s failed: %r", request.request_id, e)
            out.failed = out.failed or repr(e)
        out.seconds = time.perf_counter() - started
        return out

    def _fetch(self, request, lora, deadline: float, out: FetchResult) -> None:
        spec, res = request.peer_fetch, request.reservation
        engine = self.loop.engine
        bm = engine.block_manager
        bs = bm.block_size
        # the ids the chain hashes: a vision-language prompt's images key their tokens' blocks
        prompt = engine.cache_ids(list(request.prompt_token_ids), pixel_values(request.images))
        if not fetch_supported(engine) or not bm.enable_prefix_caching:
            out.skipped = "this worker cannot install fetched blocks (no prefix cache, or stages)"
            return
        if res.block_size != bs:
            out.skipped = f"block sizes differ ({res.block_size} there, {bs} here)"
            return
        salt = request.sampling.cache_salt  # as the engine roots this request's chain
        root = chain_root(None if lora is None else lora.cache_root, salt)
        theirs = min(res.num_cached_tokens, len(prompt) - 1) // bs
        # read from this thread, without waiting for the engine loop's turn: a hint (the module
        # docstring); the install pins and checks the chain on the loop
        ours = bm.held_prefix_tokens(prompt, theirs * bs, root) // bs
        nbytes = block_nbytes(self.caches)
        want = min(
            theirs - ours, spec.max_blocks, MAX_FETCH_BLOCKS, spec.max_bytes // max(1, nbytes)
        )
        if want <= 0:
            out.skipped = (
                "held here already" if theirs <= ours else "the bounds allow no whole block"
            )
            return
        if self._fingerprint is None:
            self._fingerprint = engine_fingerprint(engine)
        hashes = bm.chain(prompt, ours + want, root)[ours:]
        timeout = max(0.001, min(spec.timeout_ms / 1000, deadline - time.monotonic()))
        stream = self._stub(spec.address).FetchKV(
            worker_pb2.FetchKVRequest(
                request_id=request.request_id,
                first_block=ours,
                num_blocks=want,
                # (at least 1: a model with no KV layer, Mamba's, has blocks of no bytes)
                max_bytes=min(spec.max_bytes, max(1, want * nbytes)),
            ),
            timeout=timeout,
        )
        hybrid = bm.kept_states is not None
        state: list[bytes] = []  # a hybrid's: the state after the last good block
        good = self._receive(stream, request, ours, want, hashes, nbytes, out, state)
        if hybrid and good and not state:
            out.failed = out.failed or "no recurrent state came after the fetched blocks"
            return
        if not good:
            return
        caches = self.caches

        def install():
            n = bm.install_fetched(
                prompt,
                ours,
                hashes[: len(good)],
                lambda i, block_id: write_block(caches, block_id, good[i]),
                root=root,
            )
            if hybrid and (n < len(good) or not engine.install_state(hashes[n - 1], state[0])):
                return 0  # (blocks without the state after them serve no hit)
            return n

        out.block_size = bs
        out.install = self.loop.submit(install)  # runs before the engine request added next

    def _receive(self, stream, request, ours, want, hashes, nbytes, out, state) -> list[bytes]:
        """The checked blocks' bytes, in order, until the first refused one, a failure of the
        stream or `want` of them. A hybrid's state (on the stream's last block) is checked and
        appended to `state`, and ends the stream."""
        address = request.peer_fetch.address
        state_nbytes = self.loop.engine.state_bytes()
        good: list[bytes] = []
        try:
            for block in stream:
                out.bytes += len(block.data)
                i = block.index - ours
                why = (
                    f"it came as block {block.index}, block {ours + len(good)} was next"
                    if i != len(good)
                    else check_block(block, hashes[i], self._fingerprint, nbytes)
                    or (check_state(block, state_nbytes) if block.state else "")
                )
                if why:
                    out.refused += 1
                    log.warning(
                        "peer fetch for %s: block %d from %s refused (%s); computing it instead",
                        request.request_id,
                        block.index,
                        address,
                        why,
                    )
                    stream.cancel()
                    break
                good.append(block.data)
                if block.state:
                    out.bytes += len(block.state)
                    state.append(block.state)
                    break
                if len(good) == want:
                    break
        except grpc.RpcError as e:
            out.failed = f"{e.code().name}: {e.details()}"
            log.info(
                "peer fetch for %s from %s ended after %d blocks: %s; computing the rest",
                request.request_id,
                address,
                len(good),
                out.failed,
            )
        return good

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel, _, _ in channels:
            channel.close()
