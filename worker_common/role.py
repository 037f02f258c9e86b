"""Which role a worker serves, and its switch to the other one: RoleGate and the WorkerControl
service.

A worker built with both parts (prefill and decode, worker_common/process.py) holds one RoleGate
for its life. It starts SERVING the role it was launched with. The router's flip
(router/flips.py) then drives it through one state machine:

    serving --Drain(true)--> draining --SwitchRole(other)--> switching --registered--> serving
        ^---Drain(false)------'   (a flip given up)          (FAILED_PRECONDITION while work of
                                                              the old role remains: still draining)

While draining, the old role's service refuses new work (Reserve, Prefill) with UNAVAILABLE, so
the router tries another worker; what was admitted goes on. SwitchRole checks that nothing of the
old role remains (`remaining`, from the parts), changes the role, and registers again under it
before it answers, so the router holds the worker in the new pool once the call returns. The
engine, its weights and its KV pool (prefix cache included) are the same before and after. Every
transition is logged; every WorkerStats (a Stats answer, a heartbeat) and RoleStatus carries the
role and state and a count of their changes (`version`), by which the router tells a report sent
before a change it already heard of from a newer one; the router drives a worker whose report differs from its intent back to it
(router/reconcile.py): a Drain(false) or SwitchRole may come at any time, not only in a flip.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import grpc

from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
SERVING, DRAINING, SWITCHING = "serving", "draining", "switching"


class RoleGate:
    """The role and state of one worker (the module docstring), and whether new work of a role
    may start. Thread-safe; the services read it on every Reserve and Prefill."""

    def __init__(self, worker_id: str, role: str, roles: tuple[str, ...] = ROLES):
        if role not in roles:
            raise ValueError(f"role must be one of {roles}, got {role!r}")
        self.worker_id = worker_id
        self.roles = roles
        self.role = role
        self.state = SERVING
        self.version = 0  # counts changes of (role, state): WorkerStats.role_version
        self.num_switches = 0
        self._held = 0  # calls inside admitted()
        self._lock = threading.Lock()

    def _refusal(self, role: str) -> str | None:
        if self.role != role:
            return f"worker {self.worker_id} serves {self.role} now, not {role}: try another worker"
        if self.state != SERVING:
            return f"worker {self.worker_id} is {self.state} (a role flip): try another worker"
        return None

    def stamp(self, stats: worker_pb2.WorkerStats) -> worker_pb2.WorkerStats:
        """`stats` with this worker's role and state (a single-role worker's too: always its role,
        serving). The router compares them with what it intends (router/reconcile.py); every
        Stats answer and heartbeat carries them."""
        with self._lock:
            stats.role, stats.role_state = self.role, self.state
            stats.role_version = self.version
        return stats

    def status(self) -> tuple[str, str, int]:
        """(role, state, version), read together."""
        with self._lock:
            return self.role, self.state, self.version

    @contextlib.contextmanager
    def admitted(self, role: str, context):
        """Around a call that starts work of `role` (Reserve, Prefill): aborts it UNAVAILABLE
        unless the worker serves `role` and is not draining; else counts it as held until it
        returns, so that a switch waits for it (what it leaves behind, a reservation or a
        running sequence, the parts' `remaining` sees from then on)."""
        with self._lock:
            why = self._refusal(role)
            if why is None:
                self._held += 1
        if why is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, why)
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1

    def left(self, remaining: Callable[[], str]) -> str:
        """What work of the current role the worker still holds ("" when none): the calls inside
        `admitted()` first (a Reserve admitted before a Drain has no reservation yet, so
        `remaining()` alone would report nothing while one is on its way), then `remaining()`."""
        with self._lock:
            return self._left(remaining)

    def _left(self, remaining: Callable[[], str]) -> str:
        return f"{self._held} call(s) starting {self.role} work" if self._held else remaining()

    def drain(self, draining: bool) -> None:
        with self._lock:
            if self.state == SWITCHING:
                raise RoleError(f"worker {self.worker_id} is switching roles")
            before, self.state = self.state, DRAINING if draining else SERVING
            if before != self.state:
                self.version += 1
        if before != self.state:
            log.info("worker %s (%s): %s -> %s", self.worker_id, self.role, before, self.state)

    def switch(self, role: str, remaining: Callable[[], str], register: Callable[[str], None]):
        """Switches to `role` once `remaining()` says no work of the current role is left, then
        `register(role)`; on a failed registration the old role comes back (still draining)."""
        if role not in self.roles:
            raise RoleError(f"role must be one of {list(self.roles)}, got {role!r}", invalid=True)
        with self._lock:
            if self.role == role:
                raise RoleError(f"worker {self.worker_id} already serves {role}")
            if self.state != DRAINING:
                raise RoleError(
                    f"worker {self.worker_id} is {self.state}: Drain it before SwitchRole"
                )
            left = self._left(remaining)
            if left:
                raise RoleError(f"worker {self.worker_id} still has {left}")
            old, self.state = self.role, SWITCHING
            self.version += 1
        log.info("worker %s: switching %s -> %s", self.worker_id, old, role)
        try:
            with self._lock:
                self.role = role
                self.version += 1
            register(role)
        except BaseException:
            with self._lock:
                self.role, self.state = old, DRAINING
                self.version += 1
            log.exception("worker %s: switch to %s failed; still %s", self.worker_id, role, old)
            raise
        with self._lock:
            self.state = SERVING
            self.version += 1
            self.num_switches += 1
        log.info("worker %s: serving %s (was %s)", self.worker_id, role, old)


class RoleError(Exception):
    """A Drain or SwitchRole the gate refuses; `invalid`: the request itself is wrong."""

    def __init__(self, message: str, invalid: bool = False):
        super().__init__(message)
        self.invalid = invalid


class ControlServicer(worker_pb2_grpc.WorkerControlServicer):
    """WorkerControl over a gate. remaining(role) says what work of `role` the worker still holds
    ("" when none); register(role) registers the worker again under `role` (a worker without a
    router: nothing to do)."""

    def __init__(
        self,
        gate: RoleGate,
        remaining: Callable[[str], str],
        register: Callable[[str], None],
    ):
        self.gate = gate
        self._remaining = remaining
        self._register = register

    def _status(self, switch_ms: int = 0) -> worker_pb2.RoleStatus:
        role, state, version = self.gate.status()
        return worker_pb2.RoleStatus(
            worker_id=self.gate.worker_id,
            role=role,
            state=state,
            remaining=self.gate.left(lambda: self._remaining(role)),
            switch_ms=switch_ms,
            role_version=version,
        )

    def Drain(self, request, context):
        try:
            self.gate.drain(request.draining)
        except RoleError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return self._status()

    def SwitchRole(self, request, context):
        t0 = time.perf_counter()
        old = self.gate.role
        try:
            self.gate.switch(request.role, lambda: self._remaining(old), self._register)
        except RoleError as e:
            code = (
                grpc.StatusCode.INVALID_ARGUMENT
                if e.invalid
                else grpc.StatusCode.FAILED_PRECONDITION
            )
            context.abort(code, str(e))
        except grpc.RpcError as e:  # the registration with the router failed
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {self.gate.worker_id} could not register as {request.role}: "
                f"{e.code().name} {e.details()}; it still serves {old}",
            )
        return self._status(int((time.perf_counter() - t0) * 1000))
