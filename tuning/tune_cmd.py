"""`pdserve tune`: arguments, the ranked table, the winner as a deploy YAML, the candidates plot.

    pdserve tune --profile tuning/profiles/h100_llama3_8b.json --workload azure_conv \
        --slo ttft=1s,tpot=50ms,attainment=0.9 --devices 8 --colocated \
        --model /models/Meta-Llama-3-8B --out best.yaml --plot c.png
    pdserve tune --profile profile.json --workload synthetic:256:64 --slo ttft=2s,tpot=200ms --devices 2

--objective total (the default) ranks placements by goodput for a fixed budget of --devices;
per-device ranks them by goodput per device. Each row says whether its goodput was simulated (the
whole deployment through the simulator) or estimated (sized from one worker of each kind).
Placements that `pdserve up` refuses today are left out and listed, and the YAML written passes
the launcher's offline checks. --planner then simulates the best disaggregated pick with the
planner in the loop (tuning/sim_planner.py) on the workload with its phases kept, and says
whether it beats the same placement static (goodput both ways). The prefill pool may run in
pipeline stages where one stage of a TP degree cannot hold a prompt (--no-pp: never); after the
best placement, the report says whether it does and why (tune_report.pp_notes).
--include-refused ranks the placements `pdserve up` refuses today too, and writes none of them. Prefix caching is not
simulated: a trace with Mooncake hash_ids gets a note saying so. Bad arguments exit with code 2 and a message.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import dataclass

from pdserve.tuning.deploy_yaml import deploy_yaml, launcher_problems, write_yaml
from pdserve.tuning.perf_model import Profile, ProfileError, load_profile
from pdserve.tuning.slo import SLO, TuneError, parse_slo
from pdserve.tuning.tune_report import (
    BASIS_NOTE,
    instances_table,
    plot,
    pp_notes,
    seeded_percentiles,
    table,
)
from pdserve.tuning.tuner import OBJECTIVES, Candidate, Search, enumerate_placements
from pdserve.tuning.workload import RequestSpec, load_trace, synthetic


def add_args(p: argparse.ArgumentParser) -> None:
    _workload_args(p)
    _placing_args(p)
    _search_args(p)
    _planner_args(p)
    _output_args(p)
    _yaml_args(p)


def _workload_args(p: argparse.ArgumentParser) -> None:
    """The workload simulated and how it is sampled."""
    wl = p.add_argument_group("workload")
    wl.add_argument(
        "--workload",
        required=True,
        help="a trace name (azure_conv, azure_code, mooncake_synthetic), a trace file, "
        "or synthetic:PROMPT_LEN:OUTPUT_LEN",
    )
    wl.add_argument("--scale", type=float, default=1.0, help="trace lengths x this (default 1.0)")
    wl.add_argument("--max-prompt", type=int, help="cap on prompt tokens after scaling")
    wl.add_argument("--max-output", type=int, help="cap on output tokens after scaling")
    wl.add_argument(
        "--burstiness", type=float, default=1.0, help="arrival gamma shape (1: Poisson)"
    )
    wl.add_argument("--seed", type=int, default=0)


def _placing_args(p: argparse.ArgumentParser) -> None:
    """The profile, the SLO and the placements considered."""
    placing = p.add_argument_group("profile, SLO and placements")
    placing.add_argument(
        "--profile", required=True, help="profile JSON from `pdserve profile` (or a derived one)"
    )
    placing.add_argument(
        "--slo", required=True, help="e.g. ttft=200ms,tpot=50ms,attainment=0.9 (units: ms or s)"
    )
    placing.add_argument(
        "--devices",
        type=int,
        required=True,
        help="devices to place on: GPUs for a gpu profile, else CPU cores",
    )
    placing.add_argument(
        "--colocated",
        action="store_true",
        help="also consider colocated workers (prefill and decode in one engine)",
    )
    placing.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="total",
        help="the ranking for the --devices budget: the placement's total goodput (default; "
        "fewer devices on a tie) or its goodput per device",
    )
    placing.add_argument(
        "--no-pp",
        dest="pp",
        action="store_false",
        help="run every prefill worker in one stage (default: prefill pools may take pipeline "
        "stages where one stage's weights leave no room for a prompt's KV)",
    )
    placing.add_argument(
        "--include-refused",
        action="store_true",
        help="also rank the placements `pdserve up` refuses today (e.g. tensor-parallel or "
        "pipelined workers on GPUs), to plan hardware; --out still writes only one it runs",
    )
    placing.add_argument("--backend", help="KV transfer backend (default: the profile's fastest)")
    placing.add_argument("--tp", help="TP degrees to consider, e.g. 1,2 (default: the profile's)")
    placing.add_argument("--max-num-batched-tokens", type=int, default=2048)
    placing.add_argument("--max-num-seqs", type=int, default=128)


def _search_args(p: argparse.ArgumentParser) -> None:
    """How much the search simulates."""
    search = p.add_argument_group("search")
    search.add_argument(
        "--num-requests",
        type=int,
        default=300,
        help="requests sampled from the workload per simulation, at least (default 300)",
    )
    search.add_argument(
        "--max-requests",
        type=int,
        default=6000,
        help="at most this many per simulation: high rates need more to reach steady "
        "state (default 6000)",
    )
    search.add_argument(
        "--max-verify-requests",
        type=int,
        default=20000,
        help="at most this many when simulating a whole placement (default 20000)",
    )
    search.add_argument(
        "--verify-top",
        type=int,
        default=3,
        help="simulate at least this many placements whole (default 3)",
    )
    search.add_argument(
        "--time-limit",
        type=float,
        default=45.0,
        help="stop simulating whole placements after this many seconds (default 45)",
    )
    search.add_argument(
        "--seeds",
        type=int,
        default=0,
        help="also bisect the placements simulated whole once per seed with the "
        "profile's step-time variation (step_noise, step_speed from an in-load "
        "calibration) and print their goodput's p10/p50/p90 (default 0: off)",
    )


def _planner_args(p: argparse.ArgumentParser) -> None:
    """--planner: the planner simulated on the best pick."""
    planning = p.add_argument_group("planner")
    planning.add_argument(
        "--planner",
        action="store_true",
        help="after the search, simulate the best disaggregated pick with the planner in the "
        "loop (planner/policy.py, default settings at the SLO) on the workload with its own "
        "phases kept (a shift trace's phases, each at a multiple of its own rate), and report "
        "its goodput against the same placement static",
    )
    planning.add_argument(
        "--planner-phase-s",
        type=float,
        default=120.0,
        help="seconds of each phase simulated for --planner (default 120; 0: each phase's whole "
        "span)",
    )


def _output_args(p: argparse.ArgumentParser) -> None:
    """The table, the plot and the YAML."""
    output = p.add_argument_group("output")
    output.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    output.add_argument("--plot", help="write a PNG of the candidates here")
    output.add_argument("--out", help="write the best placement as a deploy YAML here")


def _yaml_args(p: argparse.ArgumentParser) -> None:
    """The settings of the YAML --out writes."""
    yaml_out = p.add_argument_group("the deploy YAML that --out writes")
    yaml_out.add_argument(
        "--model",
        help="the model the written YAML serves, as the engine loads it: 'smollm2', a .gguf file "
        "or an HF directory on every node; its name must be the profile's model. Needed with "
        "--out unless the profile's own model name is one of those",
    )
    yaml_out.add_argument(
        "--router-host",
        help="router.host of the written YAML (default: 127.0.0.1 for a local Ray, 0.0.0.0 "
        "with --ray-address)",
    )
    yaml_out.add_argument(
        "--router-port", type=int, default=50051, help="router.port (default 50051)"
    )
    yaml_out.add_argument(
        "--ray-address",
        help="ray.address of the written YAML: a Ray cluster to join (default: none, `pdserve "
        "up` starts a local Ray with ray.num_cpus = the CPUs the pools reserve)",
    )


# the flags that Search takes as they are, under the same names
SEARCH_ARGS = (
    "num_requests",
    "max_requests",
    "max_verify_requests",
    "burstiness",
    "seed",
    "max_num_batched_tokens",
    "max_num_seqs",
    "backend",
    "objective",
)


def _workload(args) -> list[RequestSpec]:
    spec = args.workload
    if spec.startswith("synthetic"):
        parts = spec.split(":")
        try:
            prompt, output = int(parts[1]), int(parts[2])
            if len(parts) != 3 or prompt < 1 or output < 1:
                raise ValueError
        except (ValueError, IndexError):
            raise TuneError(
                f"--workload {spec!r}: write synthetic:PROMPT_LEN:OUTPUT_LEN with two "
                f"integers >= 1, e.g. synthetic:512:128"
            ) from None
        return synthetic(
            max(args.num_requests, args.max_requests), 1.0, prompt, output, seed=args.seed
        )
    try:
        return load_trace(
            spec, scale=args.scale, max_prompt=args.max_prompt, max_output=args.max_output
        )
    except ValueError as e:
        raise TuneError(f"--workload: {e}") from None


def _tp_degrees(args, profile: Profile) -> list[int] | None:
    if args.tp is None:
        return None
    try:
        tps = sorted({int(x) for x in args.tp.split(",") if x.strip()})
    except ValueError:
        raise TuneError(f"--tp {args.tp!r}: a comma-separated list of integers, e.g. 1,2") from None
    bad = [t for t in tps if t not in profile.tp]
    if bad or not tps:
        raise TuneError(f"--tp {args.tp!r}: the profile has TP degrees {profile.tp_degrees} only")
    return tps


def _loadable(model: str) -> bool:
    """Whether the engine can load `model` as named (engine/loader/resolve.py): the smollm2
    alias, a .gguf file or a directory path; never a hub id it would have to fetch."""
    from pdserve.engine.loader.resolve import SMOLLM2_ALIAS

    m = model.strip()
    return (
        m.lower() == SMOLLM2_ALIAS
        or m.lower().endswith(".gguf")
        or m.startswith(("/", ".", "~"))
        or pathlib.Path(m).is_dir()
    )


def check_args(args) -> tuple[Profile, list[RequestSpec], SLO]:
    slo = parse_slo(args.slo)
    if args.devices < 2:
        raise TuneError(
            f"--devices must be >= 2 (a prefill and a decode worker), got {args.devices}"
        )
    for name in (
        "num_requests",
        "max_requests",
        "max_verify_requests",
        "verify_top",
        "max_num_batched_tokens",
        "max_num_seqs",
    ):
        if getattr(args, name) < 1:
            raise TuneError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seeds < 0:
        raise TuneError(f"--seeds must be >= 0, got {args.seeds}")
    if args.planner_phase_s < 0:
        raise TuneError(f"--planner-phase-s must be >= 0, got {args.planner_phase_s}")
    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        raise TuneError(f"--profile: {e}") from None
    if args.model is not None and not profile.matches_model(args.model):
        raise TuneError(
            f"--profile {args.profile} was measured for model {profile.model_id!r} "
            f"({profile.model_name}), not {args.model!r}: profile that model with "
            f"`pdserve profile --model {args.model}` or pass its profile"
        )
    if not 0 <= args.router_port <= 65535:
        raise TuneError(f"--router-port must be in 0..65535, got {args.router_port}")
    if args.out and args.model is None and not _loadable(profile.model_name):
        raise TuneError(
            f"--out needs --model: the profile names {profile.model_name!r}, which the engine "
            f"cannot load (it takes 'smollm2', a .gguf file or an HF directory); pass the "
            f"model's path on the nodes, e.g. --model /models/{profile.model_id}"
        )
    if args.backend is not None and args.backend not in profile.transfer:
        raise TuneError(
            f"--backend {args.backend!r}: the profile has KV transfer figures for "
            f"{sorted(profile.transfer)}"
        )
    if min(profile.tp_degrees) * 2 > args.devices:
        raise TuneError(
            f"--devices {args.devices}: the smallest TP degree in the profile is "
            f"{min(profile.tp_degrees)}, too big for a prefill and a decode worker"
        )
    return profile, _workload(args), slo


def run(args) -> int:
    """Runs `pdserve tune`; returns the exit code. Placements the launcher refuses
    (deploy/config/checks.placement_problems: tp > 1 prefill or decode workers on GPUs, the shm
    backend with GPU decode) are left out and listed. The YAML written is checked against the
    launcher's offline checks (validate_config, fit_problems with the profile's model shape) and
    carries the router's and Ray's settings (--router-host/--router-port, --ray-address, else a
    local Ray with num_cpus = the CPUs the pools reserve). Exit code 2 with a message: an unknown
    trace, an SLO without a unit, devices < 2, a profile of another model than --model, a
    malformed profile, or --out without a --model the engine can load (the profile's hub id is
    not one)."""
    t0 = time.perf_counter()
    try:
        profile, workload, slo = check_args(args)
        placements = _placements(args, profile, workload)
    except TuneError as e:
        print(f"pdserve tune: {e}", file=sys.stderr)
        return 2
    ctx = _Context(args, profile, workload, slo)
    every = placements
    placements, refused = _runnable(ctx, placements)
    if args.include_refused:  # ranked too, never written
        placements = every
    if not placements:
        print(
            f"pdserve tune: the launcher refuses every placement on {args.devices} {ctx.unit}s, "
            f"e.g. {next(iter(refused))}: {next(iter(refused.values()))[0]} "
            f"(--include-refused ranks them anyway, to plan hardware)",
            file=sys.stderr,
        )
        return 2
    search = Search(profile, workload, slo, **{name: getattr(args, name) for name in SEARCH_ARGS})
    cands = search.run(
        placements, verify_top=args.verify_top, deadline_s=args.time_limit, prune=not args.seeds
    )  # a band needs every finalist's full goodput
    seeded_note = _seeded_bands(args, profile, search, cands)
    elapsed = time.perf_counter() - t0
    _print_inputs(ctx, search, len(placements), refused, elapsed)
    _print_ranking(ctx, search, cands, seeded_note)
    best = (
        cands[0]
        if cands and cands[0].status not in ("no-rate", "dropped") and cands[0].score > 0
        else None
    )
    if best is None:
        print(
            f"\nno placement meets the SLO at any rate tried: loosen the SLO or add {ctx.unit}s",
            file=sys.stderr,
        )
        return 1
    unit = ctx.unit
    print(
        f"\nbest: {best.placement.label()}: {best.score:.3g} req/s on "
        f"{best.placement.num_devices} {unit}s = {best.per_device:.3g} req/s per {unit} "
        f"(predicted, {best.status})"
    )
    _print_stages(ctx, cands, best)
    if best.placement.label() in refused:
        print(
            f"note: `pdserve up` refuses {best.placement.label()} today "
            f"({refused[best.placement.label()][0]}): --out writes none",
            file=sys.stderr,
        )
        return 1 if args.out else 0
    if args.planner:
        from pdserve.tuning.shift_goodput import planner_report

        planner_report(args, profile, workload, slo, cands, unit)
    try:
        if args.out:
            _write_yaml(ctx, best)
    except TuneError as e:
        print(f"pdserve tune: {e}", file=sys.stderr)
        return 1
    if args.plot:
        title = f"{profile.model_id}, {args.devices} {unit}s, {slo.describe()}"
        plot(args.plot, cands, unit, title, slo.attainment, args.objective)
        print(f"wrote {args.plot}")
    return 0


@dataclass(frozen=True)
class _Context:
    """What one `pdserve tune` run decided from its arguments, for the steps that follow."""

    args: argparse.Namespace
    profile: Profile
    workload: list[RequestSpec]
    slo: SLO

    @property
    def unit(self) -> str:
        return "GPU" if self.profile.device == "gpu" else "core"

    @property
    def backend(self) -> str:
        return self.args.backend or self.profile.best_backend()

    @property
    def model(self) -> str:
        return self.args.model or self.profile.model_name

    def yaml(self, cand: Candidate) -> dict:
        """The deploy YAML of `cand` as --out would write it."""
        a = self.args
        return deploy_yaml(
            cand,
            self.profile,
            self.model,
            self.backend,
            router_host=a.router_host,
            router_port=a.router_port,
            ray_address=a.ray_address,
        )


def _placements(args, profile: Profile, workload: list[RequestSpec]) -> list:
    """The candidates (tuner.enumerate_placements) for the arguments; TuneError if none fits."""
    placements = enumerate_placements(
        profile,
        args.devices,
        colocated=args.colocated,
        tp_degrees=_tp_degrees(args, profile),
        backend=args.backend,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        pipeline=args.pp,
        min_kv_tokens=_longest_prompt(workload),
    )
    if not placements:
        raise TuneError(
            f"--devices {args.devices}: no placement fits: every worker shape of the "
            f"profile's TP degrees {profile.tp_degrees} (and prefill stages) on that many "
            f"devices leaves its weights no room for KV"
        )
    return placements


def _print_stages(ctx: _Context, cands: list, best: Candidate) -> None:
    """Whether the best runs its prefill pool in pipeline stages, and why (tune_report.pp_notes),
    for a full step: max_num_batched_tokens, or the longest prompt if shorter."""
    longest = _longest_prompt(ctx.workload)
    for line in pp_notes(
        ctx.profile,
        cands,
        best,
        tokens=min(ctx.args.max_num_batched_tokens, longest),
        num_devices=ctx.args.devices,
        min_kv_tokens=longest,
        unit=ctx.unit,
    ):
        print(line)


def _longest_prompt(workload: list[RequestSpec]) -> int:
    """The KV one prefill worker must hold at least: the longest prompt of the workload."""
    return max((r.prompt_len for r in workload), default=1)


def _runnable(ctx: _Context, placements: list) -> tuple[list, dict[str, list[str]]]:
    """The placements `pdserve up` runs today, and those it refuses (e.g. tp > 1 prefill or
    decode workers on GPUs) with why: shown, never simulated or written."""
    refused: dict[str, list[str]] = {}
    runnable = []
    for pl in placements:
        why = launcher_problems(ctx.yaml(Candidate(pl)), ctx.profile)
        if why:
            refused[pl.label()] = why
        else:
            runnable.append(pl)
    return runnable, refused


def _seeded_bands(args, profile: Profile, search: Search, cands: list) -> str | None:
    """--seeds: each finalist bisected again once per seed with the profile's step-time
    variation; the note to print about it, if any."""
    if args.seeds and not profile.has_step_variation:
        return (
            f"note: --seeds {args.seeds} skipped: the profile has no step-time variation "
            f"(serving step_noise / step_speed: experiments/calibration.fit_load, run by "
            f"experiments/slo_validation.py, or pooled by experiments/slo_pooled.py)"
        )
    if not args.seeds:
        return None
    for cand in [c for c in cands if c.status.startswith("simulated")][: args.verify_top]:
        search.band(cand, args.seeds)
    banded = [c for c in cands if c.seeded]
    if (
        len(banded) >= 2
        and seeded_percentiles(banded[1].seeded)[2] >= seeded_percentiles(banded[0].seeded)[0]
    ):
        return (
            f"note: with the profile's step-time variation ({args.seeds} seeds) the goodput "
            f"bands of {banded[0].placement.label()} and {banded[1].placement.label()} "
            f"overlap: on this hardware either may measure best in one run"
        )
    return None


def _print_inputs(ctx: _Context, search: Search, num: int, refused: dict, elapsed: float) -> None:
    """The profile, the workload, the SLO and what was searched."""
    args, profile, workload, unit = ctx.args, ctx.profile, ctx.workload, ctx.unit
    reqs = search.base
    mean_p = sum(r.prompt_len for r in reqs) / len(reqs)
    mean_o = sum(r.output_len for r in reqs) / len(reqs)
    print(
        f"profile {args.profile}: {profile.model_id} on {profile.device}"
        f"{' (DERIVED, not measured)' if profile.derived else ''}; KV backend {ctx.backend}"
    )
    print(
        f"workload {args.workload}: mean prompt {mean_p:.0f}, mean output {mean_o:.0f} tokens "
        f"(sample of {len(reqs)}); SLO {ctx.slo.describe()}"
    )
    shared = sum(1 for r in workload if r.block_ids)
    if shared:
        print(
            f"note: prefix caching is not simulated: {shared} of {len(workload)} requests name "
            f"shared prefix blocks (hash_ids), but every prompt is computed in full, so the "
            f"goodput is a lower bound where the engine's prefix cache would hit"
        )
    print(
        f"{num} placements on {args.devices} {unit}s, ranked by "
        f"{'total goodput' if args.objective == 'total' else 'goodput per ' + unit} "
        f"(--objective {args.objective}); {search.num_sims} simulations "
        f"in {elapsed:.1f} s; steady-state horizon {search.horizon_s:.0f} s of arrivals"
    )
    if refused and args.include_refused:
        first = next(iter(refused.values()))[0]
        print(
            f"{len(refused)} of them `pdserve up` refuses today, ranked anyway "
            f"(--include-refused; never written): {', '.join(list(refused)[:4])}"
            f"{', ...' if len(refused) > 4 else ''} ({first})"
        )
    elif refused:
        first = next(iter(refused.values()))[0]
        print(
            f"{len(refused)} more placements left out, refused by `pdserve up` today: "
            f"{', '.join(list(refused)[:4])}{', ...' if len(refused) > 4 else ''} ({first})"
        )
    print()


def _print_ranking(ctx: _Context, search: Search, cands: list, seeded_note: str | None) -> None:
    """One worker of each kind alone, the ranked table and what its columns mean."""
    args, unit = ctx.args, ctx.unit
    print(
        "one worker alone (prefill: ideal decode side; decode: ideal prefill), req/s; '>=': "
        f"passed at {search.max_rate:.3g} req/s, the most that --max-requests {args.max_requests} "
        f"can show in steady state:"
    )
    print(instances_table(search, unit) + "\n")
    print(table(cands, args.top, unit))
    print("\n" + BASIS_NOTE)
    print(
        "estimate: min(prefill replicas x one prefill worker, decode replicas x one decode "
        "worker); simulated: the whole deployment (its smallest repeating unit)"
        + (
            "; seeded: simulated again with the profile's step-time variation, one bisection "
            "per seed (the ranking uses the unseeded goodput)"
            if any(c.seeded for c in cands)
            else ""
        )
    )
    if seeded_note:
        print(seeded_note)
    if search.timed_out:
        print(
            f"note: stopped after --time-limit {args.time_limit:g} s; candidates marked "
            f"'estimate' were not simulated whole",
            file=sys.stderr,
        )


def _write_yaml(ctx: _Context, best: Candidate) -> None:
    """--out: the best placement as a deploy YAML, its header saying where it came from."""
    args, profile, unit = ctx.args, ctx.profile, ctx.unit
    header = [
        f"pdserve tune: {best.placement.label()}, predicted goodput {best.score:.3g} req/s "
        f"({best.per_device:.3g} per {unit}, {best.status})",
        f"SLO {ctx.slo.describe()}; workload {args.workload} (scale {args.scale}, "
        f"max prompt {args.max_prompt}, max output {args.max_output})",
        f"profile {args.profile}" + (" (DERIVED, not measured)" if profile.derived else ""),
        f"ranked by --objective {args.objective} on {args.devices} {unit}s; checked "
        f"against the launcher's refusals (`pdserve up --check` re-checks on the machine)",
    ]
    write_yaml(args.out, ctx.yaml(best), header, profile)
    print(f"wrote {args.out}")
