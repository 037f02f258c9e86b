"""`kvtransfer.backend: auto`: which backends a decode worker serves, and which one a prefill
worker pushes a request's KV over.

The ranking (`Ranking`) is two orders of backends, fastest first: one for a sender on the decode
worker's own host ("same_host") and one for a sender on another host ("cross_host"). It comes from
the deployment's `kvtransfer.profile` (a `pdserve profile` JSON, read once by the launcher in
`pdserve up`, `ranking_from_profile`) when one is set, else the built-in DEFAULT below. On a
profile, the same-host order is its `kv_transfer` figures (two processes on the machine it ran on)
and the cross-host order its optional `kv_transfer_cross_host` figures (two hosts; grpc alone when
it has none), each ordered by the time it takes to hand off a REFERENCE_TOKENS prompt's KV
(latency + bytes / bandwidth); grpc is in every order (last where it was not measured: it always
applies), shm, where it was not measured, after what was, and never in the cross-host order. A
backend that is not installed (nixl without its extra) is left out.

The decode worker (decode_worker/server.py) serves grpc always, shm when its KV pool is in host
memory, and nixl or torch only when it is installed and would be the pick for one of the two
localities (first of that order among what the worker can serve); it offers each in every
reservation (KVEndpoint.offers), listed in the same-host order, each offer carrying the decode
host's id (`host`: its boot id) and its place in the cross-host order (`cross_host_rank`, 1 = first;
0: not for another host). The prefill worker (`choices`) takes, for each reservation, the offers
that apply from where it runs, in the same-host order when its own host id equals the offer's, else
in cross-host order; shm applies only when its own view of the pool file gives the same locality
(same machine, same shared-memory mount), nixl only where NIXL is installed. A sender that cannot
open the channel it picked tries the next one. Offers without a host id (a decode worker from
before the ranking) are taken in LEGACY order.

The built-in order is measured (BENCHMARKS.md, "KV hand-off"): into the paged cache, two processes
on one CPU host, an 8k-token prompt: shm 9.40 GB/s, nixl 2.60, grpc 1.55; between hosts nothing
here measured nixl or torch against grpc, so grpc alone. Since nixl WRITEs straight out of the
prefill pool it is faster than shm on one host where blocks come in runs (8k tokens, as a worker
sends: 6.6-7.3 GB/s against 4.6-4.8), but nixl is an extra and the built-in order ranks only
what every install has; `pdserve profile` measures it where it is installed.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

from pdserve.kvtransfer.backends.shm_backend import locality

AUTO = "auto"
LEGACY = ("shm", "grpc")  # the order of offers that carry no ranking
MAX_OFFERS = 4
MAX_LOCALITY_CHARS = 128
REFERENCE_TOKENS = 2048  # the prompt whose hand-off time orders the backends
SAME_HOST, CROSS_HOST = "same_host", "cross_host"
_SECTIONS = {SAME_HOST: "kv_transfer", CROSS_HOST: "kv_transfer_cross_host"}


class ProfileRankingError(ValueError):
    """A kvtransfer.profile that cannot give a ranking; the message says why."""


@dataclass(frozen=True)
class Ranking:
    """Backends fastest first, for a sender on the decode worker's host and on another one, and
    where that came from (shown in the start table)."""

    same_host: tuple[str, ...]
    cross_host: tuple[str, ...]
    source: str

    def to_dict(self) -> dict:
        return {
            "same_host": list(self.same_host),
            "cross_host": list(self.cross_host),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> Ranking:
        """The Ranking in a worker's config (to_dict's), DEFAULT for None."""
        if data is None:
            return DEFAULT
        same, cross = tuple(data["same_host"]), tuple(data["cross_host"])
        unknown = sorted(set(same + cross) - set(_backends()))
        local_only = "shm" in cross or "cuda_ipc" in cross
        if unknown or "grpc" not in same or "grpc" not in cross or local_only:
            raise ValueError(
                f"a KV ranking names backends of {_backends()}, grpc in both orders and shm "
                f"and cuda_ipc only in the same-host one; got {data!r}"
            )
        return cls(same, cross, str(data.get("source", "")))

    def describe(self) -> str:
        """E.g. "same host shm > grpc; other hosts grpc (built-in default)"."""
        return (
            f"same host {' > '.join(self.same_host)}; other hosts {' > '.join(self.cross_host)} "
            f"({self.source})"
        )

    def served(
        self, on_host: bool, available: tuple[str, ...] | None = None, on_cuda: bool = False
    ) -> tuple[str, ...]:
        """The backends a decode worker on "auto" serves, in the same-host order (then those only
        the cross-host order names): grpc; shm when
        its KV pool is in host memory (`on_host`); cuda_ipc when it is one CUDA pool (`on_cuda`);
        nixl or torch when `available` (installed here) and the first of one order among what
        this worker can serve."""
        available = installed() if available is None else available
        listed = self.same_host + tuple(b for b in self.cross_host if b not in self.same_host)
        if on_cuda and "cuda_ipc" not in listed:
            listed = ("cuda_ipc",) + listed  # a profile from before it: first on one GPU
        can = [
            b
            for b in listed
            if b == "grpc"
            or (b == "shm" and on_host)
            or (b == "cuda_ipc" and on_cuda)
            or (b in ("nixl", "torch") and b in available)
        ]
        firsts = {next((b for b in order if b in can), "grpc") for order in self._orders()}
        return tuple(b for b in can if b in ("grpc", "shm", "cuda_ipc") or b in firsts)

    def _orders(self):
        return (self.same_host, self.cross_host)

    def pick(self, offered: list[str], same_host: bool) -> str | None:
        """What a sender takes of a decode worker's `offered` backends (the start table's
        guess: it cannot see whether shm's pool file is shared)."""
        order = self.same_host if same_host else self.cross_host
        return next((b for b in order if b in offered), None)


# A decode worker with one CUDA pool serves cuda_ipc first (Ranking.served): it applies only where
# both workers share its GPU, and there it moves KV device to device.
DEFAULT = Ranking(("shm", "grpc"), ("grpc",), "built-in default")


def _backends() -> tuple[str, ...]:
    from pdserve.kvtransfer.backends import BACKENDS

    return BACKENDS


@functools.cache
def installed() -> tuple[str, ...]:
    """The backends this process can serve or send over: grpc, shm and torch always; nixl where
    its extra is installed."""
    from pdserve.kvtransfer.backends.nixl_backend import nixl_available

    return tuple(b for b in _backends() if b != "nixl" or nixl_available())


def _handoff_s(entry, kv_bytes_per_token: int | None, where: str) -> float:
    if not isinstance(entry, dict):
        raise ProfileRankingError(f"{where}: expected an object, got {type(entry).__name__}")
    bw, lat = entry.get("bandwidth_bytes_per_s"), entry.get("latency_s", 0.0)
    if (
        not isinstance(bw, (int, float))
        or not isinstance(lat, (int, float))
        or not math.isfinite(bw)
        or not math.isfinite(lat)
        or bw <= 0
        or lat < 0
    ):
        raise ProfileRankingError(
            f"{where}: bandwidth_bytes_per_s must be a number > 0 and latency_s >= 0"
        )
    if not kv_bytes_per_token:
        return 1.0 / bw  # bandwidth alone
    return lat + REFERENCE_TOKENS * kv_bytes_per_token / bw


def ranking_from_profile(
    data: dict, source: str, available: tuple[str, ...] | None = None
) -> Ranking:
    """The ranking a `pdserve profile` JSON (`data`, read from `source`) gives; backends not in
    `available` (default: installed()) are left out. ProfileRankingError names what is wrong."""
    available = installed() if available is None else available
    if not isinstance(data, dict):
        raise ProfileRankingError(f"{source}: a profile is a JSON object")
    kv_bytes = data.get("kv_bytes_per_token")
    if not isinstance(kv_bytes, int) or kv_bytes < 1:
        kv_bytes = None
    orders = {}
    for locality_, section in _SECTIONS.items():
        figures = data.get(section) or {}
        if not isinstance(figures, dict):
            raise ProfileRankingError(f"{source}: {section}: expected an object of backends")
        if locality_ == SAME_HOST and not figures:
            raise ProfileRankingError(
                f"{source}: kv_transfer: no backend was measured (run `pdserve profile` with "
                f"--backends)"
            )
        timed = []
        for backend, entry in figures.items():
            if backend not in _backends():
                raise ProfileRankingError(
                    f"{source}: {section}.{backend}: not a KV backend ({', '.join(_backends())})"
                )
            seconds = _handoff_s(entry, kv_bytes, f"{source}: {section}.{backend}")
            local_only = backend in ("shm", "cuda_ipc")
            if backend in available and not (locality_ == CROSS_HOST and local_only):
                timed.append((seconds, backend))
        order = [b for _, b in sorted(timed)]
        if locality_ == SAME_HOST and "shm" not in figures and "shm" in available:
            order.append("shm")  # not measured: after what was
        if "grpc" not in order:  # not measured: the last resort, which always applies
            order.append("grpc")
        orders[locality_] = tuple(order)
    date = str((data.get("source") or {}).get("date") or "undated")[:10]
    machine = str((data.get("hardware") or {}).get("name") or "an unnamed machine")[:60]
    return Ranking(
        orders[SAME_HOST], orders[CROSS_HOST], f"profile {source}, {date}, measured on {machine}"
    )


def load_ranking(path: str | None) -> Ranking:
    """The ranking of the profile file at `path` (kvtransfer.profile); DEFAULT for None."""
    if not path:
        return DEFAULT
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ProfileRankingError(f"kvtransfer.profile {path}: cannot be read: {e}") from None
    except ValueError as e:
        raise ProfileRankingError(f"kvtransfer.profile {path}: not JSON: {e}") from None
    return ranking_from_profile(data, path)


# ---- the sender's side -----------------------------------------------------------------------
@functools.cache
def host_id() -> str:
    """This machine's id as offers carry it: the kernel's boot id ("" where it cannot be read)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def applies(offer) -> bool:
    """Whether this process can push into `offer` (a KVEndpoint) at all."""
    if offer.backend == "shm":
        try:
            here = locality(offer.address)
        except (ValueError, IndexError):  # an address that does not parse: not for us
            return False
        return bool(here) and here == offer.locality
    if offer.backend == "cuda_ipc":
        return _cuda_ipc_applies(offer)
    return offer.backend in ("grpc", "torch", "nixl") and offer.backend in installed()


def _named_applies(endpoint) -> bool:
    """Whether this process may push into a reservation's endpoint named without offers. A shm
    one only where its address names pool files that this process sees (shm_backend.locality:
    "" for any other file, whatever the address says), and, where it carries a locality, the
    same one as an offer must (decode workers on a named backend send it since it was added; an
    endpoint without one is taken on the pool-file check alone)."""
    if endpoint.backend != "shm":
        return True
    try:
        here = locality(endpoint.address)
    except (ValueError, IndexError):
        return False
    return bool(here) and (not endpoint.locality or here == endpoint.locality)


def _cuda_ipc_applies(offer) -> bool:
    """cuda_ipc applies where this process is on the decode worker's host, sees its process and
    its GPU (cuda_ipc_backend.why_not_here), and the offer's locality says the same."""
    from pdserve.kvtransfer.backends import cuda_ipc_backend as ipc

    try:
        fields = ipc.parse_address(offer.address)
        here = f"{fields['host']}:{fields['gpu']}"
    except ValueError:
        return False
    return here == offer.locality and ipc.why_not_here(fields) is None


def choices(endpoint) -> list:
    """The KVEndpoints to try for a reservation's `endpoint`, best first: its offers that apply,
    in the decode worker's order for where this process runs (its host or another one), when it
    has offers; else the endpoint itself (one backend, named), where it applies (`_named_applies`)."""
    offers = list(endpoint.offers)
    if not offers:
        return [endpoint] if _named_applies(endpoint) else []
    host = next((o.host for o in offers if o.host), "")
    if not host:  # a decode worker that sends no ranking
        rank = {backend: i for i, backend in enumerate(LEGACY)}
        usable = [o for o in offers if o.backend in rank and applies(o)]
        return sorted(usable, key=lambda o: rank[o.backend])
    if host == host_id():
        return [o for o in offers if applies(o)]  # listed in the same-host order
    usable = [
        o
        for o in offers
        if o.cross_host_rank > 0 and o.backend not in ("shm", "cuda_ipc") and applies(o)
    ]
    return sorted(usable, key=lambda o: o.cross_host_rank)


# the KV backends that carry a hybrid model's recurrent state (a "state" frame's payload; shm on
# its control channel beside the KV it writes in place): nixl and cuda_ipc write in place only
STATE_BACKENDS = ("grpc", "torch", "shm")


def check_state_backend(model_config, backend: str) -> None:
    """A hybrid model's decode worker: refused at start on a backend that cannot carry its
    recurrent state yet (its engine refuses a hand-off under tensor parallelism itself), or
    that writes KV in place where the model keeps none (Mamba2 alone: no pool to share)."""
    if model_config.recurrent_layers and backend not in (AUTO, *STATE_BACKENDS):
        raise ValueError(
            f"{model_config.architecture} keeps recurrent state, which the {backend} KV backend "
            f"does not carry yet: use kvtransfer.backend auto or one of {list(STATE_BACKENDS)}"
        )
    if not model_config.num_kv_layers and backend == "shm":
        raise ValueError(
            f"{model_config.architecture} keeps no KV: the shm backend has no pool to write in "
            f"place; use kvtransfer.backend auto, grpc or torch (the state frames alone)"
        )
