"""The cuda_ipc backend on CPU: its CUDA calls substituted (the pool a CPU tensor, synchronize a
recorded event), the address checks, the refusals that send a sender to the host path, the
commit after the copies, a receiver gone, and `auto` offering it only on one GPU."""

from types import SimpleNamespace

import pytest
import torch

from pdserve.kvtransfer.backends import cuda_ipc_backend as ipc
from pdserve.kvtransfer.backends.shm_backend import _boot_id
from pdserve.kvtransfer.choose import DEFAULT, Ranking, applies
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.transport import Destination
from pdserve.kvtransfer.wire import ChunkHeader

LAYOUT = KVLayout("m", "float32", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
SHAPE = (2, 2, 6, 4, 2, 4)  # [layers, k/v, blocks, block size, heads, head dim]
GPU = "GPU-11111111-2222-3333-4444-555555555555"
PEER_PID = 4242


def fields(**over) -> dict:
    base = {
        "gpu": GPU,
        "pid": PEER_PID,
        "dev": 0,
        "handle": "ab" * 64,
        "size": 2 * 2 * 6 * 4 * 2 * 4 * 4,
        "offset": 0,
        "rc": b"/torch_1_2".hex(),
        "rco": 0,
        "ev": "cd" * 64,
        "evsync": 1,
    }
    return {**base, **over}


def address(**over) -> str:
    return ipc.format_address(fields(**over), SHAPE, torch.float32, "127.0.0.1:1")


class FakeControl:
    def __init__(self, events: list):
        self.events, self.sent = events, []

    def send_headers(self, headers):
        self.events.append(("headers", [h.kind for h in headers]))
        self.sent.extend(headers)

    def flush(self, timeout):
        pass

    def close(self):
        self.events.append(("close",))


@pytest.fixture
def gpu(monkeypatch):
    """One GPU seen here, the decode process alive, the pool a CPU tensor, copies recorded."""
    state = SimpleNamespace(pool=torch.zeros(SHAPE), events=[], alive=True, opened=[])

    def open_pool(f, device):
        state.opened.append((f, device))
        return state.pool

    monkeypatch.setattr(ipc, "local_gpus", lambda: {GPU: 0})
    monkeypatch.setattr(ipc, "process_alive", lambda pid: state.alive)
    monkeypatch.setattr(ipc, "open_pool", open_pool)
    monkeypatch.setattr(ipc, "synchronize", lambda device: state.events.append(("sync",)))
    monkeypatch.setattr(ipc, "GrpcTransport", lambda control, **kw: FakeControl(state.events))
    return state


def kv_header(layer: int, start: int, end: int) -> ChunkHeader:
    return ChunkHeader("r", LAYOUT.fingerprint, layer, start, end, 0, 2, 4, "float32", kind="kv")


def test_address_round_trip_and_checks():
    got = ipc.parse_address(address())
    assert got["handle"] == bytes.fromhex("ab" * 64) and got["rc"] == b"/torch_1_2"
    assert got["shape"] == SHAPE and got["dtype"] == torch.float32 and got["evsync"] is True
    assert got["host"] == _boot_id() and got["pid"] == PEER_PID
    bad = [
        address(size=fields()["size"] + 4),  # not the pool's bytes
        address(handle="ab" * (ipc.MAX_HANDLE_BYTES + 1)),  # over the handle bound
        address(handle=""),
        address(pid=0),
        address(dev=ipc.MAX_DEVICE + 1),
        address(evsync=2),
        address(gpu="GPU/../x"),
        address(handle="zz"),
        address().replace("dtype=float32", "dtype=object"),
        address() + "&pid=7",  # a field given twice
        address().replace("cuda_ipc://", "shm://"),
    ]
    for text in bad:
        with pytest.raises(ValueError):
            ipc.parse_address(text)


def test_kv_lands_in_the_pool_and_the_commit_follows_a_synchronize(gpu):
    transport = ipc.CudaIpcTransport(address())
    dest = Destination([5, 1], LAYOUT)
    data = [torch.randn(2, 6, 2, 4) for _ in range(2)]
    for layer in range(2):
        transport.send(kv_header(layer, 0, 6), data[layer], dest)
    assert gpu.events == []  # headers wait; nothing said before the copies complete
    transport.send(ChunkHeader("r", LAYOUT.fingerprint, kind="commit"), None, dest)
    assert gpu.events == [("sync",), ("headers", ["kv", "kv", "commit"])]
    for layer in range(2):
        assert torch.equal(gpu.pool[layer, :, 5], data[layer][:, :4])
        assert torch.equal(gpu.pool[layer, :, 1, :2], data[layer][:, 4:])
    assert gpu.pool[:, :, [0, 2, 3, 4]].abs().sum() == 0  # nothing outside the reservation
    transport.send(ChunkHeader("s", LAYOUT.fingerprint, kind="commit"), None, dest)
    assert gpu.events[-1] == ("headers", ["commit"])  # no copy since: no second synchronize
    assert gpu.events.count(("sync",)) == 1


def test_chunk_outside_the_reservation_is_refused_and_aborted(gpu):
    transport = ipc.CudaIpcTransport(address())
    with pytest.raises(ValueError):
        transport.send(kv_header(0, 0, 12), torch.randn(2, 12, 2, 4), Destination([5, 1], LAYOUT))
    assert gpu.events[-1] == ("headers", ["abort"])
    assert gpu.pool.abs().sum() == 0


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda s, m: m.setattr(ipc, "_boot_id", lambda: "another-host"), "another host"),
        (lambda s, m: m.setattr(ipc, "local_gpus", lambda: {"GPU-other": 0}), "not one this"),
        (lambda s, m: setattr(s, "alive", False), "not visible"),
    ],
)
def test_refusals_send_the_sender_to_the_host_path(gpu, monkeypatch, change, why):
    text = address()
    change(gpu, monkeypatch)
    with pytest.raises(ConnectionError, match=why):
        ipc.CudaIpcTransport(text)
    assert gpu.opened == []  # refused before any handle is opened


def test_handle_that_does_not_open_is_a_connection_error(gpu, monkeypatch):
    def fails(f, device):
        raise RuntimeError("cudaIpcOpenMemHandle: invalid argument")

    monkeypatch.setattr(ipc, "open_pool", fails)
    with pytest.raises(ConnectionError, match="does not open"):
        ipc.CudaIpcTransport(address())


def test_own_process_is_refused(gpu, monkeypatch):
    monkeypatch.setattr(ipc.os, "getpid", lambda: PEER_PID)
    with pytest.raises(ConnectionError, match="this process"):
        ipc.CudaIpcTransport(address())


def test_receiver_gone_drops_the_pool(gpu):
    transport = ipc.CudaIpcTransport(address())
    gpu.alive = False
    with pytest.raises(ConnectionError, match="gone"):
        transport.send(kv_header(0, 0, 4), torch.randn(2, 4, 2, 4), Destination([0], LAYOUT))
    assert transport._cache is None and gpu.pool.abs().sum() == 0
    with pytest.raises(ConnectionError):
        transport.flush(1.0)


def test_server_publishes_checked_fields(monkeypatch):
    monkeypatch.setattr(ipc, "export_pool", lambda cache: fields())
    control = SimpleNamespace(address="127.0.0.1:9", num_channels=0, stop=lambda: None)
    monkeypatch.setattr(ipc, "ShmControlServer", lambda handler, **kw: control)
    server = ipc.CudaIpcServer(lambda h, p: None, torch.zeros(SHAPE))
    try:
        got = ipc.parse_address(server.address)
        assert got["size"] == fields()["size"] and got["gpu"] == GPU
        assert ipc.locality(server.address) == f"{_boot_id()}:{GPU}"
    finally:
        server.stop()


def test_server_refuses_an_address_a_sender_would_refuse(monkeypatch):
    big = fields(handle="ab" * 256, ev="cd" * 256, rc="ef" * 256)
    monkeypatch.setattr(ipc, "export_pool", lambda cache: big)
    stopped = []
    control = SimpleNamespace(address="127.0.0.1:9", stop=lambda: stopped.append(1))
    monkeypatch.setattr(ipc, "ShmControlServer", lambda handler, **kw: control)
    with pytest.raises(ValueError, match="characters"):
        ipc.CudaIpcServer(lambda h, p: None, torch.zeros(SHAPE))
    assert stopped == [1]


def test_opened_storage_becomes_the_pool_of_the_address():
    pool = torch.randn(SHAPE)
    got = ipc.as_pool(pool.untyped_storage(), ipc.parse_address(address()))
    assert got.shape == SHAPE and got.is_contiguous() and torch.equal(got, pool)
    with pytest.raises(ValueError, match="bytes"):
        ipc.as_pool(torch.zeros(4).untyped_storage(), ipc.parse_address(address()))


def test_export_refuses_a_host_pool():
    with pytest.raises(ValueError, match="CUDA"):
        ipc.export_pool(torch.zeros(SHAPE))


def test_auto_serves_cuda_ipc_only_for_a_cuda_pool():
    assert DEFAULT.served(False, (), on_cuda=True)[0] == "cuda_ipc"
    assert "cuda_ipc" not in DEFAULT.served(True, ())
    assert "cuda_ipc" not in DEFAULT.served(False, ())
    with pytest.raises(ValueError):
        Ranking.from_dict({"same_host": ["grpc"], "cross_host": ["cuda_ipc", "grpc"]})


def test_offer_applies_only_on_the_same_gpu(gpu, monkeypatch):
    text = address()
    offer = SimpleNamespace(backend="cuda_ipc", address=text, locality=ipc.locality(text))
    assert applies(offer)
    monkeypatch.setattr(ipc, "local_gpus", lambda: {"GPU-other": 0})
    assert not applies(offer)
    monkeypatch.setattr(ipc, "local_gpus", lambda: {GPU: 0})
    assert not applies(SimpleNamespace(backend="cuda_ipc", address=text, locality="x:y"))
    assert not applies(SimpleNamespace(backend="cuda_ipc", address="junk", locality=""))
