"""What `pdserve tune` prints and plots: the ranked table of placements (with each row's basis,
simulated or estimated, and the seeded goodput bands' p10/p50/p90), the table of one worker of
each kind alone, and the PNG of the candidates and their attainment against the request rate."""

from __future__ import annotations

import math

from pdserve.tuning.tuner import Candidate, Search


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isinf(x) else f"{x * 1e3:.0f}"


def seeded_percentiles(values: list[float]) -> tuple[float, float, float]:
    """p10, p50, p90 (numpy's linear interpolation)."""
    import numpy as np

    return tuple(float(x) for x in np.quantile(values, [0.1, 0.5, 0.9]))


def basis(c: Candidate) -> str:
    """'simulated' when the row's goodput comes from simulating the whole deployment (or, for
    colocated workers that do not slow each other, n x one simulated worker), else 'estimated'."""
    return "simulated" if c.goodput is not None or c.status == "dropped" else "estimated"


BASIS_NOTE = (
    "* basis: 'simulated' rows were run whole through the simulator (a request trace through every "
    "worker's scheduler, the KV hand-offs and the SLO; colocated workers that do not slow each "
    "other: one worker, times n), 'estimated' rows only sized from one "
    "worker of each kind alone (min(prefill replicas x one prefill worker, decode replicas x one "
    "decode worker)): an estimate ignores how the pools interact and may be optimistic"
)


def table(cands: list[Candidate], top: int, unit: str) -> str:
    seeded = any(c.seeded for c in cands[:top])
    rows = [
        f"{'#':>3}  {'placement':<26} {unit + 's':>5} {'estimate':>9} {'simulated':>9} "
        f"{'per ' + unit:>9} {'TTFT p90':>9} {'TPOT p90':>9}  "
        + (f"{'seeded p10/p50/p90':>20}  " if seeded else "")
        + f"{'basis*':<9}  status"
    ]
    for i, c in enumerate(cands[:top], 1):
        sim = "-" if c.goodput is None or c.status in ("no-rate", "dropped") else f"{c.goodput:.3g}"
        per = f"{c.per_device:.3g}" if c.status not in ("no-rate", "dropped") else "-"
        band = "/".join(f"{x:.3g}" for x in seeded_percentiles(c.seeded)) if c.seeded else "-"
        rows.append(
            f"{i:>3}  {c.placement.label():<26} {c.placement.num_devices:>5} {c.estimate:>9.3g} "
            f"{sim:>9} {per:>9} {_ms(c.ttft_p90_s):>9} {_ms(c.tpot_p90_s):>9}  "
            + (f"{band:>20}  " if seeded else "")
            + f"{basis(c):<9}  {c.status}"
        )
    if len(cands) > top:
        rows.append(f"     ... {len(cands) - top} more")
    return "\n".join(rows)


def instances_table(search: Search, unit: str) -> str:
    rows = []
    for (kind, tp), inst in sorted(search.instances.items()):
        at_least = ">=" if inst.capped else "  "
        rows.append(
            f"  {kind:<9} tp{tp}: {at_least}{inst.goodput:8.3g} req/s ({inst.goodput / tp:.3g} per "
            f"{unit}; {len(inst.trials)} trials, {inst.num_requests} requests at the goodput)"
        )
    return "\n".join(rows)


def plot(
    path: str,
    cands: list[Candidate],
    unit: str,
    title: str,
    attainment: float,
    objective: str = "per-device",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [c for c in cands if c.status not in ("no-rate", "dropped")][:25]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6))
    for i, c in enumerate(shown):
        color = "tab:green" if c.placement.colocated else "tab:blue"
        simulated = c.status.startswith("simulated")
        ax1.barh(
            i,
            c.score if objective == "total" else c.per_device,
            color=color if simulated else "white",
            edgecolor=color,
            hatch=None if simulated else "//",
        )
    ax1.set_yticks(range(len(shown)), [c.placement.label() for c in shown], fontsize=8)
    ax1.invert_yaxis()
    what = "goodput" if objective == "total" else f"goodput per {unit}"
    ax1.set_xlabel(f"{what} (req/s)  [blue: disaggregated, green: colocated]")
    ax1.set_title("candidates, best first (solid: simulated whole; hatched: estimate)")
    for c in [c for c in shown if c.trials][:6]:
        pts = sorted(c.trials)
        ax2.plot([r for r, _ in pts], [a for _, a in pts], marker="o", label=c.placement.label())
    ax2.axhline(attainment, color="gray", linestyle="--", linewidth=1)
    ax2.set_xscale("log")
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("SLO attainment (simulated; early-stopped runs: at most)")
    ax2.set_ylim(-0.02, 1.02)
    ax2.legend(fontsize=8)
    ax2.set_title("attainment vs rate, top candidates")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
