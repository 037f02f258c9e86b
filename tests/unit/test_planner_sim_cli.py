"""benchmarks/planner/sim.py's command line: sizes it cannot compare are refused up front."""

from __future__ import annotations

import pytest

from benchmarks.planner import sim as planner_sim


@pytest.mark.parametrize("gpus, tp", [("2", "1"), ("8,4", "2")])
def test_a_size_too_small_for_the_fixed_1_to_3_split_is_refused(gpus, tp, capsys):
    with pytest.raises(SystemExit) as exc:
        planner_sim.main(["--gpus", gpus, "--tp", tp, "--out", "/dev/null"])
    assert exc.value.code == 2
    assert "each size must be at least" in capsys.readouterr().err
