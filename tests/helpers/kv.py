"""The KV channels' test rig, shared by the tests of the transport backends
(tests/unit/test_kv_backends.py, tests/integration/test_kv_backends_channels.py) and of what a
stranger can do to a KV server (tests/integration/test_kv_security.py,
tests/unit/test_kv_receiver_checks.py): engine-shaped KV chunks of a prefill side (blocks of 4),
a decode side (blocks of 16) with a server feeding one KVReceiver per reserved request, and the
thread-leak checks of both.

Not a test module: imported as `from helpers.kv import ...` (tests/helpers/ is a package on pytest's sys.path). The
fixtures are `fixture_<name>` functions registered as `<name>` (`no_leaked_threads`, autouse), so
that a test module imports the one it uses and it applies to all of that module's tests.
"""

from __future__ import annotations

import time

import torch

from pdserve.kvtransfer import ChunkHeader, KVLayout, TransferState
from pdserve.kvtransfer.backends import create_shared_kv_cache, remove_shared_kv_cache, serve
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.transport import Destination

LAYOUT_KW = dict(dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8)
SRC_BLOCK_SIZE, DST_BLOCK_SIZE = 4, 16
NUM_TOKENS = 37
SRC_BLOCK_IDS = [11, 3, 7, 0, 9, 10, 2, 4, 6, 1]  # 10 blocks of 4 >= 37 tokens
TOKEN_RANGES = [(0, 20), (20, 37)]
TIMEOUT = 5.0  # every connect/flush/wait of the KV channels' tests
# a connect where many stores and groups of one test process meet at once (the torch backend's
# TCPStore and gloo rendezvous), on both sides: the sender's connect and the torch server's bound
# on a connection's group forming. The backends' own default, since loaded CI runs missed 5 s.
CONNECT_TIMEOUT = 30.0


def src_layout(model: str = "m") -> KVLayout:
    return KVLayout(model, **LAYOUT_KW, block_size=SRC_BLOCK_SIZE)


def source_cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 12, SRC_BLOCK_SIZE, 2, 8, generator=g)


def token_view(cache: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    """[layers, 2, tokens, heads, head_dim] of the first NUM_TOKENS tokens held in block_ids."""
    flat = cache.view(cache.shape[0], 2, -1, cache.shape[-2], cache.shape[-1])
    t = torch.arange(NUM_TOKENS)
    return flat[:, :, torch.tensor(block_ids)[t // block_size] * block_size + t % block_size]


def push_request(
    tx, request_id: str, seed: int, dest: Destination, model: str = "m"
) -> list[ChunkHeader]:
    """What a prefill worker does: layer by layer, two token ranges each, then the commit."""
    layout, src = src_layout(model), source_cache(seed)
    sent = []
    for layer in range(LAYOUT_KW["num_layers"]):
        for start, end in TOKEN_RANGES:
            header, data = read_chunk(
                src[layer], layout, request_id, layer, SRC_BLOCK_IDS, start, end
            )
            tx.send(header, data, dest)
            sent.append(header)
    commit = ChunkHeader(request_id, layout.fingerprint, kind="commit", first_tokens=(seed,))
    tx.send(commit, None, dest)
    return sent + [commit]


class DecodeSide:
    """A decode rank: a shared KV pool, one KVReceiver per reserved request, a server feeding them."""

    def __init__(self, backend: str, num_blocks: int = 8, **server_opts):
        self.backend = backend
        self.layout = KVLayout("m", **LAYOUT_KW, block_size=DST_BLOCK_SIZE)
        self.cache, self.path = create_shared_kv_cache(
            (3, 2, num_blocks, DST_BLOCK_SIZE, 2, 8), torch.float32
        )
        self.receivers: dict[str, KVReceiver] = {}
        self.frames: list[ChunkHeader] = []
        self.grants = None
        opts = {}
        if backend in ("nixl", "shm"):  # writes claim a grant per reservation, as on a worker
            from pdserve.kvtransfer.backends.claims import Grants

            self.grants = Grants()
            opts = dict(grants=self.grants)
        if backend == "nixl":
            opts.update(kv_caches=[self.cache])
        if backend == "shm":
            opts.update(kv_cache=self.cache, kv_path=self.path)
        if backend == "torch":  # also bounds each group's forming: a loaded run's rendezvous
            opts["timeout"] = CONNECT_TIMEOUT
        self.server = serve(backend, self.on_frame, **opts, **server_opts)

    def reserve(self, request_id: str, block_ids: list[int]) -> Destination:
        self.receivers[request_id] = KVReceiver(
            request_id, self.cache, self.layout, block_ids, 0, NUM_TOKENS
        )
        grant = self.grants.issue(request_id, block_ids) if self.grants is not None else ""
        return Destination(block_ids, self.layout, grant=grant)

    def on_frame(self, header: ChunkHeader, payload) -> None:
        self.frames.append(header)
        self.receivers[header.request_id].on_frame(header, payload)  # KeyError: not reserved here

    def wait_finished(self, request_id: str) -> KVReceiver:
        rx = self.receivers[request_id]
        deadline = time.monotonic() + TIMEOUT
        while (
            rx.state not in (TransferState.DONE, TransferState.FAILED)
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        return rx

    def assert_received(self, request_id: str, seed: int) -> None:
        rx = self.wait_finished(request_id)
        assert rx.state == TransferState.DONE, rx.error
        assert rx.first_tokens == (seed,)
        got = token_view(self.cache, rx.block_ids, DST_BLOCK_SIZE)
        assert torch.equal(got, token_view(source_cache(seed), SRC_BLOCK_IDS, SRC_BLOCK_SIZE))

    def close(self) -> None:
        self.server.stop()
        remove_shared_kv_cache(self.path)
