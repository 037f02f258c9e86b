"""Tensor parallelism on tiny random models, with TP=2's rank processes: TP=2 gives TP=1's tokens,
and with kv_cache_shared_dir rank 0 sees every rank's KV pool. (The TP sizes refused before any
rank starts: tests/unit/test_engine_tp.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.engine import KV, greedy
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-bias"])
def test_tp2_matches_tp1(refs, kind):
    model_dir, _, prompts, _ = refs(kind)
    prompts = [prompts[i] for i in (0, 3, 5, 6, 9)]  # 1, 17, 100, 200 and a shared-prefix one
    kw = dict(kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)
    tp1 = LLM(model_dir, **kw)
    want = [o.outputs[0].token_ids for o in tp1.generate(prompts, greedy(), use_tqdm=False)]
    llm = LLM(model_dir, tensor_parallel_size=2, **kw)
    try:
        got = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        # a later, smaller batch over the same ranks (decode + prefix hits across steps)
        again = llm.generate(prompts[:2], greedy(8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [w[:8] for w in want[:2]]
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
    assert llm.engine.tp is None


def test_shared_kv_pools_hold_every_ranks_heads(refs, tmp_path):
    """With kv_cache_shared_dir, rank 0 sees each rank's pool: concatenated over the kv-head axis
    they hold exactly what a tp=1 engine holds for the same request; shutdown removes the files."""
    model_dir, _, prompts, _ = refs("llama-gqa")
    kw = dict(kv_cache_memory=KV, block_size=16, enable_prefix_caching=False)
    prompt = prompts[5]
    tp1 = LLM(model_dir, **kw)
    tp1.generate(prompt, greedy(4), use_tqdm=False)
    llm = LLM(model_dir, tensor_parallel_size=2, kv_cache_shared_dir=str(tmp_path), **kw)
    try:
        paths = llm.engine.kv_cache_paths
        assert len(paths) == 2 and all(p.startswith(str(tmp_path)) for p in paths)
        llm.generate(prompt, greedy(4), use_tqdm=False)
        caches = llm.engine.rank_kv_caches()
        assert caches[0] is llm.engine.kv_cache
        num_blocks = -(-len(prompt) // 16)

        def prompt_slots(kv):  # [layers, 2, prompt tokens, heads, head_dim]; past them a block
            # may hold what a step's rejected guesses (timed speculation) wrote, which differs
            flat = kv[:, :, :num_blocks].flatten(2, 3)
            return flat[:, :, : len(prompt)]

        # both engines allocate the same first blocks to their first request
        whole = torch.cat([prompt_slots(c) for c in caches], dim=3)
        assert torch.count_nonzero(prompt_slots(caches[1])) > 0
        torch.testing.assert_close(whole, prompt_slots(tp1.engine.kv_cache), rtol=1e-4, atol=1e-5)
    finally:
        llm.shutdown()
    assert not any(os.path.exists(p) for p in paths)


class _DyingRanks:
    """A launcher whose followers exit with code 3 as they start, before they join rank 0."""

    def rendezvous_host(self) -> str:
        return "127.0.0.1"

    def launch(self, config, model_config, model_dir, kv_cache_paths, host, port):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=os._exit, args=(3,), daemon=True) for _ in kv_cache_paths[1:]]
        for p in procs:
            p.start()
        return procs

    def check(self, procs, kv_cache_paths) -> None:
        pass


def test_a_follower_that_dies_as_it_starts_fails_the_start_at_once(tiny_models):
    """Rank 0 waits for the other ranks to join; one that ended first fails the start at once,
    naming it (it used to keep rank 0 waiting PDSERVE_TP_TIMEOUT_S, ten minutes by default, for
    a timeout naming nobody); then an engine starts as usual."""
    import time

    from pdserve.engine import tp

    model_dir, _ = tiny_models("llama-gqa")
    tp.use_launcher(_DyingRanks())
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"engine rank 1 ended \(exit code 3\) before"):
            LLM(model_dir, tensor_parallel_size=2, kv_cache_memory=KV)
        assert time.monotonic() - start < 60
    finally:
        tp.use_launcher(None)
    llm = LLM(model_dir, tensor_parallel_size=2, kv_cache_memory=KV)
    llm.shutdown()


class _CheckingRanks:
    """The default launcher, checking first that rank 0's store already listens on the port
    the followers are told (`listening` records it at each launch)."""

    def __init__(self, inner):
        self.inner, self.listening = inner, []

    def rendezvous_host(self) -> str:
        return self.inner.rendezvous_host()

    def launch(self, config, model_config, model_dir, kv_cache_paths, host, port):
        import socket

        with socket.socket() as s:
            self.listening.append(s.connect_ex((host, port)) == 0)
        return self.inner.launch(config, model_config, model_dir, kv_cache_paths, host, port)

    def check(self, procs, kv_cache_paths) -> None:
        self.inner.check(procs, kv_cache_paths)


def test_the_followers_are_told_a_port_rank_0_already_listens_on(tiny_models):
    """Rank 0 binds its store before it starts the followers, on a port the kernel picks as it
    binds: a port found free and bound only later could be taken in between by any outgoing
    connection (a TP-3 decode worker's start failed in CI with EADDRINUSE so)."""
    from pdserve.engine import tp

    model_dir, _ = tiny_models("llama-gqa")
    launcher = _CheckingRanks(tp.current_launcher())
    tp.use_launcher(launcher)
    try:
        llm = LLM(model_dir, tensor_parallel_size=2, kv_cache_memory=KV)
        llm.shutdown()
    finally:
        tp.use_launcher(None)
    assert launcher.listening == [True]


def test_a_start_that_fails_after_the_default_group_leaves_none(tiny_models, monkeypatch):
    """Rank 0's start fails once its default group is up (here: making the pipeline's groups):
    that group goes with it, so the process's next engine starts, where it used to find the old
    group still initialized."""
    import torch.distributed as dist

    from pdserve.engine import tp

    model_dir, _ = tiny_models("llama-gqa")

    def refuse(*args, **kwargs):
        raise RuntimeError("no groups today")

    monkeypatch.setattr(tp.dist, "new_group", refuse)
    with pytest.raises(RuntimeError, match="no groups today"):
        LLM(model_dir, pipeline_parallel_size=2, kv_cache_memory=KV)
    assert not dist.is_initialized()
    monkeypatch.undo()
    llm = LLM(model_dir, pipeline_parallel_size=2, kv_cache_memory=KV)
    llm.shutdown()


def test_a_start_whose_rank_0_runner_fails_leaves_no_group_or_rank(tiny_models, monkeypatch):
    """Rank 0's own runner fails to build once its followers have joined: the start raises that
    error, the followers end and the default group goes, so the process's next engine starts. (The
    stop used to fail on the runner it never had, leaving both behind; a stop broadcast to
    followers in their ready barrier waited out the group's timeout.)"""
    import datetime
    import time

    import torch.distributed as dist

    from pdserve.engine import engine_core, tp

    model_dir, _ = tiny_models("llama-gqa")
    started = []
    real_start = tp.TPGroup.start

    def start(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    def refuse(*args, **kwargs):
        raise RuntimeError("no runner today")

    monkeypatch.setattr(tp.TPGroup, "start", start)
    monkeypatch.setattr(engine_core, "start_runner", refuse)
    monkeypatch.setattr(tp, "_TIMEOUT", datetime.timedelta(seconds=120))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no runner today"):
        LLM(model_dir, tensor_parallel_size=2, kv_cache_memory=KV)
    assert time.monotonic() - t0 < 100  # (not the group's timeout)
    assert not dist.is_initialized()
    assert len(started) == 1 and not any(p.is_alive() for p in started[0].procs)
    monkeypatch.undo()
    llm = LLM(model_dir, tensor_parallel_size=2, kv_cache_memory=KV)
    llm.shutdown()


def test_a_follower_takes_rank_0s_environment_of_its_launch(tmp_path, monkeypatch):
    """Local followers fork from a fork server that started once, with the environment of that
    moment; each must still see rank 0's environment as it is when that follower is launched (a
    setting changed since, here one the server started with and one it never had)."""
    import pickle
    import subprocess

    from pdserve.engine import rank_process, tp

    ctx = tp._rank_context("cpu")
    seen = []
    for i, value in enumerate(["first", "second"]):
        monkeypatch.setenv("PDSERVE_TEST_FOLLOWER_ENV", value)
        if i:
            monkeypatch.setenv("PDSERVE_TEST_FOLLOWER_NEW", "new")
        out = tmp_path / f"env{i}"
        # the follower's own environment, as a program it starts inherits it
        shell = f'printf "%s,%s" "$PDSERVE_TEST_FOLLOWER_ENV" "$PDSERVE_TEST_FOLLOWER_NEW" > {out}'
        payload = pickle.dumps((subprocess.run, (["sh", "-c", shell],)))
        proc = ctx.Process(target=rank_process.run, args=(dict(os.environ), payload))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        seen.append(out.read_text())
    assert seen == ["first,", "second,new"]


def test_rank_0_names_its_groups_as_fresh_followers_do(tiny_models, monkeypatch):
    """torch names groups by a counter of the process; one left past 0 without a default group up
    (an earlier engine's group that ended other than by a whole destroy) made rank 0 name its
    default group "2" against its followers' "0", and the ranks waited for each other until the
    group's timeout. The start now counts from 0 again."""
    import datetime

    import torch.distributed as dist

    from pdserve.engine import tp

    model_dir, _ = tiny_models("llama-gqa")
    monkeypatch.setattr(tp, "_TIMEOUT", datetime.timedelta(seconds=60))
    assert not dist.is_initialized()
    monkeypatch.setattr(dist.distributed_c10d._world, "group_count", 2)
    llm = LLM(model_dir, tensor_parallel_size=2, kv_cache_memory=KV)
    try:
        assert (
            len(llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2
        )
    finally:
        llm.shutdown()
