"""An shm sender lets go of a receiver's pool once the receiver is gone: its pool file unlinked
or replaced, or its control address serving another pool. Otherwise the sender's mapping keeps a
dead receiver's pages in /dev/shm. The control channel here is a stand-in (no socket); the same
over real receiver processes killed again and again: tests/integration/test_shm_pool_space.py."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.shm_control import fake_control, maps_of  # noqa: F401 - the fixture
from helpers.threads import wait_until
from pdserve.kvpool import create_pool_file
from pdserve.kvtransfer import ChunkHeader
from pdserve.kvtransfer.backends import shm_backend
from pdserve.kvtransfer.backends.shm_backend import ShmTransport, format_address

SHAPE = (2, 2, 4, 4, 1, 8)


pytestmark = pytest.mark.usefixtures("fake_control")


def new_pool(directory, name: str) -> str:
    """A receiver's pool file, not mapped by this process (the receiver is another process)."""
    path = os.path.join(directory, name)
    create_pool_file(path, SHAPE, torch.float32)  # its mapping goes with the returned tensor
    return path


def transport(path: str, control: str = "127.0.0.1:1") -> ShmTransport:
    return ShmTransport(format_address(path, SHAPE, torch.float32, control))


def release_now() -> None:
    """Lets go of the transports whose pool is gone, as the process's watcher thread does every
    WATCH_S: here at once, unless that thread (started by any transport of this process, another
    test's included) got there first. The tests then check that the transport was let go, and
    why, not who let it go."""
    shm_backend.release_gone_pools()


def test_a_sender_unmaps_a_pool_whose_file_was_unlinked(tmp_path):
    path = new_pool(tmp_path, "pdserve-kv-1-a-rank0")
    sender = transport(path)
    try:
        assert maps_of(path) >= 1
        os.unlink(path)  # the receiver stopped, or its replacement removed the dead one's file
        release_now()
        assert maps_of(path) == 0
        with pytest.raises(ConnectionError, match=f"KV pool is gone .*{path} was unlinked"):
            sender.send(ChunkHeader("r", "f", kind="commit"), None, None)
        with pytest.raises(ConnectionError, match="gone"):
            sender.flush(1.0)
        assert sender._control.closed
    finally:
        sender.close()


def test_the_watcher_unmaps_without_being_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_backend, "WATCH_S", 0.02)
    path = new_pool(tmp_path, "pdserve-kv-1-b-rank0")
    sender = transport(path)
    try:
        os.unlink(path)
        wait_until(lambda: maps_of(path) == 0, 5.0, "the watcher unmapped the unlinked pool")
    finally:
        sender.close()


def test_a_pool_file_replaced_under_the_same_name_is_unmapped(tmp_path):
    path = new_pool(tmp_path, "pdserve-kv-1-c-rank0")
    sender = transport(path)
    try:
        os.unlink(path)
        new_pool(tmp_path, "pdserve-kv-1-c-rank0")  # same name, another file
        release_now()
        assert maps_of(path) == 0  # neither the old pool (deleted) nor the new one is mapped
        with pytest.raises(ConnectionError, match="was replaced"):
            sender.send(ChunkHeader("r", "f", kind="abort"), None, None)
    finally:
        sender.close()


def test_a_receiver_serving_a_new_pool_at_the_same_address_releases_the_old(tmp_path):
    """A restarted receiver on the same control address: the old pool is let go at once, even
    while its file still exists."""
    old_path = new_pool(tmp_path, "pdserve-kv-1-d-rank0")
    new_path = new_pool(tmp_path, "pdserve-kv-2-d-rank0")
    old = transport(old_path, "127.0.0.1:7")
    new = None
    try:
        assert maps_of(old_path) >= 1
        new = transport(new_path, "127.0.0.1:7")
        assert maps_of(old_path) == 0 and maps_of(new_path) >= 1
        with pytest.raises(ConnectionError, match="now serves"):
            old.send(ChunkHeader("r", "f", kind="commit"), None, None)
        new.send(ChunkHeader("r", "f", kind="commit"), None, None)  # the new one works
    finally:
        old.close()
        if new is not None:
            new.close()
    assert maps_of(new_path) == 0


def test_a_live_pool_stays_mapped(tmp_path):
    path = new_pool(tmp_path, "pdserve-kv-1-e-rank0")
    other = new_pool(tmp_path, "pdserve-kv-1-f-rank0")
    sender, second = transport(path), transport(other, "127.0.0.1:2")
    try:
        assert shm_backend.release_gone_pools() == 0
        assert maps_of(path) >= 1 and maps_of(other) >= 1
    finally:
        sender.close()
        second.close()
    assert maps_of(path) == 0 and maps_of(other) == 0
