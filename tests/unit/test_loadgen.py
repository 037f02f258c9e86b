"""`pdserve bench`: the goodput/SLO math on hand-made numbers, and the load generator end to end
against an in-process tiny-model cluster (router + one prefill + one decode worker)."""

from __future__ import annotations

import csv
import json
import random
import socket

import pytest

from pdserve.cli import main
from pdserve.tuning.loadgen import run_load
from pdserve.tuning.metrics import (
    RequestRecord,
    attainment,
    attribute_itl,
    distribution,
    goodput_rate,
    meets_slo,
    parse_positive_list,
    parse_slo,
    slo_scale_goodput,
    summarize,
)
from pdserve.tuning.workload import RequestSpec, build_prompts
from worker_helpers import start_decode, start_prefill, start_router

MAX_MODEL_LEN = 256


# ---- goodput interpolation ---------------------------------------------------------------------
def test_goodput_interpolates_between_the_points_where_attainment_crosses():
    g = goodput_rate([1, 2, 4, 8], [1.0, 0.95, 0.85, 0.3], threshold=0.9)
    assert g["rate"] == pytest.approx(3.0) and not g["lower_bound"] and g["note"] == ""
    # order of the sweep points does not matter
    assert goodput_rate([8, 2, 4, 1], [0.3, 0.95, 0.85, 1.0], 0.9)["rate"] == pytest.approx(3.0)
    # a point exactly at the threshold meets it
    assert goodput_rate([1, 2], [0.9, 0.5], 0.9)["rate"] == pytest.approx(1.0)
    assert goodput_rate([1, 2], [1.0, 0.0], 0.5)["rate"] == pytest.approx(1.5)


def test_goodput_is_zero_when_even_the_lowest_rate_misses():
    g = goodput_rate([0.5, 1, 2], [0.89, 0.5, 0.1], threshold=0.9)
    assert g["rate"] == 0.0 and not g["lower_bound"] and "sweep lower rates" in g["note"]


def test_goodput_always_above_is_the_highest_rate_as_a_lower_bound():
    g = goodput_rate([0.5, 1, 2], [1.0, 0.97, 0.91], threshold=0.9)
    assert g["rate"] == 2 and g["lower_bound"] and "lower bound" in g["note"]


def test_goodput_takes_the_highest_crossing_of_a_noisy_curve():
    g = goodput_rate([1, 2, 4, 8], [0.95, 0.8, 0.92, 0.5], threshold=0.9)
    assert g["rate"] == pytest.approx(4 + 0.02 / 0.42 * 4) and "dips" in g["note"]


def test_goodput_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="one attainment per rate"):
        goodput_rate([1, 2], [0.9])
    with pytest.raises(ValueError):
        goodput_rate([], [])


# ---- SLO parsing -------------------------------------------------------------------------------
def test_parse_slo_units():
    assert parse_slo("ttft=500ms,tpot=100ms") == {"ttft": 0.5, "tpot": 0.1}
    assert parse_slo(" TTFT = 2s , e2e=1.5e3ms") == {"ttft": 2.0, "e2e": 1.5}


@pytest.mark.parametrize(
    "text, named",
    [
        ("ttft=500", "no unit"),
        ("ttft=500us", "expected NAME=VALUE"),
        ("itl=5ms", "unknown metric"),
        ("ttft=1s,ttft=2s", "twice"),
        ("ttft=0ms", "> 0"),
        ("", "no SLO"),
        ("ttft", "expected NAME=VALUE"),
    ],
)
def test_parse_slo_errors_name_the_problem(text, named):
    with pytest.raises(ValueError, match=named):
        parse_slo(text)


def test_parse_positive_list():
    assert parse_positive_list("0.5, 1,2,4", "--sweep-rates") == [0.5, 1, 2, 4]
    for bad in ("1,0", "1,-2", "a", "", "inf", "nan"):
        with pytest.raises(ValueError, match="--sweep-rates"):
            parse_positive_list(bad, "--sweep-rates")


# ---- per-request numbers -----------------------------------------------------------------------
def test_itl_spreads_a_multi_token_delta_gap_evenly():
    # deltas at 1.0 (2 tokens), 1.3 (1 token), 1.9 (3 tokens): 6 tokens -> 5 gaps
    gaps = attribute_itl([1.0, 1.3, 1.9], [2, 1, 3])
    assert gaps == pytest.approx([0.0, 0.3, 0.2, 0.2, 0.2])
    assert sum(gaps) == pytest.approx(0.9)
    assert attribute_itl([], []) == [] and attribute_itl([2.0], [1]) == []
    with pytest.raises(ValueError):
        attribute_itl([1.0], [1, 2])


def record(i=0, ttft=0.1, e2e=1.1, tokens=11, error="", prompt=10):
    return RequestRecord(
        i, 0.0, prompt, tokens, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, error=error
    )


def test_tpot_and_slo_membership():
    r = record()
    assert r.tpot_s == pytest.approx(0.1)
    assert meets_slo(r, {"ttft": 0.1, "tpot": 0.1}) and not meets_slo(
        r, {"ttft": 0.1, "tpot": 0.09}
    )
    assert meets_slo(r, {"ttft": 0.06, "tpot": 0.06}, scale=2) and not meets_slo(r, {"e2e": 1.0})
    assert record(tokens=1).tpot_s is None and meets_slo(record(tokens=1), {"tpot": 1e-6})
    assert not meets_slo(record(error="RESOURCE_EXHAUSTED"), {"ttft": 10})


def test_summary_counts_failures_as_misses():
    records = [record(i, ttft=t, e2e=t + 1.0) for i, t in enumerate([0.1, 0.2, 0.3, 0.4])]
    records.append(record(4, ttft=None, e2e=None, tokens=0, error="RESOURCE_EXHAUSTED"))
    s = summarize(records, duration_s=2.0, slo={"ttft": 0.25})
    assert (s["completed"], s["failed"], s["errors"]) == (4, 1, {"RESOURCE_EXHAUSTED": 1})
    assert s["request_throughput"] == pytest.approx(2.0) and s[
        "output_throughput"
    ] == pytest.approx(22.0)
    assert s["input_throughput"] == pytest.approx(20.0) and s["total_input_tokens"] == 40
    assert s["mean_ttft_ms"] == pytest.approx(250) and s["median_ttft_ms"] == pytest.approx(250)
    assert s["p99_ttft_ms"] == pytest.approx(397) and s["mean_tpot_ms"] == pytest.approx(100)
    assert s["slo_attainment"] == pytest.approx(2 / 5) and s["request_goodput"] == pytest.approx(
        1.0
    )
    assert distribution([], "ttft") == dict.fromkeys(
        ["mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"]
    )


def test_slo_scale_goodput_from_the_same_sweep():
    fast = [record(i, ttft=0.1) for i in range(10)]
    slow = [record(i, ttft=0.3) for i in range(10)]
    runs = [(1.0, fast), (2.0, slow)]
    assert [attainment(r, {"ttft": 0.2}) for _, r in runs] == [1.0, 0.0]
    half, one, two = slo_scale_goodput(runs, {"ttft": 0.2, "tpot": 1.0}, [0.25, 1, 2])
    assert half["rate"] == 0.0 and half["slo_s"]["ttft"] == pytest.approx(0.05)
    assert one["rate"] == pytest.approx(1.1) and not one["lower_bound"]
    assert two["rate"] == 2.0 and two["lower_bound"] and two["attainment"] == [1.0, 1.0]


# ---- end to end against the tiny cluster -------------------------------------------------------
class TinyCluster:
    def __init__(self, model_dir):
        engine = dict(max_model_len=MAX_MODEL_LEN)
        self.decode = start_decode(model_dir, engine=engine, lease_ms=5000)
        self.prefill = start_prefill(model_dir, engine=engine)
        self.routers = []

    def router(self, max_inflight=16) -> str:
        r = start_router(
            self.decode.config.model,
            self.decode,
            self.prefill,
            max_model_len=MAX_MODEL_LEN,
            max_inflight=max_inflight,
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
            and len(r["itl_s"]) == r["output_tokens"] - 1
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
    address = cluster.router(max_inflight=2)
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
