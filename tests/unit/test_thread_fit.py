"""engine/threads.py: torch's thread count follows the cores free now. The /proc readers and the
clock are replaced by a scripted machine, so each case says what the cores were doing; one test
reads the real /proc once, to check the readers parse this machine's files."""

from __future__ import annotations

import pathlib

import pytest
import torch

from pdserve.engine import threads
from pdserve.engine.threads import PERIOD_S, ThreadFit


class Machine:
    """Two allowed cores; each `advance(s, idle=..., mine=...)` is s seconds in which the two
    cores together were idle for `idle` core-seconds and this process ran `mine` core-seconds
    (100 ticks a second per core, as /proc/stat counts them)."""

    def __init__(self, monkeypatch):
        self.t, self.idle, self.total, self.own = 100.0, 0, 0, 0
        monkeypatch.setattr(threads, "_allowed_cpus", lambda: {0, 1})
        monkeypatch.setattr(threads, "_idle_ticks", lambda cpus: (self.idle, self.total))
        monkeypatch.setattr(threads, "_own_ticks", lambda: self.own)
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.t)

    def advance(self, seconds: float, idle: float, mine: float) -> None:
        self.t += seconds
        self.total += round(200 * seconds)
        self.idle += round(100 * idle * seconds)
        self.own += round(100 * mine * seconds)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_busy_neighbours_take_it_to_one_thread_and_their_end_brings_it_back(
    monkeypatch, two_threads
):
    m = Machine(monkeypatch)
    fit = ThreadFit()
    m.advance(PERIOD_S, idle=0.0, mine=2.0)  # quiet: this process uses both cores
    assert fit.fit() == 2 and torch.get_num_threads() == 2
    m.advance(PERIOD_S, idle=0.0, mine=1.0)  # two busy loops: half of the cores are theirs
    assert fit.fit() == 1 and torch.get_num_threads() == 1
    m.advance(PERIOD_S, idle=0.0, mine=0.67)  # one thread beside them: a third each
    assert fit.fit() == 1
    m.advance(PERIOD_S, idle=1.0, mine=1.0)  # they stopped: a core idles
    assert fit.fit() == 2 and torch.get_num_threads() == 2


def test_it_refits_only_once_a_period_has_passed(monkeypatch, two_threads):
    m = Machine(monkeypatch)
    fit = ThreadFit()
    m.advance(PERIOD_S / 4, idle=0.0, mine=1.0)
    assert fit.fit() == 2  # too soon to judge
    m.advance(PERIOD_S, idle=0.0, mine=1.0)
    assert fit.fit() == 1


def test_an_idle_engine_on_a_quiet_machine_keeps_every_thread(monkeypatch, two_threads):
    m = Machine(monkeypatch)
    fit = ThreadFit()
    m.advance(PERIOD_S, idle=2.0, mine=0.0)
    assert fit.fit() == 2


def test_restore_gives_back_the_count_it_started_with(monkeypatch, two_threads):
    m = Machine(monkeypatch)
    fit = ThreadFit()
    m.advance(PERIOD_S, idle=0.0, mine=1.0)
    assert fit.fit() == 1
    fit.restore()
    assert torch.get_num_threads() == 2 and fit.threads == 2


def test_one_thread_to_begin_with_is_left_alone(monkeypatch):
    m = Machine(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit = ThreadFit()
        m.advance(PERIOD_S, idle=2.0, mine=0.0)
        assert fit.fit() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_without_proc_nothing_changes(monkeypatch, two_threads):
    m = Machine(monkeypatch)
    monkeypatch.setattr(threads, "_own_ticks", lambda: None)
    fit = ThreadFit()
    m.advance(PERIOD_S, idle=0.0, mine=1.0)
    assert fit.fit() == 2 and torch.get_num_threads() == 2


@pytest.mark.skipif(not pathlib.Path("/proc/stat").exists(), reason="reads /proc")
def test_the_readers_parse_this_machines_proc():
    idle, total = threads._idle_ticks(threads._allowed_cpus())
    assert 0 <= idle <= total and total > 0
    assert threads._own_ticks() > 0
