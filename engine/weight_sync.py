"""Weights sent by a trainer process straight into every rank of a deployment, over a
torch.distributed group (gloo on CPUs): both ends of the wire, the trainer's `WeightSender` and
the engine ranks' `WeightReceiver`, so that the two always speak the same protocol.

The group: the trainer is rank 0 and hosts the group's TCPStore at (master_address,
master_port); every rank of every engine in the deployment joins it (engine rank r of a worker
whose ranks start at rank_offset is rank_offset + r), as SGLang's /init_weights_update_group and
vLLM's NCCL weight transfer do. The keys live under KEY_PREFIX, so only a pdserve sender and
pdserve ranks ever meet.

One update, for a list of tensors (names, dtypes, shapes) the engines checked against the
checkpoint they serve, under a transfer id the update request carries. Each rank says in the
store that it is ready for that id and waits for the transfer's decision, which the first party
to write it settles (Group.decide): rank 0's "go" once every rank is ready, or an "abort" from
rank 0 giving up or from a worker whose update the router called off because another worker
refused. No collective starts before "go", so a refused update leaves none waiting (gloo cannot
cancel one) and the group serves the next update.

Then rank 0 broadcasts a header (the list's digest and byte count) and every rank says whether
it matches (an all-reduce of 1 or 0 with MIN); then the tensors in list order, packed into uint8
buckets of at most BUCKET_BYTES (a bigger tensor goes alone), which each rank cuts back into
tensors; then a last all-reduce says every rank received every bucket. Only then does any engine
load what it received, so the update is all or nothing across the deployment
(engine_core.LLMEngine.receive_weights). A rank that fails or times out fails the collective for
the others; a group that failed mid-transfer is closed on both ends and must be opened again.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable

import torch
import torch.distributed as dist

from pdserve.protos.limits import check_weight_tensors

KEY_PREFIX = "pdserve-weights/"
BUCKET_BYTES = 64 << 20
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
DEFAULT_TIMEOUT_S = 600.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GO, ABORT = b"go", b"abort"  # a transfer's decision (Group.decide)


class WeightSyncError(RuntimeError):
    """A weight update or group that failed. `reinit`: the server said the group no longer holds
    every live worker, and an init makes the next update work."""

    def __init__(self, message: str, reinit: bool = False):
        super().__init__(message)
        self.reinit = reinit


Spec = tuple[str, str, tuple[int, ...]]  # (name, dtype name, shape)


def specs_of(names, dtypes, shapes) -> list[Spec]:
    return [(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]


def nbytes(spec: Spec) -> int:
    n = DTYPES[spec[1]].itemsize
    for d in spec[2]:
        n *= d
    return n


def digest(specs: list[Spec]) -> int:
    """A 63-bit digest of the list: both ends compare it before any tensor moves."""
    text = json.dumps([[n, d, list(s)] for n, d, s in specs], separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


ALIGN = 8  # each tensor starts at a multiple of this in its bucket, so any dtype can view it


def buckets(specs: list[Spec]) -> list[tuple[list[tuple[int, int]], int]]:
    """The specs in order, grouped into buckets of at most BUCKET_BYTES (a bigger tensor is a
    bucket of its own): [([(spec index, byte offset), ...], bucket bytes)]; every end computes
    the same layout from the same list."""
    out: list[tuple[list[tuple[int, int]], int]] = []
    size = 0
    for i, spec in enumerate(specs):
        n = nbytes(spec)
        if not out or size + n > BUCKET_BYTES:
            if out:
                out[-1] = (out[-1][0], size)
            out.append(([], 0))
            size = 0
        out[-1][0].append((i, size))
        size += -(-n // ALIGN) * ALIGN
    if out:
        out[-1] = (out[-1][0], size)
    return out


def pack(tensors: list[torch.Tensor], specs: list[Spec], parts, size: int) -> torch.Tensor:
    """One bucket's bytes (`buckets`' parts and size), from the tensors on any device."""
    if len(parts) == 1 and nbytes(specs[parts[0][0]]) == size:
        return tensors[parts[0][0]].to("cpu").contiguous().view(-1).view(torch.uint8)
    buf = torch.zeros(size, dtype=torch.uint8)
    for i, at in parts:
        flat = tensors[i].to("cpu").contiguous().view(-1).view(torch.uint8)
        buf[at : at + flat.numel()].copy_(flat)
    return buf


def unpack(buf: torch.Tensor, specs: list[Spec], parts) -> dict[str, torch.Tensor]:
    """A bucket's tensors, as views into its bytes."""
    out = {}
    for i, at in parts:
        name, dtype, shape = specs[i]
        out[name] = buf[at : at + nbytes(specs[i])].view(DTYPES[dtype]).view(shape)
    return out


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host`, which gloo binds (a connected UDP socket picks
    the route and sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def open_group(
    master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
) -> Group:
    """Joins the group (rank 0 hosts its store); blocks until all `world_size` ranks joined, or
    raises after `timeout_s`."""
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=_td(timeout_s),
        wait_for_workers=False,
    )
    opts = dist.ProcessGroupGloo._Options()
    host = master_address if rank == 0 else _local_address_towards(master_address, master_port)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = _td(timeout_s)
    return Group(
        dist.ProcessGroupGloo(dist.PrefixStore(KEY_PREFIX, store), rank, world_size, opts),
        store,
        timeout_s,
    )


class Group:
    """A joined group: its gloo backend, and the store it met on (rank 0 hosts it, so it must
    live as long as the group). The store also carries each update's handshake: a rank says it
    is ready for transfer T before it enters T's first collective, and rank 0 starts none until
    every rank said so, so a refused update leaves no collective waiting (gloo cannot cancel one:
    a group dropped with one pending blocks until its timeout)."""

    def __init__(self, pg: dist.ProcessGroupGloo, store: dist.TCPStore, timeout_s: float):
        self.pg, self.store, self.timeout_s = pg, store, timeout_s
        self.ctl = dist.PrefixStore(KEY_PREFIX + "ctl/", store)

    def close(self) -> None:
        """Lets go of the backend and the store, even while something (an exception's
        traceback) still holds this object: rank 0's store frees master_port once nothing
        else holds it."""
        self.pg = self.store = self.ctl = None

    def ready_keys(self, transfer_id: str) -> list[str]:
        return [f"{transfer_id}/{r}" for r in range(1, self.pg.size())]

    def set_ready(self, transfer_id: str) -> None:
        self.ctl.set(f"{transfer_id}/{self.pg.rank()}", b"1")

    def decide(self, transfer_id: str, go: bool) -> bool:
        """Settles whether transfer `transfer_id` runs: the first party to decide wins (the
        trainer's "go" once every rank is ready; an "abort" from the trainer giving up or from a
        worker whose update was called off). True when it runs."""
        want = GO if go else ABORT
        return self.ctl.compare_set(f"{transfer_id}/decided", b"", want) == GO

    def decision(self, transfer_id: str) -> bytes | None:
        """GO, ABORT, or None while undecided."""
        key = f"{transfer_id}/decided"
        return self.ctl.get(key) if self.ctl.check([key]) else None

    def forget(self, transfer_id: str) -> None:
        """Drops the transfer's keys (rank 0, once it is over)."""
        for key in [*self.ready_keys(transfer_id), f"{transfer_id}/decided"]:
            self.ctl.delete_key(key)

    def broadcast(self, tensor: torch.Tensor, root: int):
        return self.pg.broadcast(tensor, root)

    def allreduce(self, tensors: list[torch.Tensor], op=dist.ReduceOp.SUM):
        return self.pg.allreduce(tensors, op)


def _agree(group, ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    group.allreduce([flag], dist.ReduceOp.MIN).wait()
    return bool(flag.item())


def _header(group, specs: list[Spec] | None) -> torch.Tensor:
    head = torch.zeros(2, dtype=torch.int64)
    if specs is not None:
        head[0] = digest(specs)
        head[1] = sum(nbytes(s) for s in specs)
    group.broadcast(head, 0).wait()
    return head


class WeightReceiver:
    """One engine rank's membership of a trainer's group: joined on a thread of its own (the rank
    keeps serving meanwhile), then `receive` takes one update. Not thread-safe beyond that: the
    engine calls it from its step, one call at a time."""

    def __init__(self, name: str, master_address, master_port, rank, world_size, timeout_s):
        self.name, self.rank, self.timeout_s = name, rank, timeout_s
        self.group: Group | None = None
        self.error: BaseException | None = None
        self._joined = threading.Event()

        def join():
            try:
                self.group = open_group(master_address, master_port, rank, world_size, timeout_s)
            except BaseException as e:  # kept for the next receive to report
                self.error = e
            finally:
                self._joined.set()

        self._thread = threading.Thread(target=join, name=f"pdserve-weights-{name}", daemon=True)
        self._thread.start()

    def wait_joined(self, timeout_s: float | None = None) -> Group:
        if not self._joined.wait(self.timeout_s if timeout_s is None else timeout_s):
            raise WeightSyncError(f"group {self.name!r}: the trainer and every rank did not join")
        if self.group is None:
            raise WeightSyncError(f"group {self.name!r} could not be joined: {self.error}")
        return self.group

    def receive(self, specs: list[Spec], transfer_id: str) -> dict[str, torch.Tensor]:
        """Every tensor of `specs` from rank 0 (views into the buckets), once every rank of the
        group agreed on the list and received all of it; raises WeightSyncError otherwise (the
        group is then closed). `transfer_id`: the update's, as the trainer's `send` has it."""
        group = self.wait_joined()
        try:
            group.set_ready(transfer_id)
            self._await_go(group, transfer_id)
        except RuntimeError as e:  # the store: its host, the trainer, is gone
            if isinstance(e, WeightSyncError):
                raise  # called off or not started: the group is as it was
            self.close()
            raise WeightSyncError(f"group {self.name!r}: {e}") from e
        try:
            head = _header(group, None)
            expected = (digest(specs), sum(nbytes(s) for s in specs))
            if not _agree(group, (int(head[0]), int(head[1])) == expected):
                raise WeightSyncError(
                    "the trainer's tensors are not the ones the update request listed (names, "
                    "dtypes and shapes must be the same list, in the same order)"
                )
            out: dict[str, torch.Tensor] = {}
            works = []
            for parts, size in buckets(specs):
                buf = torch.empty(size, dtype=torch.uint8)
                works.append(group.broadcast(buf, 0))
                out.update(unpack(buf, specs, parts))
            for work in works:
                work.wait()
            if not _agree(group, True):
                raise WeightSyncError("another rank of the group did not receive every tensor")
            return out
        except WeightSyncError:
            self.close()
            raise
        except RuntimeError as e:  # gloo's: a timeout, a rank gone
            self.close()
            raise WeightSyncError(f"group {self.name!r}: {e}") from e

    def _await_go(self, group: Group, transfer_id: str) -> None:
        """Waits for the transfer's decision; raises WeightSyncError (the group stays usable)
        when it was called off or nobody decided within the group's timeout."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while True:
            decided = group.decision(transfer_id)
            if decided == GO:
                return
            if decided is not None:
                raise WeightSyncError(f"transfer {transfer_id[:64]!r} was called off")
            if time.monotonic() > deadline:
                if group.decide(transfer_id, go=False):  # decided meanwhile: it runs
                    return
                raise WeightSyncError(
                    f"transfer {transfer_id[:64]!r}: the trainer did not start it within "
                    f"{self.timeout_s:g} s"
                )
            time.sleep(pause)
            pause = min(0.02, pause * 2)

    def call_off(self, transfer_id: str) -> bool:
        """Any thread: calls the transfer off unless it already runs (False then)."""
        group = self.group
        return group is not None and not group.decide(transfer_id, go=False)

    def close(self) -> None:
        self.group = None
        self.error = WeightSyncError(f"group {self.name!r} was closed after a failure")


def send(
    group: Group,
    tensors: list[torch.Tensor],
    specs: list[Spec],
    transfer_id: str,
    wait=None,
    gate=None,
) -> bool:
    """Rank 0's side of one update (the module's docstring): False when the ranks refused the
    list, True once every rank received every tensor. `transfer_id` is the one the update request
    gave the ranks; no collective starts before every rank said it is ready for it. `gate()` is
    called while waiting for that and may raise to give up (the group stays usable); past the
    group's timeout WeightSyncError. `wait(works)` waits for gloo works (by default each work's
    own wait)."""
    if wait is None:

        def wait(works):
            for work in works:
                work.wait()

    keys = group.ready_keys(transfer_id)
    deadline = time.monotonic() + group.timeout_s
    pause = 0.001
    try:
        while not group.ctl.check(keys):
            if group.decision(transfer_id) is not None:
                raise WeightSyncError(f"transfer {transfer_id[:64]!r} was called off by a worker")
            if gate is not None:
                gate()
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"transfer {transfer_id[:64]!r}: not every rank was ready within "
                    f"{group.timeout_s:g} s (no tensor was sent; the group is still usable)"
                )
            time.sleep(pause)
            pause = min(0.02, pause * 2)
    except BaseException:
        group.decide(transfer_id, go=False)  # the ranks that are ready stop waiting
        raise
    if not group.decide(transfer_id, go=True):
        raise WeightSyncError(f"transfer {transfer_id[:64]!r} was called off by a worker")
    head = torch.tensor([digest(specs), sum(nbytes(s) for s in specs)], dtype=torch.int64)
    wait([group.broadcast(head, 0)])
    flag = torch.tensor([1], dtype=torch.int64)
    wait([group.allreduce([flag], dist.ReduceOp.MIN)])
    group.forget(transfer_id)  # every rank took part in the all-reduce: each is past the decision
    if not flag.item():
        return False
    works, keep = [], []
    for parts, size in buckets(specs):
        buf = pack(tensors, specs, parts, size)
        keep.append(buf)  # a buffer must live until its broadcast is done
        works.append(group.broadcast(buf, 0))
    wait(works)
    flag = torch.tensor([1], dtype=torch.int64)
    wait([group.allreduce([flag], dist.ReduceOp.MIN)])
    return bool(flag.item())


class WeightSender:
    """The trainer's end: pdserve's HTTP endpoints and the group, driven together.

        sender = WeightSender("http://router:8000", master_address="10.0.0.5", master_port=29600)
        sender.init()                                   # every rank of both pools joins
        sender.update(model.named_parameters(), version="step-40")   # all or nothing

    `world_size` defaults to 1 + the deployment's ranks, as the router's /weight_info says.
    Each call raises WeightSyncError when the server refused (the group stays usable) or the
    transfer failed once started (the group is then closed: init again)."""

    def __init__(
        self,
        base_url: str,
        master_address: str,
        master_port: int,
        *,
        api_key: str | None = None,
        group_name: str = DEFAULT_GROUP,
        world_size: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reinit: bool = True,
    ):
        self.base_url = base_url.rstrip("/")
        self.master_address, self.master_port = master_address, master_port
        self.api_key, self.group_name = api_key, group_name
        self.world_size, self.timeout_s = world_size, timeout_s
        self._derived_world = world_size is None  # from /weight_info, at each init
        self.reinit, self.reinits = reinit, 0  # re-init when the server says so; how often
        self.group: Group | None = None

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s + 60) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"{}")
            except ValueError:
                return e.code, {"message": str(e)}

    def _beside(self, method: str, path: str, body: dict):
        """The HTTP call on a thread of its own: (thread, result list)."""
        result: list = []

        def run():
            try:
                result.append(self._call(method, path, body))
            except BaseException as e:  # reported by _check
                result.append((0, {"message": f"{type(e).__name__}: {e}"}))

        thread = threading.Thread(target=run, name="pdserve-weights-http", daemon=True)
        thread.start()
        return thread, result

    @staticmethod
    def _check(what: str, thread: threading.Thread, result: list) -> dict:
        thread.join()
        status, body = result[0]
        if status != 200 or not body.get("success", False):
            raise WeightSyncError(
                f"{what}: HTTP {status}: {body.get('message', body)}",
                reinit=bool(body.get("reinit_group")),
            )
        return body

    def _wait(self, works, what: str, thread, result) -> None:
        """Waits for gloo works, giving up as soon as the server answered a failure (its ranks
        will never take part)."""
        deadline = time.monotonic() + self.timeout_s
        for work in works:
            while not work.is_completed():
                if not thread.is_alive() and result and result[0][0] != 200:
                    self.close()
                    self._check(what, thread, result)
                if time.monotonic() > deadline:
                    self.close()
                    raise WeightSyncError(f"{what}: the ranks did not take part in time")
                time.sleep(0.005)
            work.wait()

    def init(self) -> None:
        if self.world_size is None:
            status, info = self._call("GET", "/weight_info")
            if status != 200 or not isinstance(info.get("ranks"), int):
                raise WeightSyncError(f"/weight_info: HTTP {status}: {info}")
            self.world_size = 1 + info["ranks"]
        body = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": "gloo",
            "timeout_s": self.timeout_s,
        }
        thread, result = self._beside("POST", "/init_weights_update_group", body)
        group: list = []
        opener = threading.Thread(
            target=lambda: group.append(
                open_group(
                    self.master_address, self.master_port, 0, self.world_size, self.timeout_s
                )
            ),
            daemon=True,
        )
        opener.start()
        while opener.is_alive():
            if not thread.is_alive() and result and result[0][0] != 200:
                self._check("/init_weights_update_group", thread, result)
            opener.join(0.05)
        if not group:
            self._check("/init_weights_update_group", thread, result)
            raise WeightSyncError("the group could not be opened: a rank did not join in time")
        self.group = group[0]
        self._check("/init_weights_update_group", thread, result)

    def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str = "", **extra
    ) -> dict:
        """Sends every tensor (float32, bfloat16 or float16, on the CPU or any device) and returns
        the server's answer once every worker of both pools serves them. `extra`: more fields of
        /update_weights_from_distributed (abort_all_requests, keep_pause). When the server says
        the group no longer holds every live worker (one restarted or left since the init), the
        sender inits the group again and sends once more (with `reinit`, the default)."""
        if self.group is None:
            raise WeightSyncError("no group: call init() first (again after a failure)")
        items = [(n, t.detach()) for n, t in named_tensors]
        names = [n for n, _ in items]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in items]
        shapes = [list(t.shape) for _, t in items]
        why = check_weight_tensors(names, dtypes, shapes)
        if why is not None:
            raise WeightSyncError(why)
        try:
            return self._update(items, names, dtypes, shapes, version, extra)
        except WeightSyncError as e:
            if not (e.reinit and self.reinit):
                raise
        self.close()
        gc.collect()  # the old group's store holds master_port until it is freed
        if self._derived_world:
            self.world_size = None  # the deployment's ranks may have changed
        self.init()
        self.reinits += 1
        return self._update(items, names, dtypes, shapes, version, extra)

    def _update(self, items, names, dtypes, shapes, version: str, extra: dict) -> dict:
        specs = specs_of(names, dtypes, shapes)
        transfer_id = uuid.uuid4().hex
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": self.group_name,
            "weight_version": version,
            "transfer_id": transfer_id,
            **extra,
        }
        what = "/update_weights_from_distributed"
        thread, result = self._beside("POST", what, body)
        group = self.group

        def wait(works):
            self._wait(works, what, thread, result)

        def gate():  # the server answered before the ranks were ready: a refusal
            if not thread.is_alive():
                self._check(what, thread, result)
                raise WeightSyncError(f"{what}: answered before every rank was ready")

        try:
            if not send(group, [t for _, t in items], specs, transfer_id, wait, gate):
                self.close()
                self._check(what, thread, result)
                raise WeightSyncError("the ranks refused the tensor list")
        except WeightSyncError:
            # called off: the server's answer says why (a worker refused the update)
            thread.join(self.timeout_s + 60)
            if result:
                self._check(what, thread, result)
            raise
        except RuntimeError as e:
            self.close()
            raise WeightSyncError(f"{what}: {e}") from e
        return self._check(what, thread, result)

    def destroy(self) -> dict:
        status, body = self._call(
            "POST", "/destroy_weights_update_group", {"group_name": self.group_name}
        )
        self.close()
        if status != 200:
            raise WeightSyncError(f"/destroy_weights_update_group: HTTP {status}: {body}")
        return body

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
