"""The SLO `pdserve tune` searches for (TTFT, TPOT and the share of requests that must meet both),
its --slo parser, and TuneError, the error of a bad `pdserve tune` argument."""

from __future__ import annotations

import re
from dataclasses import dataclass


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
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s)\s*", text)
    if not m:
        raise TuneError(
            f"--slo {key}={text!r}: give a number with a unit, ms or s "
            f"(e.g. {key}=200ms or {key}=0.2s)"
        )
    value = float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)
    if value <= 0:
        raise TuneError(f"--slo {key}: must be > 0, got {text!r}")
    return value


def parse_slo(text: str) -> SLO:
    """'ttft=200ms,tpot=50ms,attainment=0.9' (attainment optional, also as 90%)."""
    parts = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "attainment"):
            raise TuneError(
                f"--slo: {item!r} is not one of ttft=..., tpot=..., attainment=... "
                f"(e.g. ttft=200ms,tpot=50ms,attainment=0.9)"
            )
        parts[key] = value.strip()
    missing = [k for k in ("ttft", "tpot") if k not in parts]
    if missing:
        raise TuneError(
            f"--slo: {' and '.join(missing)} missing (e.g. ttft=200ms,tpot=50ms,attainment=0.9)"
        )
    att = parts.get("attainment", "0.9")
    try:
        attainment = float(att[:-1]) / 100 if att.endswith("%") else float(att)
    except ValueError:
        raise TuneError(
            f"--slo attainment={att!r}: a fraction in (0, 1], e.g. 0.9 or 90%"
        ) from None
    if not 0 < attainment <= 1:
        raise TuneError(f"--slo attainment={att!r}: a fraction in (0, 1], e.g. 0.9 or 90%")
    return SLO(_duration("ttft", parts["ttft"]), _duration("tpot", parts["tpot"]), attainment)
