"""engine/weight_sync.py's wire layout, without a group: buckets keep the list's order, start
every tensor at an ALIGN-byte offset (so a float32 after an odd-sized bfloat16 tensor can still be
viewed), stay within BUCKET_BYTES unless one tensor is bigger alone, and a bucket packed by the
trainer's side unpacks on a rank's side into the same tensors bit for bit, for every dtype; the
digest tells two lists apart by any name, dtype, shape or order."""

from __future__ import annotations

import torch

from pdserve.engine import weight_sync as ws


def _specs(tensors: dict) -> list:
    return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]


def test_buckets_pack_and_unpack_every_dtype_bit_for_bit(monkeypatch):
    monkeypatch.setattr(ws, "BUCKET_BYTES", 64)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, generator=g).bfloat16(),  # 6 bytes: the next starts at 8
        "b": torch.randn(2, 3, generator=g),
        "c": torch.randn(5, generator=g).half(),
        "big": torch.randn(40, generator=g),  # 160 bytes: a bucket of its own
        "d": torch.randn(1, generator=g),
    }
    specs = _specs(tensors)
    layout = ws.buckets(specs)
    order = [i for parts, _ in layout for i, _ in parts]
    assert order == list(range(len(specs)))
    for parts, size in layout:
        assert all(at % ws.ALIGN == 0 for _, at in parts)
        assert size <= 64 or len(parts) == 1
    # a (6 bytes, padded to 8), b (24) and c (10) share one; big alone; d after it
    assert [[i for i, _ in parts] for parts, _ in layout] == [[0, 1, 2], [3], [4]]
    assert [[at for _, at in parts] for parts, _ in layout][0] == [0, 8, 32]
    values = list(tensors.values())
    got = {}
    for parts, size in layout:
        got.update(ws.unpack(ws.pack(values, specs, parts, size).clone(), specs, parts))
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(-1), t.view(-1))
        assert got[name].shape == t.shape


def test_the_digest_tells_lists_apart():
    base = [("a", "float32", (2, 3)), ("b", "bfloat16", (4,))]
    variants = [
        [("a", "float32", (3, 2)), ("b", "bfloat16", (4,))],
        [("a", "float16", (2, 3)), ("b", "bfloat16", (4,))],
        [("x", "float32", (2, 3)), ("b", "bfloat16", (4,))],
        list(reversed(base)),
    ]
    assert ws.digest(base) == ws.digest(list(base))
    assert len({ws.digest(v) for v in [base, *variants]}) == 1 + len(variants)
