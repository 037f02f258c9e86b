"""Rank 0's side of the later pipeline stages' push reports (issue #53), without processes: the
gathers are started without waiting (engine/tp.py TPGroup.gather_reports), handed to their sinks
oldest first once done or when the engine must have them (harvest_reports), at most
MAX_PENDING_REPORTS pending, with the first stage's rows filled in as NOT_PUSHED, and shutdown
waits for them without handing them on."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import tp as tp_module
from pdserve.engine.kv_publish import NOT_PUSHED, PUSHED
from pdserve.engine.tp import MAX_PENDING_REPORTS, TPGroup


class FakeWork:
    def __init__(self, parts, sent):
        self.parts, self.sent, self.done, self.waited = parts, sent, False, False

    def is_completed(self):
        return self.done

    def wait(self):
        self.waited = True
        for part, value in zip(self.parts, self.sent):
            part.copy_(value)


class FakeProc:
    def is_alive(self):
        return True

    def join(self, timeout=None):
        pass

    def kill(self):
        pass


@pytest.fixture
def group(monkeypatch):
    """A TPGroup of TP 2 x PP 2 (3 followers; ranks 2 and 3 the later stage) whose gathers are
    FakeWorks, each later stage's rank reporting [step, PUSHED] per push."""
    works = []

    def gather(mine, parts, dst, group, async_op):
        assert async_op and dst == 0 and group == "reports"
        step = len(works)
        sent = [torch.tensor([[step, PUSHED]] * mine.shape[0]) for _ in parts[1:]]
        works.append(FakeWork(parts[1:], sent))
        return works[-1]

    monkeypatch.setattr(tp_module.dist, "gather", gather)
    monkeypatch.setattr(tp_module.dist, "get_world_size", lambda group: 3)
    return TPGroup([FakeProc()] * 3, "control", pipelined=True, reports="reports"), works


def test_reports_reach_their_sinks_in_order_once_done_or_when_waited_for(group):
    tpg, works = group
    heard = []
    tpg.gather_reports(2, lambda r: heard.append(("a", r)))
    tpg.gather_reports(1, lambda r: heard.append(("b", r)))
    assert tpg.reports_pending == 2 and heard == []  # nothing waited for
    works[1].done = True
    tpg.harvest_reports(wait=False)
    assert heard == []  # the older one first
    works[0].done = True
    tpg.harvest_reports(wait=False)
    assert [name for name, _ in heard] == ["a", "b"] and tpg.reports_pending == 0
    a = heard[0][1]
    assert a.shape == (4, 2, 2)
    assert a[:2].tolist() == [[[0, NOT_PUSHED]] * 2] * 2  # the first stage's ranks
    assert a[2:].tolist() == [[[0, PUSHED]] * 2] * 2
    assert heard[1][1][2:].tolist() == [[[1, PUSHED]]] * 2
    tpg.gather_reports(1, lambda r: heard.append(("c", r)))
    tpg.harvest_reports(wait=True)  # not done: waited for
    assert works[2].waited and heard[-1][0] == "c"


def test_at_most_max_pending_reports_are_left_pending(group):
    tpg, works = group
    heard = []
    for i in range(MAX_PENDING_REPORTS + 2):
        tpg.gather_reports(1, lambda r, i=i: heard.append(i))
        assert tpg.reports_pending <= MAX_PENDING_REPORTS
    assert heard == [0, 1] and [w.waited for w in works] == [True, True] + [False] * (
        MAX_PENDING_REPORTS
    )


def test_shutdown_waits_for_the_reports_without_handing_them_on(group, monkeypatch):
    tpg, works = group
    monkeypatch.setattr(tp_module, "_broadcast_bytes", lambda data, group: data)
    monkeypatch.setattr(tp_module.dist, "destroy_process_group", lambda: None)
    heard = []
    tpg.gather_reports(1, heard.append)
    tpg.shutdown()
    assert works[0].waited and heard == [] and tpg.reports_pending == 0
