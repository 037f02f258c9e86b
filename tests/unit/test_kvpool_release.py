"""A KV pool's pages given back and taken again (kvpool.release_pool, refill_pool: a sleeping
engine's, engine/sleep.py): the tensor stays valid and reads as zeros, edges included; a pool
file's blocks are freed on the filesystem (a tmpfs gets its space back) and seen as zeros
through a second mapping, as an shm sender's; refilled, the file's blocks are allocated again,
and where the kernel cannot give them back the error says what to free."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

import pdserve.kvpool as kvpool
from pdserve.kvpool import (
    PoolSpaceError,
    create_pool_file,
    map_pool_file,
    refill_pool,
    release_pool,
)

N = 1 << 20  # float32 values: 4 MiB, many whole pages


def test_a_private_pool_reads_as_zeros_edges_included():
    big = torch.ones(N + 7)
    pool = big[3 : 3 + N]  # (not page-aligned at either end: its edges are partial pages)
    dropped = release_pool(pool, shared=False)
    assert dropped >= (N * 4) - 2 * kvpool.PAGE
    assert not pool.any()
    assert big[:3].eq(1).all() and big[3 + N :].eq(1).all()  # nothing outside it touched
    refill_pool(pool, shared=False)
    assert not pool.any()
    pool.fill_(2)  # usable as before
    assert pool.eq(2).all()


def test_a_pool_files_blocks_are_freed_and_allocated_again(tmp_path):
    path = str(tmp_path / "pdserve-kv-sleep")
    pool = create_pool_file(path, (N,), torch.float32)
    other = map_pool_file(path, (N,), torch.float32)  # another process's mapping, as shm's
    pool.fill_(1)
    assert os.stat(path).st_blocks * 512 >= N * 4
    if release_pool(pool, shared=True) == 0:
        pytest.skip("this filesystem cannot free a file's blocks (zeroed instead)")
    assert os.stat(path).st_blocks * 512 < kvpool.PAGE * 2
    assert not other.any()
    refill_pool(pool, shared=True)
    assert os.stat(path).st_blocks * 512 >= N * 4  # reserved again, as create_pool_file does
    other.fill_(3)
    assert pool.eq(3).all()


def test_a_refill_the_kernel_refuses_names_what_to_free(monkeypatch):
    pool = torch.zeros(N)

    class Refusing:
        def __call__(self, addr, length, advice):
            ctypes.set_errno(errno.ENOMEM)
            return -1

    monkeypatch.setattr(kvpool, "_madvise", Refusing)
    with pytest.raises(PoolSpaceError, match="could not take its memory back") as e:
        refill_pool(pool, shared=True)
    assert "\n" not in str(e.value)


def test_where_the_kernel_will_not_drop_pages_every_byte_is_zeroed(monkeypatch):
    pool = torch.ones(N)
    monkeypatch.setattr(kvpool, "_madvise", lambda: None)
    assert release_pool(pool, shared=False) == 0
    assert not pool.any()
