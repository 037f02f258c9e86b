"""The Signals reading the planner policy's tests build (tests/unit/test_planner.py, the rules one
by one, and tests/unit/test_planner_scenarios.py, the named situations): `sig` fills every field
of planner/policy.py's Signals from short keyword names, with quiet defaults (1P:2D, no latency
sample, nothing queued, unknown speed and demand, decode KV at 20%), so a test names only what its
rule reads. Plain functions, no state: each test makes its own Planner.
"""

from __future__ import annotations

from pdserve.planner.policy import Signals


def sig(
    now,
    ttft=None,
    tpot=None,
    p=1,
    d=2,
    kv=0.2,
    local=0,
    queued=0,
    speed=0.0,
    wait=0.0,
    rate=0.0,
    itl=None,
):
    """Signals at `now` (s): p prefill and d decode workers, TTFT/TPOT p90 (s), decode KV use,
    the local prefill bound, queued prompt tokens, one prefill worker's tokens/s, the longest
    wait for decode KV (s), prompt tokens/s arriving and the median inter-token gap (s)."""
    return Signals(now, p, d, ttft, tpot, queued, speed, kv, local, wait, rate, itl)
