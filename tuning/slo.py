"""The SLOs `pdserve tune` searches for and `pdserve bench` measures against: one --slo grammar
for both, the SLO the tuner takes, and TuneError, the error of a bad `pdserve tune` argument.

    ttft=200ms,tpot=50ms,attainment=0.9      (also e2e=..., attainment as 90%)

Items are NAME=VALUE, comma-separated, in any order and case, each name at most once: ttft, tpot
and e2e are durations with a unit (ms or s) and must be > 0, attainment a fraction in (0, 1] or a
percentage. `parse_slo_items` reads the grammar; `parse_slo` is the tuner's reading (ttft and
tpot required, e2e not searched for, attainment 0.9 unless given) and `latency_slos` bench's
(the durations given, attainment taken from its own --attainment). Pure functions: a bad string
raises TuneError (a ValueError) whose message says what to write instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DURATIONS = ("ttft", "tpot", "e2e")
KEYS = (*DURATIONS, "attainment")
_ITEM = re.compile(r"\s*([a-z0-9_]+)\s*=\s*(.*?)\s*", re.I)
_DURATION = re.compile(r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(ms|s)?", re.I)
_EXAMPLE = "e.g. ttft=200ms,tpot=50ms,attainment=0.9"


class TuneError(ValueError):
    """A bad argument; the message says what to change."""


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def describe(self) -> str:
        return (
            f"TTFT <= {self.ttft_s * 1e3:g} ms and TPOT <= {self.tpot_s * 1e3:g} ms "
            f"for {self.attainment:.0%} of requests"
        )


def _duration(key: str, text: str) -> float:
    m = _DURATION.fullmatch(text)
    if not m:
        raise TuneError(
            f"SLO {key}={text!r}: expected NAME=VALUE, a number with a unit, ms or s "
            f"(e.g. {key}=200ms or {key}=0.2s)"
        )
    if m.group(2) is None:
        raise TuneError(
            f"SLO {key}={text!r} has no unit: give a number with a unit, ms or s "
            f"(e.g. {key}={m.group(1)}ms or {key}={m.group(1)}s)"
        )
    value = float(m.group(1))
    if not value > 0:
        raise TuneError(f"SLO {key}={text!r} must be > 0")
    return value / 1000.0 if m.group(2).lower() == "ms" else value


def _attainment(text: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise TuneError(f"SLO attainment={text!r}: a fraction in (0, 1], e.g. 0.9 or 90%")
    return value


def parse_slo_items(text: str) -> dict[str, float]:
    """The items of an --slo string: durations in seconds, attainment as a fraction."""
    items: dict[str, float] = {}
    for item in filter(str.strip, text.split(",")):
        m = _ITEM.fullmatch(item)
        if not m:
            raise TuneError(f"SLO {item.strip()!r}: expected NAME=VALUE ({_EXAMPLE})")
        name, value = m.group(1).lower(), m.group(2)
        if name not in KEYS:
            raise TuneError(f"SLO {item.strip()!r}: unknown metric {name!r}; use {', '.join(KEYS)}")
        if name in items:
            raise TuneError(f"SLO {name} given twice in {text!r}")
        items[name] = _attainment(value) if name == "attainment" else _duration(name, value)
    return items


def parse_slo(text: str) -> SLO:
    """`pdserve tune`'s SLO: ttft and tpot required, attainment 0.9 unless given."""
    items = parse_slo_items(text)
    missing = [k for k in ("ttft", "tpot") if k not in items]
    if missing:
        raise TuneError(f"--slo: {' and '.join(missing)} missing ({_EXAMPLE})")
    if "e2e" in items:
        raise TuneError("--slo: pdserve tune searches for TTFT and TPOT; it takes no e2e SLO")
    return SLO(items["ttft"], items["tpot"], items.get("attainment", 0.9))


def latency_slos(text: str) -> dict[str, float]:
    """`pdserve bench`'s SLOs: {"ttft": 0.5, "tpot": 0.1} (seconds) for "ttft=500ms,tpot=0.1s";
    at least one. bench's share to meet them is its own --attainment."""
    items = parse_slo_items(text)
    if "attainment" in items:
        raise TuneError(
            f"SLO attainment in {text!r}: pdserve bench takes the share as --attainment"
        )
    if not items:
        raise TuneError(f"no SLO in {text!r}: expected e.g. ttft=500ms,tpot=100ms")
    return items
