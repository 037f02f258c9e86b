"""The nixl backend's pure parts, without NIXL or a socket: the decode side's write grants (claims,
frames, held reservations and their bound), the claim and address parsers, the WRITE descriptors
against write_chunk, and the clear errors where NIXL is not installed (config check, connect).
Transfers themselves: tests/integration/test_kv_nixl_trust.py and test_kv_nixl_cluster.py."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from helpers.deploy_config import error_of, write
from pdserve.deploy.config import schema
from pdserve.kvtransfer.backends import claims, connect, nixl_backend
from pdserve.kvtransfer.backends.claims import GrantRefused, Grants, parse_claim
from pdserve.kvtransfer.backends.nixl_backend import (
    _descriptors,
    _paged_descriptors,
    format_address,
    parse_address,
)
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.reshard import read_chunk, write_chunk
from pdserve.kvtransfer.wire import ChunkHeader, decode_frame, encode_frame


def kv(rid, grant, in_place=True):
    return ChunkHeader(rid, "f", 0, 0, 4, 0, 2, 8, "float32", in_place=in_place, grant=grant)


def test_a_claim_must_match_a_live_reservation():
    grants = Grants()
    token = grants.issue("r1", [4, 9])
    with pytest.raises(GrantRefused, match="forged"):
        grants.claim("r1", "x" * 32, [4, 9])
    with pytest.raises(GrantRefused, match="forged"):
        grants.claim("r2", token, [4, 9])  # another request's id
    with pytest.raises(GrantRefused, match="outside the reservation"):
        grants.claim("r1", token, [4, 10])
    assert grants.claim("r1", token, [4, 9]) == grants.window_s
    assert grants.num_refused == 3


def test_a_retry_from_another_sender_is_held_until_both_senders_are_gone(monkeypatch):
    """The router retries a prefill into the same reservation. Again from the same agent (whose
    earlier WRITEs are over) a claim changes nothing; from another agent, the first may still be
    writing, so a sender's last frame no longer ends a hold: both senders' processes gone do,
    and past the bound without that the hold is stuck (reported, not freed)."""
    grants = Grants()
    token = grants.issue("r1", [1])
    grants.claim("r1", token, [1], agent="prefill-a")
    grants.claim("r1", token, [1], agent="prefill-a")
    grants.check(ChunkHeader("r1", "f", kind="abort", grant=token))
    assert grants.close("r1", lambda: pytest.fail("not held"))  # one claimant: its word ends it
    token = grants.issue("r1", [1])
    grants.claim("r1", token, [1], agent="prefill-a", process={"pid": 1})
    grants.claim("r1", token, [1], agent="prefill-b", process={"pid": 2})
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    grants.check(ChunkHeader("r1", "f", kind="abort", grant=token))
    assert not released
    dead = {1}
    monkeypatch.setattr(claims, "process_gone", lambda p: p.get("pid") in dead)
    grants.release_bound_s = 0.0
    assert grants.due() == 0 and not released and "held past" in grants.stuck()
    dead.add(2)
    assert grants.due() == 1 and released == [1] and grants.stuck() == ""
    assert grants.num_released_sender_gone == 1 and grants.num_stuck_total == 1


def test_a_grant_of_an_ended_reservation_is_refused():
    grants = Grants()
    token = grants.issue("r1", [1])
    assert grants.close("r1", lambda: None)  # never claimed: free at once
    with pytest.raises(GrantRefused, match="gone"):
        grants.claim("r1", token, [1])


def test_frames_need_the_grant_and_kv_frames_a_claim():
    grants = Grants()
    token = grants.issue("r1", [1])
    assert "write grant" in grants.check(kv("r1", "y" * 32))
    assert "write grant" in grants.check(kv("r1", ""))
    assert "no sender claimed" in grants.check(kv("r1", token))
    grants.claim("r1", token, [1])
    assert grants.check(kv("r1", token)) is None
    assert grants.check(kv("unknown", "z")) is None  # not reserved here: the hand-off drops it


def test_a_reservation_ended_mid_claim_is_held_until_the_senders_last_frame():
    grants = Grants()
    token = grants.issue("r1", [1, 2])
    grants.claim("r1", token, [1, 2])
    released = []
    assert not grants.close("r1", lambda: released.append("r1"))
    assert grants.num_held == 1 and not released
    assert grants.check(ChunkHeader("r1", "f", kind="abort", grant="bad")) is not None
    assert not released  # a frame without the grant says nothing
    assert grants.check(ChunkHeader("r1", "f", kind="abort", grant=token)) is None
    assert released == ["r1"] and grants.num_held == 0


def test_the_senders_last_frame_before_the_end_frees_at_once():
    grants = Grants()
    token = grants.issue("r1", [1])
    grants.claim("r1", token, [1])
    grants.check(ChunkHeader("r1", "f", kind="commit", first_tokens=(3,), grant=token))
    assert grants.close("r1", lambda: pytest.fail("not held"))


def test_a_held_reservation_past_its_bound_is_stuck_not_freed():
    """A fake stuck transfer: the sender claimed, the reservation ended, and neither its last
    word nor proof of its end comes. Past the bound its blocks stay held and the grants say why
    the worker is unhealthy, once; the sender's last word, late, frees them and clears it."""
    grants = Grants(window_s=1.0, xfer_timeout_s=1.0)
    assert grants.release_bound_s == 1.0 + 1.0 + claims.RELEASE_MARGIN_S
    token = grants.issue("r1", [1, 2, 3])
    grants.claim("r1", token, [1, 2, 3], agent="a", process={})  # a process that cannot be proven
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    assert grants.due() == 0 and not released and grants.stuck() == ""
    grants.release_bound_s = 0.0  # the bound passed
    assert grants.due() == 0 and not released and grants.num_held == 1
    why = grants.stuck()
    assert "1 reservation(s) (3 KV blocks) held past the KV write bound" in why and "'r1'" in why
    assert grants.due() == 0 and grants.num_stuck_total == 1  # counted once
    grants.check(ChunkHeader("r1", "f", kind="abort", grant=token))  # the sender's word, late
    assert released == [1] and grants.stuck() == "" and grants.num_held == 0


def test_a_dead_senders_hold_ends_before_its_bound(monkeypatch):
    """A sending process proven gone writes no more: its held blocks go at the next sweep, the
    bound not reached; an alive one's stay. With pid_proof off (a VRAM pool) nothing is proof."""
    alive = {7}
    monkeypatch.setattr(claims, "process_gone", lambda p: p.get("pid") not in alive)
    for pid_proof, pid, freed in ((True, 8, True), (True, 7, False), (False, 8, False)):
        grants = Grants(pid_proof=pid_proof)
        token = grants.issue("r1", [1])
        grants.claim("r1", token, [1], agent="a", process={"pid": pid})
        released = []
        assert not grants.close("r1", lambda: released.append(1))
        assert grants.due() == int(freed) and released == ([1] if freed else [])
        assert grants.num_held == int(not freed) and grants.stuck() == ""


def test_a_committed_claim_holds_nothing_and_is_dropped_at_its_bound():
    grants = Grants()
    token = grants.issue("r1", [1])
    grants.claim("r1", token, [1], agent="a")
    grants.claim("r1", token, [1], agent="b")  # a commit cannot end a two-sender claim
    assert not grants.close("r1", None)
    assert grants.num_held == 0
    with pytest.raises(GrantRefused, match="replayed"):
        grants.claim("r1", token, [1], agent="c")
    grants.release_bound_s = 0.0
    assert grants.due() == 0 and grants.stuck() == "" and grants.token("r1") == ""


def fake_proc(root, boot="b-1", pidns="pid:[1]", procs=None):
    """A /proc with a boot id, this process's pid namespace and {pid: (state, start)}."""
    (root / "sys/kernel/random").mkdir(parents=True)
    (root / "sys/kernel/random/boot_id").write_text(boot + "\n")
    (root / "self/ns").mkdir(parents=True)
    (root / "self/ns/pid").symlink_to(pidns)
    for pid, (state, start) in (procs or {}).items():
        (root / str(pid)).mkdir()
        rest = " ".join(["0"] * 18 + [str(start)] + ["0"] * 10)  # start: field 22
        (root / str(pid) / "stat").write_text(f"{pid} (a name) x) {state} {rest}\n")
    return str(root)


def test_process_gone_needs_proof(tmp_path):
    proc = fake_proc(tmp_path, procs={10: ("S", 500), 11: ("Z", 600), 12: ("S", 999)})
    me = {"boot": "b-1", "pidns": "pid:[1]", "start": 500}
    gone = claims.process_gone
    assert not gone(dict(me, pid=10), proc)  # alive
    assert gone(dict(me, pid=11, start=600), proc)  # a zombie writes nothing
    assert gone(dict(me, pid=12), proc)  # the pid names another process now
    assert gone(dict(me, pid=13), proc)  # no such pid
    assert not gone(dict(me, pid=13, boot="b-2"), proc)  # another kernel: no proof
    assert not gone(dict(me, pid=13, pidns="pid:[2]"), proc)  # another namespace: no proof
    assert not gone({}, proc) and not gone(None, proc)


def test_this_process_is_alive_by_its_own_identity():
    me = claims.process_identity()
    assert set(me) == {"boot", "pidns", "pid", "start"}
    assert not claims.process_gone(me)
    assert claims.process_gone(dict(me, start=me["start"] + 1))


@pytest.mark.parametrize("window_s,xfer_timeout_s", [(0, 1), (1, 0), (-1, 1)])
def test_grant_bounds_must_be_positive(window_s, xfer_timeout_s):
    with pytest.raises(ValueError, match="must be > 0"):
        Grants(window_s=window_s, xfer_timeout_s=xfer_timeout_s)


@pytest.mark.parametrize(
    "claim, words",
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1]), "msgpack map"),
        (msgpack.packb({"request_id": "", "grant": "g", "block_ids": []}), "request_id"),
        (msgpack.packb({"request_id": "r", "grant": "", "block_ids": []}), "grant"),
        (msgpack.packb({"request_id": "r", "grant": "g", "block_ids": [-1]}), "block_ids"),
        (msgpack.packb({"request_id": "r", "grant": "g", "block_ids": [True]}), "block_ids"),
        (msgpack.packb({"request_id": "r", "grant": "g", "block_ids": "1"}), "block_ids"),
        (b"x" * (claims.MAX_CLAIM_BYTES + 1), "at most"),
        (
            msgpack.packb({"request_id": "r", "grant": "g", "block_ids": [], "process": 1}),
            "process",
        ),
        (
            msgpack.packb(
                {"request_id": "r", "grant": "g", "block_ids": [], "process": {"pid": 1}}
            ),
            "process",
        ),
    ],
)
def test_bad_claims_say_what_to_fix(claim, words):
    with pytest.raises(ValueError, match=words):
        parse_claim(claim)


def test_addresses_round_trip_and_bad_ones_are_refused():
    address = format_address("agent-1", "127.0.0.1:5000", 2)
    assert parse_address(address) == ("agent-1", "127.0.0.1:5000", 2)
    for bad in ("grpc://x?control=a&tp=1", "nixl://x?tp=1", "nixl://x?control=a&tp=0", "nixl://"):
        with pytest.raises(ValueError, match="not a nixl KV address"):
            parse_address(bad)


def test_the_grant_rides_only_on_frames_that_have_one():
    plain = ChunkHeader("r", "f", kind="commit")
    assert b"grant" not in b"".join(bytes(p) for p in encode_frame(plain))
    with_grant = dataclasses.replace(plain, grant="abc")
    assert decode_frame(b"".join(bytes(p) for p in encode_frame(with_grant)))[0] == with_grant


def apply(descs_local, descs_remote, src: bytes, dst: bytearray) -> None:
    """What the WRITE does: each local range copied to its remote range (addresses here are
    offsets into src and dst)."""
    for (s, n, _), (d, m, _) in zip(descs_local.tolist(), descs_remote.tolist()):
        assert n == m
        dst[d : d + n] = src[s : s + n]


@pytest.mark.parametrize(
    "start,end,head_lo,head_hi,tp",
    [(0, 13, 0, 4, 1), (5, 11, 0, 4, 1), (3, 9, 0, 4, 2), (2, 14, 1, 3, 2), (0, 4, 2, 4, 1)],
)
@pytest.mark.parametrize("block_ids", [[7, 2, 5, 0], [2, 3, 4, 8]])  # scattered; a run of three
def test_descriptors_move_what_write_chunk_writes(start, end, head_lo, head_hi, tp, block_ids):
    """The descriptors of a chunk into each receiving rank's pool, applied as copies, give the
    pool write_chunk gives: the same blocks, tokens and heads, nothing else touched."""
    layers, heads, dim, bs, blocks = 2, 4, 3, 4, 9
    layout = KVLayout("m", "float32", layers, heads, dim, bs)
    data = torch.randn(2, end - start, head_hi - head_lo, dim)
    header = ChunkHeader("r", layout.fingerprint, 1, start, end, head_lo, head_hi, dim, "float32")
    hpr = heads // tp
    for rank in range(tp):
        rank_layout = dataclasses.replace(layout, tp_size=tp, tp_rank=rank)
        want = torch.zeros(layers, 2, blocks, bs, hpr, dim)
        write_chunk(want, rank_layout, block_ids, header, data)
        lo, hi = max(head_lo, rank * hpr), min(head_hi, (rank + 1) * hpr)
        got = bytearray(want.numel() * 4)
        if lo < hi:
            src = data[:, :, lo - head_lo : hi - head_lo].contiguous()
            local, remote = _descriptors(
                0, 0, 1, tuple(block_ids), start, end, tuple(want.shape), 4, lo - rank * hpr,
                hi - lo,
            )  # fmt: skip
            apply(local, remote, src.numpy().tobytes(), got)
        got_t = torch.frombuffer(got, dtype=torch.float32).view(want.shape)
        assert torch.equal(got_t, want)


@pytest.mark.parametrize("src_bs,dst_bs", [(4, 4), (2, 4), (8, 4)])
@pytest.mark.parametrize("start,end,tp", [(0, 13, 1), (5, 11, 1), (3, 9, 2), (0, 16, 2)])
@pytest.mark.parametrize("order", ["scattered", "runs"])
def test_paged_descriptors_move_what_write_chunk_writes(src_bs, dst_bs, start, end, tp, order):
    """A chunk straight out of the sender's paged pool (send_paged), its descriptors applied as
    copies: each receiving rank's pool as write_chunk makes it from the gathered chunk, with
    block sizes that differ between the two sides and heads split across receiving ranks."""
    layers, heads, dim, blocks = 2, 4, 3, 9
    n_src = 16 // src_bs
    src_ids = list(range(1, n_src + 1)) if order == "runs" else list(range(n_src, 0, -1))
    dst_ids = [2, 3, 4, 5] if order == "runs" else [7, 2, 5, 0]
    src_pool = torch.randn(2, n_src + 2, src_bs, heads, dim)
    src_layout = KVLayout("m", "float32", layers, heads, dim, src_bs)
    header, data = read_chunk(src_pool, src_layout, "r", 1, src_ids, start, end)
    dst_layout = KVLayout("m", "float32", layers, heads, dim, dst_bs)
    hpr = heads // tp
    first = start // src_bs
    for rank in range(tp):
        rank_layout = dataclasses.replace(dst_layout, tp_size=tp, tp_rank=rank)
        want = torch.zeros(layers, 2, blocks, dst_bs, hpr, dim)
        write_chunk(want, rank_layout, dst_ids, header, data)
        got = bytearray(want.numel() * 4)
        local, remote = _paged_descriptors(
            tuple(src_pool.shape), tuple(src_ids[first:]), start, end, rank * hpr,
            tuple(want.shape), tuple(dst_ids), 0, hpr, 4,
        )  # fmt: skip
        apply(local, remote, src_pool.numpy().tobytes(), got)
        got_t = torch.frombuffer(got, dtype=torch.float32).view(want.shape)
        assert torch.equal(got_t[0], want[1])  # layer 1's chunk, moved at layer 0 offsets
        if order == "runs" and tp == 1 and src_bs == dst_bs:
            assert len(local) == 2  # K and V each one piece


def test_whole_rank_chunks_move_one_descriptor_per_block_run():
    """One descriptor per (K or V, block), and one per run of consecutive blocks."""
    shape = (1, 2, 8, 4, 2, 3)
    local, remote = _descriptors(0, 0, 0, (3, 0, 6), 2, 10, shape, 4)
    assert local.shape == remote.shape == (2 * 3, 3)  # K and V of 3 blocks
    assert np.array_equal(local[:, 1], remote[:, 1])
    local, remote = _descriptors(0, 0, 0, (4, 5, 6), 2, 10, shape, 4)
    assert local.shape == (2, 3) and list(local[:, 1]) == [8 * 2 * 3 * 4] * 2


def test_config_check_names_the_extra_without_nixl(tmp_path, monkeypatch):
    monkeypatch.setattr(schema, "nixl_installed", lambda: False)
    msg = error_of(write(tmp_path, "kvtransfer:\n  backend: nixl\n"))
    assert "kvtransfer.backend" in msg and "pdserve[nixl]" in msg


def test_connect_names_the_extra_without_nixl(monkeypatch):
    monkeypatch.setattr(nixl_backend, "nixl_module", lambda: None)
    with pytest.raises(RuntimeError, match=r"pdserve\[nixl\]"):
        connect("nixl", "nixl://a?control=127.0.0.1:1&tp=1")
