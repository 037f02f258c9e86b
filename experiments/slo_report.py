"""The report of experiments/slo_validation.py: the measured rows of each sweep file, their comparison
with every simulation, the repeated-measurement table, the plots (attainment against rate, measured
and simulated; TTFT and TPOT CDFs) and the printed summary."""

from __future__ import annotations

import json
import math

import numpy as np

from experiments.slo_simulate import PLACEMENTS, stats
from pdserve.tuning import metrics


def finish_attainment_axes(ax, title: str) -> None:
    """An attainment-vs-rate panel's target line (90%), labels, range, title and legend."""
    ax.axhline(90, color="gray", ls="--", lw=1)
    ax.set(
        xlabel="request rate (req/s)",
        ylabel="joint SLO attainment (%)",
        ylim=(0, 105),
        title=title,
    )
    ax.legend(fontsize=7)


def measured_rows(args, placement: str, wl: str, slo: dict, path=None) -> list[dict] | None:
    path = path or args.out.with_name(f"slo_validation_{placement}_{wl}.json")
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    rows = []
    for run in data["runs"]:
        s, reqs = run["summary"], run["requests"]
        ttft = [r["ttft_s"] if not r["error"] else math.inf for r in reqs]
        tpot = [r["tpot_s"] if not r["error"] else math.inf for r in reqs if r["output_len"] >= 2]
        ok_ttft = [t <= slo["ttft"] for t in ttft]
        ok_tpot = [
            not r["error"] and (r["tpot_s"] is None or r["tpot_s"] <= slo["tpot"]) for r in reqs
        ]
        rows.append(
            {
                "rate": run["rate"],
                "attainment": s["slo_attainment"],
                **stats(ttft, tpot),
                "ttft_ok": float(np.mean(ok_ttft)),
                "tpot_ok": float(np.mean(ok_tpot)),
                "completed": s["completed"],
                "failed": s["failed"],
                "duration_s": run["duration_s"],
                "cached_prompt_tokens": s["cached_prompt_tokens"],
                "max_send_lag_ms": s["max_send_lag_ms"],
                "server_ms": s.get("server_ms"),
                "request_goodput": s.get("request_goodput"),
            }
        )
    return rows


def goodput(rows: list[dict], threshold: float = 0.9) -> dict:
    return metrics.goodput_rate(
        [r["rate"] for r in rows], [r["attainment"] for r in rows], threshold
    )


# ---- report -------------------------------------------------------------------------------------
def _f(x, spec=".0f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:{spec}}"


def comparison(results: dict, label: str, wl: str) -> list[dict]:
    out = []
    sims = results["simulations"][label]["runs"]
    for placement in PLACEMENTS:
        meas = results["measured_rows"].get(placement, {}).get(wl)
        sim = sims.get(placement, {}).get(wl)
        if not meas or not sim:
            continue
        for m, s in zip(meas, sim):
            out.append(
                {
                    "placement": placement,
                    "rate": m["rate"],
                    "measured": m,
                    "simulated": s,
                    "diff_pp": 100 * (s["attainment"] - m["attainment"]),
                }
            )
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| placement | rate (req/s) | measured att. | simulated att. | sim - meas (pp) | "
        "TTFT p50 meas/sim (ms) | TTFT p90 meas/sim | TPOT p50 meas/sim (ms) | TPOT p90 meas/sim |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, s = r["measured"], r["simulated"]
        lines.append(
            f"| {r['placement']} | {r['rate']:g} | {100 * m['attainment']:.1f}% | "
            f"{100 * s['attainment']:.1f}% | {r['diff_pp']:+.1f} | "
            f"{_f(m['p50_ttft_ms'])} / {_f(s['p50_ttft_ms'])} | {_f(m['p90_ttft_ms'])} / {_f(s['p90_ttft_ms'])} | "
            f"{_f(m['p50_tpot_ms'], '.1f')} / {_f(s['p50_tpot_ms'], '.1f')} | "
            f"{_f(m['p90_tpot_ms'], '.1f')} / {_f(s['p90_tpot_ms'], '.1f')} |"
        )
    return "\n".join(lines)


def earlier_runs(args, results: dict) -> list[dict]:
    """Earlier measurements of a placement and workload (kept by --remeasure), with how much CPU
    other processes used during them."""
    out = []
    for placement, entries in results.get("earlier", {}).items():
        for e in entries:
            for wl in args.workloads:
                if wl not in e:
                    continue
                path = args.out.with_name(
                    f"slo_validation_{placement}_{wl}{e['files_suffix']}.json"
                )
                if not path.is_file():
                    continue
                rows = measured_rows(args, placement, wl, results["slo_s"], path)
                out.append(
                    {
                        "placement": placement,
                        "workload": wl,
                        "suffix": e["files_suffix"],
                        "foreign_cores_avg": e[wl]["cpu"]["foreign_cores_avg"],
                        "rows": rows,
                    }
                )
    return out


def repeats(results: dict, label: str = "in-load") -> list[dict]:
    """Per placement, workload and rate: every measurement of it (the latest, then the earlier
    ones kept by --remeasure), their mean, the simulation's distance to it, and each run's oracle
    simulation (oracle_per_rate; None where its steps were not recorded)."""
    sims = results.get("simulations", {}).get(label, {}).get("runs", {})
    oracle = results.get("simulations", {}).get("sweep-steps (oracle)", {}).get("runs", {})
    out = []
    for placement, per_wl in results["measured_rows"].items():
        for wl, rows in per_wl.items():
            sim = sims.get(placement, {}).get(wl)
            if not sim:
                continue
            earlier = [
                e
                for e in results.get("earlier_runs", [])
                if e["placement"] == placement and e["workload"] == wl
            ]
            oracles = [oracle.get(placement, {}).get(wl)] + [
                next(
                    (
                        o["rows"]
                        for o in results.get("oracle_earlier", [])
                        if o["placement"] == placement
                        and o["workload"] == wl
                        and o["suffix"] == e["suffix"]
                    ),
                    None,
                )
                for e in earlier
            ]
            for k, (row, srow) in enumerate(zip(rows, sim)):
                runs = [row] + [e["rows"][k] for e in earlier]
                meas = [r["attainment"] for r in runs]
                out.append(
                    {
                        "placement": placement,
                        "workload": wl,
                        "rate": row["rate"],
                        "measured": meas,
                        "mean": float(np.mean(meas)),
                        "simulated": srow["attainment"],
                        "diff_to_mean_pp": 100 * (srow["attainment"] - float(np.mean(meas))),
                        "oracle": [o[k]["attainment"] if o else None for o in oracles],
                    }
                )
    return out


def plot_validation(results: dict, args, wl: str) -> str | None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8), tight_layout=True)
    labels = list(results.get("simulations", {}))
    styles = {
        label: "-" if i == len(labels) - 1 else (":", "--", "-.", (0, (5, 1)))[i % 4]
        for i, label in enumerate(labels)
    }
    slo = results["slo_s"]
    drawn = False
    for i, placement in enumerate(PLACEMENTS):
        ax = fig.add_subplot(1, 2, i + 1)
        meas = results["measured_rows"].get(placement, {}).get(wl)
        if meas:
            ax.plot(
                [r["rate"] for r in meas],
                [100 * r["attainment"] for r in meas],
                "o-",
                color="black",
                lw=2,
                label="measured",
            )
            drawn = True
        for e in results.get("earlier_runs", []):
            if e["placement"] == placement and e["workload"] == wl:
                ax.plot(
                    [r["rate"] for r in e["rows"]],
                    [100 * r["attainment"] for r in e["rows"]],
                    "o",
                    mfc="none",
                    color="gray",
                    label=f"measured earlier ({e['suffix'][1:]}, others used "
                    f"{e['foreign_cores_avg']:.2f} cores)",
                )
        for label, block in results.get("simulations", {}).items():
            sim = block["runs"].get(placement, {}).get(wl)
            if sim:
                ax.plot(
                    [r["rate"] for r in sim],
                    [100 * r["attainment"] for r in sim],
                    marker="x",
                    ls=styles[label],
                    label=f"simulated: {label}",
                )
        finish_attainment_axes(
            ax,
            f"{wl}, {placement}: TTFT <= {slo['ttft'] * 1e3:g} ms, TPOT <= {slo['tpot'] * 1e3:g} ms",
        )
    if not drawn:
        return None
    path = args.out.parent / f"slo_validation_{wl}_attainment.png"
    fig.savefig(path, dpi=100)
    return path.name


def plot_cdfs(results: dict, args, wl: str) -> str | None:
    """TTFT and TPOT CDFs of both placements at each rate, measured (solid) and simulated (dotted)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), tight_layout=True)
    axes = [fig.add_subplot(1, 2, i + 1) for i in range(2)]
    colors = {"disaggregated": "tab:blue", "colocated": "tab:green"}
    drawn = False
    for placement in PLACEMENTS:
        path = args.out.with_name(f"slo_validation_{placement}_{wl}.json")
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        for k, run in enumerate(data["runs"]):
            alpha = 0.4 + 0.6 * k / max(1, len(data["runs"]) - 1)
            for ax, key in zip(axes, ("ttft_s", "tpot_s")):
                vals = sorted(
                    1e3 * r[key] for r in run["requests"] if not r["error"] and r[key] is not None
                )
                n = len([r for r in run["requests"] if key == "ttft_s" or r["output_len"] >= 2])
                ax.step(
                    vals,
                    [(i + 1) / n for i in range(len(vals))],
                    where="post",
                    color=colors[placement],
                    alpha=alpha,
                    label=f"{placement} {run['rate']:g} req/s",
                )
                drawn = True
    if not drawn:
        return None
    slo = results["slo_s"]
    for ax, key, name in zip(axes, ("ttft", "tpot"), ("TTFT", "TPOT")):
        ax.axvline(slo[key] * 1e3, color="gray", ls="--", lw=1, label="SLO")
        ax.set(
            xlabel=f"{name} (ms, log)",
            ylabel="share of requests",
            xscale="log",
            ylim=(0, 1.02),
            title=f"{wl}: measured {name} CDF (darker = higher rate)",
        )
        ax.legend(fontsize=7)
    out = args.out.parent / f"slo_validation_{wl}_cdf.png"
    fig.savefig(out, dpi=100)
    return out.name


def report(args, results: dict) -> None:
    slo = results["slo_s"]
    results["measured_rows"] = {}
    for placement in PLACEMENTS:
        for wl in args.workloads:
            rows = measured_rows(args, placement, wl, slo)
            if rows:
                results["measured_rows"].setdefault(placement, {})[wl] = rows
    results["earlier_runs"] = earlier_runs(args, results)
    results["repeats"] = repeats(results)
    results["comparison"] = {
        label: {wl: comparison(results, label, wl) for wl in args.workloads}
        for label in results.get("simulations", {})
    }
    summary = {}
    for wl in args.workloads:
        for placement in PLACEMENTS:
            meas = results["measured_rows"].get(placement, {}).get(wl)
            if not meas:
                continue
            summary.setdefault(wl, {})[placement] = {
                "goodput_measured": goodput(meas),
                "goodput_simulated": {
                    label: goodput(b["runs"][placement][wl])
                    for label, b in results.get("simulations", {}).items()
                    if b["runs"].get(placement, {}).get(wl)
                },
                "p99_ttft_ms": [r["p99_ttft_ms"] for r in meas],
                "p99_tpot_ms": [r["p99_tpot_ms"] for r in meas],
                "attainment": [r["attainment"] for r in meas],
                "rates": [r["rate"] for r in meas],
            }
    results["summary"] = summary
    plots = []
    for wl in args.workloads:
        plots += [
            p for p in (plot_validation(results, args, wl), plot_cdfs(results, args, wl)) if p
        ]
    results["plots"] = plots
    for label in results.get("simulations", {}):
        for wl in args.workloads:
            rows = results["comparison"][label][wl]
            if rows:
                print(f"\n### {wl}, simulator '{label}'\n")
                print(table(rows))
    if any(len(r["measured"]) > 1 for r in results["repeats"]):
        print("\n### repeated measurements vs the 'in-load' simulation\n")
        print(
            "| workload | placement | rate | measured att. (each run) | mean | simulated | sim - mean (pp) "
            "| oracle - measured, each run (pp) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in results["repeats"]:
            print(
                f"| {r['workload']} | {r['placement']} | {r['rate']:g} | "
                f"{' / '.join(f'{100 * m:.1f}' for m in r['measured'])} | {100 * r['mean']:.1f} | "
                f"{100 * r['simulated']:.1f} | {r['diff_to_mean_pp']:+.1f} | "
                + " / ".join(
                    "-" if o is None else f"{100 * (o - m):+.1f}"
                    for o, m in zip(r["oracle"], r["measured"])
                )
                + " |"
            )
    for e in results["earlier_runs"]:
        print(
            f"\nearlier run {e['placement']} {e['workload']} {e['suffix']} (others used "
            f"{e['foreign_cores_avg']:.2f} cores): attainment "
            f"{[round(100 * r['attainment'], 1) for r in e['rows']]} % at {[r['rate'] for r in e['rows']]}"
        )
    for wl, per in summary.items():
        print(f"\n{wl}:")
        for placement, s in per.items():
            g = s["goodput_measured"]
            print(
                f"  {placement}: measured goodput {'>= ' if g['lower_bound'] else ''}{g['rate']:.2f} req/s; "
                f"attainment {[f'{100 * a:.0f}%' for a in s['attainment']]} at {s['rates']}; "
                f"p99 TTFT {[_f(x) for x in s['p99_ttft_ms']]} ms; p99 TPOT {[_f(x, '.1f') for x in s['p99_tpot_ms']]} ms"
            )
    for key, t in results.get("tuner", {}).items():
        print(
            f"\ntuner ({key}): best {t['best']} at {t['best_goodput']} req/s; ranking {t['ranking']}"
        )
