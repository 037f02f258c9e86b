"""A pipelined prefill worker's stages as claimants of one nixl reservation (issue #53;
kvtransfer/backends/claims.py Grants): each stage's rank claims as its part of one sender
(PipelineStage), a later stage releases its claim after each step's WRITEs ended, and rank 0's
commit or abort ends the first stage's claim. A reservation that ends is freed once every stage
is over: at once when each said so, else when the missing one releases, its process is proven
gone, or past the bound its connection closed. Forged, duplicate or out-of-range stage claims
and releases are refused, and a retry from another (non-stage) agent keeps the two-sender rule.
Without NIXL or a socket; the same over NIXL with real ranks: tests/integration/
test_pp_handoff_nixl.py."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.kvtransfer.backends import claims
from pdserve.kvtransfer.backends.claims import GrantRefused, Grants, parse_claim, parse_release
from pdserve.kvtransfer.transport import PipelineStage
from pdserve.kvtransfer.wire import ChunkHeader
from pdserve.prefill_worker.stage_push import StageChannels, StageSender

X = "5e" * 16  # the pipelined sender's id (rank 0 makes one per request)
BLOCKS = [1, 2]


def part(stage, layers, rank=0, sender=X, stages=2):
    return PipelineStage(sender, stage, stages, layers, rank)


def staged(grants: Grants, rid="r1") -> str:
    """A reservation claimed by a 2-stage sender of a 5-layer model: rank 0 (stage 0, layers
    0-1) as agent a0 on connection p0, the later stage's rank as a1 on p1 (processes that cannot
    be proven gone: another host)."""
    token = grants.issue(rid, BLOCKS)
    grants.claim(rid, token, BLOCKS, agent="a0", process={}, peer="p0", stage=part(0, (0, 2)))
    grants.claim(rid, token, BLOCKS, agent="a1", process={}, peer="p1", stage=part(1, (2, 5)))
    return token


def word(kind, token, rid="r1"):
    more = {"first_tokens": (3,), "await_kv": True} if kind == "commit" else {}
    return ChunkHeader(rid, "f", kind=kind, grant=token, **more)


def test_a_commit_after_every_stage_released_frees():
    grants = Grants(num_layers=5)
    token = staged(grants)
    assert grants.release("r1", token, "a1", X, "p1") is False  # live: nothing held yet
    assert grants.check(word("commit", token)) is None
    assert grants.close("r1", lambda: pytest.fail("not held"))  # every stage said it is over
    # the reservation ends first (a lease, a bad frame): held until rank 0's last word
    token = staged(grants, "r2")
    grants.release("r2", token, "a1", X, "p1")
    released = []
    assert not grants.close("r2", lambda: released.append("r2"))
    assert grants.num_held == 1
    grants.check(word("commit", token, "r2"))
    assert released == ["r2"] and grants.num_held == 0 and grants.stuck() == ""


def test_a_commit_with_a_stage_still_writing_does_not_free():
    """Rank 0 commits only after every later stage released; a commit that finds one that did
    not (not rank 0's, or the order broken) ends the first stage's claim alone."""
    grants = Grants(num_layers=5)
    token = staged(grants)
    grants.check(word("commit", token))
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    assert grants.num_held == 1 and not released
    assert grants.release("r1", token, "a1", X, "p1") is True  # its WRITEs ended
    assert released == [1] and grants.num_held == 0 and grants.num_released_stages == 1


def test_an_abort_ends_only_the_first_stages_claim():
    grants = Grants(num_layers=5)
    token = staged(grants)
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    grants.check(word("abort", token))  # rank 0 aborts while the later stage is mid-step
    assert not released and grants.num_held == 1
    grants.release("r1", token, "a1", X, "p1")
    assert released == [1]
    # between two steps (the later stage released the last one) an abort frees at once
    token = staged(grants, "r2")
    grants.release("r2", token, "a1", X, "p1")
    grants.check(word("abort", token, "r2"))
    assert grants.close("r2", lambda: pytest.fail("not held"))
    # a later stage that claimed again (its next step) writes again: its release counts no more
    token = staged(grants, "r3")
    grants.release("r3", token, "a1", X, "p1")
    grants.claim("r3", token, BLOCKS, agent="a1", process={}, peer="p1", stage=part(1, (2, 5)))
    grants.check(word("abort", token, "r3"))
    assert not grants.close("r3", lambda: released.append(3))
    assert released == [1]


def test_a_stage_that_never_releases_falls_to_proof_or_the_bound(monkeypatch):
    grants = Grants(window_s=1.0, xfer_timeout_s=1.0, num_layers=5)
    token = staged(grants)
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    grants.check(word("abort", token))
    grants.release_bound_s = 0.0
    assert grants.due() == 0 and not released and "held past" in grants.stuck()
    grants.peer_gone("p1")  # its connection closed from its side: past the bound, over
    assert grants.due() == 1 and released == [1] and grants.stuck() == ""
    # a later stage's process proven gone frees before the bound, with rank 0's word
    grants = Grants(num_layers=5)
    token = grants.issue("r2", BLOCKS)
    for agent, stage, pid in (("a0", part(0, (0, 2)), 10), ("a1", part(1, (2, 5)), 11)):
        grants.claim("r2", token, BLOCKS, agent=agent, process={"pid": pid}, stage=stage)
    monkeypatch.setattr(claims, "process_gone", lambda p: p.get("pid") == 11)
    assert not grants.close("r2", lambda: released.append(2))
    assert grants.due() == 0  # stage 0 (pid 10) may still write
    grants.check(word("abort", token, "r2"))
    assert released == [1] and grants.due() == 1 and released == [1, 2]


@pytest.mark.parametrize(
    "stage, why",
    [
        (part(1, (2, 5)), "claimed by another agent"),  # a1's part, from another agent
        (part(2, (2, 5), stages=2), "0 <= stage < stages"),
        (part(1, (2, 5), stages=6), "2 <= stages <= 5"),  # more stages than layers
        (part(0, (0, 2), stages=1), "2 <= stages"),
        (part(1, (2, 6)), "do not fit the pool's 5 layers"),
        (part(1, (3, 3)), "do not fit"),
        (part(1, (1, 5), rank=1), "overlap stage 0's"),
        (part(1, (3, 5), rank=1), "another rank of it claimed [2, 5]"),
        (part(1, (2, 5), stages=3), "another stage of its sender said 2"),
        (part(1, (2, 5), rank=claims.MAX_STAGE_RANKS), "out of range"),
        (part(1, (2, 5), sender=""), "out of range"),
    ],
)
def test_forged_duplicate_or_out_of_range_stage_claims_are_refused(stage, why):
    grants = Grants(num_layers=5)
    token = staged(grants)
    with pytest.raises(GrantRefused, match=why.replace("[", r"\[")):
        grants.claim("r1", token, BLOCKS, agent="intruder", process={}, peer="p9", stage=stage)
    assert grants.num_refused == 1
    # nothing changed: the stages' words still free it, the intruder is no claimant
    grants.release("r1", token, "a1", X, "p1")
    grants.check(word("abort", token))
    assert grants.close("r1", lambda: pytest.fail("not held"))


def test_a_stage_may_claim_again_and_its_other_ranks_join():
    grants = Grants(num_layers=5)
    token = staged(grants)
    grants.claim("r1", token, BLOCKS, agent="a1", process={}, peer="p1", stage=part(1, (2, 5)))
    # TP 2 in the later stage: its second rank pushes its own heads of the same layers
    grants.claim(
        "r1", token, BLOCKS, agent="a2", process={}, peer="p2", stage=part(1, (2, 5), rank=1)
    )
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    grants.check(word("abort", token))
    grants.release("r1", token, "a1", X, "p1")
    assert not released  # a2 may still write
    grants.release("r1", token, "a2", X, "p2")
    assert released == [1]


def test_forged_releases_are_refused_and_free_nothing():
    grants = Grants(num_layers=5)
    token = staged(grants)
    grants.claim("r1", token, BLOCKS, agent="plain", process={}, peer="p7")  # not a stage
    for args, why in [
        (("r1", "x" * 32, "a1", X, "p1"), "write grant"),
        (("r1", token, "a1", "0" * 32, "p1"), "no pipelined claim"),  # another sender's id
        (("r1", token, "nobody", X, "p1"), "no pipelined claim"),
        (("r1", token, "plain", X, "p7"), "no pipelined claim"),  # a non-stage claimant
        (("r1", token, "a1", X, "p9"), "another connection"),
    ]:
        with pytest.raises(GrantRefused, match=why):
            grants.release(*args)
    assert grants.release("gone", token, "a1", X, "p1") is False  # no such reservation
    assert grants.num_refused == 5


def test_a_retry_from_another_non_stage_agent_keeps_the_two_sender_rule(monkeypatch):
    """Claimants that are not all stages of one sender: neither a commit nor an abort can be
    told to be whose, so they end nothing; the stages' own releases still count for them, and
    the other sender needs its process proven gone (or the bound), as before."""
    grants = Grants(num_layers=5)
    token = staged(grants)
    grants.claim("r1", token, BLOCKS, agent="b", process={"pid": 20}, peer="pb")  # the retry
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    grants.check(word("abort", token))
    grants.check(word("commit", token))
    grants.release("r1", token, "a1", X, "p1")
    assert not released and grants.num_held == 1  # a0 (no word of its own) and b may write
    # another pipelined sender's stage (a retry from another such worker) is the same
    other = Grants(num_layers=5)
    token2 = staged(other)
    y = "7a" * 16
    other.claim(
        "r1", token2, BLOCKS, agent="c0", process={}, peer="pc", stage=part(0, (0, 2), sender=y)
    )
    other.release("r1", token2, "a1", X, "p1")
    other.check(word("commit", token2))
    assert not other.close("r1", lambda: released.append(2)) and not released
    # the processes of the stage 0 agent and of b proven gone: over
    monkeypatch.setattr(claims, "process_gone", lambda p: p.get("pid") == 20)
    grants.release_bound_s = 0.0
    grants.peer_gone("p0")
    assert grants.due() == 1 and released == [1]


def test_a_lone_later_stage_claim_is_not_ended_by_an_abort():
    """Rank 0 pushed over another backend (or nothing yet): the abort on this channel is not the
    later stage's word, unlike a lone non-stage claimant's."""
    grants = Grants(num_layers=5)
    token = grants.issue("r1", BLOCKS)
    grants.claim("r1", token, BLOCKS, agent="a1", process={}, peer="p1", stage=part(1, (2, 5)))
    released = []
    assert not grants.close("r1", lambda: released.append(1))
    grants.check(word("abort", token))
    assert not released
    grants.release("r1", token, "a1", X, "p1")
    assert released == [1]


def claim_bytes(**more):
    return msgpack.packb({"request_id": "r", "grant": "g", "block_ids": [1], **more})


def test_a_claims_stage_fields_are_parsed_and_checked():
    assert parse_claim(claim_bytes())[5] is None  # not pipelined: today's claim
    stage = parse_claim(claim_bytes(stage=1, stages=2, rank=1, layers=[2, 5], sender=X))[5]
    assert stage == PipelineStage(X, 1, 2, (2, 5), 1)
    for more, why in [
        (dict(stage=1), "not one of a pipelined"),
        (dict(sender=X), "not one of a pipelined"),
        (dict(stages=2, layers=[0, 2]), '"sender"'),
        (dict(stages=2, sender=X), '"layers"'),
        (dict(stages=2, sender=X, layers=[0]), '"layers"'),
        (dict(stages=2, sender=X, layers=[0, -1]), '"layers"'),
        (dict(stages=2, sender=X, layers=[0, True]), '"layers"'),
        (dict(stages="2"), '"stage", "stages" and "rank"'),
        (dict(stages=2, stage=-1), '"stage", "stages" and "rank"'),
        (dict(stages=2, sender="s" * 65, layers=[0, 2]), '"sender"'),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_claim(claim_bytes(**more))


def test_a_release_is_parsed_and_checked():
    ask = {"request_id": "r", "grant": "g", "agent": "a", "sender": X}
    assert parse_release(msgpack.packb(ask)) == ("r", "g", "a", X)
    for bad, why in [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1]), "msgpack map"),
        (msgpack.packb(dict(ask, sender="")), '"sender"'),
        (msgpack.packb(dict(ask, agent=1)), '"agent"'),
        (msgpack.packb(dict(ask, grant="")), '"grant"'),
        (msgpack.packb(dict(ask, request_id="")), '"request_id"'),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_release(bad)


class NixlLike:
    """A transport with nixl's `release`: what a later stage's channels call on it."""

    def __init__(self, fail_release=False):
        self.calls, self.fail_release, self.closed = [], fail_release, False

    def flush(self, timeout):
        self.calls.append("flush")

    def release(self, request_id):
        self.calls.append(("release", request_id))
        if self.fail_release:
            raise ConnectionError("the decode side is gone")

    def close(self):
        self.closed = True


class Sink:
    def __init__(self, transport, request_id="r1"):
        self.transport, self.request_id, self.channel = transport, request_id, ("nixl", "x")


def test_a_stages_channels_release_its_claim_after_each_flush():
    channels = StageChannels(StageSender())
    nixl = NixlLike()
    channels._transports[("nixl", "x")] = nixl
    channels.flush(Sink(nixl))
    assert nixl.calls == ["flush", ("release", "r1")]  # the WRITEs' headers, then its word
    failing = NixlLike(fail_release=True)
    with pytest.raises(ConnectionError):  # the step's push fails: its report says so
        channels.flush(Sink(failing))
    # a claim refused for this request alone: released where held, the channel kept
    channels.failed(Sink(nixl, "r2"), PermissionError("its reservation ended"))
    assert nixl.calls[-1] == ("release", "r2") and channels._transports[("nixl", "x")] is nixl
    channels.failed(Sink(nixl, "r3"), ConnectionError("the channel broke"))
    assert ("nixl", "x") not in channels._transports  # dropped (closed on a thread)
