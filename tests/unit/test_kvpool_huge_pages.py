"""A KV pool that only its own process uses can be advised for transparent huge pages before it
is zero-filled (kvpool.new_private_pool); the engine does so when asked (kv_cache_huge_pages),
and a decode worker asks on the nixl backend.

Whether the kernel then backs the pool with 2 MiB pages depends on its THP setting and on free
memory, so these tests check what the code controls: the pool's zeros, shape and dtype, and the
advice itself (the "hg" flag madvise sets on the mapping, /proc/self/smaps)."""

from __future__ import annotations

import mmap
import sys
import types

import pytest
import torch

from pdserve.kvpool import HUGE_PAGE, advise_huge_pages, new_private_pool

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def first_huge_page(tensor: torch.Tensor) -> int:
    return -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE


@linux_only
def test_a_private_pool_is_zeroed_and_advised_for_huge_pages():
    shape = (4, 2, 64, 16, 2, 64)  # 8 MiB of float32: at least three whole huge pages inside
    pool = new_private_pool(shape, torch.float32)
    assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous()
    assert not pool.any()
    assert "hg" in vm_flags(first_huge_page(pool))


@linux_only
def test_plain_memory_is_not_advised_and_too_small_tensors_cannot_be():
    # a mapping of its own (torch's allocator may hand out memory advised before)
    region = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    big = torch.frombuffer(region, dtype=torch.uint8)
    assert "hg" not in vm_flags(first_huge_page(big))  # what the advice changes
    assert not advise_huge_pages(torch.zeros(1024))  # no whole huge page inside
    assert not advise_huge_pages(big[::2])  # not contiguous: its bytes are not one range
    assert advise_huge_pages(big)
    assert "hg" in vm_flags(first_huge_page(big))
    del big


def test_an_empty_pool_is_refused():
    with pytest.raises(ValueError, match="non-empty shape"):
        new_private_pool((30, 2, 0, 16, 3, 64), torch.bfloat16)


@linux_only
def test_the_engine_puts_its_cpu_pool_on_huge_pages_when_asked(tiny_models, monkeypatch):
    from pdserve.engine import model_runner
    from pdserve.engine.llm import LLM

    made = []
    real = model_runner.new_private_pool
    monkeypatch.setattr(model_runner, "new_private_pool", lambda *a: made.append(a) or real(*a))
    model_dir, _ = tiny_models("llama-gqa")
    for asked in (True, False):
        made.clear()
        llm = LLM(model_dir, kv_cache_memory=16 << 20, max_model_len=256, kv_cache_huge_pages=asked)
        try:
            cache = llm.engine.kv_cache
            assert cache.numel() * cache.element_size() >= 8 << 20
            assert len(made) == (1 if asked else 0)
            if asked:  # (memory not asked for may still lie in a range advised before)
                assert "hg" in vm_flags(first_huge_page(cache))
        finally:
            llm.shutdown()


def test_a_decode_worker_asks_for_huge_pages_on_the_nixl_backend_only():
    from pdserve.decode_worker.server import DecodePart

    def extras(backend: str) -> dict:
        part = DecodePart.__new__(DecodePart)  # only its config is read
        part.cfg = types.SimpleNamespace(kv_backend=backend)
        return part.engine_extras(None)

    assert extras("nixl") == {"kv_cache_huge_pages": True}
    assert extras("shm") == extras("grpc") == extras("auto") == {}
