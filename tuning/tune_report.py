"""What `pdserve tune` prints and plots: the ranked table of placements (with each row's basis,
simulated or estimated, and the seeded goodput bands' p10/p50/p90), the table of one worker of
each kind alone, the notes on whether the prefill pool runs in pipeline stages and why
(`pp_notes`), and the PNG of the candidates and their attainment against the request rate."""

from __future__ import annotations

import math

from pdserve.tuning.perf_model import Profile
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
    for (kind, tp, pp), inst in sorted(search.instances.items()):
        at_least = ">=" if inst.capped else "  "
        shape = f"tp{tp}" + (f" pp{pp}" if pp > 1 else "")
        rows.append(
            f"  {kind:<9} {shape + ':':<10} {at_least}{inst.goodput:8.3g} req/s "
            f"({inst.goodput / (tp * pp):.3g} per "
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


# ---- pipeline stages ----------------------------------------------------------------------------
def _step_ms(profile: Profile, tp: int, pp: int, tokens: int) -> float:
    """One prefill step of one `tokens`-token prompt, in ms, for a worker of tp x pp ranks."""
    return profile.placed_step_model(tp, pp, "prefill").prefill_time(tokens, tokens * tokens) * 1e3


def _nodes(profile: Profile, ranks: int, unit: str) -> str:
    n = profile.nodes_spanned(ranks)
    if n == 1:
        return "stays on one node"
    return f"would span {n} nodes of {profile.devices_per_node} {unit}s"


def pp_notes(
    profile: Profile,
    cands: list[Candidate],
    best: Candidate,
    *,
    tokens: int,
    num_devices: int,
    min_kv_tokens: int,
    unit: str,
) -> list[str]:
    """Whether the best placement runs its prefill pool in pipeline stages, and why (or why
    not), priced for one step of a `tokens`-token prompt: the stages take turns (no
    micro-batching), so stages pay off only where one stage's weights leave no room for KV and a
    TP group over as many devices would pay its all-reduces across nodes."""
    pl = best.placement
    if pl.colocated:
        return [
            "prefill pp: colocated workers run one stage (a decode step in stages pays every "
            "stage per token)"
        ]
    tp, pp = pl.prefill.tp, pl.prefill.pp
    nodes = (
        f"{profile.devices_per_node} {unit}s a node"
        if profile.devices_per_node
        else "every device on one node (the profile gives no hardware.devices_per_node)"
    )
    notes = [f"prefill pp ({nodes}; a {tokens}-token prompt's prefill step, no micro-batching):"]
    if pp > 1:
        return notes + _staged(profile, tp, pp, tokens, min_kv_tokens, unit)
    return notes + _one_stage(profile, cands, tp, tokens, num_devices, min_kv_tokens, unit)


def _staged(
    profile: Profile, tp: int, pp: int, tokens: int, min_kv_tokens: int, unit: str
) -> list[str]:
    """Why the best runs its prefill workers in pp stages of tp: what they cost and hold, and
    what one TP group over as many devices would cost."""
    staged, one = _step_ms(profile, tp, pp, tokens), profile.kv_capacity(tp, 1)
    c = profile.pp_costs(tp, pp)
    why = [
        f"  prefill pp {pp} x tp {tp} chosen: {pp} stages of tp {tp} cost {staged:.1f} ms a "
        f"step ({c.handoff_s(tokens) * 1e3:.2f} ms of it hand-offs, {c.node_crossings} of "
        f"{pp - 1} between nodes) and hold {profile.kv_capacity(tp, pp)} KV tokens, where "
        f"tp {tp} in one stage holds {one}"
        + (f" (the longest prompt is {min_kv_tokens})" if one < min_kv_tokens else "")
    ]
    wide = tp * pp
    if wide in profile.tp:
        ar = profile.pp_costs(wide, 1).allreduce_s(tokens) * 1e3
        why.append(
            f"  a tp {wide} group {_nodes(profile, wide, unit)}"
            + (f"; its all-reduces over the inter-node link cost {ar:.1f} ms a step" if ar else "")
            + f": its step costs {_step_ms(profile, wide, 1, tokens):.1f} ms"
        )
    else:
        why.append(f"  the profile has no tp {wide} (TP must divide the model's KV heads)")
    return why


def _one_stage(
    profile: Profile,
    cands: list[Candidate],
    tp: int,
    tokens: int,
    num_devices: int,
    min_kv_tokens: int,
    unit: str,
) -> list[str]:
    """Why the best runs its prefill workers of tp in one stage: for each TP degree searched,
    whether stages were searched and what they would cost."""
    from pdserve.tuning.tuner import pp_degrees, pp_dominated

    rows = []
    for t in sorted({tp} | {c.placement.prefill.tp for c in cands if c.placement.prefill}):
        for k in pp_degrees(profile, t, num_devices)[1:2]:  # pp 2 says it for all
            if profile.kv_capacity(t, k) <= 0:
                continue
            one, staged = _step_ms(profile, t, 1, tokens), _step_ms(profile, t, k, tokens)
            if pp_dominated(profile, t, k, min_kv_tokens):
                rows.append(
                    f"  tp {t}: not searched in stages: one stage holds "
                    f"{profile.kv_capacity(t, 1)} KV tokens (the longest prompt is "
                    f"{min_kv_tokens}), so {k} workers of tp {t} serve {k} prompts at a time on "
                    f"the devices of one in {k} stages, whose step costs {staged:.1f} ms against "
                    f"{one:.1f} ms"
                )
            else:
                ranked = [
                    c
                    for c in cands
                    if c.placement.prefill
                    and (c.placement.prefill.tp, c.placement.prefill.pp) == (t, k)
                ]
                rows.append(
                    f"  tp {t} pp {k}: searched ({len(ranked)} placement"
                    f"{'s' if len(ranked) != 1 else ''}; one stage of tp {t} "
                    f"holds {profile.kv_capacity(t, 1)} KV tokens, {k} stages "
                    f"{profile.kv_capacity(t, k)}; a step costs {staged:.1f} ms), not the best"
                )
    ar = profile.pp_costs(tp, 1).allreduce_s(tokens) * 1e3
    chosen = (
        f"  not chosen: the best runs prefill tp {tp} in one stage, which "
        f"{_nodes(profile, tp, unit)}"
        + (f" (its all-reduces over the inter-node link cost {ar:.1f} ms a step)" if ar else "")
        + f": its step costs {_step_ms(profile, tp, 1, tokens):.1f} ms"
    )
    return [chosen] + rows
