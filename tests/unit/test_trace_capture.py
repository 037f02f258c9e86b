"""Live traffic as a replayable trace (router/capture.py): Mooncake-format lines whose hash_ids
share exactly where prompts share 512-token prefixes, read back by tuning/workload.py; rotation,
the bounded id map, and a file that cannot be written (one error line, nothing raised)."""

from __future__ import annotations

import json
import logging

from pdserve.router import capture as capture_mod
from pdserve.router.capture import TraceCapture
from pdserve.tuning.workload import build_prompts, load_trace

B = capture_mod.BLOCK_TOKENS


def _prompt(*blocks, tail: int = 0, base: int = 1000) -> list[int]:
    """Whole blocks filled with token `base + block`, then `tail` tokens of 7."""
    return [base + b for b in blocks for _ in range(B)] + [7] * tail


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ids_share_where_prompts_share_prefixes(tmp_path):
    cap = TraceCapture(str(tmp_path / "t.jsonl"))
    try:
        a = cap.hash_ids(_prompt(1, 2, 3, tail=10))
        b = cap.hash_ids(_prompt(1, 2, 4))
        c = cap.hash_ids(_prompt(9, 2, 3, tail=10))  # block 2 after another first block
        d = cap.hash_ids(_prompt(1, 2, 3, tail=10))
    finally:
        cap.close()
    assert len(a) == 4 and len(b) == 3  # the partial last block has an id too
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(c) & set(a)  # a chain: equal blocks after different prefixes differ
    assert d == a


def test_lines_replay_with_the_same_lengths_and_sharing(tmp_path):
    path = tmp_path / "t.jsonl"
    cap = TraceCapture(str(path))
    t0 = 1_700_000_000_000_000_000
    prompts = [_prompt(1, 2, tail=100), _prompt(1, 2, 3), _prompt(5, tail=3), _prompt(1, tail=8)]
    for i, p in enumerate(prompts):
        cap.record(t0 + i * 250_000_000, p, 16 + i)
    cap.close()
    lines = _lines(path)
    assert [d["timestamp"] for d in lines] == [0, 250, 500, 750]
    assert [d["input_length"] for d in lines] == [len(p) for p in prompts]
    assert [d["output_length"] for d in lines] == [16, 17, 18, 19]
    assert lines[0]["hash_ids"][:2] == lines[1]["hash_ids"][:2]
    assert lines[3]["hash_ids"][0] == lines[0]["hash_ids"][0]
    # the reader the bench and the tuner use takes it as it is
    specs = load_trace(str(path))
    assert [s.prompt_len for s in specs] == [len(p) for p in prompts]
    assert [s.output_len for s in specs] == [16, 17, 18, 19]
    rebuilt = build_prompts(specs, vocab_size=49152, seed=3)
    assert rebuilt[0][: 2 * B] == rebuilt[1][: 2 * B]  # shared prefixes replay as shared
    assert rebuilt[3][:B] == rebuilt[0][:B] and rebuilt[2][:B] != rebuilt[0][:B]


def test_the_file_rotates_past_its_bound(tmp_path):
    path = tmp_path / "t.jsonl"
    cap = TraceCapture(str(path), max_bytes=300)
    for i in range(12):
        cap.record(i * 1_000_000, _prompt(i), 4)
    cap.close()
    older = tmp_path / "t.jsonl.1"
    assert older.exists() and path.exists()
    assert older.stat().st_size >= 300
    assert cap.written == 12 and len(_lines(path)) + len(_lines(older)) <= 12


def test_the_id_map_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(capture_mod, "MAX_CHAINS", 2)
    cap = TraceCapture(str(tmp_path / "t.jsonl"))
    try:
        first = cap.hash_ids(_prompt(1, 2, 3))  # the third chain is not remembered
        again = cap.hash_ids(_prompt(1, 2, 3))
    finally:
        cap.close()
    assert first[:2] == again[:2] and first[2] != again[2]
    assert len(cap._ids) == 2


def test_an_unwritable_file_is_one_error_line(tmp_path, caplog):
    caplog.set_level(logging.ERROR, "pdserve.router.capture")
    cap = TraceCapture(str(tmp_path / "missing-dir" / "t.jsonl"))
    cap.record(0, [1, 2, 3], 1)  # nothing raised, nothing written
    cap.close()
    assert cap.failed and "cannot open" in cap.failed
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "serving goes on" in errors[0].getMessage()


def test_a_full_block_extending_an_earlier_partial_one_shares_its_id(tmp_path):
    cap = TraceCapture(str(tmp_path / "t.jsonl"))
    try:
        short = cap.hash_ids(_prompt(1) + [5] * 100)  # block 1, then 100 tokens of a block
        long = cap.hash_ids(_prompt(1) + [5] * 100 + [6] * (B - 100))  # that block, whole
        other = cap.hash_ids(_prompt(1) + [5] * 100 + [8] * (B - 100))  # claimed already
    finally:
        cap.close()
    assert long == short and other[0] == short[0] and other[1] != short[1]
