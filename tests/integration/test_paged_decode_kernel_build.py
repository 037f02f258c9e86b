"""The compiled CPU decode kernel's build, in a process of its own: a lock file left by a build that
was killed does not hang the next one. The kernel itself: tests/unit/test_paged_decode_kernel.py."""

from __future__ import annotations

import pytest

from pdserve.engine.kernels import cpu_paged_decode

kernel = cpu_paged_decode()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain: the torch path is used")


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_worker(tmp_path):
    """torch's build lock is a plain file; a worker killed mid-build used to leave every later
    worker waiting on it forever."""
    import subprocess
    import sys

    code = (
        "import engine.kernels as k\n"
        "from engine.loader import default_cache_dir\n"
        "key = k._build_key(k._SRC, [])\n"
        "build = default_cache_dir() / 'kernels' / key\n"
        "build.mkdir(parents=True, exist_ok=True)\n"
        "(build / 'lock').touch()\n"
        "assert k.cpu_paged_decode() is not None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
