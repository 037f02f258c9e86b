"""The LoRA adapters the router serves: which request `model` names which adapter, the cards
ListModels and /v1/models show, and the run-time load and unload every worker is told of.

A deployment's adapters (`lora.modules`, {name: path}) are loaded by every worker from its own
config at start (engine/lora.py, worker_common/lora.py), so a worker that joins later or flips
role has them; the router knows their names from the same config. A request whose `model` is an
adapter's name runs under that adapter on both legs (ReserveRequest.lora_name and
PrefillRequest.lora_name; the decode worker's ReserveResponse.lora_hash makes the prefill worker
refuse an adapter whose weights differ from the decode worker's), and its prefix affinity keys
on the adapter (router/affinity.py), so a prompt under one adapter never looks cached because
the base or another adapter ran it. `model` empty or the base model's id runs the base; any
other name is NOT_FOUND (404), as vLLM answers.

`load` and `unload` (the HTTP front's /v1/load_lora_adapter and /v1/unload_lora_adapter, off
unless `allow_runtime_updates`) call LoadLoRA or UnloadLoRA on every worker of both pools, one
after another with a bounded timeout each, and change the router's names only once every
worker took the change: a worker's refusal (a bad path, a rank above max_lora_rank) is the
client's answer, and the workers that had already loaded a new adapter unload it again. A worker
the pool holds dead (silent, or its engine stalled) is not called: the catch-up below brings it
up to date when it answers again.

A worker that registers after a run-time change (or comes back after a crash with its config's
adapters only) is brought up to date from its reports (`on_report`, a WorkerPool report
listener): when its WorkerStats lack an adapter the router serves, or list one the router
unloaded at run time, a catch-up thread (one per worker at a time, never the health thread)
calls LoadLoRA (`if_absent`, so a second push of a stale report changes nothing) or UnloadLoRA
on it, under the same lock as the endpoints (a failed one is tried again CATCH_UP_RETRY_S,
router/catch_up.py,
later, at its next report after that). Until its Stats list an adapter, the pool's picks
send that adapter's requests to the other workers (router/pool.py), so none reaches a worker
that would refuse it; `catch_ups` and `catch_up_failures` count the calls.
Thread-safe: gRPC handler threads resolve names while the HTTP front loads.
"""

from __future__ import annotations

import logging
import re
import threading

import grpc

from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router.catch_up import CatchUps

log = logging.getLogger(__name__)
WORKER_CALL_TIMEOUT_S = 60.0  # one worker's LoadLoRA (it reads the adapter from its disk)
# the names and paths engine/lora.py accepts (the router reaches workers over gRPC only, so it
# checks them itself, before any worker is called)
MAX_NAME_LEN, MAX_PATH_LEN = 256, 4096
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")


class LoRAError(ValueError):
    pass


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise LoRAError(
            f"lora_name must be a non-empty string of at most {MAX_NAME_LEN} characters"
        )
    if not _NAME_RE.match(name):
        raise LoRAError(
            f"lora_name {name!r} may hold only letters, digits and . _ : / @ + - "
            f"(and not start with a punctuation mark)"
        )
    return name


def check_path(path: object) -> str:
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_LEN or "\x00" in path:
        raise LoRAError(f"lora_path must be a non-empty path of at most {MAX_PATH_LEN} characters")
    return path


class AdapterCallError(Exception):
    """A load or unload that did not happen: `status` the HTTP status, `message` why."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RouterAdapters:
    def __init__(
        self,
        base_id: str,
        enabled: bool = False,
        modules: dict | tuple = (),
        allow_runtime_updates: bool = False,
        pool=None,
        aliases: tuple[str, ...] = (),
    ):
        self.pool = pool  # router/pool.py WorkerPool: the workers load and unload tell
        self.base_id = base_id
        self.aliases = tuple(aliases)  # other names of the base model (RouterConfig's)
        self._base_names = frozenset((base_id, *self.aliases))
        self.enabled = enabled
        self.allow_runtime_updates = allow_runtime_updates
        pairs = modules.items() if isinstance(modules, dict) else modules
        self._paths: dict[str, str] = dict(pairs)
        # names unloaded at run time (a worker whose config has them gets them unloaded too)
        self._removed: set[str] = set()
        self._lock = threading.Lock()
        self._admin = threading.Lock()  # one load, unload or catch-up call at a time
        self._catch_ups = CatchUps("router-lora-catch-up")
        self.catch_ups = 0  # LoadLoRA and UnloadLoRA calls of catch-ups that took
        self.catch_up_failures = 0
        if enabled and pool is not None and hasattr(pool, "on_report"):
            pool.on_report(self.on_report)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._paths)

    def adapter_for(self, model: str) -> str | None:
        """The adapter a request's `model` names ("" for the base model), None when it names
        nothing served here."""
        if not model or model in self._base_names:
            return ""
        with self._lock:
            return model if model in self._paths else None

    def served(self) -> list[str]:
        """Every name a request may give: the base model's id, its aliases, the adapters'."""
        return [self.base_id, *self.aliases, *self.names()]

    def cards(self, base: pdserve_pb2.ModelCard) -> list[pdserve_pb2.ModelCard]:
        """ListModels: the base model's card and one per alias (the same but for its id, as vLLM
        lists each served name), then one per adapter with `parent` the base's id and `root` its
        path."""
        out = [base]
        for alias in self.aliases:
            card = pdserve_pb2.ModelCard()
            card.CopyFrom(base)
            card.id = alias
            out.append(card)
        with self._lock:
            adapters = list(self._paths.items())
        for name, path in adapters:
            card = pdserve_pb2.ModelCard()
            card.CopyFrom(base)
            card.id, card.parent, card.root = name, base.id, path
            out.append(card)
        return out

    # ---- run-time changes (the HTTP front's endpoints) ------------------------------------------
    def _check_allowed(self) -> None:
        if not self.enabled:
            raise AdapterCallError(
                404, "LoRA adapters are off here: the deployment needs lora.enabled"
            )
        if not self.allow_runtime_updates:
            raise AdapterCallError(
                404,
                "loading and unloading LoRA adapters at run time is off here: the deployment "
                "needs lora.allow_runtime_updates",
            )

    def load(self, name: object, path: object) -> None:
        self._check_allowed()
        pool = self.pool
        try:
            check_name(name)
        except LoRAError as e:
            raise AdapterCallError(400, str(e), "lora_name") from None
        try:
            check_path(path)
        except LoRAError as e:
            raise AdapterCallError(400, str(e), "lora_path") from None
        if name in self._base_names:
            raise AdapterCallError(400, f"lora_name {name!r} names the base model", "lora_name")
        with self._admin:
            with self._lock:
                existed = name in self._paths
            done = []
            for worker in _live(pool):
                try:
                    worker.stub.LoadLoRA(
                        worker_pb2.LoadLoRARequest(lora_name=name, lora_path=path),
                        timeout=WORKER_CALL_TIMEOUT_S,
                    )
                    done.append(worker)
                except grpc.RpcError as e:
                    if not existed:
                        self._unload_on(done, name)
                    raise _worker_error(e, pool.name(worker), "lora_path") from None
            with self._lock:
                self._paths[name] = path
                self._removed.discard(name)

    def unload(self, name: object) -> None:
        self._check_allowed()
        pool = self.pool
        try:
            check_name(name)
        except LoRAError as e:
            raise AdapterCallError(400, str(e), "lora_name") from None
        with self._admin:
            with self._lock:
                if name not in self._paths:
                    raise AdapterCallError(
                        404, f"no LoRA adapter named {name!r} is loaded", "lora_name"
                    )
            with self._lock:  # no new request takes it from now on
                del self._paths[name]
                self._removed.add(name)
            for worker in _live(pool):
                try:
                    worker.stub.UnloadLoRA(
                        worker_pb2.UnloadLoRARequest(lora_name=name),
                        timeout=WORKER_CALL_TIMEOUT_S,
                    )
                except grpc.RpcError as e:
                    raise _worker_error(e, pool.name(worker), "lora_name") from None

    # ---- catch-up of workers that missed a run-time change (module docstring) -------------------
    def _changes_for(self, stats) -> tuple[dict[str, str], list[str]]:
        """({name: path} to load, [names] to unload) to bring a worker whose last report is
        `stats` up to date."""
        listed = set(stats.lora_adapters)
        cut = stats.lora_adapters_count > len(stats.lora_adapters)
        with self._lock:
            load = {} if cut else {n: p for n, p in self._paths.items() if n not in listed}
            unload = sorted(listed & self._removed)
        return load, unload

    def on_report(self, worker, stats) -> None:
        """A WorkerPool report listener (on the health thread or a heartbeat's: returns at once):
        starts a catch-up thread for a worker that lacks an adapter or has an unloaded one."""
        if not self.enabled or not stats.worker_id:
            return
        load, unload = self._changes_for(stats)
        if not load and not unload:
            return
        self._catch_ups.start(worker, self._catch_up)

    def _catch_up(self, worker) -> None:
        pool = self.pool
        with self._admin:  # after a load or unload under way: its outcome is what we push
            stats = worker.stats
            if stats is None or not pool.is_member(worker):
                return
            load, unload = self._changes_for(stats)
            for name, path in load.items():
                self._catch_up_call(
                    worker,
                    "LoadLoRA",
                    worker_pb2.LoadLoRARequest(lora_name=name, lora_path=path, if_absent=True),
                )
            for name in unload:
                self._catch_up_call(
                    worker, "UnloadLoRA", worker_pb2.UnloadLoRARequest(lora_name=name)
                )

    def _catch_up_call(self, worker, method: str, request) -> None:
        try:
            getattr(worker.stub, method)(request, timeout=WORKER_CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            self._catch_ups.failed(worker)
            log.warning(
                "LoRA catch-up of worker %s: %s %s failed: %s %s",
                self.pool.name(worker),
                method,
                request.lora_name,
                e.code().name,
                e.details(),
            )
            self.catch_up_failures += 1  # last: a count read means its call is all done
        else:
            self._catch_ups.succeeded(worker)
            log.info(
                "LoRA catch-up of worker %s: %s %s",
                self.pool.name(worker),
                method,
                request.lora_name,
            )
            self.catch_ups += 1

    @staticmethod
    def _unload_on(workers, name: str) -> None:
        for worker in workers:
            try:
                worker.stub.UnloadLoRA(
                    worker_pb2.UnloadLoRARequest(lora_name=name), timeout=WORKER_CALL_TIMEOUT_S
                )
            except grpc.RpcError:
                pass  # best effort: the router never sends requests for it there


def _live(pool) -> list:
    """The workers a load or unload calls: every member but the dead ones (silent, or a stalled
    engine), which the catch-up brings up to date once their reports come back."""
    return [w for w in pool.members() if not getattr(w, "dead", "")]


def _worker_error(e: grpc.RpcError, worker: str, param: str) -> AdapterCallError:
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return AdapterCallError(400, f"worker {worker}: {e.details()}", param)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return AdapterCallError(409, f"worker {worker}: {e.details()}")
    return AdapterCallError(
        503, f"worker {worker} did not take the change: {code.name} {e.details()}; retry"
    )
