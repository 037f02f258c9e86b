"""Ports on 127.0.0.1 that are free now, for servers a test starts on ports of its choosing.

They are drawn at random from 10000-19999: below Linux's ephemeral range (32768-60999 by
default), from which every bind(0) and outgoing connection of the other test processes draws,
so a port chosen here and bound a moment later by the server under test is not taken in
between by someone's connection; and below 20000-29999, where helpers.ray_nodes places the Ray
nodes' worker port ranges.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 10000, 20000


def free_ports(n: int, avoid: set[int] = frozenset()) -> list[int]:
    """n distinct ports free now, none of them in `avoid` (ports chosen earlier and not bound
    yet). Each socket stays bound until all n are chosen, so one call never returns a port
    twice (Ray refused to start one node with its node manager and object manager on the same
    port)."""
    socks, ports = [], []
    try:
        tries = 0
        while len(ports) < n:
            tries += 1
            if tries > n + 200:
                raise RuntimeError(f"no {n} free ports in {LOW}-{HIGH - 1} outside {sorted(avoid)}")
            port = random.randrange(LOW, HIGH)
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
        return ports
    finally:
        for s in socks:
            s.close()
