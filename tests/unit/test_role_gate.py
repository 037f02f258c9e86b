"""RoleGate (worker_common/role.py): which work a worker admits while it serves, drains and
switches roles, and when a switch is refused."""

from __future__ import annotations

import grpc
import pytest

from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.worker_common.role import DRAINING, SERVING, ControlServicer, RoleError, RoleGate


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def admit(gate, role) -> str | None:
    """None when `role` work is admitted; else the refusal's details (always UNAVAILABLE)."""
    ctx = Context()
    try:
        with gate.admitted(role, ctx):
            return None
    except Aborted:
        assert ctx.code == grpc.StatusCode.UNAVAILABLE
        return ctx.details


def test_a_serving_gate_admits_its_role_only():
    gate = RoleGate("w", "decode")
    assert admit(gate, "decode") is None
    assert "serves decode now, not prefill" in admit(gate, "prefill")


def test_draining_refuses_new_work_and_a_switch_waits_for_what_remains():
    gate, registered = RoleGate("w", "decode"), []
    with pytest.raises(RoleError, match="Drain it before SwitchRole"):
        gate.switch("prefill", lambda: "", registered.append)
    gate.drain(True)
    assert gate.state == DRAINING and "draining" in admit(gate, "decode")
    with pytest.raises(RoleError, match="still has 2 running sequence"):
        gate.switch("prefill", lambda: "2 running sequence(s)", registered.append)
    assert (gate.role, registered) == ("decode", [])
    gate.switch("prefill", lambda: "", registered.append)
    assert (gate.role, gate.state, registered, gate.num_switches) == (
        "prefill",
        SERVING,
        ["prefill"],
        1,
    )
    assert admit(gate, "prefill") is None and admit(gate, "decode") is not None


def test_a_call_admitted_before_the_drain_holds_the_switch_until_it_returns():
    gate = RoleGate("w", "prefill")
    ctx = Context()
    with gate.admitted("prefill", ctx):  # a Prefill call under way
        gate.drain(True)
        with pytest.raises(RoleError, match="1 call"):
            gate.switch("decode", lambda: "", lambda role: None)
    gate.switch("decode", lambda: "", lambda role: None)
    assert gate.role == "decode"


def test_a_drain_reports_a_call_admitted_before_it_as_work_left():
    # the router's flip switches once a Drain reports nothing left: a Reserve admitted just before
    # the Drain has made no reservation yet, so the parts' remaining() alone says "" (the race
    # behind a CI failure, "worker w0 still has 1 reservation(s)" at SwitchRole)
    gate = RoleGate("w", "decode")
    control = ControlServicer(gate, remaining=lambda role: "", register=lambda role: None)
    with gate.admitted("decode", Context()):
        status = control.Drain(worker_pb2.DrainRequest(draining=True), Context())
        assert status.state == DRAINING and status.remaining == "1 call(s) starting decode work"
    assert control.Drain(worker_pb2.DrainRequest(draining=True), Context()).remaining == ""


def test_a_failed_registration_keeps_the_old_role_and_the_drain():
    gate = RoleGate("w", "decode")
    gate.drain(True)

    def fail(role):
        raise grpc.RpcError()

    with pytest.raises(grpc.RpcError):
        gate.switch("prefill", lambda: "", fail)
    assert (gate.role, gate.state, gate.num_switches) == ("decode", DRAINING, 0)
    gate.drain(False)
    assert admit(gate, "decode") is None


def test_bad_roles_and_single_role_workers():
    gate = RoleGate("w", "decode")
    gate.drain(True)
    with pytest.raises(RoleError, match="role must be one of") as info:
        gate.switch("verifier", lambda: "", lambda role: None)
    assert info.value.invalid
    with pytest.raises(RoleError, match="already serves decode"):
        gate.switch("decode", lambda: "", lambda role: None)
    single = RoleGate("w", "prefill", roles=("prefill",))
    stamped = single.stamp(worker_pb2.WorkerStats())  # cannot flip, but says what it serves
    assert (stamped.role, stamped.role_state) == ("prefill", SERVING)
    assert gate.stamp(worker_pb2.WorkerStats()).role_state == DRAINING
    with pytest.raises(ValueError, match="role must be one of"):
        RoleGate("w", "colocated")
