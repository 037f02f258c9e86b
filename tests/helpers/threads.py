"""Waiting and leak checks shared by the tests: poll a condition until a deadline (`wait_until`),
run a function on several threads at once, check that a block leaves no threads behind, and check
that an engine has released every KV block. Tests wait on events through these, not on fixed
sleeps, so a loaded machine makes them slower, not flaky."""

from __future__ import annotations

import contextlib
import threading
import time


def wait_until(cond, timeout: float, what: str, poll_s: float = 0.02) -> None:
    """Polls `cond` until it holds; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout}s: {what}")


def run_in_threads(fn, n: int, timeout: float = 60.0) -> dict:
    """fn(0) .. fn(n - 1), each on its own thread, all at once: {i: what fn(i) returned}. The
    threads' exceptions fail the caller (not lost in the threads)."""
    results, errors = {}, []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # surfaced below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return results


def non_daemon_threads() -> set:
    return {t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()}


@contextlib.contextmanager
def leaves_no_threads(timeout: float = 5.0):
    """Fails if the block leaves non-daemon threads behind for more than `timeout` seconds."""
    before = non_daemon_threads()
    yield
    wait_until(
        lambda: non_daemon_threads() <= before,
        timeout,
        f"threads left: {non_daemon_threads() - before}",
    )


@contextlib.contextmanager
def threads_joined(timeout: float):
    """Fails if a thread the block started (daemon or not) is still alive `timeout` seconds after
    it ended."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + timeout
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, f"threads left behind: {sorted(t.name for t in left)}"


def assert_no_leaks(engine) -> None:
    """Every block is free or evictable (cached, ref 0) and the block accounting is consistent;
    a hybrid's every recurrent-state slot free or keeping a state."""
    bm = engine.block_manager
    bm.check_consistency()
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks still referenced"
    slots = engine.scheduler.slots
    if slots is not None:
        assert slots.num_free == slots.num_slots, f"{slots.num_free} of {slots.num_slots} free"
