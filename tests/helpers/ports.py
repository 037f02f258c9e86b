"""Ports on 127.0.0.1 that are free now, for servers a test starts on ports of its choosing."""

from __future__ import annotations

import random
import socket

# Chosen below Linux's ephemeral range (32768-60999 by default), which every bind to port 0 and
# every outgoing connection of the other test processes draws from, and above Ray's worker ports
# (10002-19999): a port free when chosen and bound a moment later by the test's server was taken
# in between by such a draw (Ray's GCS refused to start on one).
LOW, HIGH = 20000, 32767


def free_ports(n: int, avoid: set[int] = frozenset()) -> list[int]:
    """n distinct ports free now, none of them in `avoid` (ports chosen earlier and not bound
    yet). Each socket stays bound until all n are chosen: a port asked for alone and released
    can come back from the next ask (Ray then refused to start one node with its node manager
    and object manager on the same port)."""
    pick = random.SystemRandom()
    socks, ports = [], []
    try:
        for _ in range(n + 1000):
            if len(ports) == n:
                return ports
            port = pick.randint(LOW, HIGH)
            if port in avoid or port in ports:
                continue
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        raise RuntimeError(f"no {n} free ports in {LOW}-{HIGH} outside the ones to avoid")
    finally:
        for s in socks:
            s.close()
