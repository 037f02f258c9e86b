"""A local Ray's old session folders in its temp dir (deploy/ray_connect.py prune_ray_sessions):
all but the newest are removed, and never one that may be in use."""

from __future__ import annotations

import os
import time

from pdserve.deploy.ray_connect import SESSION_QUIET_S, prune_ray_sessions


def _dead_pid() -> int:
    for pid in range(4_000_000, 3_000_000, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            continue
    raise AssertionError("no free pid found")


def _session(root, minute: int, pid: int, logs_age_s: float = 2 * SESSION_QUIET_S):
    folder = root / f"session_2026-12-01_08-{minute:02d}-03_167121_{pid}"
    (folder / "logs").mkdir(parents=True)
    log = folder / "logs" / "raylet.out"
    log.write_text("x")
    then = time.time() - logs_age_s
    os.utime(log, (then, then))
    return folder.name


def test_all_but_the_newest_go_and_those_in_use_stay(tmp_path):
    dead = _dead_pid()
    old = [_session(tmp_path, m, dead) for m in range(5)]  # minutes 0..4: the oldest
    running = _session(tmp_path, 5, os.getpid())  # its starter still runs
    written = _session(tmp_path, 6, dead, logs_age_s=10)  # a Ray still writes its logs
    newest = [_session(tmp_path, m, dead) for m in range(7, 10)]
    (tmp_path / "session_latest").symlink_to(tmp_path / newest[-1])
    (tmp_path / "session_notes").mkdir()  # not a name Ray gives

    removed = prune_ray_sessions(tmp_path, keep=3)

    assert sorted(removed) == old
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([running, written, *newest, "session_latest", "session_notes"])
    assert prune_ray_sessions(tmp_path, keep=3) == []


def test_fewer_than_kept_is_a_no_op(tmp_path):
    names = [_session(tmp_path, m, _dead_pid()) for m in range(3)]
    assert prune_ray_sessions(tmp_path, keep=3) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
