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
that registers after a run-time load does not have that adapter until it is loaded again (it
has its config's); a request for it there is refused FAILED_PRECONDITION, before any work.
Thread-safe: gRPC handler threads resolve names while the HTTP front loads.
"""

from __future__ import annotations

import re
import threading

import grpc

from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2

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
    ):
        self.pool = pool  # router/pool.py WorkerPool: the workers load and unload tell
        self.base_id = base_id
        self.enabled = enabled
        self.allow_runtime_updates = allow_runtime_updates
        pairs = modules.items() if isinstance(modules, dict) else modules
        self._paths: dict[str, str] = dict(pairs)
        self._lock = threading.Lock()
        self._admin = threading.Lock()  # one load or unload at a time

    def names(self) -> list[str]:
        with self._lock:
            return list(self._paths)

    def adapter_for(self, model: str) -> str | None:
        """The adapter a request's `model` names ("" for the base model), None when it names
        nothing served here."""
        if not model or model == self.base_id:
            return ""
        with self._lock:
            return model if model in self._paths else None

    def cards(self, base: pdserve_pb2.ModelCard) -> list[pdserve_pb2.ModelCard]:
        """ListModels: the base model's card, then one per adapter with `parent` the base's id."""
        out = [base]
        for name in self.names():
            card = pdserve_pb2.ModelCard()
            card.CopyFrom(base)
            card.id, card.parent = name, base.id
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
        if name == self.base_id:
            raise AdapterCallError(400, f"lora_name {name!r} is the base model's id", "lora_name")
        with self._admin:
            with self._lock:
                existed = name in self._paths
            done = []
            for worker in pool.members():
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
            for worker in pool.members():
                try:
                    worker.stub.UnloadLoRA(
                        worker_pb2.UnloadLoRARequest(lora_name=name),
                        timeout=WORKER_CALL_TIMEOUT_S,
                    )
                except grpc.RpcError as e:
                    raise _worker_error(e, pool.name(worker), "lora_name") from None

    @staticmethod
    def _unload_on(workers, name: str) -> None:
        for worker in workers:
            try:
                worker.stub.UnloadLoRA(
                    worker_pb2.UnloadLoRARequest(lora_name=name), timeout=WORKER_CALL_TIMEOUT_S
                )
            except grpc.RpcError:
                pass  # best effort: the router never sends requests for it there


def _worker_error(e: grpc.RpcError, worker: str, param: str) -> AdapterCallError:
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return AdapterCallError(400, f"worker {worker}: {e.details()}", param)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return AdapterCallError(409, f"worker {worker}: {e.details()}")
    return AdapterCallError(
        503, f"worker {worker} did not take the change: {code.name} {e.details()}; retry"
    )
