"""A pipelined prefill worker's later-stage rank keeps one KV channel per decode endpoint
(prefill_worker/stage_push.py StageChannels): two first calls for one address that both connect
end with one channel kept, used by both, and the other closed, not left open unreferenced."""

from __future__ import annotations

import threading
import time

from pdserve.prefill_worker import stage_push


class FakeTransport:
    def __init__(self):
        self.closed = threading.Event()

    def close(self):
        self.closed.set()


def test_two_first_calls_for_one_address_keep_one_channel_and_close_the_other(monkeypatch):
    made, both_connecting = [], threading.Barrier(2, timeout=10)

    def connect(backend, address, **opts):
        both_connecting.wait()  # each call connects before either has kept its channel
        transport = FakeTransport()
        made.append(transport)
        return transport

    monkeypatch.setattr(stage_push, "connect", connect)
    channels = stage_push.StageSender().channels()
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(channels._transport("grpc", "127.0.0.1:1")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(made) == 2 and len(got) == 2
    assert got[0] is got[1]  # both calls use the one channel kept
    dropped = next(t for t in made if t is not got[0])
    deadline = time.monotonic() + 10
    while not dropped.closed.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped.closed.is_set() and not got[0].closed.is_set()
    channels.close()
    assert got[0].closed.is_set()
