"""The first code a local follower rank runs, in a process forked from multiprocessing's fork
server (engine/tp.py, LocalRanks).

LocalRanks starts followers from the fork server, which imported torch once, so that no follower
pays torch's import again. A forked process has the fork server's environment, taken when that
server started, and the modules it imported; rank 0's environment may have changed since (a
PDSERVE_* setting, a test's). So `run` first puts rank 0's environment, as it was when the rank
was launched, in place, and only then unpickles what the follower runs: the modules that
unpickling imports (pdserve's engine, which reads some settings as it is imported) see the
settings rank 0 saw. This module imports nothing of pdserve's itself, so nothing here is read
before the environment is right.
"""

from __future__ import annotations

import os
import pickle


def run(env: dict[str, str], payload: bytes) -> None:
    """Rank 0's environment `env`, then `payload` (a pickled (function, args)) called."""
    os.environ.clear()
    os.environ.update(env)
    target, args = pickle.loads(payload)
    target(*args)
