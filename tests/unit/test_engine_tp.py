"""Tensor parallelism on tiny random models, what needs no rank process: a TP size that does not
divide the heads (or is 0) is refused without leaving a process group behind, and stale shared KV
pool files are removed. TP=2 itself: tests/integration/test_engine_tp_ranks.py."""

from __future__ import annotations

import os

import pytest

from helpers.engine import KV, greedy
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tp_must_divide_heads(refs):
    model_dir, _, prompts, expected = refs("llama-gqa")
    with pytest.raises(ValueError, match="tensor_parallel_size") as exc:
        llm = LLM(model_dir, kv_cache_memory=KV, tensor_parallel_size=3)
        llm.shutdown()
    assert "heads" in str(exc.value)
    # nothing of the refused group is left behind: a single-process engine still works
    import torch.distributed as dist

    assert not dist.is_initialized()
    llm = LLM(model_dir, kv_cache_memory=KV)
    assert llm.generate(prompts[1], greedy(), use_tqdm=False)[0].outputs[0].token_ids == expected[1]


def test_tp_zero_is_refused(refs):
    model_dir, *_ = refs("llama-gqa")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir, kv_cache_memory=KV, tensor_parallel_size=0)


def test_stale_shared_kv_files_are_removed(tmp_path):
    from pdserve.kvpool import remove_stale_pool_files

    dead = 2**22 + 7  # above the largest pid_max Linux allows: no such process
    stale = tmp_path / f"pdserve-kv-{dead}-abcd-rank0"
    # a pool the shm backend made itself (create_shared_kv_cache) has no rank in its name
    stale_shm = tmp_path / f"pdserve-kv-{dead}-0123456789ab"
    alive = tmp_path / f"pdserve-kv-{os.getpid()}-abcd-rank0"
    other = tmp_path / "unrelated"
    for p in (stale, stale_shm, alive, other):
        p.write_bytes(b"x")
    remove_stale_pool_files(str(tmp_path))
    assert not stale.exists() and not stale_shm.exists()
    assert alive.exists() and other.exists()
