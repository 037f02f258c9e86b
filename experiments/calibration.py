"""Serving-path calibration: how a profile's "serving" block (perf_model.py) is measured and
fitted. The requests sent through a running deployment (calibrate_child, in its own process) and
the fits made from their records (fit_serving: prefill and decode step models plus the per-request
first-token latency; fit_interference: how much each side of a disaggregated pair slows while the
other computes), the in-load fits (fit_load: step models, interference, step speed and noise from a
loaded deployment's engine steps), and the profile entries made from them (serving_entries).
experiments/slo_validation.py runs these against a deployment; pooled.py pools the in-load calibrations
of many runs into one profile for `pdserve tune --profile`."""

from __future__ import annotations

import datetime as _dt
import json
import pathlib
import time

import numpy as np

from pdserve.tuning import workload

PLACEMENTS = ("disaggregated", "colocated")
# the profile's serving.interference key for each worker kind's fitted factor
INTERFERENCE_KEY = {
    "decode": "decode_while_prefill",
    "prefill": "prefill_while_decode",
    "colocated": "colocated_while_busy",
}
CAL_PREFILL_LENS = (32, 128, 512, 64, 256, 32, 128, 512)  # isolated requests, one at a time
CAL_DECODE_BATCHES = (1, 4, 16)  # requests sent together, 64 + 64 tokens
CAL_SEED = 5000
CAL_BG_BATCH = 8  # interference: decode batch (64 + 160)
CAL_PROBE_LEN, CAL_PROBE_TIMES = 256, (1.5, 2.7, 3.9, 5.1)  # ... and prompts prefilled beside it


def calibrate_child(router: str, out_path: str, placement: str) -> int:
    """Runs in its own process (as the load generator does): isolated prompts of CAL_PREFILL_LENS
    tokens one at a time (TTFT through the whole path), then batches of requests sent together
    (the step time while all of a worker's requests decode), and, disaggregated, a decode batch
    with prompts prefilled beside it (how much each side slows while the other computes). Writes
    the raw records; the fit happens in the parent (fit_serving, fit_interference)."""
    from pdserve.tuning import loadgen

    card = loadgen.model_card(router)
    out = {"prefill": [], "decode": []}
    for k, n in enumerate(CAL_PREFILL_LENS):
        spec = workload.RequestSpec(0.0, n, 2)
        recs, _ = loadgen.run_load(
            router, [spec], workload.build_prompts([spec], card.vocab_size, CAL_SEED + k)
        )
        out["prefill"].append(recs[0].to_json())
        time.sleep(0.2)
    for k, b in enumerate(CAL_DECODE_BATCHES):
        specs = [workload.RequestSpec(0.0, 64, 64)] * b
        recs, _ = loadgen.run_load(
            router, specs, workload.build_prompts(specs, card.vocab_size, CAL_SEED + 100 + k)
        )
        out["decode"].append({"batch": b, "requests": [r.to_json() for r in recs]})
        time.sleep(0.2)
    if placement == "disaggregated":
        # interference: a decode batch runs while isolated prompts are prefilled beside it
        specs = [workload.RequestSpec(0.0, 64, 160)] * CAL_BG_BATCH + [
            workload.RequestSpec(t, CAL_PROBE_LEN, 2) for t in CAL_PROBE_TIMES
        ]
        recs, _ = loadgen.run_load(
            router, specs, workload.build_prompts(specs, card.vocab_size, CAL_SEED + 200)
        )
        out["interference"] = [r.to_json() for r in recs]
    pathlib.Path(out_path).write_text(json.dumps(out))
    return 0


def token_times(record: dict) -> list[float]:
    """When each of a load-generator record's tokens arrived, in seconds from the run's start."""
    t = record["send_s"] + record["ttft_s"]
    times = [t]
    for gap in record.get("itl_per_token_s", record["itl_s"]):  # (older records: per token)
        t += gap
        times.append(t)
    return times


def fit_interference(records: list[dict], serving_prefill, extra_s: float) -> dict:
    """decode_while_prefill: the background batch's median gap while a probe prompt was being
    prefilled over its median gap while the prefill worker was idle, minus 1; prefill_while_decode:
    the probes' TTFT (less what the simulator adds after the step) over the serving prefill model,
    minus 1."""
    bg = records[:CAL_BG_BATCH]
    probes = [
        r
        for r in records[CAL_BG_BATCH:]
        if not r["error"] and r["timings"].get("prefill_end_unix_ns")
    ]
    if any(r["error"] for r in bg) or not probes:
        return {}
    t0 = min(r["send_unix_ns"] - r["send_s"] * 1e9 for r in records)  # the run's start, unix ns
    busy = [
        (
            (r["timings"]["prefill_start_unix_ns"] - t0) / 1e9,
            (r["timings"]["prefill_end_unix_ns"] - t0) / 1e9,
        )
        for r in probes
    ]
    times = [token_times(r) for r in bg]
    lo, hi = max(ts[0] for ts in times), min(ts[-1] for ts in times)
    on, off = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if a < lo or b > hi or b <= a:
                continue
            share = sum(max(0.0, min(b, e) - max(a, s)) for s, e in busy) / (b - a)
            (on if share > 0.5 else off if share == 0 else []).append(b - a)
    out = {"num_gaps_busy": len(on), "num_gaps_idle": len(off)}
    if len(on) >= 5 and len(off) >= 5:
        out["gap_busy_s"], out["gap_idle_s"] = float(np.median(on)), float(np.median(off))
        out["decode_while_prefill"] = max(0.0, out["gap_busy_s"] / out["gap_idle_s"] - 1)
    n = CAL_PROBE_LEN
    model = serving_prefill[0] + serving_prefill[1] * n + serving_prefill[2] * n * n
    ttft = float(np.median([r["ttft_s"] for r in probes])) - extra_s
    out.update(
        probe_ttft_s=ttft + extra_s,
        probe_model_s=model + extra_s,
        prefill_while_decode=max(0.0, ttft / model - 1),
    )
    return out


def decode_windows(batch: list[dict]) -> list[dict]:
    """Per decode worker: the window in which every request it holds is decoding (after the last
    first token, before the first last token), its batch size, the sum of the contexts at the
    window's middle, and the median gap between tokens inside the window (= its step time)."""
    groups: dict[str, list[dict]] = {}
    for r in batch:
        if not r["error"] and r["ttft_s"] is not None:
            groups.setdefault(r["timings"].get("decode_worker") or "?", []).append(r)
    out = []
    for worker, reqs in groups.items():
        times = [token_times(r) for r in reqs]
        lo, hi = max(ts[0] for ts in times), min(ts[-1] for ts in times)
        gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if a >= lo and b <= hi]
        if len(gaps) < 3 * len(reqs):
            continue
        mid = (lo + hi) / 2
        context = sum(
            r["prompt_len"] + sum(1 for x in ts if x <= mid) for r, ts in zip(reqs, times)
        )
        out.append(
            {
                "worker": worker,
                "batch": len(reqs),
                "context": context,
                "step_s": float(np.median(gaps)),
                "num_gaps": len(gaps),
            }
        )
    return out


def fit_serving(engine_profile, placement: str, raw: dict, backend: str = "grpc") -> dict:
    """Serving-path coefficients for the worker kinds of `placement`, from the calibration records:
    prefill a', b' fitted to (isolated TTFT - what the simulator adds after the prefill step for
    that request, e.g. the exposed KV transfer) with the engine's attention coefficient c kept;
    decode a', b' fitted to the in-window step times with the engine's per-context-token c kept."""
    from pdserve.tuning.perf_model import fit_nonnegative
    from pdserve.tuning.simulator import Placement, PoolSpec, Simulator

    m = engine_profile.tp[1]
    pool = PoolSpec(1, 1, 2048, 128, m.kv_capacity_tokens)
    sim = Simulator(
        engine_profile,
        Placement(None, pool) if placement == "colocated" else Placement(pool, pool, backend),
    )
    pf_x, pf_y, pf_rows = [], [], []
    for r in raw["prefill"]:
        if r["error"] or r["ttft_s"] is None:
            continue
        n = r["prompt_len"]
        bare = m.prefill_time(n, n * n)
        extra = sim.run([workload.RequestSpec(0.0, n, 2)]).requests[0].ttft_s - bare
        target = r["ttft_s"] - extra - m.prefill[2] * n * n
        pf_x.append([1.0, float(n)])
        pf_y.append(target)
        pf_rows.append(
            {"prompt_len": n, "ttft_s": r["ttft_s"], "engine_model_s": bare, "sim_extra_s": extra}
        )
    dc_x, dc_y, dc_rows = [], [], []
    for b in raw["decode"]:
        for w in decode_windows(b["requests"]):
            dc_x.append([1.0, float(w["batch"])])
            dc_y.append(w["step_s"] - m.decode[2] * w["context"])
            dc_rows.append({**w, "engine_model_s": m.decode_time(w["batch"], w["context"])})
    pf = fit_nonnegative(pf_x, [max(y, 1e-6) for y in pf_y])
    dc = fit_nonnegative(dc_x, [max(y, 1e-6) for y in dc_y])
    # the fitted intercept is what an isolated request's TTFT pays once; of it, only the engine's
    # own step intercept is step time: the rest (RPC hops, the router, streaming the token back)
    # is the request's first-token latency, which in a loaded worker's mixed steps the decodes
    # sharing the step do not pay
    latency = max(0.0, pf["coef"][0] - m.prefill[0])
    prefill = [min(pf["coef"][0], m.prefill[0]), pf["coef"][1], m.prefill[2]]
    decode = [dc["coef"][0], dc["coef"][1], m.decode[2]]
    for row in pf_rows:
        n = row["prompt_len"]
        row["serving_model_s"] = latency + prefill[0] + prefill[1] * n + prefill[2] * n * n
    for row in dc_rows:
        row["serving_model_s"] = decode[0] + decode[1] * row["batch"] + decode[2] * row["context"]
    kinds = (
        {
            "colocated": {
                "prefill": {"coef": prefill},
                "decode": {"coef": decode},
                "first_token_latency_s": latency,
            }
        }
        if placement == "colocated"
        else {
            "prefill": {"prefill": {"coef": prefill}, "first_token_latency_s": latency},
            "decode": {"decode": {"coef": decode}},
        }
    )
    interference = {}
    if raw.get("interference"):
        extra = sim.run([workload.RequestSpec(0.0, CAL_PROBE_LEN, 2)]).requests[
            0
        ].ttft_s - m.prefill_time(CAL_PROBE_LEN, CAL_PROBE_LEN**2)
        interference = fit_interference(raw["interference"], prefill, extra + latency)
    return {
        "kinds": kinds,
        "prefill_samples": pf_rows,
        "decode_samples": dc_rows,
        "prefill_fit": pf["fit"],
        "decode_fit": dc["fit"],
        "interference": interference,
    }


# ---- in-load calibration: step models fitted from the steps a loaded deployment ran ------------
LOAD_TRACE, LOAD_TRACE_START_S = (
    "azure_conv",
    60.0,
)  # a later part of the trace than the measured slice
# the loads the sweep is judged at, not past them: the highest rate of the 180-request conv sweeps
# (calibrating past it, at 4 req/s, overloaded the prefill worker, and there both sides ran slower
# beside each other than they did in the sweeps: docs/experiments/slo-validation.md)
LOAD_RATES, LOAD_REQUESTS, LOAD_SEED = (2.0,), 150, 7000
CONTINUOUS_GAP_S = 0.02  # a step that starts this soon after the one before: the loop never idled
NOISE_POINTS = 40  # quantiles of measured/modelled step time kept as the profile's step_noise
NOISE_MIN_STEPS = 40  # steps with prompt tokens, and without, needed to keep their noise apart
INTERFERENCE_GRID = [k / 100 for k in range(0, 101, 2)]  # factors tried for fit_load's interference
INTERFERENCE_MIN_STEPS = 20  # steps needed with another worker busy, and with none, to fit it
SPEED_WINDOW_S = 0.5  # step_speed windows: 0.5 s means of measured/modelled decode step time had
# a lag-1 autocorrelation of 0.6-0.8 in the calibrations of 2026-11-23


def effective_steps(steps: list[dict]) -> list[dict]:
    """One worker's StepRecords (dicts) with "eff_s": the time the step held the engine loop, from
    its start to the next step's start when the loop went straight on (the step's outputs were
    dispatched and the calls that waited for it ran: commits, Reserves, new requests), else its own
    duration plus the median of those in-between times."""
    steps = sorted(steps, key=lambda s: s["start"])
    gaps = [b["start"] - a["end"] for a, b in zip(steps, steps[1:])]
    between = float(np.median([g for g in gaps if g < CONTINUOUS_GAP_S] or [0.0]))
    out = []
    for i, s in enumerate(steps):
        if i + 1 < len(steps) and gaps[i] < CONTINUOUS_GAP_S:
            eff = steps[i + 1]["start"] - s["start"]
        else:
            eff = s["end"] - s["start"] + between
        out.append({**s, "eff_s": eff})
    return out


def modelled_s(model, step: dict) -> float:
    """A StepRecord's time as the simulator prices it with `model` (a perf_model.StepModel)."""
    if step["tokens"] == step["num_decode"]:
        return model.decode_time(step["num_decode"], step["decode_context"])
    return model.prefill_time(step["tokens"], step["prefill_pairs"], step["decode_context"])


def _fit_models(m, dec: list[dict], pre: list[dict], scale) -> tuple[list, list, dict]:
    """(prefill coef, decode coef, fit details) on each step's eff_s / scale(step)."""
    from pdserve.tuning.perf_model import fit_nonnegative

    out = {}
    decode = list(m.decode)
    if len(dec) >= 10:
        fit = fit_nonnegative(
            [[1.0, s["num_decode"], s["decode_context"]] for s in dec],
            [s["eff_s"] / scale(s) for s in dec],
        )
        decode, out["decode_fit"] = fit["coef"], fit["fit"]
        out["decode"] = {"coef": decode}
    prefill = list(m.prefill)
    if len(pre) >= 10:
        fit = fit_nonnegative(
            [[1.0, s["tokens"], s["prefill_pairs"]] for s in pre],
            [max(1e-6, s["eff_s"] / scale(s) - decode[2] * s["decode_context"]) for s in pre],
        )
        prefill, out["prefill_fit"] = fit["coef"], fit["fit"]
        out["prefill"] = {"coef": prefill}
    return prefill, decode, out


def fit_load_steps(
    engine_profile, kind: str, steps: list[dict], speed_window_s: float | None = None
) -> dict:
    """Step models for one worker kind from its loaded steps: the decode model a + b*B + c*C on
    the decode-only steps, the prefill model a + b*T + c*A on the steps with prompt tokens (less
    the decode model's c times their decode rows' context, as the simulator prices a mixed step);
    a kind without decode-only steps keeps the engine's decode model. step_noise: quantiles of
    measured / modelled over its decode-only steps, and prompt_step_noise over its steps with
    prompt tokens, where each has NOISE_MIN_STEPS steps (else step_noise over all of them): a
    30 ms decode step jitters by tens of percent, a 400 ms prompt chunk by a few, and a 2026-11-23
    oracle that lent the pooled spread to the chunks was pessimistic on colocated by 2-4 pp.

    Where the steps say whether another worker was in a step when they started ("others_busy",
    from fit_load) and both cases have INTERFERENCE_MIN_STEPS steps, "interference" is the factor
    f (on INTERFERENCE_GRID) for which the models times 1 + f on those steps fit best: how much
    slower this kind runs while a worker beside it on the host computes. The models are then those
    of a step with the host to itself.

    With speed_window_s, the ratio is split into a slow and a fast part: step_speed holds, per
    worker (the steps' "worker" key), the speed of each window of that many seconds in which it
    ran steps (speed_traces), in time order, and the noise is taken from each step's ratio over
    its window's speed."""
    from pdserve.tuning.perf_model import StepModel

    m = engine_profile.tp[1]
    dec = [s for s in steps if s["tokens"] == s["num_decode"]]
    pre = [s for s in steps if s["tokens"] > s["num_decode"]]
    out = {"num_steps": len(steps), "num_decode_steps": len(dec), "num_prefill_steps": len(pre)}
    busy = sum(1 for s in steps if s.get("others_busy"))
    grid = INTERFERENCE_GRID if min(busy, len(steps) - busy) >= INTERFERENCE_MIN_STEPS else [0.0]
    best = None
    for f in grid:
        scale = lambda s, f=f: 1.0 + f * bool(s.get("others_busy"))  # noqa: E731
        prefill, decode, fits = _fit_models(m, dec, pre, scale)
        model = StepModel(tuple(prefill), tuple(decode), m.kv_capacity_tokens)
        sse = sum((s["eff_s"] - modelled_s(model, s) * scale(s)) ** 2 for s in steps)
        if best is None or sse < best[0]:
            best = (sse, f, model, fits, scale)
    _, f, model, fits, scale = best
    out.update(fits)
    if len(grid) > 1:
        out["interference"] = float(f)
        out["num_steps_others_busy"] = busy
    modelled = np.array([modelled_s(model, s) * scale(s) for s in steps])
    ratios = np.array([s["eff_s"] for s in steps]) / modelled if steps else np.zeros(0)
    if len(ratios) and speed_window_s:
        out["step_speed"], ratios = speed_traces(steps, ratios, modelled, speed_window_s)
    if len(ratios):
        prompt = np.array([s["tokens"] > s["num_decode"] for s in steps])
        qs = (np.arange(NOISE_POINTS) + 0.5) / NOISE_POINTS
        quantiles = lambda r: [round(float(x), 4) for x in np.quantile(r, qs)]  # noqa: E731
        if min(prompt.sum(), (~prompt).sum()) >= NOISE_MIN_STEPS:
            out["step_noise"] = quantiles(ratios[~prompt])
            out["prompt_step_noise"] = quantiles(ratios[prompt])
        else:
            out["step_noise"] = quantiles(ratios)
        out["ratio_p50_p90_p99"] = [float(np.quantile(ratios, q)) for q in (0.5, 0.9, 0.99)]
    return out


def speed_traces(steps: list[dict], ratios, modelled, window_s: float) -> tuple[dict, np.ndarray]:
    """({window_s, traces}, the ratios over their window's speed): per worker, for each window
    of window_s in which it ran steps, in time order, the speed measured / modelled over the
    window's steps taken together (their summed time over their summed modelled time, so a long
    step weighs as its time does)."""
    by_worker: dict = {}
    for i, s in enumerate(steps):
        by_worker.setdefault(s.get("worker", ""), []).append((s["start"], i))
    traces = []
    fast = np.empty(len(steps))
    for rows in by_worker.values():
        rows.sort()
        windows: dict[int, list[int]] = {}
        for t, i in rows:
            windows.setdefault(int((t - rows[0][0]) // window_s), []).append(i)
        trace = []
        for k in sorted(windows):
            idx = windows[k]
            speed = float(np.sum(ratios[idx] * modelled[idx]) / np.sum(modelled[idx]))
            trace.append(round(speed, 4))
            fast[idx] = ratios[idx] / speed
        traces.append(trace)
    return {"window_s": window_s, "traces": traces}, fast


def others_busy(raw: dict) -> dict[str, list[bool]]:
    """Worker name -> per step (in its order in raw): whether another worker of the same
    deployment was in a step when it started. Workers named "<run>:<name>" (pooled calibrations)
    are compared only within their run."""
    import bisect

    group = lambda name: name.split(":", 1)[0] if ":" in name else ""  # noqa: E731
    spans = {
        name: sorted((s["start"], s["end"]) for s in w["steps"])
        for name, w in raw["workers"].items()
    }
    out = {}
    for name, w in raw["workers"].items():
        others = [spans[o] for o in spans if o != name and group(o) == group(name)]
        flags = []
        for s in w["steps"]:
            t = s["start"]
            hit = False
            for sp in others:  # the other's last step starting at or before t: still running?
                i = bisect.bisect_right(sp, (t, float("inf"))) - 1
                if i >= 0 and sp[i][1] > t:
                    hit = True
                    break
            flags.append(hit)
        out[name] = flags
    return out


def fit_load(
    engine_profile, raw: dict, speed_window_s: float | None = None, interference: bool = True
) -> dict:
    """kind -> fit_load_steps over every worker of that kind in a load calibration's raw records
    (each step tagged with its worker's name, for step_speed, and, unless interference=False,
    with others_busy, for the interference factor)."""
    busy = (
        others_busy(raw)
        if interference
        else {n: [False] * len(w["steps"]) for n, w in raw["workers"].items()}
    )
    by_kind: dict[str, list[dict]] = {}
    for name, w in raw["workers"].items():
        flags = dict(zip(((s["start"], s["end"]) for s in w["steps"]), busy[name]))
        by_kind.setdefault(w["kind"], []).extend(
            {**s, "worker": name, "others_busy": flags[(s["start"], s["end"])]}
            for s in effective_steps(w["steps"])
        )
    return {
        kind: fit_load_steps(engine_profile, kind, steps, speed_window_s)
        for kind, steps in by_kind.items()
    }


def step_model_check(profile, raw: dict) -> dict:
    """How well a profile's step models time the steps a sweep really ran: per worker kind, the
    number of steps, measured / modelled step time (mean, p50, p90) and the share of the sweep's
    span the workers spent in steps."""
    out = {}
    for kind in sorted({w["kind"] for w in raw["workers"].values()}):
        m = profile.step_model(1, kind)
        ratios, busy, span = [], 0.0, 0.0
        for w in raw["workers"].values():
            if w["kind"] != kind or not w["steps"]:
                continue
            steps = effective_steps(w["steps"])
            for s in steps:
                ratios.append(s["eff_s"] / modelled_s(m, s))
                busy += s["eff_s"]
            span += steps[-1]["end"] - steps[0]["start"]
        if ratios:
            out[kind] = {
                "num_steps": len(ratios),
                "ratio_mean": float(np.mean(ratios)),
                "ratio_p50": float(np.median(ratios)),
                "ratio_p90": float(np.quantile(ratios, 0.9)),
                "busy_share": busy / span if span else None,
            }
    return out


# ---- the profile's "serving" entries ------------------------------------------------------------
def now() -> str:
    """A profile's source.date: UTC, to the second."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def serving_entries(fits: dict, isolated: dict) -> dict:
    """A profile's "serving" entries from fit_load's fits; each kind's first-token latency comes
    from the isolated calibration's serving profile (`isolated`: its "serving" block), and the
    fitted interference factors go to serving.interference."""
    out: dict = {}
    for kind, fit in fits.items():
        entry = {
            k: fit[k]
            for k in ("prefill", "decode", "step_noise", "prompt_step_noise", "step_speed")
            if k in fit
        }
        latency = isolated.get(kind, {}).get("1", {}).get("first_token_latency_s")
        if latency is not None:
            entry["first_token_latency_s"] = latency
        out[kind] = {"1": entry}
        if "interference" in fit:
            out.setdefault("interference", {})[INTERFERENCE_KEY[kind]] = fit["interference"]
    return out
