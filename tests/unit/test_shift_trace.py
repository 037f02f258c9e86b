"""Workload-shift traces (tuning/shift_trace.py): phases laid end to end at their durations, the
ratio filter on every row of its phase, the shipped trace loading by name with its boundaries read
back (and rebuilt byte for byte from the command in traces/README.md), users' CSVs as sources,
and bad input refused with a message that says what to fix."""

import re
import shlex

import pytest

from pdserve.tuning import shift_trace, workload
from pdserve.tuning.shift_trace import Phase

SHIPPED = "shift_code_conv_decode"


def _user_csv(path, n=100, gap=1.0):
    """n requests, one every `gap` s from 5 s on, request i with prompt 100+i and output 1+i."""
    lines = ["arrived_at,num_prefill_tokens,num_decode_tokens"]
    lines += [f"{5 + i * gap},{100 + i},{1 + i}" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_phases_follow_each_other_at_their_durations(tmp_path):
    src = _user_csv(tmp_path / "mine.csv")
    phases = [
        Phase("window", src, 30, start_s=10),  # source times 15..44 s (from its first request)
        Phase("poisson", src, 20, rate=3.0),
        Phase("tail", "azure_code", 50),
    ]
    rows = shift_trace.build_shift_rows(phases, seed=1)
    out = shift_trace.write_shift_trace(rows, tmp_path / "shift.csv")
    assert [r.arrived_at for r in rows] == sorted(r.arrived_at for r in rows)
    window = [r for r in rows if r.phase == "window"]
    assert [r.arrived_at for r in window] == [float(i) for i in range(30)]
    assert [r.num_prefill_tokens for r in window] == list(range(110, 140))
    poisson = [r for r in rows if r.phase == "poisson"]
    assert poisson[0].arrived_at == 30.0 and all(30 <= r.arrived_at < 50 for r in poisson)
    assert 30 <= len(poisson) <= 90  # ~60 at 3 req/s over 20 s
    assert [r.num_decode_tokens for r in poisson] == [1 + i for i in range(len(poisson))]
    tail = [r for r in rows if r.phase == "tail"]
    assert tail[0].arrived_at == 50.0 and tail[-1].arrived_at < 100
    assert [r.phase for r in rows] == ["window"] * 30 + ["poisson"] * len(poisson) + ["tail"] * len(
        tail
    )
    bounds = shift_trace.phase_boundaries(out)
    assert bounds == [
        ("window", 0.0, 30.0),
        ("poisson", 30.0, 50.0),
        ("tail", 50.0, tail[-1].arrived_at),
    ]
    # the same rows come back through load_trace, given the written file's path
    reqs = workload.load_trace(str(out))
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [tuple(r[:3]) for r in rows]
    parts = shift_trace.split_by_phase(reqs, bounds)
    assert {name: len(v) for name, v in parts.items()} == {
        "window": 30,
        "poisson": len(poisson),
        "tail": len(tail),
    }
    assert list(parts) == ["window", "poisson", "tail"]


def test_rate_phase_wraps_round_its_source_and_is_seeded(tmp_path):
    src = _user_csv(tmp_path / "few.csv", n=4)
    rows = shift_trace.build_shift_rows([Phase("p", src, 10, rate=5.0, start_s=2)], seed=3)
    # from the source's request at 2 s on (the third), then round to the beginning
    assert [r.num_prefill_tokens for r in rows[:6]] == [102, 103, 100, 101, 102, 103]
    again = shift_trace.build_shift_rows([Phase("p", src, 10, rate=5.0, start_s=2)], seed=3)
    other = shift_trace.build_shift_rows([Phase("p", src, 10, rate=5.0, start_s=2)], seed=4)
    assert again == rows and [r.arrived_at for r in other] != [r.arrived_at for r in rows]


def test_the_filter_holds_on_every_row_of_its_phase_only():
    phases = [
        Phase("plain", "azure_conv", 120),
        Phase("decode", "azure_conv", 120, rate=4.0, min_ratio=0.5),
        Phase("prefill", "azure_conv", 120, max_ratio=0.05),
        Phase("band", "azure_conv", 120, rate=4.0, min_ratio=0.2, max_ratio=0.3),
    ]
    rows = shift_trace.build_shift_rows(phases)
    by = {p.name: [r for r in rows if r.phase == p.name] for p in phases}
    assert all(len(v) > 20 for v in by.values()), {k: len(v) for k, v in by.items()}

    def ratio(r):
        return r.num_decode_tokens / r.num_prefill_tokens

    assert all(ratio(r) >= 0.5 for r in by["decode"])
    assert all(ratio(r) <= 0.05 for r in by["prefill"])
    assert all(0.2 <= ratio(r) <= 0.3 for r in by["band"])
    plain = [ratio(r) for r in by["plain"]]  # unfiltered: both sides occur
    assert min(plain) < 0.05 and max(plain) > 0.5


def test_the_shipped_trace_loads_by_name_and_reads_back_its_phases(monkeypatch):
    monkeypatch.delenv("PDSERVE_TRACES_DIR", raising=False)
    assert SHIPPED in workload.TRACES
    path = workload.resolve_trace(SHIPPED)
    assert path.parent == workload.BUNDLED_TRACES_DIR and path.stat().st_size < 1_000_000
    reqs = workload.load_trace(SHIPPED)
    bounds = shift_trace.phase_boundaries(SHIPPED)
    assert [(n, s, e) for n, s, e in bounds[:2]] == [
        ("prefill_heavy", 0.0, 600.0),
        ("balanced", 600.0, 1200.0),
    ]
    assert bounds[2][:2] == ("decode_heavy", 1200.0) and 1790 < bounds[2][2] < 1800
    parts = shift_trace.split_by_phase(reqs, bounds)
    assert {k: len(v) for k, v in parts.items()} == {  # traces/README.md
        "prefill_heavy": 1482,
        "balanced": 2867,
        "decode_heavy": 2989,
    }
    assert all(r.output_len / r.prompt_len >= 0.4 for r in parts["decode_heavy"])
    medians = [sorted(r.output_len / r.prompt_len for r in v)[len(v) // 2] for v in parts.values()]
    assert medians == sorted(medians)  # prefill-heavy, then balanced, then decode-heavy
    scaled = workload.load_trace(SHIPPED, scale=0.1, max_prompt=512, max_output=64)
    assert len(scaled) == len(reqs) and max(r.prompt_len for r in scaled) == 512


def test_the_readme_command_rebuilds_the_shipped_trace_byte_for_byte(tmp_path, capsys):
    readme = (workload.BUNDLED_TRACES_DIR / "README.md").read_text()
    block = re.search(r"```bash\n(python -m pdserve\.tuning\.shift_trace .*?)```", readme, re.S)
    assert block, "traces/README.md has no shift_trace command"
    argv = shlex.split(block.group(1).replace("\\\n", " "))[3:]
    out = argv.index("--out")
    assert argv[out + 1] == f"tuning/traces/{SHIPPED}.csv"
    argv[out + 1] = str(tmp_path / "rebuilt.csv")
    assert shift_trace.main(argv) == 0
    rebuilt = (tmp_path / "rebuilt.csv").read_bytes()
    assert rebuilt == workload.resolve_trace(SHIPPED).read_bytes()
    printed = capsys.readouterr().out
    assert re.search(r"decode_heavy\s+1200\.0\s+1800\.0\s+2989\s", printed), printed


def test_bad_phases_are_refused_with_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="phase nope: unknown trace 'no_such_trace'"):
        shift_trace.build_shift_rows([Phase("nope", "no_such_trace", 60)])
    with pytest.raises(ValueError, match="duration must be > 0 s, got 0.0"):
        shift_trace.parse_phase("a=azure_conv:0")
    with pytest.raises(ValueError, match="rate must be > 0 req/s"):
        Phase("a", "azure_conv", 60, rate=0)
    with pytest.raises(ValueError, match="min_ratio 2 is above max_ratio 1"):
        Phase("a", "azure_conv", 60, min_ratio=2, max_ratio=1)
    with pytest.raises(ValueError, match="phase names must differ: a repeated"):
        shift_trace.build_shift_rows([Phase("a", "azure_conv", 60), Phase("a", "azure_code", 60)])
    for text in ("azure_conv:60", "a=azure_conv", "a=azure_conv:ten", "a=:60"):
        with pytest.raises(ValueError, match=re.escape("write NAME=SOURCE:SECONDS[:RATE]")):
            shift_trace.parse_phase(text)
    with pytest.raises(ValueError, match="shorten the phase, start it earlier or give it a rate"):
        shift_trace.build_shift_rows([Phase("long", "azure_code", 3600)])
    with pytest.raises(ValueError, match="keeps no request: widen the filter"):
        shift_trace.build_shift_rows([Phase("f", "azure_code", 60, rate=1, min_ratio=1000)])
    src = _user_csv(tmp_path / "mine.csv", n=10)
    with pytest.raises(ValueError, match="before the phase's start 50"):
        shift_trace.build_shift_rows([Phase("late", src, 5, rate=1, start_s=50)])
    with pytest.raises(ValueError, match="not a shift trace"):
        shift_trace.phase_boundaries("azure_code")


def test_parse_phase_reads_rate_and_paths_with_colons():
    assert shift_trace.parse_phase("d=azure_conv:600:5") == Phase("d", "azure_conv", 600, 5.0)
    assert shift_trace.parse_phase("d=azure_conv:90") == Phase("d", "azure_conv", 90)
    assert shift_trace.parse_phase("d=C:/t.csv:90") == Phase("d", "C:/t.csv", 90)


def test_the_command_line_refuses_bad_arguments(tmp_path, capsys):
    out = str(tmp_path / "x.csv")
    with pytest.raises(SystemExit) as e:
        shift_trace.main(["--phase", "a=azure_conv", "--out", out])
    assert e.value.code == 2
    assert "write NAME=SOURCE:SECONDS[:RATE]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        shift_trace.main(["--phase", "a=azure_conv:60", "--filter", "a=high", "--out", out])
    assert "--filter 'a=high': write NAME=MIN[:MAX]" in capsys.readouterr().err
    code = shift_trace.main(["--phase", "a=azure_conv:60", "--filter", "b=0.5", "--out", out])
    assert code == 2 and "no phase is named 'b' (phases: a)" in capsys.readouterr().err
    code = shift_trace.main(["--phase", "a=missing.csv:60", "--out", out])
    assert code == 2 and "phase a: unknown trace 'missing.csv'" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()
    code = shift_trace.main(
        ["--phase", "a=azure_conv:60", "--start", "a=100", "--filter", "a=:0.1", "--out", out]
    )
    assert code == 0
    rows = shift_trace.phase_boundaries(out)
    assert rows[0][:2] == ("a", 0.0) and rows[0][2] < 60
