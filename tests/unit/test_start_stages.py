"""A worker's start stages (worker_common/start_stages.py): every engine function they trace still
exists, an engine built under `traced` reports its stages in the order they happen with what an
operator needs (the KV capacity in blocks, tokens and sequences at max_model_len), the engine's
functions are its own again afterwards, and a reader gets only the lines it has not seen. On a
real deployment's console: tests/e2e/test_ray_nodes.py."""

from __future__ import annotations

import pathlib

import pytest

from pdserve.worker_common.start_stages import (
    STAGE_POINTS,
    StageLog,
    kv_capacity,
    resolve_point,
    traced,
)


def test_every_traced_point_exists_in_the_engine():
    for module, path, _ in STAGE_POINTS:
        owner, name = resolve_point(module, path)
        assert callable(getattr(owner, name)), (module, path)


def test_a_reader_gets_the_lines_it_has_not_seen():
    clock = iter([100.0, 101.5, 103.0, 110.0, 110.0])
    stages = StageLog("decode-0", clock=lambda: next(clock))
    stages.add("weights", "loaded in 1.5s")
    assert [s.line() for s in stages.since(0)] == ["   1.5s weights: loaded in 1.5s"]
    stages.add("warm-up", "one throwaway request in 0.2s")
    assert [s.name for s in stages.since(1)] == ["warm-up"]
    assert stages.since(2) == [] and stages.since(-3) == stages.since(0)
    stages.begin()  # the start proper: its stages count from here
    assert stages.add("serving", "decode on 127.0.0.1:1").t == 0.0


def test_kv_capacity_counts_whole_sequences_of_max_model_len():
    assert kv_capacity(512, 16, 2048, 128) == dict(
        blocks=512, block_size=16, tokens=8192, max_model_len=2048, max_seqs_at_max_len=4
    )
    # one block short of a fifth sequence, and max_num_seqs bounds it too
    assert kv_capacity(639, 16, 2048, 128)["max_seqs_at_max_len"] == 4
    assert kv_capacity(640, 16, 2048, 3)["max_seqs_at_max_len"] == 3
    assert kv_capacity(10, 16, 100, 8)["max_seqs_at_max_len"] == 1  # 7 blocks per sequence


def test_an_engine_built_under_traced_reports_its_stages_in_order(tiny_models, caplog):
    from pdserve.engine import LLM, precision
    from pdserve.engine.engine_core import LLMEngine
    from pdserve.engine.model_runner import ModelRunner

    model_dir, _ = tiny_models("llama-gqa")
    originals = (LLMEngine.warm_up, precision.choose_precision, ModelRunner._new_kv_cache)
    stages = StageLog("decode-0")
    caplog.set_level("INFO", "pdserve.worker_common.start_stages")
    with traced(stages):
        llm = LLM(model_dir, dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
        llm.engine.warm_up()
    llm.shutdown()
    assert (LLMEngine.warm_up, precision.choose_precision, ModelRunner._new_kv_cache) == originals
    seen = [(s.name, s.text) for s in stages.since(0) if s.name != "kernel build"]
    assert [name for name, _ in seen] == [
        "model files",
        "weights",
        "precision probe",
        "precision probe",
        "KV capacity",  # (taken once the precision is chosen, in the cache dtype chosen with it)
        "warm-up",
        "warm-up",
    ]
    text = dict(seen)
    assert text["model files"].startswith(model_dir)
    blocks = llm.engine.runner.num_blocks
    per_seq = -(-256 // 16)
    assert text["KV capacity"].startswith(f"{blocks} blocks x 16 tokens = {blocks * 16} tokens")
    assert (
        f"{min(blocks // per_seq, 128)} sequences of max_model_len 256 at once"
        in text["KV capacity"]
    )
    assert "quantization=none (float32)" in text["precision probe"]
    assert text["warm-up"].startswith("one throwaway request in ")
    times = [s.t for s in stages.since(0)]
    assert times == sorted(times)
    # each line is in the worker's own log too
    assert sum("decode-0 start:" in r.getMessage() for r in caplog.records) == len(times)


def test_a_kernel_build_says_when_it_begins_and_how_it_ended(monkeypatch):
    from pdserve.engine import kernels

    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")  # the build gives up at once: the torch path
    stages = StageLog("prefill-0")
    with traced(stages):
        assert kernels._build("paged_decode", pathlib.Path("unused.cpp"), []) is None
    assert [(s.name, s.text.split(" (")[0]) for s in stages.since(0)] == [
        ("kernel build", "paged_decode: building, or loading the cached build"),
        ("kernel build", "paged_decode: unavailable, the torch path serves instead"),
    ]


def test_a_failing_stage_raises_as_before_and_the_engine_is_restored():
    from pdserve.engine.engine_core import LLMEngine

    original = LLMEngine.warm_up
    stages = StageLog("decode-1")
    with pytest.raises(RuntimeError, match="warm_up runs before any request"):
        with traced(stages):

            class Busy:
                _requests = {"r": 1}
                _undelivered = []

            LLMEngine.warm_up(Busy())
    assert LLMEngine.warm_up is original
    assert [(s.name, s.text) for s in stages.since(0)] == [("warm-up", "one throwaway request")]
