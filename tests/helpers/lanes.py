"""What the test processes of one parallel run share, and what they must not: the `serial`
marker's lock and torch's share of the cores. tests/conftest.py registers this module as a
plugin.

scripts/test.sh runs the suite with pytest-xdist, three test files at a time (`-n 3 --dist
loadfile`): most of the suite waits on sockets, subprocess starts and timeouts rather than
computing, so files beside it fill the idle cores. `--dist loadfile` keeps a file's tests
on one xdist worker, so a module-scoped cluster or local Ray is started once, not once per worker.

A test marked `serial` needs the machine to itself: it loads the machine on purpose (busy
processes beside a cluster) or times something against a bound that a second test beside it
would eat into. Every test holds a lock file of the run while it runs, setup and teardown
included (a module's cluster starts in its first test's setup): a `serial` test holds it
exclusively, any other test shared. A serial test waiting for it first takes a second lock, the
turnstile, that every other test passes through before it takes its shared lock, so a waiting
serial test is not starved: the other worker finishes the test it is in and waits at the
turnstile until the serial test is done. Outside xdist (a plain `pytest`, or `-n 0`) there is no
lock and nothing waits.

A test marked `exclusive(name)` holds a resource of the machine that no other test may hold at
the same time, though the rest of the suite may run beside it: `exclusive("default-ports")`, the
router's default ports 127.0.0.1:50051 and :8000, which the README tour's `pdserve up` listens on
and an `up --check` of a shipped example checks are free. Tests with the same name never run at
once; consecutive tests of one file with it keep it between them, so a module-scoped fixture (the
README tour's deployment) holds it for its whole life. It is taken before the serial lock and
its turnstile, so a test waiting for it holds neither (the Ray cluster of `ray start` nodes,
tests/e2e/test_ray_nodes.py, was one such name until its start timed out beside the rest of a
suite on a slow CPU: now it is `serial`); a test is never both `serial` and
`exclusive` (the tour's file, holding the name between its tests, would wait at the turnstile for
a serial test that waits for the name).

Each xdist worker is a process with its own session fixtures (tiny models under its own pytest
temp dir), its own local Rays (each in a fresh temp dir, on ports Ray picks) and its own servers
(port 0, or a port probed free just before it is used); the model conversion cache and the
compiled kernels' cache are shared and safe to share (conversions land by an atomic rename,
kernel builds under torch's build lock). What workers must not share is the CPU: `torch_threads()`
gives each worker its share of the cores, so two workers on two cores do not run four OpenMP
threads that spin against each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import tempfile

import pytest

LOCK_ENV = "PDSERVE_TEST_SERIAL_LOCK"  # the run's lock file, set by the xdist controller
MARKERS = (
    "serial: needs the machine to itself (loads it on purpose, or times something against a "
    "bound): under pytest-xdist it runs while no other test does (tests/helpers/lanes.py)",
    'exclusive(name): holds a resource of the machine ("default-ports": 127.0.0.1:50051 and '
    ":8000) that no other test with the same name may hold at once (tests/helpers/lanes.py)",
)
_names: dict[str, int] = {}  # exclusive name -> the descriptor that holds its lock


def torch_threads() -> int:
    """This process's share of the cores for torch: at most 2, and under pytest-xdist the cores
    divided among its workers (at least 1)."""
    cores = os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, min(2, cores // max(1, workers)))


def pytest_configure(config):
    """On the xdist controller (it spawns its workers after this, with its environment): a fresh
    lock file for this run, so that two runs on one machine (two checkouts) never wait on each
    other."""
    workers = getattr(config.option, "numprocesses", None)
    if workers and not os.environ.get("PYTEST_XDIST_WORKER"):
        fd, path = tempfile.mkstemp(prefix="pdserve-serial-", suffix=".lock")
        os.close(fd)
        os.environ[LOCK_ENV] = path
        config._pdserve_serial_lock = path


def pytest_unconfigure(config):
    path = getattr(config, "_pdserve_serial_lock", None)
    if path:
        pathlib.Path(path).unlink(missing_ok=True)
        for extra in pathlib.Path(path).parent.glob(pathlib.Path(path).name + ".*"):
            extra.unlink(missing_ok=True)  # the turnstile and the exclusive names' locks
        os.environ.pop(LOCK_ENV, None)


def _lock(path: str, exclusive: bool) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _held(path: str, exclusive: bool):
    fd = _lock(path, exclusive)
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock


def _exclusive_names(item) -> set[str]:
    names = set()
    for mark in item.iter_markers("exclusive"):
        if len(mark.args) != 1 or not isinstance(mark.args[0], str) or not mark.args[0]:
            raise pytest.UsageError(f"{item.nodeid}: exclusive() takes one name, got {mark.args}")
        names.add(mark.args[0])
    return names


def pytest_collection_modifyitems(config, items):
    """Refuses a misspelt `exclusive` and a test marked both `serial` and `exclusive`; in an xdist
    worker, orders the files longest first (see `file_order`)."""
    for item in items:
        if _exclusive_names(item) and item.get_closest_marker("serial") is not None:
            raise pytest.UsageError(f"{item.nodeid}: a test is `serial` or `exclusive`, not both")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = file_order(items)


LANE_RANK = {"e2e": 0, "chaos": 1, "gpu": 2, "integration": 3, "unit": 4}


HEAVY_LANES = ("e2e", "chaos")  # files that start clusters: several processes each
LIGHT_PER_HEAVY = 2  # light files handed out after each heavy one while both remain


def file_order(items):
    """The items with their files in the order the xdist controller hands files out (scripts/
    test.sh passes --no-loadscope-reorder, so it keeps this order): the files likely to take
    longest first, so that the run does not end with one worker on a minute-long file while the
    other idles. Likely length: the lane (an e2e file runs `pdserve up` for a minute, a unit
    file seconds), then whether the file loads the real SmolLM2 (a `slow` test). The heavy
    files (e2e and chaos: a cluster of processes each) are interleaved with the rest, one then
    LIGHT_PER_HEAVY others, so that the three test processes seldom all run clusters at once:
    three clusters on two cores spent a fifth more CPU on the same work than one at a time
    (docs/contributing.md). Each file's tests keep their order, and the order is the same in
    every worker (xdist requires it)."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def key(entry):
        index, (path, its) = entry
        lane = path.parent.name
        slow = any(i.get_closest_marker("slow") is not None for i in its)
        return (LANE_RANK.get(lane, len(LANE_RANK)), not slow, index)

    ordered = sorted(enumerate(files.items()), key=key)
    heavy = [e for e in ordered if e[1][0].parent.name in HEAVY_LANES]
    light = [e for e in ordered if e[1][0].parent.name not in HEAVY_LANES]
    mixed = []
    while heavy:
        mixed.append(heavy.pop(0))
        mixed += light[:LIGHT_PER_HEAVY]
        del light[:LIGHT_PER_HEAVY]
    mixed += light
    return [item for _, (_, its) in mixed for item in its]


def _take_names(item) -> None:
    """Takes the item's `exclusive` names that this process does not hold yet, in sorted order
    (two tests with two names each never wait on each other in a cycle)."""
    path = os.environ.get(LOCK_ENV)
    names = _exclusive_names(item)
    if not path or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for name in sorted(names - _names.keys()):
        _names[name] = _lock(f"{path}.{name}", True)


def _release_names(item, nextitem) -> None:
    """Releases the names that the next test does not take in the same file."""
    same_file = nextitem is not None and nextitem.path == item.path
    keep = _exclusive_names(nextitem) if same_file else set()
    for name in list(_names):
        if name not in keep:
            os.close(_names.pop(name))


@contextlib.contextmanager
def turn(serial: bool):
    """The run's lock for one test: exclusive for a `serial` test, shared otherwise (see the
    module docstring); nothing outside an xdist worker."""
    path = os.environ.get(LOCK_ENV)
    if not path or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    if serial:
        with _held(path + ".turnstile", True), _held(path, True):
            yield
    else:
        with _held(path + ".turnstile", True):
            pass  # waits here while a serial test waits for or holds the lock
        with _held(path, False):
            yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _take_names(item)
    try:
        with turn(item.get_closest_marker("serial") is not None):
            yield
    finally:
        _release_names(item, nextitem)
