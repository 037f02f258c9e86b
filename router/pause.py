"""The router's pause: every new request held at the one gate in front of both pools, for a
reinforcement-learning trainer that syncs the weights (or a LoRA adapter) between rollouts, or
an operator who wants the engines idle. The HTTP front's vLLM endpoints (router/openai/pause.py):

    POST /pause?mode=abort   the running requests end now (finish_reason "abort", with what
                             they generated), then the answer: no request runs anywhere
    POST /pause?mode=wait    the running requests finish first, then the answer
    POST /resume             the held requests run, in their queue order
    GET  /is_paused          {"is_paused": bool}

A disaggregated deployment has no single engine to pause: a request's prefill and decode legs
run on two workers, and pausing each engine apart would leave a leg half done on one side. The
router's admission (router/admission.py) is the one place every Generate and Embed call passes
before any worker sees it, so closing it pauses the whole cluster at once; "abort" then ends the
admitted calls through PDServe.Abort's path (router/service.py abort_all), which frees their KV
on both pools, and /pause answers only when the last admitted call has left, so a trainer that
reads 200 knows no worker runs a request. Held requests wait in the admission queue (bounded by
max_queued; the time paused does not count towards max_queue_wait_s; a client's deadline and
its leaving still end its wait). vLLM's third mode, "keep", freezes running requests inside the
engine; pdserve's engines cannot, so it is refused, saying so.

Two kinds of hold close the gate, and it opens only when neither is left: a client's /pause
(until its /resume), and each weight update under way (`hold` and `release`, from
router/openai/weights.py, whatever this deployment switch says), so an update that ends never
reopens a gate a client or another update still holds. Off unless the deployment sets `router.pause_endpoints` (any client
with a key could stop the service): then 404, as vLLM answers without its dev mode. One
RouterPause per router, built with its servicer; thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pdserve.router.admission import Admission

MODES = ("abort", "wait")
DEFAULT_TIMEOUT_S = 600.0  # /pause's wait for the running requests to end, unless told
MAX_TIMEOUT_S = 3600.0


class PauseError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RouterPause:
    def __init__(self, admission: Admission, abort_all: Callable[[], int], enabled: bool):
        """abort_all: ends every admitted Generate call (finish_reason "abort"), returning how
        many it asked to end."""
        self.admission, self._abort_all, self.enabled = admission, abort_all, enabled
        self._lock = threading.Lock()
        self._by_client = False  # a client's /pause holds the gate until its /resume
        self._holds = 0  # weight updates under way, each holding it

    def check_enabled(self) -> None:
        if not self.enabled:
            raise PauseError(
                404, "pausing is off here: the deployment needs router.pause_endpoints: true"
            )

    @staticmethod
    def check_mode(mode: object) -> str:
        if mode == "keep":
            raise PauseError(
                400,
                "mode=keep freezes running requests inside the engine, which pdserve's engines "
                "cannot do; use mode=abort (they end now) or mode=wait (they finish first)",
                "mode",
            )
        if mode not in MODES:
            raise PauseError(
                400, f"mode must be one of abort, wait; got {str(mode)[:40]!r}", "mode"
            )
        return str(mode)

    @staticmethod
    def check_timeout(timeout: object) -> float:
        try:
            value = float(timeout)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            value = float("nan")
        if not 0 < value <= MAX_TIMEOUT_S:
            raise PauseError(
                400,
                f"timeout must be seconds in (0, {MAX_TIMEOUT_S:g}]; got {timeout!r}",
                "timeout",
            )
        return value

    def pause(self, mode: str) -> int:
        """A client's hold: closes the gate and, for "abort", ends the admitted calls: how many
        it ended. Never blocks past short locks."""
        self.check_enabled()
        with self._lock:
            self._by_client = True
            self.admission.pause()
        return self._abort_all() if mode == "abort" else 0

    def hold(self, mode: str) -> int:
        """A weight update's hold (router/weights.py), which its own switch allows: as `pause`,
        until its `release`."""
        with self._lock:
            self._holds += 1
            self.admission.pause()
        return self._abort_all() if mode == "abort" else 0

    def release(self, keep: bool = False) -> None:
        """A weight update's hold ends; with `keep` it becomes a client's (keep_pause: /resume
        opens the gate)."""
        with self._lock:
            self._holds -= 1
            self._by_client = self._by_client or keep
            self._open_if_free_locked()

    def abort_stragglers(self) -> int:
        """Under "abort": ends a call admitted just before the gate closed and registered only
        after `pause` looked (how many)."""
        return self._abort_all()

    def idle(self) -> bool:
        """No admitted call runs (on any worker, for this router's requests)."""
        return self.admission.idle()

    def running(self) -> int:
        return self.admission.running()

    def resume(self) -> None:
        """A client's hold ends (the gate stays closed while a weight update holds it)."""
        self.check_enabled()
        with self._lock:
            self._by_client = False
            self._open_if_free_locked()

    def _open_if_free_locked(self) -> None:
        if not self._by_client and self._holds == 0:
            self.admission.resume()

    @property
    def is_paused(self) -> bool:
        return self.admission.is_paused
