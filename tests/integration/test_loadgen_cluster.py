"""`pdserve bench`: the load generator end to end against an in-process tiny-model cluster (router
+ one prefill + one decode worker), and its argument errors. The goodput/SLO math on hand-made
numbers: tests/unit/test_loadgen.py."""

from __future__ import annotations

import csv
import json
import random
import socket

import pytest

from helpers.worker import start_decode, start_prefill, start_router
from pdserve.cli import main
from pdserve.tuning.loadgen import run_load
from pdserve.tuning.metrics import summarize
from pdserve.tuning.workload import RequestSpec, build_prompts

MAX_MODEL_LEN = 256


# ---- end to end against the tiny cluster -------------------------------------------------------
class TinyCluster:
    def __init__(self, model_dir):
        engine = dict(max_model_len=MAX_MODEL_LEN)
        self.decode = start_decode(model_dir, engine=engine, lease_ms=5000)
        self.prefill = start_prefill(model_dir, engine=engine)
        self.routers = []

    def router(self, max_inflight=16, max_queued=1024) -> str:
        r = start_router(
            self.decode.config.model,
            self.decode,
            self.prefill,
            max_model_len=MAX_MODEL_LEN,
            max_inflight=max_inflight,
            max_queued=max_queued,
        )
        self.routers.append(r)
        return r.address

    def stop(self):
        for r in self.routers:
            r.stop()
        self.prefill.stop()
        self.decode.stop()


@pytest.fixture(scope="module")
def cluster(tiny_models, one_thread):
    c = TinyCluster(tiny_models("llama-gqa")[0])
    yield c
    c.stop()


def write_trace(path, n=20, seed=3):
    """A CSV trace in the bundled traces' format: a request every ~12 ms, outputs 1-12 tokens."""
    rng = random.Random(seed)
    rows = [
        (
            round(0.2 + i * 0.01 + rng.random() * 0.005, 4),
            rng.randint(4, 40),
            1 if i == 5 else rng.randint(2, 12),
        )
        for i in range(n)
    ]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        w.writerows(rows)
    return rows


def bench_trace(cluster, tmp_path, out, *extra: str) -> int:
    """`pdserve bench` of tmp_path/trace.csv against a router of `cluster` (a loose SLO), its
    result written to `out`; the exit code."""
    router = cluster.router(max_inflight=32)
    trace = str(tmp_path / "trace.csv")
    return main(
        ["bench", "--router", router, "--trace", trace, *extra]
        + ["--slo", "ttft=10s,tpot=2s", "--out", str(out)]
    )


def test_bench_runs_a_trace_open_loop_and_writes_the_summary(cluster, tmp_path, capsys):
    rows = write_trace(tmp_path / "trace.csv")
    out = tmp_path / "result.json"
    rc = bench_trace(cluster, tmp_path, out, "--num-requests", "20")
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    result = json.loads(out.read_text())
    reqs, s = result["requests"], result["summary"]
    assert result["kind"] == "run" and result["model"]["vocab_size"] == 256 and len(reqs) == 20
    assert [r["error"] for r in reqs] == [""] * 20
    assert [(r["prompt_len"], r["output_tokens"]) for r in reqs] == [(p, o) for _, p, o in rows]
    # the trace's own arrival times, shifted to start at 0, kept by an open loop
    assert [r["arrival_s"] for r in reqs] == pytest.approx([t - rows[0][0] for t, _, _ in rows])
    # open loop: requests overlap instead of waiting for the one before (in this process the
    # cluster shares the GIL with the client, so sends may lag their arrival a little)
    assert any(b["send_s"] < a["send_s"] + a["e2e_s"] for a, b in zip(reqs, reqs[1:]))
    assert all(0 <= r["send_s"] - r["arrival_s"] < 1.0 for r in reqs)
    for r in reqs:
        assert (
            r["ttft_s"] > 0
            and r["e2e_s"] >= r["ttft_s"]
            and len(r["itl_per_token_s"]) == r["output_tokens"] - 1
        )
        assert (r["tpot_s"] is None) == (r["output_tokens"] == 1)
        t = r["timings"]
        assert t["prefill_worker"] == "p0" and t["decode_worker"] == "d0"
        assert 0 < t["queued_unix_ns"] <= t["prefill_start_unix_ns"] <= t["first_token_unix_ns"]
    assert (s["completed"], s["failed"]) == (20, 0) and s["total_output_tokens"] == sum(
        o for *_, o in rows
    )
    for key in (
        "duration",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "slo_attainment",
        "request_goodput",
        *(
            f"{m}_{k}_ms"
            for m in ("mean", "median", "p90", "p99")
            for k in ("ttft", "tpot", "itl", "e2el")
        ),
    ):
        assert s[key] is not None and s[key] >= 0, key
    assert s["slo_attainment"] == 1.0 and s["server_ms"]["prefill"]["mean"] > 0


def test_sweep_writes_goodput_and_plots(cluster, tmp_path):
    write_trace(tmp_path / "trace.csv", n=10)
    out = tmp_path / "sweep.json"
    rc = bench_trace(cluster, tmp_path, out, "--sweep-rates", "20,50", "--slo-scales", "0.000001,1")
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["rate"] for r in result["runs"]] == [20, 50]
    assert all(len(r["requests"]) == 10 and r["summary"]["completed"] == 10 for r in result["runs"])
    g = result["goodput"]
    assert g["attainment"] == [1.0, 1.0] and g["rate"] == 50 and g["lower_bound"]
    tiny, one = result["slo_scales"]
    assert tiny["rate"] == 0.0 and one["rate"] == 50
    assert len(result["plots"]) == 3
    for path in result["plots"]:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_full_router_refuses_and_the_run_goes_on(cluster):
    address = cluster.router(max_inflight=2, max_queued=0)  # no admission queue: refused at once
    requests = [RequestSpec(0.0, 16, 100)] * 8  # all at once: more than the router admits
    records, duration_s = run_load(address, requests, build_prompts(requests, 256, seed=1))
    s = summarize(records, duration_s)
    assert s["errors"].get("RESOURCE_EXHAUSTED", 0) >= 1 and s["completed"] >= 2
    assert s["completed"] + s["errors"]["RESOURCE_EXHAUSTED"] == 8
    assert all(r.output_tokens == 100 for r in records if r.ok)


def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    write_trace(tmp_path / "trace.csv", n=3)
    trace = str(tmp_path / "trace.csv")
    cases = [
        (["--trace", "nope"], "unknown trace 'nope'"),
        (["--trace", trace, "--slo", "ttft=500"], "has no unit"),
        (["--trace", trace, "--rate", "0"], "--rate must be > 0"),
        (["--trace", trace, "--sweep-rates", "1,2"], "needs --slo"),
        (["--prompt-len", "8"], "--output-len"),
        (["--trace", trace, "--burstiness", "0.5"], "--burstiness"),
        (["--trace", trace, "--trace-start", "-1"], "--trace-start must be >= 0"),
        (["--trace", trace, "--trace-start", "100"], "no requests from 100"),
        (["--trace", trace, "--router", dead], f"router {dead} unreachable: UNAVAILABLE"),
    ]
    for argv, named in cases:
        assert main(["bench", *argv]) == 2, argv
        assert named in capsys.readouterr().err, argv
