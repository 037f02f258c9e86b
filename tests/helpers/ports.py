"""Ports on 127.0.0.1 that are free now, for servers a test starts on ports of its choosing."""

from __future__ import annotations

import socket


def free_ports(n: int, avoid: set[int] = frozenset()) -> list[int]:
    """n distinct ports free now, none of them in `avoid` (ports chosen earlier and not bound
    yet). Each socket stays bound until all n are chosen: a port asked for alone and released
    can come back from the next ask (Ray then refused to start one node with its node manager
    and object manager on the same port)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
            if len(socks) > n + 100:
                raise RuntimeError("no free ports outside the ones to avoid")
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()
