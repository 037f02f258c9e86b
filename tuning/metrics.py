"""The numbers of a load-generator run: per-request records, latency distributions, SLO attainment,
`vllm bench serve` style summaries and DistServe goodput. Pure functions, no I/O.

Latencies are vLLM's (`vllm bench serve`, vllm/benchmarks/serve.py calculate_metrics): TTFT from
the send to the first delta that carries tokens; ITL one gap per streamed delta after the first
(the gaps between chunks, so a delta of several tokens counts once, as vLLM counts an SSE chunk);
TPOT (E2E - TTFT) / (output tokens - 1) per request; each as mean, median, std and percentiles in
ms under vLLM's keys ("p99_itl_ms"). pdserve's own per-token figure, each delta's gap split evenly
over its tokens (attribute_itl, what the router's ITL histogram counts), is kept apart under
names that say so: `itl_per_token_s`, "p90_itl_per_token_ms".

Two goodputs, named apart:
  request_goodput  vLLM's --goodput: completed requests that meet every SLO, per second, at the
                   load that was offered (one run).
  goodput rate     DistServe's: the highest request rate at which at least `threshold` of the
                   requests meet both the TTFT and the TPOT SLO, interpolated over a rate sweep.
Failed requests (RESOURCE_EXHAUSTED, deadline, ...) count as missing every SLO, so shedding load
cannot raise attainment.

Closed-loop chat sessions (tuning/sessions.py) record each turn as a SessionRecord; summarize_turns
gives their table per turn index (latency, the share of reusable prompt tokens served from a cache)
and compare_runs sets a run with prefix reuse against one without, turn by turn.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the request's own send unless named
    otherwise. `error` is "" for a completed request, else the gRPC status code name (or the
    Finish reason "error"/"abort", or "NO_FINISH")."""

    index: int
    arrival_s: float  # scheduled send, from the run's start
    prompt_len: int
    output_len: int  # max_tokens asked for (ignore_eos: the tokens expected)
    send_s: float = 0.0  # actual send, from the run's start (open loop: ~arrival_s)
    send_unix_ns: int = 0
    ttft_s: float | None = None  # first TokenDelta that carries tokens
    e2e_s: float | None = None  # the end of the stream
    # vLLM's ITL: one gap per token-carrying delta after the first (between streamed chunks)
    itl_s: list[float] = field(default_factory=list)
    # pdserve's per-token split of the same gaps: one per output token after the first
    itl_per_token_s: list[float] = field(default_factory=list)
    client_queue_s: float = 0.0  # waiting for a --max-concurrency slot before the send
    output_tokens: int = 0
    cached_prompt_tokens: int = 0
    kv_transfer_bytes: int = 0  # Finish.usage: KV the prefill worker pushed to the decode worker
    finish_reason: str = ""
    error: str = ""
    error_message: str = ""
    timings: dict = field(default_factory=dict)  # Finish.timings: unix ns stamps, worker names

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than 2 tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return dict(asdict(self), tpot_s=self.tpot_s)


@dataclass
class SessionRecord(RequestRecord):
    """One turn of a closed-loop chat session: the request's record plus its place in the session,
    the prompt tokens a cache could hold for it (the previous turn's prompt and answer; 0 on turn
    1) and the cache hits the server reported. `cache_hits` is Finish.usage.cache_hits by source
    (prefill_worker, decode_worker), None when the server does not report
    them. `prompt_ids` stays out of to_json (the prompts are rebuilt from the seed and the
    answers); `answer_ids` is kept, so two runs' answers can be compared."""

    session: int = 0
    turn: int = 1  # 1-based
    reusable_prompt_tokens: int = 0
    cache_hits: dict[str, int] | None = None
    answer_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        out = super().to_json()
        del out["prompt_ids"]
        return out


def summarize_turns(
    records: list[SessionRecord], planned: dict[int, int] | None = None
) -> list[dict]:
    """One row per turn index (ascending): requests sent, completed, errors by code, turns planned
    but not sent because an earlier turn of their session failed (`planned`: turn -> sessions that
    have it), TTFT and ITL distributions (ms, the `distribution` keys; median = P50), prompt
    tokens, and the hit share: cached prompt tokens over reusable prompt tokens, summed over the
    completed requests (None on a turn with nothing reusable, e.g. turn 1; a shared document can
    still give turn 1 cached tokens). Cache hits by source are summed where the server reports
    them."""
    turns = sorted({r.turn for r in records} | set(planned or ()))
    rows = []
    for k in turns:
        sent = [r for r in records if r.turn == k]
        done = [r for r in sent if r.ok]
        errors: dict[str, int] = {}
        for r in sent:
            if not r.ok:
                errors[r.error] = errors.get(r.error, 0) + 1
        reusable = sum(r.reusable_prompt_tokens for r in done)
        cached = sum(r.cached_prompt_tokens for r in done)
        reported = [r.cache_hits for r in done if r.cache_hits is not None]
        by_source: dict[str, int] | None = None
        if reported:
            by_source = {}
            for hits in reported:
                for source, n in hits.items():
                    by_source[source] = by_source.get(source, 0) + n
        ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
        row = dict(
            turn=k,
            requests=len(sent),
            completed=len(done),
            failed=len(sent) - len(done),
            errors=errors,
            skipped=max(0, (planned or {}).get(k, len(sent)) - len(sent)),
            mean_prompt_tokens=(sum(r.prompt_len for r in sent) / len(sent)) if sent else None,
            reusable_prompt_tokens=reusable,
            cached_prompt_tokens=cached,
            hit_share=cached / reusable if reusable else None,
            cache_hits=by_source,
            sum_ttft_s=sum(ttfts),
            output_tokens=sum(r.output_tokens for r in done),
        )
        row.update(distribution(ttfts, "ttft"))
        row.update(distribution([g for r in done for g in r.itl_s], "itl"))
        rows.append(row)
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_runs(on: dict, off: dict) -> dict:
    """Reuse on against reuse off, for two runs of the same sessions; each run is
    {"summary": summarize(...), "turns": summarize_turns(...)}. Per turn index in both: TTFT
    P50 and P90 ratios and the ITL P90 ratio (on / off: below 1 is faster with reuse), the mean
    TTFT saved per request (ms, off - on) and the TTFT saved over the turn's completed requests
    (s, sum off - sum on; comparable when both completed the same number). Overall: the same
    ratios over every request, throughput ratios and the wall time saved (s, off - on)."""
    off_by_turn = {t["turn"]: t for t in off["turns"]}
    turns = []
    for a in on["turns"]:
        b = off_by_turn.get(a["turn"])
        if b is None:
            continue
        saved = (
            b["mean_ttft_ms"] - a["mean_ttft_ms"]
            if a["mean_ttft_ms"] is not None and b["mean_ttft_ms"] is not None
            else None
        )
        turns.append(
            dict(
                turn=a["turn"],
                completed=(a["completed"], b["completed"]),
                ttft_p50_ratio=_ratio(a["median_ttft_ms"], b["median_ttft_ms"]),
                ttft_p90_ratio=_ratio(a["p90_ttft_ms"], b["p90_ttft_ms"]),
                itl_p90_ratio=_ratio(a["p90_itl_ms"], b["p90_itl_ms"]),
                ttft_saved_ms_mean=saved,
                ttft_saved_s=b["sum_ttft_s"] - a["sum_ttft_s"],
                hit_share=(a["hit_share"], b["hit_share"]),
            )
        )
    s, t = on["summary"], off["summary"]
    overall = dict(
        completed=(s["completed"], t["completed"]),
        ttft_p50_ratio=_ratio(s["median_ttft_ms"], t["median_ttft_ms"]),
        ttft_p90_ratio=_ratio(s["p90_ttft_ms"], t["p90_ttft_ms"]),
        itl_p90_ratio=_ratio(s["p90_itl_ms"], t["p90_itl_ms"]),
        request_throughput_ratio=_ratio(s["request_throughput"], t["request_throughput"]),
        output_throughput_ratio=_ratio(s["output_throughput"], t["output_throughput"]),
        time_saved_s=t["duration"] - s["duration"],
    )
    return dict(turns=turns, overall=overall)


def same_answers(a: list[SessionRecord], b: list[SessionRecord]) -> dict:
    """How many turns completed in both runs returned the same token ids (greedy decoding with
    reuse on and off must agree), and which (session, turn) pairs differed (at most 10)."""
    theirs = {(r.session, r.turn): r.answer_ids for r in b if r.ok}
    both = [(r.session, r.turn, r.answer_ids) for r in a if r.ok and (r.session, r.turn) in theirs]
    differ = [(s, k) for s, k, ids in both if ids != theirs[(s, k)]]
    return dict(compared=len(both), identical=len(both) - len(differ), differ=differ[:10])


def attribute_itl(times: list[float], counts: list[int]) -> list[float]:
    """Inter-token gaps from the arrival times of the deltas that carried tokens and their token
    counts. A delta may carry several tokens: its gap from the previous delta is split evenly over
    them. Tokens that came in the first delta with the first token get gaps of 0. So there is one
    gap per token after the first and the gaps sum to the last delta's time minus the first's."""
    if len(times) != len(counts):
        raise ValueError(f"{len(times)} delta times but {len(counts)} token counts")
    if not times:
        return []
    gaps = [0.0] * (counts[0] - 1)
    for prev, now, n in zip(times, times[1:], counts[1:]):
        gaps += [(now - prev) / n] * n
    return gaps


def parse_positive_list(text: str, what: str) -> list[float]:
    """ "0.5,1,2" -> [0.5, 1.0, 2.0]; every value finite and > 0."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"{what} {text!r}: expected comma-separated numbers, e.g. 0.5,1,2,4"
        ) from None
    bad = [v for v in values if not (v > 0 and math.isfinite(v))]
    if not values or bad:
        raise ValueError(f"{what} {text!r}: every value must be a number > 0")
    return values


def distribution(values_s: list[float], name: str) -> dict[str, float | None]:
    """mean/median/p90/p99 of `values_s` (seconds) in ms, keyed as vLLM does ("p90_ttft_ms")."""
    keys = [f"{k}_{name}_ms" for k in ("mean", "median", "p90", "p99")]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=float) * 1e3
    stats = (a.mean(), np.median(a), np.percentile(a, 90), np.percentile(a, 99))
    return {k: float(v) for k, v in zip(keys, stats)}


def percentile_key(p: float) -> str:
    """A percentile's name in a key, as vLLM writes it: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def latency_stats(
    values_s: list[float], name: str, percentiles: tuple[float, ...] = (90, 99)
) -> dict[str, float | None]:
    """vLLM's statistics of `values_s` (seconds) in ms: mean, median, std (numpy's, ddof 0) and
    each percentile (numpy's linear interpolation), keyed "mean_itl_ms", "std_itl_ms",
    "p99_itl_ms"; None each when there are no values."""
    keys = [f"{k}_{name}_ms" for k in ("mean", "median", "std")]
    keys += [f"{percentile_key(p)}_{name}_ms" for p in percentiles]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=float) * 1e3
    stats = [a.mean(), np.median(a), a.std(), *(np.percentile(a, p) for p in percentiles)]
    return {k: float(v) for k, v in zip(keys, stats)}


def meets_slo(r: RequestRecord, slo: dict[str, float], scale: float = 1.0) -> bool:
    """Completed and within every SLO (each multiplied by `scale`); a single-token output has no
    TPOT and meets a TPOT SLO, as in vLLM."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    return all(values[k] is None or values[k] <= limit * scale for k, limit in slo.items())


def attainment(records: list[RequestRecord], slo: dict[str, float], scale: float = 1.0) -> float:
    """Share of all requests (failed ones included, as misses) that meet every SLO."""
    if not records:
        return 0.0
    return sum(meets_slo(r, slo, scale) for r in records) / len(records)


def goodput_rate(rates: list[float], attainments: list[float], threshold: float = 0.9) -> dict:
    """DistServe goodput from a sweep: the highest rate with attainment >= threshold, linearly
    interpolated between the last swept rate at or above the threshold and the next one below.
    Returns {"rate", "lower_bound", "note"}: rate 0 when even the lowest rate misses;
    lower_bound when the highest rate swept still meets it (the true goodput is higher)."""
    if len(rates) != len(attainments) or not rates:
        raise ValueError(
            f"need one attainment per rate, got {len(rates)} rates, {len(attainments)} attainments"
        )
    points = sorted(zip(rates, attainments))
    above = [i for i, (_, a) in enumerate(points) if a >= threshold]
    if not above:
        return dict(
            rate=0.0,
            lower_bound=False,
            note=f"attainment < {threshold:g} at every rate swept, even {points[0][0]:g} req/s: "
            f"sweep lower rates",
        )
    i = above[-1]
    dipped = any(a < threshold for _, a in points[:i])
    note = (
        f"attainment dips below {threshold:g} at a lower rate and recovers: the highest crossing "
        f"is taken; "
        if dipped
        else ""
    )
    if i == len(points) - 1:
        return dict(
            rate=points[i][0],
            lower_bound=True,
            note=note + f"a lower bound: attainment still >= {threshold:g} at the highest rate "
            f"swept ({points[i][0]:g} req/s): sweep higher rates",
        )
    (r0, a0), (r1, a1) = points[i], points[i + 1]
    rate = r0 + (a0 - threshold) / (a0 - a1) * (r1 - r0)
    return dict(rate=rate, lower_bound=False, note=note.rstrip("; "))


def slo_scale_goodput(
    runs: list[tuple[float, list[RequestRecord]]],
    slo: dict[str, float],
    scales: list[float],
    threshold: float = 0.9,
) -> list[dict]:
    """For each scale, the goodput rate with every SLO multiplied by it, from the same sweep."""
    rates = [rate for rate, _ in runs]
    out = []
    for s in scales:
        att = [attainment(records, slo, s) for _, records in runs]
        out.append(
            dict(
                scale=s,
                slo_s={k: v * s for k, v in slo.items()},
                attainment=att,
                **goodput_rate(rates, att, threshold),
            )
        )
    return out


# the latency metrics a summary holds, by the name in their keys ("p99_<name>_ms"): vLLM's four,
# then pdserve's per-token ITL and the wait for a --max-concurrency slot (vLLM's
# client_queue_time)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "itl_per_token", "client_queue_time")
# the percentiles every summary has (the table's and the sweep's), whatever else is asked for
BASE_PERCENTILES = (90.0, 99.0)


def _latencies(done: list[RequestRecord]) -> dict[str, list[float]]:
    """Each of LATENCY_METRICS' values over the completed requests, in seconds."""
    return dict(
        ttft=[r.ttft_s for r in done],
        tpot=[r.tpot_s for r in done if r.tpot_s is not None],
        itl=[g for r in done for g in r.itl_s],
        e2el=[r.e2e_s for r in done],
        itl_per_token=[g for r in done for g in r.itl_per_token_s],
        client_queue_time=[r.client_queue_s for r in done],
    )


def peak_concurrency(records: list[RequestRecord]) -> int:
    """The most completed requests in flight at once, from their send to their stream's end
    (vLLM's max_concurrent_requests: half-open intervals, an end before a send at the same
    instant)."""
    events = sorted(
        [(r.send_s, 1) for r in records if r.ok and r.e2e_s is not None]
        + [(r.send_s + r.e2e_s, -1) for r in records if r.ok and r.e2e_s is not None]
    )
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (),
) -> dict:
    """The `vllm bench serve` result of one run (throughputs over completed requests): counts,
    throughputs and, for each of LATENCY_METRICS, latency_stats at P90, P99 and `percentiles`.
    max_send_lag_ms is the client's own lateness, a --max-concurrency wait left out."""
    done = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    num_in = sum(r.prompt_len for r in done)
    num_out = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    lag_s = max((r.send_s - r.arrival_s - r.client_queue_s for r in records), default=0.0)
    out = dict(
        completed=len(done),
        failed=len(records) - len(done),
        errors=errors,
        duration=duration_s,
        total_input_tokens=num_in,
        total_output_tokens=num_out,
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in done),
        request_throughput=len(done) * per_s,
        input_throughput=num_in * per_s,
        output_throughput=num_out * per_s,
        total_token_throughput=(num_in + num_out) * per_s,
        max_concurrent_requests=peak_concurrency(records),
        max_send_lag_ms=lag_s * 1e3,
    )
    ps = tuple(sorted(set(BASE_PERCENTILES) | {float(p) for p in percentiles}))
    for name, values in _latencies(done).items():
        out.update(latency_stats(values, name, ps))
    if slo:
        out["slo_s"] = dict(slo)
        out["slo_attainment"] = attainment(records, slo)
        out["request_goodput"] = sum(meets_slo(r, slo) for r in done) * per_s
    out["server_ms"] = server_breakdown(done)
    return out


# `vllm bench serve`'s top-level result keys that a summary has under the same name and meaning
VLLM_TOTALS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_concurrent_requests",
)  # fmt: skip


def vllm_keys(summary: dict, metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> dict:
    """The flat keys `vllm bench serve --save-result` writes, from a summary: the totals, and for
    each metric in `metrics` mean, median, std and each percentile in `percentiles` ("mean_ttft_ms",
    "std_ttft_ms", "p99_ttft_ms"), so that a script written for vLLM's result file reads them.
    As in vLLM, a metric with no values (no request completed; ITL of one-token outputs) reads
    0.0 here, and request_goodput is None without SLOs; the summary keeps None for both."""
    out = {k: summary.get(k) for k in VLLM_TOTALS}
    for name in metrics:
        stats = ("mean", "median", "std", *(percentile_key(p) for p in percentiles))
        for stat in stats:
            value = summary.get(f"{stat}_{name}_ms")
            out[f"{stat}_{name}_ms"] = 0.0 if value is None else value
    return out


def vllm_detailed(records: list[RequestRecord]) -> dict[str, list]:
    """`vllm bench serve --save-detailed`'s per-request lists, in request order: prompt and output
    tokens, TTFT, the ITL gaps, E2E latency, the send time and the --max-concurrency wait (s,
    from the run's start), and the error ("" when completed). A request that failed before its
    first token reads 0.0 for TTFT and latency, as in vLLM. There is no generated text: the
    requests and answers are token ids."""
    return dict(
        input_lens=[r.prompt_len for r in records],
        output_lens=[r.output_tokens if r.ok else 0 for r in records],
        ttfts=[r.ttft_s or 0.0 for r in records],
        itls=[list(r.itl_s) for r in records],
        latencies=[r.e2e_s or 0.0 for r in records],
        start_times=[r.send_s for r in records],
        queue_times=[r.client_queue_s for r in records],
        errors=["" if r.ok else f"{r.error}: {r.error_message}" for r in records],
    )


def server_breakdown(records: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """Mean and p90 (ms) of each server stage (protos/timings.py, the one definition), from
    the Finish timings of the requests that reached it."""
    from pdserve.protos.pdserve.v1 import pdserve_pb2
    from pdserve.protos.timings import STAGES, stage_durations

    fields = set(pdserve_pb2.Timings.DESCRIPTOR.fields_by_name)
    stages = [
        stage_durations(pdserve_pb2.Timings(**{k: v for k, v in r.timings.items() if k in fields}))
        for r in records
    ]
    out = {}
    for name in STAGES:
        values = [d[f"{name}_s"] for d in stages if d[f"{name}_s"] is not None]
        if values:
            d = distribution(values, name)
            out[name] = dict(mean=d[f"mean_{name}_ms"], p90=d[f"p90_{name}_ms"])
    return out
