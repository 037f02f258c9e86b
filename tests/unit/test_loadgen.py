"""`pdserve bench`: the goodput/SLO math on hand-made numbers. The load generator end to end
against an in-process tiny-model cluster: tests/integration/test_loadgen_cluster.py."""

from __future__ import annotations

import pytest

from pdserve.tuning.metrics import (
    RequestRecord,
    attainment,
    attribute_itl,
    distribution,
    goodput_rate,
    meets_slo,
    parse_positive_list,
    slo_scale_goodput,
    summarize,
)
from pdserve.tuning.slo import latency_slos as parse_slo


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
