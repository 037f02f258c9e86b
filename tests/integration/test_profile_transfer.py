"""`pdserve profile`'s transfer receiver answers each batch with that batch's transfers, even when
the next batch lands before the receiver's own thread runs again (a loaded machine: CI saw a ping
counted as lost, `shm: 0 of 1 transfers done`). The receiver runs on a thread here, behind a pipe
end that stalls after every answer, so the profiler's next request always lands in that stall."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import torch

from pdserve.tuning import profiler

INFO = dict(
    id="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
    kv_bytes_per_token=2 * 2 * 2 * 8 * 4,
)  # fmt: skip


class _StallAfterAnswer:
    """The receiver's pipe end: every batch answer is sent, then the thread sleeps."""

    def __init__(self, conn):
        self.conn = conn

    def recv(self):
        return self.conn.recv()

    def send(self, msg):
        self.conn.send(msg)
        if isinstance(msg, dict) and "address" not in msg:
            time.sleep(0.3)


class _Alive:
    exitcode = None

    def is_alive(self):
        return True


def test_next_batch_landing_during_the_answer_is_counted(monkeypatch):
    monkeypatch.setattr(profiler, "_BATCH_WAIT_S", 5.0)
    threads = torch.get_num_threads()  # the receiver sets this process's to 1, as its own
    parent, child = mp.Pipe()
    tokens = profiler.TRANSFER_BLOCK_SIZE
    receiver = threading.Thread(
        target=profiler._receiver_main, args=(_StallAfterAnswer(child), INFO, tokens, 1)
    )
    receiver.start()
    source = (torch.randn(profiler._pool_shape(INFO, tokens, 1)), profiler._block_ids(0, tokens))
    link = profiler._Link("shm", parent, _Alive(), profiler._layout(INFO), 1, source)
    try:
        link.connect()
        for _ in range(3):
            ((sent, landed),) = link.send_batch(tokens, 1)
            assert landed >= sent
        link.close()
    finally:
        parent.send("stop")
        receiver.join(30)
        torch.set_num_threads(threads)
    assert not receiver.is_alive()
