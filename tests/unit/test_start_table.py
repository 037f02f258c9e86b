"""The table `pdserve up` prints after `ready` (deploy/start_table.py): one aligned row per worker
with its node, process id, cores, precision, KV backend and capacity and log file, "?" for what a worker did
not report. The real workers' rows: tests/e2e/test_ray_nodes.py."""

from __future__ import annotations

from pdserve.deploy.start_table import COLUMNS, core_ranges, format_table, row

DECODE = dict(
    worker_id="decode-0",
    role="decode",
    node_ip="10.0.0.2",
    node_id="10c5ef9d0123456789",
    pinned=True,
    cores=[2, 3],
    device="cpu",
    dtype="float32",
    quantization="int8",
    kv_backend="grpc",
    tp=1,
    blocks=512,
    block_size=16,
    tokens=8192,
    max_model_len=2048,
    max_seqs_at_max_len=4,
    log_file="/tmp/ray/session_x/logs/worker-ab-01-123.err",
    pid=4242,
)


def test_core_ranges_are_compressed():
    assert core_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert core_ranges([3]) == "3"
    assert core_ranges([]) == ""


def test_a_row_says_where_and_how_the_worker_serves():
    assert row(DECODE) == (
        "decode-0",
        "decode",
        "10.0.0.2 (10c5ef9d)",
        "4242",
        "2-3 (pinned)",
        "float32+int8",
        "grpc",
        "512 x 16 = 8192 tokens",
        "4 at 2048 tokens",
        "/tmp/ray/session_x/logs/worker-ab-01-123.err",
    )
    gpu = {**DECODE, "device": "cuda", "quantization": None, "dtype": "bfloat16", "tp": 2}
    assert row(gpu)[5] == "bfloat16 on cuda, tp 2"
    unpinned = {**DECODE, "pinned": False, "cores": [0, 1, 2, 3]}
    assert row(unpinned)[4] == "any of 0-3"
    # a worker Ray niced and that could not undo it says so; at 0 nothing is added
    assert row({**DECODE, "niceness": 15})[4] == "2-3 (pinned), nice 15"
    assert row({**DECODE, "niceness": 0})[4] == "2-3 (pinned)"
    assert row(DECODE, kv_backend="none (colocated)")[6] == "none (colocated)"


def test_what_a_worker_did_not_report_shows_as_a_question_mark():
    assert row({"worker_id": "prefill-1", "role": "prefill"}) == ("prefill-1", "prefill") + (
        "?",
    ) * (len(COLUMNS) - 2)


def test_the_table_has_a_header_and_aligned_columns():
    prefill = {**DECODE, "worker_id": "prefill-10", "role": "prefill", "quantization": None}
    lines = format_table([DECODE, prefill]).splitlines()
    assert len(lines) == 3
    assert lines[0].split() == [
        "worker",
        "role",
        "node",
        "pid",
        "cores",
        "precision",
        "KV",
        "backend",
        "KV",
        "blocks",
        "max",
        "seqs",
        "log",
    ]
    # every column starts where its header does
    for name in ("role", "node", "pid", "cores", "precision", "KV backend", "KV blocks", "log"):
        at = lines[0].index(name)
        assert lines[1][at - 2 : at] == "  " and lines[1][at] != " ", (name, lines)
        assert lines[2][at - 2 : at] == "  " and lines[2][at] != " ", (name, lines)
    assert lines[2].startswith("prefill-10  prefill  10.0.0.2 (10c5ef9d)  4242")
    assert "float32 " in lines[2] and "float32+int8" in lines[1]
    assert not any(line.endswith(" ") for line in lines)


def test_on_auto_a_prefill_row_says_what_it_pushes_over():
    from pdserve.deploy.start_table import auto_pick

    decode = {**DECODE, "kv_backend": "auto: shm, grpc"}
    far = {**decode, "worker_id": "decode-1", "node_id": "ffff0000"}
    prefill = {**DECODE, "worker_id": "prefill-0", "role": "prefill", "kv_backend": None}
    assert auto_pick(prefill, [decode, prefill]) == "auto -> shm"
    assert auto_pick(prefill, [decode, far, prefill]) == "auto -> shm (1), grpc (1)"
    gpu = {**decode, "kv_backend": "auto: grpc"}  # a KV pool off the host: no shm offered
    assert auto_pick(prefill, [gpu, prefill]) == "auto -> grpc"
    assert auto_pick(decode, [decode, prefill]) is None  # decode rows say what they offer
    assert auto_pick(prefill, [DECODE, prefill]) is None  # a named backend: no pick
    table = format_table([decode, prefill])
    assert "auto: shm, grpc" in table and "auto -> shm" in table
