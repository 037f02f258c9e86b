"""Shared KV pools that fail cleanly: a new pool file's memory is reserved when it is made, and a
filesystem that cannot hold it raises one line naming the path, the bytes needed and the bytes
free. A real full tmpfs (a private mount namespace): tests/integration/test_shm_pool_space.py."""

from __future__ import annotations

import errno
import os
import types

import pytest
import torch

from pdserve.kvpool import PoolSpaceError, create_pool_file

SHAPE = (2, 2, 4, 4, 1, 8)  # 512 float32 values: 2048 bytes
NBYTES = 2 * 2 * 4 * 4 * 1 * 8 * 4


def test_a_new_pool_file_is_allocated_not_sparse(tmp_path):
    """A sparse file would take its pages on first touch, and a full tmpfs answers that touch
    with SIGBUS: the pool's bytes are allocated when the file is made."""
    path = str(tmp_path / "pdserve-kv-alloc")
    pool = create_pool_file(path, SHAPE, torch.float32)
    assert pool.shape == SHAPE and not pool.any()
    assert os.stat(path).st_blocks * 512 >= NBYTES


def test_no_space_at_allocation_is_one_line_naming_needed_and_free(tmp_path, monkeypatch):
    """posix_fallocate failing with ENOSPC (a tmpfs filled after the free-space check)."""

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = str(tmp_path / "pdserve-kv-full")
    with pytest.raises(PoolSpaceError) as raised:
        create_pool_file(path, SHAPE, torch.float32)
    message = str(raised.value)
    assert "\n" not in message
    assert f"the shared KV pool {path} needs {NBYTES} bytes" in message
    assert f"{tmp_path} has " in message and " bytes (" in message and " free: " in message
    assert "kv_cache_memory" in message and "--shm-size" in message and "grpc" in message
    assert isinstance(raised.value, OSError)
    assert not os.path.exists(path)  # no half-made pool left behind


def test_too_little_free_space_fails_before_allocating(tmp_path, monkeypatch):
    """The free-space check names what is free, and allocates nothing."""
    free = types.SimpleNamespace(f_bavail=1, f_frsize=1024)
    monkeypatch.setattr(os, "fstatvfs", lambda fd: free)

    def must_not_run(fd, offset, length):
        raise AssertionError("allocated despite too little free space")

    monkeypatch.setattr(os, "posix_fallocate", must_not_run)
    path = str(tmp_path / "pdserve-kv-small")
    with pytest.raises(
        PoolSpaceError, match=rf"needs {NBYTES} bytes .* has 1024 bytes \(0.0 MiB\) free"
    ):
        create_pool_file(path, SHAPE, torch.float32)
    assert not os.path.exists(path)


def test_a_filesystem_that_cannot_allocate_ahead_still_gets_its_pool(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    path = str(tmp_path / "pdserve-kv-sparse")
    pool = create_pool_file(path, SHAPE, torch.float32)
    assert os.path.getsize(path) == NBYTES and not pool.any()
