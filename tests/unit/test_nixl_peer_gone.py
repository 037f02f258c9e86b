"""A nixl sender on another host that dies (kvtransfer/backends/claims.py Grants): its
process cannot be proven gone from here, but once its control connection was closed from its
side (`peer_gone`) and the claim's bound passed, the held blocks are freed and the worker is
healthy again; before the bound, or with the connection still open, they stay held. The same with
real processes and sockets: tests/chaos/test_nixl_chaos.py (its remote case)."""

from __future__ import annotations

from pdserve.kvtransfer.backends.claims import Grants


def held(grants: Grants, rid: str, peers: dict[str, str]) -> list:
    """A reservation claimed by each agent of `peers` (agent -> its connection), from processes
    that cannot be proven gone (another host), then ended while the claims may write."""
    token = grants.issue(rid, [1, 2])
    for agent, peer in peers.items():
        grants.claim(rid, token, [1, 2], agent=agent, process={}, peer=peer)
    released = []
    assert not grants.close(rid, lambda: released.append(rid))
    return released


def test_a_disconnected_senders_hold_ends_at_its_bound_and_health_returns():
    grants = Grants(window_s=1.0, xfer_timeout_s=1.0)
    released = held(grants, "r1", {"a": "ipv4:10.0.0.9:40001"})
    assert grants.peer_gone("ipv4:10.0.0.9:40001") == 1
    assert grants.due() == 0 and not released  # before the bound: still held
    grants.release_bound_s = 0.0  # the bound passed
    assert grants.due() == 1 and released == ["r1"]
    assert grants.num_held == 0 and grants.stuck() == "" and grants.num_released_peer_gone == 1
    assert grants.num_stuck_total == 0


def test_a_stuck_hold_is_freed_once_its_sender_disconnects():
    grants = Grants(window_s=1.0, xfer_timeout_s=1.0)
    released = held(grants, "r1", {"a": "ipv4:10.0.0.9:40001"})
    grants.release_bound_s = 0.0
    assert grants.due() == 0 and "held past the KV write bound" in grants.stuck()
    assert grants.peer_gone("ipv4:10.0.0.9:40002") == 0  # another connection: nothing
    assert grants.due() == 0 and grants.stuck()
    grants.peer_gone("ipv4:10.0.0.9:40001")
    assert grants.due() == 1 and released == ["r1"] and grants.stuck() == ""


def test_every_sender_of_a_claim_must_be_gone():
    grants = Grants(window_s=1.0, xfer_timeout_s=1.0)
    released = held(grants, "r1", {"a": "ipv4:10.0.0.9:1", "b": "ipv4:10.0.0.8:2"})
    grants.release_bound_s = 0.0
    grants.peer_gone("ipv4:10.0.0.9:1")
    assert grants.due() == 0 and not released and grants.stuck()  # b may still write
    grants.peer_gone("ipv4:10.0.0.8:2")
    assert grants.due() == 1 and released == ["r1"]


def test_a_claim_again_after_a_disconnect_is_a_live_sender():
    grants = Grants(window_s=1.0, xfer_timeout_s=1.0)
    token = grants.issue("r1", [1])
    grants.claim("r1", token, [1], agent="a", process={}, peer="ipv4:10.0.0.9:1")
    grants.peer_gone("ipv4:10.0.0.9:1")
    grants.claim("r1", token, [1], agent="a", process={}, peer="ipv4:10.0.0.9:7")  # reconnected
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    grants.release_bound_s = 0.0
    assert grants.due() == 0 and not released and grants.stuck()
