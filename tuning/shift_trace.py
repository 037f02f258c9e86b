"""Workload-shift traces: request traces whose mix changes over time, built from phases.

This module owns the shift-trace format and the tools that make and read it. A phase takes
requests from one source trace (a bundled trace name such as `azure_code`, or a path to a user's
.csv or Mooncake-style .jsonl, gzip-compressed or not) for a fixed number of seconds. A phase
either keeps the source's own arrival times from a window of it, or draws the source's requests in
order and gives them Poisson arrivals at a rate of its own. An optional filter on the
output-to-input token ratio makes a phase lean one way (for example decode-heavy). The phases are
laid end to end in time, and the result is a CSV with the columns
arrived_at,num_prefill_tokens,num_decode_tokens,phase.

`workload.load_trace` reads such a file like any other trace (it ignores the phase column), so the
simulator, the tuner and the load generator take it by name or path. `phase_boundaries` reads
back each phase's name, start and end, so a planner that moves the prefill:decode split can be
compared with the best static split per phase. `python -m pdserve.tuning.shift_trace --help`
builds one from the command line; `add_arguments` and `run` serve a `pdserve` subcommand too.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import math
import pathlib
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.tuning.workload import RequestSpec, arrivals, load_trace, resolve_trace

COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens", "phase")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Phase:
    """One phase of a shift trace.

    `rate` None keeps the source's arrival times: the phase is the window of `duration_s` seconds
    that opens at the source's first request (after the filter) at or after `start_s`. With a
    rate, the phase takes the source's requests in arrival order from `start_s` on (after the
    filter, wrapping round to the source's beginning if it runs out) and gives them Poisson
    arrivals at `rate` requests per second. The filter keeps the rows whose
    num_decode_tokens / num_prefill_tokens lies in [min_ratio, max_ratio]; None leaves that side
    open. Lengths are kept as the source has them, except that each is at least 1 token.
    """

    name: str
    source: str
    duration_s: float
    rate: float | None = None
    start_s: float = 0.0
    min_ratio: float | None = None
    max_ratio: float | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"phase name {self.name!r}: use letters, digits, '_', '.' or '-' only")
        if not self.source:
            raise ValueError(f"phase {self.name}: name a source trace")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"phase {self.name}: duration must be > 0 s, got {self.duration_s}")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"phase {self.name}: rate must be > 0 req/s, got {self.rate}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"phase {self.name}: start must be >= 0 s, got {self.start_s}")
        for side, value in (("min_ratio", self.min_ratio), ("max_ratio", self.max_ratio)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"phase {self.name}: {side} must be >= 0, got {value}")
        if (
            self.min_ratio is not None
            and self.max_ratio is not None
            and self.min_ratio > self.max_ratio
        ):
            raise ValueError(
                f"phase {self.name}: min_ratio {self.min_ratio} is above max_ratio {self.max_ratio}"
            )

    def keeps(self, prompt_len: int, output_len: int) -> bool:
        """Whether the filter keeps a request of these lengths (output / input ratio in range)."""
        ratio = output_len / prompt_len
        if self.min_ratio is not None and ratio < self.min_ratio:
            return False
        return self.max_ratio is None or ratio <= self.max_ratio


class ShiftRow(NamedTuple):
    arrived_at: float  # seconds from the start of the shift trace
    num_prefill_tokens: int
    num_decode_tokens: int
    phase: str


def build_shift_rows(phases: Sequence[Phase], seed: int = 0) -> list[ShiftRow]:
    """The shift trace's rows, phase after phase: phase i runs from the sum of the durations
    before it, and its first request arrives exactly at that start. Mooncake prefix ids are not
    kept (the CSV has no column for them). `seed` seeds the arrivals of phases with a rate."""
    if not phases:
        raise ValueError("a shift trace needs at least one phase")
    names = [p.name for p in phases]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"phase names must differ: {', '.join(repeated)} repeated")
    sources: dict[str, list[RequestSpec]] = {}
    rows: list[ShiftRow] = []
    offset = 0.0
    for i, phase in enumerate(phases):
        if phase.source not in sources:
            try:
                sources[phase.source] = load_trace(phase.source)
            except ValueError as e:
                raise ValueError(f"phase {phase.name}: {e}") from None
        times_lengths = _phase_requests(phase, sources[phase.source], seed + i)
        end = offset + phase.duration_s
        for rel, prompt, output in times_lengths:
            t = round(offset + rel, 6)
            if t < end:  # rounding never pushes a request into the next phase
                rows.append(ShiftRow(t, prompt, output, phase.name))
        offset = end
    return rows


def _phase_requests(
    phase: Phase, source: list[RequestSpec], seed: int
) -> list[tuple[float, int, int]]:
    """(seconds from the phase's start, prompt, output) for each request of the phase."""
    what = f"phase {phase.name}: {phase.source}"
    if phase.start_s > source[-1].arrival_s:
        raise ValueError(
            f"{what} ends at {source[-1].arrival_s:.1f} s, before the phase's start "
            f"{phase.start_s} s"
        )
    if phase.min_ratio is not None or phase.max_ratio is not None:
        what += f" filtered to output/input in [{phase.min_ratio or 0}, {phase.max_ratio or 'inf'}]"
    kept = [r for r in source if phase.keeps(r.prompt_len, r.output_len)]
    if phase.rate is None:
        window = [r for r in kept if r.arrival_s >= phase.start_s]
        if not window:
            raise ValueError(f"{what} has no request from {phase.start_s} s on")
        t0 = window[0].arrival_s
        last = source[-1].arrival_s
        if t0 + phase.duration_s > last:
            raise ValueError(
                f"{what} holds requests up to {last - t0:.1f} s after {t0:.1f} s only, not "
                f"{phase.duration_s} s: shorten the phase, start it earlier or give it a rate"
            )
        return [
            (r.arrival_s - t0, r.prompt_len, r.output_len)
            for r in window
            if r.arrival_s < t0 + phase.duration_s
        ]
    if not kept:
        raise ValueError(f"{what} keeps no request: widen the filter")
    first = next((i for i, r in enumerate(kept) if r.arrival_s >= phase.start_s), 0)
    pool = kept[first:] + kept[:first]  # from start_s on, then round to the beginning
    times = _arrivals_within(phase.duration_s, phase.rate, seed)
    return [
        (t, pool[i % len(pool)].prompt_len, pool[i % len(pool)].output_len)
        for i, t in enumerate(times)
    ]


def _arrivals_within(duration_s: float, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` from 0 up to (not including) `duration_s`; the first is at 0."""
    n = max(16, math.ceil(duration_s * rate * 1.2) + 16)
    while True:
        times = arrivals(n, rate, seed=seed)  # same seed: a longer run extends the same sequence
        if times[-1] >= duration_s:
            return [t for t in times if t < duration_s]
        n *= 2


def write_shift_trace(rows: Sequence[ShiftRow], path: str | pathlib.Path) -> pathlib.Path:
    """Write the rows as a shift-trace CSV (header arrived_at,num_prefill_tokens,
    num_decode_tokens,phase); return the path."""
    path = pathlib.Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow(
                (repr(r.arrived_at), r.num_prefill_tokens, r.num_decode_tokens, r.phase)
            )
    return path


def phase_boundaries(name_or_path: str | pathlib.Path) -> list[tuple[str, float, float]]:
    """(name, start_s, end_s) of each phase of a shift trace (a trace name or a path), in order.

    A phase starts at its first request (the builder puts one exactly at each phase's start) and
    ends where the next one starts. The last phase ends at its last request: the file holds
    arrivals only, so a quiet tail after the last one cannot be told from the file. Times are as
    in the file, which is what `load_trace` returns with its default `start_s`."""
    path = resolve_trace(str(name_or_path))
    spans: list[list] = []  # [name, first arrival, last arrival]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        reader = csv.DictReader(f)
        if "phase" not in (reader.fieldnames or ()):
            raise ValueError(f"{path}: not a shift trace (no 'phase' column)")
        for line, r in enumerate(reader, start=2):
            try:
                t = float(r["arrived_at"])
            except (TypeError, ValueError):
                raise ValueError(
                    f"{path}:{line}: arrived_at {r['arrived_at']!r} is not a number"
                ) from None
            name = r["phase"]
            if spans and spans[-1][0] == name:
                if t < spans[-1][2]:
                    raise ValueError(f"{path}:{line}: arrivals go back in time")
                spans[-1][2] = t
                continue
            if any(s[0] == name for s in spans):
                raise ValueError(f"{path}:{line}: phase {name!r} comes back after another phase")
            if spans and t < spans[-1][2]:
                raise ValueError(f"{path}:{line}: phase {name!r} starts before the last one ends")
            spans.append([name, t, t])
    if not spans:
        raise ValueError(f"{path}: no requests")
    ends = [s[1] for s in spans[1:]] + [spans[-1][2]]
    return [(name, start, end) for (name, start, _), end in zip(spans, ends)]


def split_by_phase(
    requests: Sequence[RequestSpec], boundaries: Sequence[tuple[str, float, float]]
) -> dict[str, list[RequestSpec]]:
    """The requests of each phase (in phase order), by arrival: phase i holds [start_i, end_i),
    the last one its end too. `requests` are `load_trace` of the shift trace with start_s=0."""
    out: dict[str, list[RequestSpec]] = {name: [] for name, _, _ in boundaries}
    starts = [start for _, start, _ in boundaries]
    for r in requests:
        i = next((j for j in range(len(starts) - 1, -1, -1) if r.arrival_s >= starts[j]), None)
        if i is None or (i == len(starts) - 1 and r.arrival_s > boundaries[-1][2]):
            raise ValueError(f"a request at {r.arrival_s} s lies outside every phase")
        out[boundaries[i][0]].append(r)
    return out


def phase_stats(rows: Sequence[ShiftRow]) -> list[dict]:
    """Per phase, in order: requests, median prompt and output tokens, mean rate (req/s over
    the phase's span as `phase_boundaries` reads it back)."""
    spans = {name: (start, end) for name, start, end in _boundaries_of(rows)}
    out = []
    for name, (start, end) in spans.items():
        mine = [r for r in rows if r.phase == name]
        out.append(
            {
                "phase": name,
                "start_s": start,
                "end_s": end,
                "requests": len(mine),
                "median_prompt": statistics.median(r.num_prefill_tokens for r in mine),
                "median_output": statistics.median(r.num_decode_tokens for r in mine),
                "rate": len(mine) / (end - start) if end > start else float("nan"),
            }
        )
    return out


def _boundaries_of(rows: Sequence[ShiftRow]) -> list[tuple[str, float, float]]:
    firsts: dict[str, float] = {}
    for r in rows:
        firsts.setdefault(r.phase, r.arrived_at)
    names = list(firsts)
    ends = [firsts[n] for n in names[1:]] + ([rows[-1].arrived_at] if rows else [])
    return [(n, firsts[n], e) for n, e in zip(names, ends)]


# ---------------------------------------------------------------------------------------------
# Command line


def parse_phase(text: str) -> Phase:
    """NAME=SOURCE:SECONDS[:RATE] as a Phase (no window start, no filter)."""
    usage = (
        f"--phase {text!r}: write NAME=SOURCE:SECONDS[:RATE], e.g. prefill=azure_code:600 "
        f"or decode=azure_conv:600:5"
    )
    name, eq, rest = text.partition("=")
    if not eq or not name or not rest:
        raise ValueError(usage)
    parts = rest.rsplit(":", 2)
    try:
        if len(parts) == 3 and _is_number(parts[1]):
            source, seconds, rate = parts[0], float(parts[1]), float(parts[2])
        else:
            source, _, last = rest.rpartition(":")
            seconds, rate = float(last), None
    except ValueError:
        raise ValueError(usage) from None
    if not source:
        raise ValueError(usage)
    return Phase(name, source, seconds, rate)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _named_value(option: str, text: str, example: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name or not value:
        raise ValueError(f"{option} {text!r}: write {example}")
    return name, value


def _phase_arg(text: str) -> Phase:
    try:
        return parse_phase(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _filter_arg(text: str) -> tuple[str, float | None, float | None]:
    example = "NAME=MIN[:MAX] (output/input ratio), e.g. decode=0.4 or prefill=:0.05"
    try:
        name, value = _named_value("--filter", text, example)
        low, _, high = value.partition(":")
        bounds = (float(low) if low else None, float(high) if high else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--filter {text!r}: write {example}") from None
    if bounds == (None, None):
        raise argparse.ArgumentTypeError(f"--filter {text!r}: give a MIN, a MAX or both")
    return (name, *bounds)


def _start_arg(text: str) -> tuple[str, float]:
    example = "NAME=SECONDS, e.g. decode=600"
    try:
        name, value = _named_value("--start", text, example)
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--start {text!r}: write {example}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shift-trace options, for `python -m pdserve.tuning.shift_trace` or a subcommand."""
    parser.add_argument(
        "--phase",
        action="append",
        type=_phase_arg,
        required=True,
        metavar="NAME=SOURCE:SECONDS[:RATE]",
        help="a phase, repeated in time order. SOURCE is a bundled trace (azure_code, azure_conv, "
        "mooncake_synthetic) or a path to a .csv (arrived_at,num_prefill_tokens,"
        "num_decode_tokens) or Mooncake .jsonl, optionally .gz. Without RATE the phase keeps the "
        "source's arrival times over a SECONDS-long window; with RATE (req/s) it takes the "
        "source's requests in order and gives them Poisson arrivals",
    )
    parser.add_argument(
        "--filter",
        action="append",
        type=_filter_arg,
        default=[],
        metavar="NAME=MIN[:MAX]",
        help="keep only the rows of phase NAME whose output/input token ratio is >= MIN and "
        "<= MAX (either may be empty), e.g. decode=0.4 for a decode-heavy phase",
    )
    parser.add_argument(
        "--start",
        action="append",
        type=_start_arg,
        default=[],
        metavar="NAME=SECONDS",
        help="where in its source phase NAME begins (default 0: the source's first request)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the arrivals of phases with a RATE"
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="the CSV to write")


def phases_from_args(args: argparse.Namespace) -> list[Phase]:
    """The --phase list with its --start and --filter options applied."""
    phases = {p.name: p for p in args.phase}
    if len(phases) != len(args.phase):
        names = [p.name for p in args.phase]
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"--phase: names must differ, {', '.join(repeated)} repeated")
    fields: dict[str, dict] = {name: {} for name in phases}
    for option, items in (("--filter", args.filter), ("--start", args.start)):
        for name, *values in items:
            if name not in phases:
                raise ValueError(
                    f"{option} {name}=...: no phase is named {name!r} (phases: {', '.join(phases)})"
                )
            if option == "--filter":
                fields[name].update(min_ratio=values[0], max_ratio=values[1])
            else:
                fields[name].update(start_s=values[0])
    out = []
    for name, phase in phases.items():
        p = fields[name]
        out.append(Phase(phase.name, phase.source, phase.duration_s, phase.rate, **p))
    return out


def run(args: argparse.Namespace) -> int:
    """Build and write the shift trace the arguments describe; print each phase's stats."""
    try:
        rows = build_shift_rows(phases_from_args(args), seed=args.seed)
        path = write_shift_trace(rows, args.out)
    except (ValueError, OSError) as e:
        print(f"shift trace: {e}", file=sys.stderr)
        return 2
    print(f"{path}: {len(rows)} requests")
    print("phase               start_s    end_s  requests  median_in  median_out  req/s")
    for s in phase_stats(rows):
        print(
            f"{s['phase']:<18} {s['start_s']:8.1f} {s['end_s']:8.1f} {s['requests']:9d} "
            f"{s['median_prompt']:10g} {s['median_output']:11g} {s['rate']:6.2f}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.tuning.shift_trace",
        description="Build a workload-shift trace from phases laid end to end in time.",
        epilog="example: --phase prefill=azure_code:600 --phase balanced=azure_conv:600 "
        "--phase decode=azure_conv:600:5 --start decode=600 --filter decode=0.4 "
        "--out shift.csv",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
