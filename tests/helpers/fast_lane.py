"""The fast lane's contract, enforced: a test in tests/unit opens no socket, starts no process,
and loads no real model. tests/conftest.py imports the hooks and the fixture below.

When every collected test is under tests/unit (the fast lane: `bash scripts/test.sh tests/unit`),
this conftest wraps the calls that would break that contract: Python sockets, gRPC servers and
channels, torch.distributed's TCP store, subprocesses and multiprocessing, and resolving the real
SmolLM2. Such a call during a test raises LaneViolation, and a test whose code swallowed it still
fails at teardown, naming what it did: move that test to tests/integration. Two calls are one-offs
of the process, not of the test that happens to come first, and stay allowed: the compiled CPU
kernels' build (torch's cpp_extension runs the compiler once per cache entry; engine/kernels asks
ninja its version once) and a socket opened while a module is imported (urllib3 probes for IPv6
once). In a run that also collects other folders (the full suite), the guard stays off: servers
and threads of those tests are expected.
"""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import pathlib
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import grpc.aio
import pytest
import torch.distributed

from pdserve.engine.loader import resolve

FAST_LANE = pathlib.Path(__file__).resolve().parents[1] / "unit"
_state = {"on": False, "test": None}
_seen: dict[str, list[str]] = {}  # test node id -> what it did


class LaneViolation(RuntimeError):
    """A fast-lane test did what only tests/integration may do."""


def _one_off() -> bool:
    """The compiled kernels' build, or a module being imported (see the module docstring)."""
    frame = sys._getframe(3)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(os.path.join("torch", "utils", "cpp_extension.py")):
            return True
        if name.endswith(os.path.join("engine", "kernels", "__init__.py")):  # (ninja's version)
            return True
        if name == "<frozen importlib._bootstrap>":
            return True
        frame = frame.f_back
    return False


def _violate(what: str) -> None:
    test = _state["test"]
    if test is None or _one_off():
        return
    _seen.setdefault(test, []).append(what)
    raise LaneViolation(f"{what}: the fast lane opens no socket, process or real model")


def _guard(owner, attr: str, what: str) -> None:
    original = getattr(owner, attr)

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        _violate(what)
        return original(*args, **kwargs)

    setattr(owner, attr, guarded)


def _socket_guard() -> None:
    original_init, original_pair = socket.socket.__init__, socket.socketpair
    pairing = {"depth": 0}

    def init(self, *args, **kwargs):
        if not pairing["depth"] and kwargs.get("fileno") is None:
            _violate("socket.socket()")
        original_init(self, *args, **kwargs)

    def socketpair(*args, **kwargs):  # an event loop's self-pipe: no network
        pairing["depth"] += 1
        try:
            return original_pair(*args, **kwargs)
        finally:
            pairing["depth"] -= 1

    socket.socket.__init__, socket.socketpair = init, socketpair


def _smollm2_guard() -> None:
    original = resolve.smollm2_gguf_path

    @functools.wraps(original)
    def smollm2_gguf_path():
        path = original()  # raises by itself where the model package is absent
        _violate("resolving the real SmolLM2")
        return path

    resolve.smollm2_gguf_path = smollm2_gguf_path


def pytest_collection_modifyitems(session, config, items):
    inside = [FAST_LANE in pathlib.Path(str(item.path)).resolve().parents for item in items]
    if items and all(inside) and not _state["on"]:
        _state["on"] = True
        _socket_guard()
        _smollm2_guard()
        for owner, attr, what in [
            (subprocess.Popen, "__init__", "a subprocess"),
            (multiprocessing.process.BaseProcess, "start", "a multiprocessing process"),
            (futures.ProcessPoolExecutor, "__init__", "a process pool"),
            (grpc, "server", "a gRPC server"),
            (grpc, "insecure_channel", "a gRPC channel"),
            (grpc, "secure_channel", "a gRPC channel"),
            (grpc.aio, "server", "a gRPC server"),
            (grpc.aio, "insecure_channel", "a gRPC channel"),
            (grpc.aio, "secure_channel", "a gRPC channel"),
            (torch.distributed, "TCPStore", "torch.distributed's TCP store"),
            (torch.distributed, "init_process_group", "a torch.distributed group"),
        ]:
            _guard(owner, attr, what)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _state["test"] = item.nodeid if _state["on"] else None
    try:
        yield
    finally:
        _state["test"] = None


@pytest.fixture(autouse=True)
def fast_lane_contract(request):
    yield
    seen = _seen.pop(request.node.nodeid, None)
    if seen:
        pytest.fail(
            f"{request.node.nodeid} did {sorted(set(seen))}; the fast lane (tests/unit) opens no "
            "socket, process or real model: move the test to tests/integration",
            pytrace=False,
        )
