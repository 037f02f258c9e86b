"""`pdserve up` serving until Ctrl-C or SIGTERM (deploy/launcher.py Cluster.wait): the first
signal stops the deployment once and says why; a second one while it stops (an impatient second
Ctrl-C, or a SIGTERM from a supervisor beside the Ctrl-C) is logged and ignored, so the teardown
finishes and no traceback ends the command; the previous handlers are back afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from pdserve.deploy.launcher import Cluster


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_while_stopping_is_ignored(first, caplog):
    stops = []

    def stop():
        stops.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)  # the teardown is interrupted twice
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # (handlers run between bytecodes of this thread)

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    threading.Timer(0.1, os.kill, (os.getpid(), first)).start()
    with caplog.at_level("INFO", logger="pdserve.deploy.launcher"):
        reason = Cluster.wait(SimpleNamespace(stop=stop), poll_s=0.02)
    assert reason == ("interrupted" if first == signal.SIGINT else "SIGTERM")
    assert len(stops) == 1
    assert caplog.text.count("already stopping") == 2
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
