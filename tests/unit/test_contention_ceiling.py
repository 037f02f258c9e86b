"""benchmarks/engine/contention.py's share ceiling and efficiency, on made-up runs."""

from benchmarks.engine.contention import _ceiling


def test_ceiling_and_efficiency_from_the_runs():
    res = {
        "quiet_median": 120.0,
        "busy_tok_s": [40.0, 42.0, 30.0],
        "busy_own_cores": [0.5, 0.6, 0.5],
    }
    out = _ceiling(res, [70.0, 60.0, 80.0])
    # a median of 0.5 cores at 70 tok/s alone on one thread: 35 of the quiet 120
    assert out["share_ceiling"] == round(0.5 * 70 / 120, 3)
    # tokens per CPU-second 80, 70, 60: their median over the one-thread speed
    assert out["busy_efficiency"] == 1.0
    assert out["one_thread_quiet_tok_s"] == [70.0, 60.0, 80.0]
