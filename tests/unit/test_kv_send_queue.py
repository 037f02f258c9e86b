"""The gRPC KV sender's frame queue under a receiver that stops taking frames: a send blocked on a
full queue fails once nothing was taken for the timeout (a stopped or hung decode worker must not
hold a prefill worker's engine thread), while a queue that drains slowly never times out, however
long the whole send takes."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.kvtransfer.backends.grpc_sender import _FrameQueue


def full_queue() -> _FrameQueue:
    queue = _FrameQueue(max_bytes=100)
    queue.put([b"x" * 100], False, timeout=1.0, failed=lambda: False)
    return queue


def test_a_send_into_a_queue_nothing_drains_times_out():
    queue = full_queue()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="nothing taken for 0.3s"):
        queue.put([b"y" * 10], False, timeout=0.3, failed=lambda: False)
    assert time.monotonic() - t0 < 5  # it gave up, rather than waiting for a drain


def test_a_send_into_a_slowly_draining_queue_waits_past_the_timeout():
    queue = _FrameQueue(max_bytes=100)
    for _ in range(10):
        queue.put([b"x" * 10], False, timeout=1.0, failed=lambda: False)

    def drain_slowly():  # one item every 0.15 s: progress well within the 0.3 s timeout
        for _ in range(10):
            time.sleep(0.15)
            with queue.cond:
                item = queue.items.popleft()
            queue.release(item[1])

    drainer = threading.Thread(target=drain_slowly)
    drainer.start()
    t0 = time.monotonic()
    queue.put([b"y" * 95], False, timeout=0.3, failed=lambda: False)  # needs 9 items gone
    waited = time.monotonic() - t0
    drainer.join()
    assert waited > 0.3  # longer than the timeout in all, without raising


def test_a_send_returns_when_the_stream_fails_meanwhile():
    queue = full_queue()
    failed = threading.Event()
    threading.Timer(0.2, failed.set).start()
    queue.put([b"y" * 10], False, timeout=30.0, failed=failed.is_set)  # returns, no raise
