"""The parallel run's locks (tests/helpers/lanes.py), with threads standing in for xdist workers:
flock locks taken through two open() calls conflict even within one process, as they do between
the worker processes."""

from __future__ import annotations

import os
import pathlib
import threading
import time

import pytest

from helpers import lanes

WAIT_S = 30.0  # a bound for a hung lock only: the test never waits this long when it passes


@pytest.fixture
def run_lock(tmp_path, monkeypatch):
    """An xdist worker's view: the run's lock file and a worker id."""
    path = tmp_path / "run.lock"
    monkeypatch.setenv(lanes.LOCK_ENV, str(path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    before = dict(lanes._names)  # this process's own names, when it is an xdist worker
    yield path
    for name in set(lanes._names) - set(before):  # a failed test's: not left held
        os.close(lanes._names.pop(name))


class Log:
    def __init__(self):
        self.events: list[str] = []
        self.lock = threading.Lock()

    def add(self, event: str) -> None:
        with self.lock:
            self.events.append(event)


def _in_turn(serial: bool, name: str, log: Log, entered: threading.Event, leave: threading.Event):
    with lanes.turn(serial):
        log.add(f"{name} in")
        entered.set()
        assert leave.wait(WAIT_S)
        log.add(f"{name} out")


def _start(serial: bool, name: str, log: Log):
    entered, leave = threading.Event(), threading.Event()
    thread = threading.Thread(target=_in_turn, args=(serial, name, log, entered, leave))
    thread.start()
    return thread, entered, leave


def test_a_serial_test_waits_for_the_running_one_and_a_later_one_waits_for_it(run_lock):
    log = Log()
    a, a_in, a_leave = _start(False, "a", log)
    assert a_in.wait(WAIT_S)
    s, s_in, s_leave = _start(True, "serial", log)
    time.sleep(0.3)  # the serial test is now waiting for `a`: it must not have entered
    assert not s_in.is_set()
    b, b_in, b_leave = _start(False, "b", log)  # arrives while the serial test waits
    time.sleep(0.3)
    assert not b_in.is_set(), "a test passed a waiting serial test at the turnstile"
    a_leave.set()
    assert s_in.wait(WAIT_S)
    time.sleep(0.3)
    assert not b_in.is_set(), "a test ran beside a serial test"
    s_leave.set()
    assert b_in.wait(WAIT_S)
    b_leave.set()
    for thread in (a, s, b):
        thread.join(WAIT_S)
    assert log.events == ["a in", "a out", "serial in", "serial out", "b in", "b out"]


def test_tests_that_are_not_serial_run_side_by_side(run_lock):
    log = Log()
    a, a_in, a_leave = _start(False, "a", log)
    b, b_in, b_leave = _start(False, "b", log)
    assert a_in.wait(WAIT_S) and b_in.wait(WAIT_S)  # both inside at once
    a_leave.set()
    b_leave.set()
    a.join(WAIT_S)
    b.join(WAIT_S)


def test_outside_xdist_nothing_is_locked(tmp_path, monkeypatch):
    monkeypatch.delenv(lanes.LOCK_ENV, raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    with lanes.turn(True), lanes.turn(True):  # would deadlock if either took a lock
        pass
    assert list(tmp_path.iterdir()) == []


class Item:
    """The parts of a pytest item that lanes.py reads."""

    def __init__(self, path: str, *names: str, serial: bool = False):
        self.path, self.nodeid = path, f"{path}::t"
        self.marks = [pytest.mark.exclusive(n).mark for n in names]
        self.serial = serial

    def iter_markers(self, name):
        return iter(self.marks) if name == "exclusive" else iter(())

    def get_closest_marker(self, name):
        return pytest.mark.serial.mark if name == "serial" and self.serial else None


def test_an_exclusive_name_is_held_across_one_file_and_released_after_it(run_lock):
    first, second = Item("tour.py", "default-ports"), Item("tour.py", "default-ports")
    lanes._take_names(first)
    held = dict(lanes._names)
    assert list(held) == ["default-ports"]
    lanes._release_names(first, second)  # the next test of the file keeps it
    assert lanes._names == held
    lanes._take_names(second)
    assert lanes._names == held  # taken once, not twice
    lanes._release_names(second, Item("other.py"))
    assert lanes._names == {}

    # released: another holder (another worker's descriptor) gets it at once
    got = threading.Event()

    def other():
        os.close(lanes._lock(f"{run_lock}.default-ports", True))
        got.set()

    thread = threading.Thread(target=other)
    thread.start()
    assert got.wait(WAIT_S)
    thread.join(WAIT_S)


def test_a_held_exclusive_name_makes_another_holder_wait(run_lock):
    lanes._take_names(Item("wheel.py", "default-ports"))
    got = threading.Event()

    def other():
        with lanes._held(f"{run_lock}.default-ports", True):
            got.set()

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    time.sleep(0.3)
    assert not got.is_set(), "two holders of one exclusive name at once"
    lanes._release_names(Item("wheel.py"), None)
    assert got.wait(WAIT_S)
    thread.join(WAIT_S)


def test_marks_that_cannot_work_are_refused():
    with pytest.raises(pytest.UsageError, match="not both"):
        lanes.pytest_collection_modifyitems(None, [Item("a.py", "default-ports", serial=True)])
    bad = Item("a.py")
    bad.marks = [pytest.mark.exclusive().mark]
    with pytest.raises(pytest.UsageError, match="takes one name"):
        lanes.pytest_collection_modifyitems(None, [bad])


@pytest.mark.parametrize(
    ("cores", "workers", "threads"),
    [(2, None, 2), (2, "2", 1), (2, "3", 1), (8, "2", 2), (1, None, 1)],
)
def test_each_worker_gets_its_share_of_the_cores(monkeypatch, cores, workers, threads):
    monkeypatch.setattr(lanes.os, "cpu_count", lambda: cores)
    if workers is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    assert lanes.torch_threads() == threads


class Collected:
    """The parts of a collected test that file_order reads."""

    def __init__(self, path: str, slow: bool = False):
        self.path = pathlib.Path(path)
        self.slow = slow

    def get_closest_marker(self, name):
        return pytest.mark.slow.mark if name == "slow" and self.slow else None


def test_files_go_out_longest_first_and_keep_their_tests_order():
    unit_a = [Collected("tests/unit/test_a.py") for _ in range(3)]
    integ = Collected("tests/integration/test_b.py")
    integ_slow = [
        Collected("tests/integration/test_c.py"),
        Collected("tests/integration/test_c.py", True),
    ]
    e2e = Collected("tests/e2e/test_d.py", True)
    chaos = Collected("tests/chaos/test_e.py")
    items = [chaos, e2e, integ, *integ_slow, *unit_a]
    # the heavy lanes' files first among theirs, each followed by two of the others, the slow
    # integration file before the plain one and both before the unit file
    assert lanes.file_order(items) == [e2e, *integ_slow, integ, chaos, *unit_a]
    # the lane first, whatever the collection's order (a file's tests keep theirs)
    assert lanes.file_order(list(reversed(items)))[:3] == [e2e, *reversed(integ_slow)]


def test_heavy_files_are_spread_between_the_others():
    heavy = [Collected(f"tests/e2e/test_h{i}.py", True) for i in range(3)]
    light = [Collected(f"tests/unit/test_l{i}.py") for i in range(8)]
    order = [str(c.path.name) for c in lanes.file_order(heavy + light)]
    assert order == [
        "test_h0.py", "test_l0.py", "test_l1.py", "test_h1.py", "test_l2.py", "test_l3.py",
        "test_h2.py", "test_l4.py", "test_l5.py", "test_l6.py", "test_l7.py",
    ]  # fmt: skip
