"""A stand-in for an shm sender's control channel (the gRPC channel that carries its headers), so
the unit lane can build ShmTransports on pool files without a socket: tests/unit/test_shm_*.py
patch it in with `fake_control`."""

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
