"""The request traces that ship with pdserve (tuning/traces/): found by name with no setup,
$PDSERVE_TRACES_DIR and plain paths still win, and gzip-compressed traces read like plain ones."""

import gzip
import json

import pytest

from pdserve.tuning import workload


def test_every_named_trace_loads_from_the_bundled_folder(monkeypatch):
    monkeypatch.delenv("PDSERVE_TRACES_DIR", raising=False)
    assert workload.traces_dir() == workload.BUNDLED_TRACES_DIR
    rows = {"azure_conv": 19366, "azure_code": 8819, "mooncake_synthetic": 3993}  # traces/README.md
    rows["shift_code_conv_decode"] = 7338
    rows["shift_code_conv_reason"] = 17355
    for name in workload.TRACES:
        path = workload.resolve_trace(name)
        assert path.parent == workload.BUNDLED_TRACES_DIR
        reqs = workload.load_trace(name)
        assert len(reqs) == rows[name] and reqs[0].arrival_s == 0.0
    mooncake = workload.load_trace("mooncake_synthetic", scale=0.25, max_requests=5)
    assert mooncake[0].block_ids and mooncake[0].block_tokens == 128
    assert (workload.BUNDLED_TRACES_DIR / "LICENSES.md").is_file()


def test_traces_dir_from_the_environment_and_gzip(tmp_path, monkeypatch):
    lines = [
        {"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 20, "output_length": 9},
    ]
    with gzip.open(tmp_path / "mooncake_synthetic.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(d) + "\n" for d in lines))
    (tmp_path / "azure_conv.csv").write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n1.5,10,2\n2.0,30,4\n"
    )
    with gzip.open(tmp_path / "mine.csv.gz", "wt") as f:
        f.write("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,5,1\n")
    monkeypatch.setenv("PDSERVE_TRACES_DIR", str(tmp_path))
    reqs = workload.load_trace("mooncake_synthetic")
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.block_ids) for r in reqs] == [
        (0.0, 700, 3, (0, 1)),
        (0.5, 20, 9, ()),
    ]
    assert [(r.arrival_s, r.prompt_len) for r in workload.load_trace("azure_conv")] == [
        (0.0, 10),
        (0.5, 30),
    ]
    assert [r.prompt_len for r in workload.load_trace(str(tmp_path / "mine.csv.gz"))] == [5]
    with pytest.raises(ValueError, match="is not in .*PDSERVE_TRACES_DIR"):
        workload.load_trace("azure_code")  # not in the folder the environment names
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a trace this reader knows"):
        workload.load_trace(str(tmp_path / "broken.jsonl.gz"))
