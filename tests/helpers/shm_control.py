"""For the unit tests of an shm sender (tests/unit/test_shm_*.py): a stand-in for its control
channel (the gRPC channel that carries its headers), so the unit lane can build ShmTransports on
pool files without a socket (`fake_control` patches it in), and a count of this process's
mappings of a pool file."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.backends import shm_backend


class FakeControl:
    """The control channel of a ShmTransport, without gRPC."""

    def __init__(self, address, **opts):
        self.address, self.headers, self.closed = address, [], False

    def send_headers(self, headers):
        if self.closed:
            raise ConnectionError("closed")
        self.headers += headers

    def flush(self, timeout):
        pass

    def close(self):
        self.closed = True


@pytest.fixture
def fake_control(monkeypatch):
    monkeypatch.setattr(shm_backend, "GrpcTransport", FakeControl)


def maps_of(path: str) -> int:
    """How many of this process's mappings are of `path` (unlinked ones end in "(deleted)")."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if path in line)
