"""What a stranger (or a broken peer) on the network can do to a decode worker's KV server: without
the cluster secret nothing reaches the handler; every field it sends is checked before work; a
layer counts as written only when its bytes arrived; idle channels cannot lock real senders out.
(The receiver's own check of an in-place header: tests/unit/test_kv_receiver_checks.py.)"""

from __future__ import annotations

import dataclasses
import math
import struct
import threading
import time
import types
import uuid

import grpc
import msgpack
import pytest
import torch.distributed as dist

from helpers.kv import (
    CONNECT_TIMEOUT,
    LAYOUT_KW,
    NUM_TOKENS,
    SRC_BLOCK_IDS,
    TIMEOUT,
    DecodeSide,
    push_request,
    source_cache,
    src_layout,
)
from pdserve.kvtransfer import ChunkHeader, TransferState
from pdserve.kvtransfer.backends import channels, connect
from pdserve.kvtransfer.backends.grpc_backend import (
    CHANNEL_METADATA_KEY,
    FLUSH_METHOD,
    PUSH_METHOD,
    frame_pieces,
)
from pdserve.kvtransfer.backends.torch_auth import CONNECTIONS_KEY, conn_prefix
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.protos.security import INSECURE, ClusterSecurity

SECURITY = ClusterSecurity("kv-test-secret-0123456789")
STRANGERS = [INSECURE, ClusterSecurity("not-the-cluster-secret")]
QUICK = 2.0  # a refusal comes back well within this (a spinning or hanging server does not)


@pytest.fixture
def sides():
    made = []

    def make(backend: str, cls=DecodeSide, **opts) -> DecodeSide:
        made.append(cls(backend, security=SECURITY, **opts))
        return made[-1]

    yield make
    for side in made:
        side.close()


def grpc_address(side: DecodeSide) -> str:
    address = side.server.address
    return address.split("control=")[1] if side.backend == "shm" else address


def frame(header: ChunkHeader, payload=b"") -> bytes:
    return b"".join(bytes(p) for p in frame_pieces(header, payload))


def raw_frame(fields: dict, payload=b"") -> bytes:
    """A frame whose header fields we write ourselves (ChunkHeader would refuse them)."""
    head = msgpack.packb(fields)
    return struct.pack("<I", len(head)) + head + payload


def raw_push(address: str, messages: list[bytes], security=SECURITY):
    """A Push stream of our own: returns once the server handled it (or raises its RpcError)."""
    channel = security.channel(address)
    try:
        return channel.stream_unary(PUSH_METHOD)(
            iter(messages), timeout=TIMEOUT, metadata=((CHANNEL_METADATA_KEY, uuid.uuid4().hex),)
        )
    finally:
        channel.close()


def finished(side: DecodeSide, request_id: str) -> KVReceiver:
    rx = side.wait_finished(request_id)
    assert rx.state in (TransferState.DONE, TransferState.FAILED), (
        f"{request_id} is still {rx.state!r}"
    )
    return rx


def push_good(side: DecodeSide, tx, request_id: str = "good", seed: int = 3) -> None:
    dest = side.reserve(request_id, [5, 6, 7])
    push_request(tx, request_id, seed, dest)
    tx.flush(TIMEOUT)
    side.assert_received(request_id, seed)


# ---- who may send ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["grpc", "shm", "torch"])
def test_only_a_sender_with_the_secret_reaches_the_handler(sides, backend):
    side = sides(backend, **({"auth_timeout": 2.0} if backend == "torch" else {}))
    for stranger in STRANGERS:
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError, match="secret"):
            connect(backend, side.server.address, security=stranger, timeout=TIMEOUT)
        assert time.monotonic() - t0 < QUICK
    assert side.frames == [] and side.server.num_channels == 0  # refused: nothing held
    tx = connect(backend, side.server.address, security=SECURITY, timeout=CONNECT_TIMEOUT)
    try:
        push_good(side, tx)
        assert side.server.num_channels == 1
    finally:
        tx.close()


@pytest.mark.parametrize("backend", ["grpc", "shm"])
def test_a_raw_stream_without_the_secret_writes_nothing(sides, backend):
    side = sides(backend)
    dest = side.reserve("r", [0, 1, 2])
    header, data = read_chunk(source_cache(1)[0], src_layout(), "r", 0, SRC_BLOCK_IDS, 0, 20)
    for stranger in STRANGERS:
        with pytest.raises(grpc.RpcError) as err:
            raw_push(grpc_address(side), [frame(header, data.numpy().tobytes())], security=stranger)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel = stranger.channel(grpc_address(side))
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(FLUSH_METHOD)(
                msgpack.packb({"channel": "x", "frames": 0, "wait_s": 0}), timeout=QUICK
            )
        channel.close()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert side.frames == [] and side.server.num_channels == 0
    assert (
        side.receivers["r"].state == TransferState.PENDING
        and not side.cache[:, :, dest.block_ids].any()
    )


def test_silent_forged_and_flooding_torch_handshakes_block_nobody(sides):
    side = sides("torch", auth_timeout=0.5)
    host, port = side.server.address.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), is_master=False, timeout=dist.constants.default_pg_timeout
    )
    silent = store.add(CONNECTIONS_KEY, 1) - 1  # takes a connection and never answers
    forged = store.add(CONNECTIONS_KEY, 1) - 1
    store.wait([conn_prefix(forged) + "nonce"])
    store.set(conn_prefix(forged) + "auth", b"\0" * 32)
    tx = connect("torch", side.server.address, security=SECURITY, timeout=CONNECT_TIMEOUT)
    try:
        push_good(side, tx)
    finally:
        tx.close()
    store.wait([conn_prefix(forged) + "verdict", conn_prefix(silent) + "verdict"])
    assert store.get(conn_prefix(forged) + "verdict") == b"refused: wrong credentials"
    assert store.get(conn_prefix(silent) + "verdict").startswith(b"refused: no answer")
    store.add(CONNECTIONS_KEY, 100_000)  # a flood of connection numbers
    tx = connect("torch", side.server.address, security=SECURITY, timeout=CONNECT_TIMEOUT)
    try:
        push_good(side, tx, "after-flood", seed=4)
    finally:
        tx.close()
    assert {h.request_id for h in side.frames} == {"good", "after-flood"}
    del store


# ---- fields a stranger sends -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "ask,complaint",
    [
        ({"channel": "c", "frames": 1, "wait_s": math.nan}, "wait_s"),
        ({"channel": "c", "frames": 1, "wait_s": math.inf}, "wait_s"),
        ({"channel": "c", "frames": 1, "wait_s": -1.0}, "wait_s"),
        ({"channel": "c", "frames": 1, "wait_s": "0.5"}, "wait_s"),
        ({"channel": "c", "frames": -1, "wait_s": 0.1}, "frames"),
        ({"channel": "c", "frames": True, "wait_s": 0.1}, "frames"),
        ({"channel": "c", "frames": 2**63, "wait_s": 0.1}, "frames"),
        ({"channel": "c" * 65, "frames": 1, "wait_s": 0.1}, "channel"),
        ({"channel": 7, "frames": 1, "wait_s": 0.1}, "channel"),
        ([1, 2, 3], "map"),
    ],
)
def test_flush_refuses_bad_fields_at_once(sides, ask, complaint):
    side = sides("grpc")
    channel = SECURITY.channel(side.server.address)
    flush = channel.unary_unary(FLUSH_METHOD)
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            flush(msgpack.packb(ask), timeout=QUICK)
        assert time.monotonic() - t0 < QUICK
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and complaint in err.value.details()
        )
        if complaint == "wait_s":
            assert "finite number of seconds >= 0" in err.value.details()
        reply = flush(msgpack.packb({"channel": "c", "frames": 0, "wait_s": 0.0}), timeout=QUICK)
        assert msgpack.unpackb(reply) == {"frames": -1}  # the server still answers
    finally:
        channel.close()


def test_bad_header_fields_fail_their_request_and_spare_the_channel(sides):
    side = sides("grpc")
    layout, fp = src_layout(), src_layout().fingerprint
    good = side.reserve("good", [5, 6, 7])
    for rid in ("bad-layer", "bad-token", "bad-dim"):
        side.reserve(rid, [0, 1, 2])
    header, data = read_chunk(source_cache(1)[0], layout, "bad-layer", 0, SRC_BLOCK_IDS, 0, 20)
    payload = data.numpy().tobytes()
    fields = dataclasses.asdict(header)
    messages = [
        raw_frame({**fields, "layer": "0"}, payload),  # names its request: fails it
        raw_frame({**fields, "request_id": "x" * 300}, payload),  # names none: dropped
        raw_frame({**fields, "request_id": "bad-token", "kind": "commit", "first_tokens": ["7"]})
        + frame(
            dataclasses.replace(header, request_id="bad-dim", head_dim=4),
            payload[: len(payload) // 2],
        ),
        frame(ChunkHeader("ghost", fp, kind="abort")),  # a request this rank never had
    ]
    for layer in range(LAYOUT_KW["num_layers"]):  # then a whole good request
        for start, end in ((0, 20), (20, NUM_TOKENS)):
            h, d = read_chunk(
                source_cache(9)[layer], layout, "good", layer, SRC_BLOCK_IDS, start, end
            )
            messages.append(frame(h, d.numpy().tobytes()))
    messages.append(frame(ChunkHeader("good", fp, kind="commit", first_tokens=(9,))))
    raw_push(side.server.address, messages)
    assert "layer" in finished(side, "bad-layer").error
    assert "first_tokens" in finished(side, "bad-token").error
    assert "head_dim" in finished(side, "bad-dim").error
    side.assert_received("good", 9)  # the channel that carried the bad frames went on
    assert good.block_ids == [5, 6, 7]


# ---- a layer is written only when its bytes arrived ------------------------------------------------
@pytest.mark.parametrize("backend", ["grpc", "torch"])
def test_in_place_frames_off_the_shm_backend_fail_their_request(sides, backend):
    side = sides(backend)
    dest = side.reserve("claims", [0, 1, 2])
    tx = connect(backend, side.server.address, security=SECURITY, timeout=CONNECT_TIMEOUT)
    try:
        for layer in range(LAYOUT_KW["num_layers"]):
            header, _ = read_chunk(
                source_cache(2)[layer], src_layout(), "claims", layer, SRC_BLOCK_IDS, 0, NUM_TOKENS
            )
            tx.send(dataclasses.replace(header, in_place=True), None, dest)
        tx.send(
            ChunkHeader("claims", src_layout().fingerprint, kind="commit", first_tokens=(1,)),
            None,
            dest,
        )
        tx.flush(TIMEOUT)
        rx = finished(side, "claims")
        assert rx.state == TransferState.FAILED and "only valid on the shm backend" in rx.error
        assert rx.bytes_received == 0 and rx.first_tokens == ()
        push_good(side, tx)
    finally:
        tx.close()


@pytest.mark.parametrize("backend", ["grpc", "torch"])
def test_a_payload_of_the_wrong_size_fails_its_request(sides, backend):
    side = sides(backend)
    tx = connect(backend, side.server.address, security=SECURITY, timeout=CONNECT_TIMEOUT)
    try:
        for rid, mangle in [
            ("short", lambda d: d.reshape(-1)[:-1]),
            ("wide", lambda d: d.double()),
        ]:
            dest = side.reserve(rid, [0, 1, 2])
            header, data = read_chunk(
                source_cache(3)[0], src_layout(), rid, 0, SRC_BLOCK_IDS, 0, 20
            )
            tx.send(header, mangle(data), dest)
            tx.flush(TIMEOUT)
            rx = finished(side, rid)
            assert rx.state == TransferState.FAILED and "payload" in rx.error, rx.error
            assert rx.bytes_received == 0 and not side.cache[:, :, dest.block_ids].any()
        push_good(side, tx)
    finally:
        tx.close()


# ---- channel limits ----------------------------------------------------------------------------------
class IdleStreams:
    """Push streams opened and left idle, as a stranger holding a server's channels would."""

    def __init__(self, address: str, count: int):
        self._release = threading.Event()
        self.channels = [SECURITY.channel(address) for _ in range(count)]
        self.calls = [
            c.stream_unary(PUSH_METHOD).future(
                self._idle(),
                wait_for_ready=True,
                metadata=((CHANNEL_METADATA_KEY, uuid.uuid4().hex),),
            )
            for c in self.channels
        ]

    def _idle(self):
        self._release.wait()
        yield from ()

    def ended(self) -> list[grpc.StatusCode]:
        return [call.exception().code() for call in self.calls if call.done()]

    def close(self) -> None:
        self._release.set()
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            channel.close()


def wait_until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("per_peer", [8, 16])
def test_idle_channels_of_one_peer_do_not_lock_out_a_fresh_sender(sides, per_peer, monkeypatch):
    """20 idle streams from one address: at most max_channels_per_peer (default 8) are admitted; with
    that limit at 16 they fill every slot (max_channels=16), and a fresh sender still gets one.

    The channel table's clock stands still until the test moves it: on a loaded CI machine the 20
    admissions took over min_idle_evict_s, so the last ones evicted the first instead of being
    refused."""
    now = [time.monotonic()]
    monkeypatch.setattr(channels, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    side = sides("grpc", min_idle_evict_s=1.0, max_channels_per_peer=per_peer)
    idle = IdleStreams(side.server.address, 20)
    try:
        wait_until(
            lambda: side.server.num_channels == per_peer and len(idle.ended()) == 20 - per_peer,
            "the idle streams were not admitted or refused",
            timeout=30,
        )
        assert set(idle.ended()) == {grpc.StatusCode.RESOURCE_EXHAUSTED}  # refused: nothing held
        now[0] += 1.2  # now they have been idle long enough
        tx = connect("grpc", side.server.address, security=SECURITY, timeout=TIMEOUT)
        try:
            push_good(side, tx)
            assert side.server.num_channels == per_peer
        finally:
            tx.close()
        wait_until(
            lambda: grpc.StatusCode.CANCELLED in idle.ended(), "no idle stream was evicted", 30
        )
    finally:
        idle.close()


def test_a_channel_closed_while_idle_reopens_at_the_next_send(sides):
    side = sides("grpc", idle_timeout_s=0.3)
    tx = connect("grpc", side.server.address, security=SECURITY, timeout=TIMEOUT)
    try:
        push_good(side, tx, "before", seed=5)
        wait_until(lambda: side.server.num_channels == 0, "the idle channel was not closed")
        # the sender hears of it: its Push call ends (an event, not a sleep long enough on a quiet
        # machine)
        wait_until(lambda: tx._stream.ended.is_set(), "the sender never saw its channel close", 30)
        push_good(side, tx, "after", seed=6)
    finally:
        tx.close()


def test_an_evicted_sender_reopens_or_says_frames_were_lost(sides):
    side = sides("grpc", max_channels=1, min_idle_evict_s=0.1)
    a = connect("grpc", side.server.address, security=SECURITY, timeout=TIMEOUT)
    try:
        push_good(side, a, "a1", seed=1)
        time.sleep(0.5)
        b = connect("grpc", side.server.address, security=SECURITY, timeout=TIMEOUT)  # evicts a
        try:
            push_good(side, b, "b1", seed=2)
            dest = side.reserve("b2", [0, 1, 2])
            header, data = read_chunk(
                source_cache(4)[0], src_layout(), "b2", 0, SRC_BLOCK_IDS, 0, 20
            )
            b.send(header, data, dest)  # not flushed yet
            time.sleep(0.5)
            push_good(side, a, "a2", seed=3)  # a's frames were all confirmed: it reopens
            # (evicting b, idle and now the oldest)
            with pytest.raises(ConnectionError, match="closed the channel"):
                b.flush(TIMEOUT)  # b's frame may be lost: it must say so
        finally:
            b.close()
    finally:
        a.close()


class SlowSide(DecodeSide):
    """A decode side whose handler holds request "slow" until released."""

    def __init__(self, *args, **kwargs):
        self.entered, self.release = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def on_frame(self, header, payload) -> None:
        if header.request_id == "slow":
            self.entered.set()
            self.release.wait(TIMEOUT)
            return
        super().on_frame(header, payload)


def test_a_busy_channel_is_never_evicted(sides):
    side = sides("grpc", cls=SlowSide, max_channels=1, min_idle_evict_s=0.1)
    a = connect("grpc", side.server.address, security=SECURITY, timeout=TIMEOUT)
    try:
        a.send(ChunkHeader("slow", src_layout().fingerprint, kind="abort"), None, None)
        assert side.entered.wait(TIMEOUT)
        time.sleep(0.2)  # no frame for a while, but one in its handler
        with pytest.raises(ConnectionError, match="RESOURCE_EXHAUSTED.*all busy"):
            connect("grpc", side.server.address, security=SECURITY, timeout=TIMEOUT)
        assert side.server.num_channels == 1
        side.release.set()
        a.flush(TIMEOUT)
        push_good(side, a)
    finally:
        side.release.set()
        a.close()


def test_one_peer_has_a_channel_limit(sides):
    side = sides("grpc", max_channels=8, max_channels_per_peer=2, min_idle_evict_s=60.0)
    held = [
        connect("grpc", side.server.address, security=SECURITY, timeout=TIMEOUT) for _ in range(2)
    ]
    try:
        with pytest.raises(ConnectionError, match="RESOURCE_EXHAUSTED.*max_channels_per_peer=2"):
            connect("grpc", side.server.address, security=SECURITY, timeout=TIMEOUT)
        assert side.server.num_channels == 2
    finally:
        for tx in held:
            tx.close()
