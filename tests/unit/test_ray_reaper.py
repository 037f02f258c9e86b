"""The process table the watchdog of a local Ray reads (deploy/ray_reaper.py): a process found by
pid and start time, and every process that descends from Ray's head processes. The watchdog
killing a dead driver's leftovers, with real processes: tests/integration/
test_ray_reaper_processes.py; after a kill -9 of `pdserve up`: tests/e2e/test_deploy_ray_orphans.py.
"""

from __future__ import annotations

import os
import sys

import pytest

from pdserve.deploy import ray_reaper

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the watchdog reads /proc")


def test_this_process_is_found_with_its_parent_and_a_stable_start_time():
    ppid, start, name = ray_reaper.stat(os.getpid())
    assert ppid == os.getppid() and start > 0 and name
    assert ray_reaper.stat(os.getpid())[1] == start  # the same process: the same start time
    assert ray_reaper.process_table()[os.getpid()][:2] == (ppid, start)
    assert ray_reaper.stat(1 << 30) is None  # no such pid


def test_descendants_follow_the_tree_from_the_roots_only():
    # pid -> (parent, start, name): 10 (the driver) started 20 (raylet), which started 21 and 22
    # (the agents); 22 started 23 (a worker's TP rank); 30 is someone else's
    table = {
        10: (1, 100, "pdserve"),
        20: (10, 101, "raylet"),
        21: (20, 102, "ray::DashboardAgent"),
        22: (20, 103, "ray::RuntimeEnvAgent"),
        23: (22, 104, "python"),
        30: (1, 105, "bash"),
    }
    assert ray_reaper.descendants(table, [20]) == {20, 21, 22, 23}
    assert ray_reaper.descendants(table, [22, 99]) == {22, 23}  # a root gone: nothing of it
    assert ray_reaper.descendants(table, []) == set()


def test_a_name_is_rays_title_or_the_program():
    assert ray_reaper.name_of(1 << 30, "comm") == "comm"  # gone: the name the table had
    assert "python" in ray_reaper.name_of(os.getpid(), "x")  # the program, not the fallback
