"""A captured trace replays as the traffic it recorded (issue #51, must-show c): a Mooncake-format
trace with shared prefixes sent through a router that captures (router/capture.py), the capture
read back by `pdserve bench`'s reader with the same request count, lengths and order, its replay
hitting the prefix cache request for request as the original did, and `pdserve tune --workload`
taking the file."""

from __future__ import annotations

import argparse
import json

import pytest

from helpers.models import make_tiny_model
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.tuning import tune_cmd
from pdserve.tuning.loadgen import run_load
from pdserve.tuning.workload import build_prompts, load_trace

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 2048
# (ms, prompt tokens, output tokens, 512-token prefix blocks): 0 and 1 shared widely
ORIGINAL = [
    (0, 1100, 4, [0, 1, 2]),
    (400, 1300, 4, [0, 1, 3]),
    (800, 700, 4, [0, 4]),
    (1200, 300, 4, [5]),
    (1600, 1100, 4, [0, 1, 2]),
    (2000, 1536, 4, [0, 1, 3]),
]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-long")
    make_tiny_model(path, "llama-gqa", seed=2, max_position_embeddings=MAX_LEN)
    return str(path)


def _run(router, path, seed):
    specs = load_trace(str(path))
    records, _ = run_load(router.address, specs, build_prompts(specs, vocab_size=256, seed=seed))
    assert not [r.error for r in records if r.error]
    return specs, records


def test_a_capture_replays_as_the_original(long_model, tmp_path):
    original = tmp_path / "original.jsonl"
    original.write_text(
        "".join(
            json.dumps(dict(timestamp=t, input_length=p, output_length=o, hash_ids=h)) + "\n"
            for t, p, o, h in ORIGINAL
        )
    )
    captured = tmp_path / "captured.jsonl"
    engine = dict(max_model_len=MAX_LEN, kv_cache_memory=8 << 20)
    decode = start_decode(long_model, engine=engine)
    prefill = start_prefill(long_model, engine=engine)
    router = start_router(
        long_model, decode, prefill, max_model_len=MAX_LEN, capture_trace=str(captured)
    )
    try:
        specs, first = _run(router, original, seed=0)
        capture = router.servicer.capture
        router.servicer.capture = None  # the replay is not recorded
        capture.close()
        assert capture.written == len(ORIGINAL) and capture.dropped == 0
        lines = [json.loads(line) for line in captured.read_text().splitlines()]
        assert sorted(d["input_length"] for d in lines) == sorted(p for _, p, _, _ in ORIGINAL)
        # another seed: the replay's tokens are new to the caches, only its own sharing hits
        again, second = _run(router, captured, seed=1)
    finally:
        stop_all([], router, prefill, decode)
    assert [(s.prompt_len, s.output_len) for s in again] == [
        (s.prompt_len, s.output_len) for s in specs
    ]
    hits = [r.cached_prompt_tokens for r in first]
    assert sum(hits) > 0, hits  # the original's shared prefixes hit
    assert [r.cached_prompt_tokens for r in second] == hits

    # the tuner reads it as a workload
    args = argparse.Namespace(
        workload=str(captured), scale=1.0, max_prompt=None, max_output=None, num_requests=6,
        max_requests=6, seed=0,
    )  # fmt: skip
    assert [(s.prompt_len, s.output_len) for s in tune_cmd._workload(args)] == [
        (s.prompt_len, s.output_len) for s in specs
    ]
