"""`kvtransfer.backend: auto`: which backend a prefill worker pushes a request's KV over.

A decode worker started with backend "auto" serves more than one backend at once and offers them
all in each reservation (KVEndpoint.offers): grpc always, shm when its KV pool is in host memory
(the pool's files are then shared, so a sender on the same machine can write into them). Each
offer is a complete KVEndpoint; an shm offer also carries `locality`, the decode host's boot id
and pool-file identity (shm_backend.locality). The prefill worker takes, for each reservation, the
first backend in RANKING whose offer applies from where it runs: shm only when its own view of
the pool file gives the same locality (same machine, same shared-memory mount), grpc anywhere.
A sender that cannot open the channel it picked tries the next one that applies.

The ranking is measured (BENCHMARKS.md, "KV hand-off"): into the paged cache, two processes on one
CPU host, an 8k-token prompt: shm 9.40 GB/s, nixl 2.60, grpc 1.55. nixl and torch are not offered
by auto: on one host shm beats them, and between hosts nothing here measured them against grpc;
choose them by name (`backend: nixl` / `torch`) where they win.
"""

from __future__ import annotations

from pdserve.kvtransfer.backends.shm_backend import locality

AUTO = "auto"
RANKING = ("shm", "grpc")  # fastest first, of the backends auto offers
MAX_OFFERS = 4
MAX_LOCALITY_CHARS = 128


def applies(offer) -> bool:
    """Whether this process can push into `offer` (a KVEndpoint) at all."""
    if offer.backend == "shm":
        try:
            here = locality(offer.address)
        except (ValueError, IndexError):  # an address that does not parse: not for us
            return False
        return bool(here) and here == offer.locality
    return offer.backend == "grpc"


def choices(endpoint) -> list:
    """The KVEndpoints to try for a reservation's `endpoint`, best first: its offers that apply,
    in RANKING's order, when it has offers; else the endpoint itself (one backend, named)."""
    if not endpoint.offers:
        return [endpoint]
    rank = {backend: i for i, backend in enumerate(RANKING)}
    usable = [o for o in endpoint.offers if o.backend in rank and applies(o)]
    return sorted(usable, key=lambda o: rank[o.backend])
