"""An shm sender faults a receiver's pool into its page tables beside its hand-offs, not in front
of them: the first hand-off after `pdserve up` (and after each idle close of the channel) waited
0.25 s for a 1 GiB pool. The populate runs on a thread of its own, a chunk per madvise call with
a rest after each, and stops when the transport closes. That thread keeps the process's priority:
at nice 19 on a busy machine, a call preempted while holding the mmap lock stalled the engine
thread for seconds. The control channel is a stand-in (no socket), as in
tests/unit/test_shm_peer_pools.py."""

from __future__ import annotations

import gc
import mmap
import os
import threading

import pytest
import torch

from helpers.shm_control import fake_control, maps_of  # noqa: F401 - the fixture
from helpers.threads import wait_until
from pdserve.kvpool import create_pool_file
from pdserve.kvtransfer.backends import shm_backend
from pdserve.kvtransfer.backends.shm_backend import (
    ShmTransport,
    format_address,
    map_shared_kv_cache,
    populate,
)

SHAPE = (2, 2, 64, 16, 2, 32)  # 1 MiB of float32: 256 pages


pytestmark = pytest.mark.usefixtures("fake_control")


@pytest.fixture
def pool(tmp_path) -> str:
    """A receiver's pool file, not mapped by this process."""
    path = str(tmp_path / "pdserve-kv-1-populate-rank0")
    create_pool_file(path, SHAPE, torch.float32)  # its mapping goes with the returned tensor
    return path


def rss_of(path: str) -> int:
    """Bytes of this process's mappings of `path` that its page tables hold (smaps' Rss)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith(path)
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def test_populate_faults_in_every_page_a_chunk_at_a_time(pool):
    cache = map_shared_kv_cache(pool, SHAPE, torch.float32)
    size = cache.numel() * cache.element_size()
    assert rss_of(pool) == 0
    assert populate(cache, threading.Event(), chunk=16 * mmap.PAGESIZE)
    assert rss_of(pool) == size
    assert torch.count_nonzero(cache) == 0  # faulted in, not written


def test_populate_stops_between_chunks_once_told(pool):
    cache = map_shared_kv_cache(pool, SHAPE, torch.float32)
    stop = threading.Event()
    stop.set()
    assert not populate(cache, stop, chunk=mmap.PAGESIZE)
    assert rss_of(pool) == 0


def test_populate_rests_after_each_call_for_its_duty(pool):
    class Recording(threading.Event):
        def __init__(self):
            super().__init__()
            self.rests = []

        def wait(self, timeout=None):
            self.rests.append(timeout)
            return super().wait(0)

    cache = map_shared_kv_cache(pool, SHAPE, torch.float32)
    stop = Recording()
    assert populate(cache, stop, chunk=64 * mmap.PAGESIZE, duty=0.25)
    assert rss_of(pool) == cache.numel() * cache.element_size()
    # four calls of 64 pages, a rest between each two: none after the last
    assert len(stop.rests) == 3 and all(r > 0 for r in stop.rests)
    stop.rests.clear()
    assert populate(cache, stop, chunk=64 * mmap.PAGESIZE)  # duty 1: no rests
    assert stop.rests == []


def test_a_sender_populates_on_a_thread_of_its_own_at_the_process_s_priority(pool, monkeypatch):
    seen = []
    release = threading.Event()
    real = shm_backend.populate

    def watched(tensor, stop=None, chunk=0, duty=1.0):
        me = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, me)
        seen.append((threading.current_thread().name, nice, chunk, duty))
        release.wait(10)
        return real(tensor, stop, chunk, duty)

    monkeypatch.setattr(shm_backend, "populate", watched)
    # the constructor returns while the populate still waits: a hand-off can start at once
    sender = ShmTransport(format_address(pool, SHAPE, torch.float32, "127.0.0.1:1"))
    try:
        wait_until(lambda: seen, 10, "the populate never started")
        assert sender.populate_thread.is_alive()
        ((name, nice, chunk, duty),) = seen
        assert name == "pdserve-shm-populate" and name != threading.main_thread().name
        assert nice == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert chunk == shm_backend.POPULATE_CHUNK and duty == shm_backend.POPULATE_DUTY < 1
        release.set()
        sender.populate_thread.join(10)
        assert not sender.populate_thread.is_alive()
        assert rss_of(pool) >= torch.Size(SHAPE).numel() * 4
    finally:
        release.set()
        sender.close()


def test_a_closed_sender_s_pool_is_unmapped_while_its_populate_waits(pool, monkeypatch):
    """A starved populate thread must not keep a gone receiver's pool mapped (its /dev/shm
    pages stay allocated while any process maps them)."""
    monkeypatch.setattr(shm_backend, "POPULATE_CHUNK", mmap.PAGESIZE)
    monkeypatch.setattr(shm_backend, "POPULATE_JOIN_S", 0.2)  # close gives up on it soon
    started, release = threading.Event(), threading.Event()
    real = shm_backend.populate

    def held(tensor, stop=None, chunk=0, duty=1.0):
        started.set()
        release.wait(10)
        return real(tensor, stop, chunk, duty)

    monkeypatch.setattr(shm_backend, "populate", held)
    sender = ShmTransport(format_address(pool, SHAPE, torch.float32, "127.0.0.1:1"))
    thread = sender.populate_thread
    assert started.wait(10)
    assert maps_of(pool) == 1
    sender.close()
    del sender
    gc.collect()
    try:
        assert thread.is_alive() and maps_of(pool) == 0
    finally:
        release.set()
    thread.join(10)
    assert not thread.is_alive()
    assert rss_of(pool) == 0
