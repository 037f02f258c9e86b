"""A prefill worker and a decode worker as two processes on one GPU, handing KV off by CUDA IPC:
the prefill process opens the decode engine's CUDA pool and writes each layer's KV into it
device to device; the tokens equal one engine's on the same GPU. With kv_backend "cuda_ipc" the
decode worker serves nothing else, so a pass means the IPC path carried the KV; with "auto" it
offers cuda_ipc first and the host path after it. Also the backend alone, two processes, one
pool: its bytes equal what was sent. Skipped without CUDA."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from helpers.gpu import TwoProcessCluster, engine_tokens
from helpers.models import random_prompts
from pdserve.kvtransfer.layout import KVLayout

pytestmark = pytest.mark.gpu

NEW = 8  # helpers.worker.GREEDY's max_tokens
LAYOUT = KVLayout("m", "bfloat16", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
POOL = (3, 2, 16, 4, 2, 8)


@pytest.mark.parametrize("backend", ["cuda_ipc", "auto"])
def test_cuda_ipc_handoff_is_token_identical(tiny_models, backend):
    model_dir, _ = tiny_models("llama-gqa")
    prompts = random_prompts([5, 23, 40], seed=3)
    expected = engine_tokens(model_dir, prompts, NEW)
    cluster = TwoProcessCluster(model_dir, kv_backend=backend)
    try:
        got = [cluster.generate(f"r{i}", p) for i, p in enumerate(prompts)]
    finally:
        cluster.stop()
    assert got == expected


def _receiver(conn) -> None:
    """A decode side of the backend alone: serves its CUDA pool, then returns its bytes."""
    from pdserve.kvtransfer.backends import serve

    pool = torch.zeros(POOL, dtype=torch.bfloat16, device="cuda")
    frames = []
    server = serve("cuda_ipc", lambda h, p: frames.append(h.kind), kv_cache=pool)
    conn.send(server.address)
    conn.recv()  # the sender is done
    deadline = time.monotonic() + 10
    while len(frames) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    torch.cuda.synchronize()
    conn.send((list(frames), pool.cpu().view(torch.int16).numpy()))
    conn.recv()
    server.stop()


def test_backend_writes_into_another_process_pool():
    from pdserve.kvtransfer.backends import connect
    from pdserve.kvtransfer.transport import Destination
    from pdserve.kvtransfer.wire import ChunkHeader

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    try:
        assert conn.poll(120), "the receiver did not start"
        tx = connect("cuda_ipc", conn.recv(), timeout=30.0)
        dest = Destination([7, 2, 11], LAYOUT)
        data = [torch.randn(2, 10, 2, 8, device="cuda").bfloat16() for _ in range(3)]
        for layer in range(3):
            header = ChunkHeader("r", LAYOUT.fingerprint, layer, 0, 10, 0, 2, 8, "bfloat16")
            tx.send(header, data[layer], dest)
        tx.send(ChunkHeader("r", LAYOUT.fingerprint, kind="commit"), None, dest)
        tx.flush(30.0)
        conn.send("done")
        assert conn.poll(60)
        frames, pool = conn.recv()
        pool = torch.from_numpy(pool).view(torch.bfloat16)
        tx.close()
        conn.send("stop")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert frames == ["kv", "kv", "kv", "commit"]
    for layer in range(3):
        flat = pool[layer].view(2, -1, 2, 8)
        sent = data[layer].cpu()
        for i, block in enumerate([7, 2, 11]):
            n = min(4, 10 - 4 * i)
            assert torch.equal(flat[:, block * 4 : block * 4 + n], sent[:, 4 * i : 4 * i + n])
