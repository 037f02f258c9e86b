"""The report of benchmarks/engine/bench.py: the two sides' results combined into one JSON report with
its summary against the targets (combine, modes_summary), and that report rendered as the markdown
tables the script prints (render, render_modes)."""

from __future__ import annotations

import os
import sys

from benchmarks.bench_common import CONTENTION_WARN_CORES, TOKEN_HI, TOKEN_LO, fmt, git_head

TARGET_DECODE_RATIO = 2.5
TARGET_TTFT_RATIO = 1.0
TARGET_PREFIX_SPEEDUP = 5.0


# ---- the JSON report --------------------------------------------------------------------------
def get(d: dict, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def agreement(a: list[list[int]] | None, b: list[list[int]] | None) -> dict | None:
    """How far pdserve's greedy outputs agree with HF's (same prompts)."""
    if not a or not b or len(a) != len(b):
        return None
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        prefixes.append(n)
    return {
        "identical_requests": sum(1 for x, y in zip(a, b) if x == y),
        "num_requests": len(a),
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "min_common_prefix": min(prefixes),
    }


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def combine(args, hf: dict, pd: dict, command: str) -> dict:
    N, P, M = args.num_requests, args.prompt_len, args.new_tokens
    hf_dec, pd_dec = get(hf, "decode", "decode_tok_s"), get(pd, "decode", "decode_tok_s")
    hf_e2e, pd_e2e = get(hf, "decode", "e2e_tok_s"), get(pd, "decode", "e2e_tok_s")
    hf_ttft, pd_ttft = get(hf, "ttft512", "median_s"), get(pd, "ttft512", "median_s")
    cold, hot = get(pd, "prefix", "cold_median_s"), get(pd, "prefix", "cached_median_s")
    ratio = lambda a, b: (a / b) if (a is not None and b) else None  # noqa: E731
    dec_ratio, e2e_ratio = ratio(pd_dec, hf_dec), ratio(pd_e2e, hf_e2e)
    ttft_ratio, speedup = ratio(pd_ttft, hf_ttft), ratio(cold, hot)
    summary = {
        "decode": {
            "hf_tok_s": hf_dec,
            "pdserve_tok_s": pd_dec,
            "ratio": dec_ratio,
            "target": f">= {TARGET_DECODE_RATIO}x HF decode-only",
            "pass": None if dec_ratio is None else dec_ratio >= TARGET_DECODE_RATIO,
        },
        "e2e": {"hf_tok_s": hf_e2e, "pdserve_tok_s": pd_e2e, "ratio": e2e_ratio},
        # from each side's median decode-step time: the same comparison, insensitive to bursts of
        # VM slowness that land on one side's wall time and not the other's
        "decode_median_step": {
            "hf_tok_s": get(hf, "decode", "decode_tok_s_median_step"),
            "pdserve_tok_s": get(pd, "decode", "decode_tok_s_median_step"),
            "ratio": ratio(
                get(pd, "decode", "decode_tok_s_median_step"),
                get(hf, "decode", "decode_tok_s_median_step"),
            ),
        },
        "ttft512": {
            "hf_forward_median_s": hf_ttft,
            "hf_forward_best_s": get(hf, "ttft512", "best_s"),
            "pdserve_median_s": pd_ttft,
            "pdserve_best_s": get(pd, "ttft512", "best_s"),
            "ratio": ttft_ratio,
            "target": "pdserve median <= HF forward median",
            "pass": None if ttft_ratio is None else ttft_ratio <= TARGET_TTFT_RATIO,
        },
        "prefix": {
            "cold_median_s": cold,
            "cached_median_s": hot,
            "speedup": speedup,
            "target": f">= {TARGET_PREFIX_SPEEDUP}x faster than cold",
            "pass": None if speedup is None else speedup >= TARGET_PREFIX_SPEEDUP,
        },
        "peak_rss": {
            "hf_bytes": get(hf, "memory_peak", "ru_maxrss_bytes"),
            "pdserve_bytes": get(pd, "memory_peak", "ru_maxrss_bytes"),
            "hf_vm_hwm_bytes": get(hf, "memory_peak", "vm_hwm_bytes"),
            "pdserve_vm_hwm_bytes": get(pd, "memory_peak", "vm_hwm_bytes"),
            "pdserve_kv_cache_bytes": get(pd, "kv_cache", "bytes"),
            "pdserve_kv_cache_blocks": get(pd, "kv_cache", "num_blocks"),
        },
        "output_agreement": agreement(
            get(hf, "decode", "output_token_ids"), get(pd, "decode", "output_token_ids")
        ),
    }
    return {
        "command": command,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "git_head": git_head(),
        "quick": args.quick,
        "config": {
            "num_requests": N,
            "prompt_len": P,
            "new_tokens": M,
            "ttft_len": args.ttft_len,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "repeats": args.repeats,
            "prefill_repeats": args.prefill_repeats,
            "threads": args.threads,
            "dtype": "float32",
            "greedy": True,
            "model": args.model,
            "kv_cache_memory": args.kv_cache_memory,
            "wait_idle_s": args.wait_idle,
            "token_id_range": [TOKEN_LO, TOKEN_HI],
        },
        "machine": hf.get("machine") or pd.get("machine"),
        "summary": summary,
        "hf": hf,
        "pdserve": pd,
    }


def modes_summary(hf: dict, runs: dict, lc: dict) -> dict:
    """Per pdserve mode, against HF float32 (and llama.cpp's one stream) measured in the same run."""
    ratio = lambda a, b: (a / b) if (a is not None and b) else None  # noqa: E731
    hf_dec, hf_one = get(hf, "decode", "decode_tok_s"), get(hf, "one_stream", "decode_tok_s")
    hf_ttft, lc_one = get(hf, "ttft512", "median_s"), get(lc, "one_stream", "decode_tok_s")
    out = {
        "hf": {"decode_tok_s": hf_dec, "one_stream_tok_s": hf_one, "ttft512_s": hf_ttft},
        "llamacpp": {"one_stream_tok_s": lc_one, "how": lc.get("how"), "error": lc.get("error")},
        "pdserve": {},
    }
    for m, pd in runs.items():
        dec, one, ttft = (
            get(pd, "decode", "decode_tok_s"),
            get(pd, "one_stream", "decode_tok_s"),
            get(pd, "ttft512", "median_s"),
        )
        out["pdserve"][m] = {
            "mode_note": get(pd, "mode", "note"),
            "error": pd.get("error"),
            "decode_tok_s": dec,
            "decode_vs_hf": ratio(dec, hf_dec),
            "one_stream_tok_s": one,
            "one_stream_vs_hf": ratio(one, hf_one),
            "one_stream_vs_llamacpp": ratio(one, lc_one),
            "ttft512_s": ttft,
            "ttft512_vs_hf": ratio(ttft, hf_ttft),
        }
    return out


# ---- markdown -----------------------------------------------------------------------------------
def render_modes(summary: dict, args) -> str:
    hf, lc = summary["hf"], summary["llamacpp"]
    ms = lambda x: None if x is None else x * 1000  # noqa: E731
    lines = [
        f"### Serving modes vs HF float32 and llama.cpp (same run; {args.num_requests} concurrent "
        f"x {args.prompt_len} prompt x {args.new_tokens} new; one stream {args.prompt_len} + "
        f"{args.new_tokens}; TTFT of {args.ttft_len} tokens)",
        "",
        f"| side | decode tok/s, {args.num_requests} concurrent | vs HF | one stream tok/s | vs HF | vs llama.cpp "
        "| TTFT 512 ms | vs HF |",
        "|---|---|---|---|---|---|---|---|",
        f"| HF transformers float32 | {fmt(hf['decode_tok_s'])} | 1.00x | {fmt(hf['one_stream_tok_s'])} "
        f"| 1.00x | - | {fmt(ms(hf['ttft512_s']), '.0f')} | 1.00x |",
        f"| llama.cpp (same GGUF) | - | - | {fmt(lc['one_stream_tok_s'])} | "
        f"{fmt(lc['one_stream_tok_s'] / hf['one_stream_tok_s'] if lc['one_stream_tok_s'] and hf['one_stream_tok_s'] else None, '.2f', 'x')} "
        f"| 1.00x | - | - |",
    ]
    for m, r in summary["pdserve"].items():
        lines.append(
            f"| pdserve {m} | {fmt(r['decode_tok_s'])} | {fmt(r['decode_vs_hf'], '.2f', 'x')} "
            f"| {fmt(r['one_stream_tok_s'])} | {fmt(r['one_stream_vs_hf'], '.2f', 'x')} "
            f"| {fmt(r['one_stream_vs_llamacpp'], '.2f', 'x')} | {fmt(ms(r['ttft512_s']), '.0f')} "
            f"| {fmt(r['ttft512_vs_hf'], '.2f', 'x')} |"
        )
    lines.append("")
    lines += [
        f"- {m}: {r['mode_note']}" for m, r in summary["pdserve"].items() if r.get("mode_note")
    ]
    if lc.get("how"):
        lines.append(f"- llama.cpp: llama-cpp-python {lc['how']}")
    return "\n".join(lines)


def render(report: dict) -> str:
    c, s, m = report["config"], report["summary"], report["machine"] or {}
    hf, pd = report["hf"], report["pdserve"]
    N, P, M = c["num_requests"], c["prompt_len"], c["new_tokens"]
    mib = lambda b: None if b is None else b / 2**20  # noqa: E731
    ms = lambda x: None if x is None else x * 1000  # noqa: E731
    runs_ms = lambda xs: [round(x * 1000, 1) for x in xs]  # noqa: E731
    lines = [
        f"## pdserve engine benchmark{' (QUICK smoke run)' if report['quick'] else ''}",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {m.get('cpu_model')} ({m.get('cpu_count')} cpus), torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}, threads {m.get('torch_num_threads')}, "
        f"python {m.get('python')}, {m.get('date_utc')}, commit {report.get('git_head')}",
        f"- CPU flags: {' '.join(m.get('cpu_flags') or [])}",
        f"- model {c['model']}, pdserve {c['dtype']} (HF float32), greedy; prompts = random token ids in "
        f"[{c['token_id_range'][0]}, {c['token_id_range'][1]})",
        "",
        "| metric | HF transformers | pdserve | pdserve/HF | target | result |",
        "|---|---|---|---|---|---|",
        f"| decode-only tok/s ({N} req x {P} prompt, {M} new) | {fmt(s['decode']['hf_tok_s'])} "
        f"| {fmt(s['decode']['pdserve_tok_s'])} | {fmt(s['decode']['ratio'], '.2f', 'x')} "
        f"| >= {TARGET_DECODE_RATIO}x | {verdict(s['decode']['pass'])} |",
        f"| decode tok/s from the median step time | {fmt(s['decode_median_step']['hf_tok_s'])} "
        f"| {fmt(s['decode_median_step']['pdserve_tok_s'])} "
        f"| {fmt(s['decode_median_step']['ratio'], '.2f', 'x')} | (same target) | - |",
        f"| end-to-end tok/s ({N}x{M} / total) | {fmt(s['e2e']['hf_tok_s'])} "
        f"| {fmt(s['e2e']['pdserve_tok_s'])} | {fmt(s['e2e']['ratio'], '.2f', 'x')} | (info) | - |",
        f"| TTFT, fresh {c['ttft_len']}-token prompt, median ms (HF: one forward) "
        f"| {fmt(ms(s['ttft512']['hf_forward_median_s']))} | {fmt(ms(s['ttft512']['pdserve_median_s']))} "
        f"| {fmt(s['ttft512']['ratio'], '.2f', 'x')} | <= 1.0x | {verdict(s['ttft512']['pass'])} |",
        f"| TTFT cold {c['prefix_len']}+{c['suffix_len']} tokens, median ms | - "
        f"| {fmt(ms(s['prefix']['cold_median_s']))} | - | - | - |",
        f"| TTFT cached {c['prefix_len']}-prefix + {c['suffix_len']} fresh, median ms | - "
        f"| {fmt(ms(s['prefix']['cached_median_s']))} | cold/cached = "
        f"{fmt(s['prefix']['speedup'], '.1f', 'x')} | >= {TARGET_PREFIX_SPEEDUP}x | "
        f"{verdict(s['prefix']['pass'])} |",
        f"| peak RSS MiB (ru_maxrss, own process) | {fmt(mib(s['peak_rss']['hf_bytes']), '.0f')} "
        f"| {fmt(mib(s['peak_rss']['pdserve_bytes']), '.0f')} "
        f"| {fmt((s['peak_rss']['pdserve_bytes'] or 0) / s['peak_rss']['hf_bytes'], '.2f', 'x') if s['peak_rss']['hf_bytes'] and s['peak_rss']['pdserve_bytes'] else 'n/a'} "
        f"| printed | INFO |",
        "",
        "Details:",
    ]
    hd, ht = hf.get("decode", {}), hf.get("ttft512", {})
    pdd, pt, pp = pd.get("decode", {}), pd.get("ttft512", {}), pd.get("prefix", {})
    if "t_total_s" in hd:
        lines.append(
            f"- HF decode: prefill {hd['t_prefill_s']:.2f} s (median of "
            f"{[round(x, 2) for x in hd['t_prefill_runs_s']]}), generate total "
            f"{hd['t_total_s']:.2f} s -> decode {hd['t_total_s'] - hd['t_prefill_s']:.2f} s "
            f"for {N}x{M - 1} tokens"
        )
    if "t_total_s" in pdd:
        lines.append(
            f"- pdserve decode: total {pdd['t_total_s']:.2f} s in {pdd['num_steps']} steps; "
            f"all first tokens after {pdd['num_prefill_phase_steps']} steps / "
            f"{pdd['t_all_first_token_s']:.2f} s; then {pdd['decode_tokens']} tokens in "
            f"{pdd['decode_time_s']:.2f} s; prefix-cache hits "
            f"{sum(pdd['num_cached_tokens'])} tokens; preemptions {pdd['num_preemptions']}"
        )
    if "runs_s" in ht:
        lines.append(
            f"- HF forward {c['ttft_len']} runs ms: {runs_ms(ht['runs_s'])} "
            f"(best {ht['best_s'] * 1000:.1f}); with logits_to_keep=1 (info): "
            f"{runs_ms(ht['logits_to_keep1_runs_s'])}"
        )
    if "runs_s" in pt:
        lines.append(
            f"- pdserve TTFT {c['ttft_len']} runs ms: {runs_ms(pt['runs_s'])} "
            f"(best {pt['best_s'] * 1000:.1f}); cached tokens {pt['num_cached_tokens']}"
        )
    if "cold_runs_s" in pp:
        lines.append(
            f"- prefix: cold runs ms {runs_ms(pp['cold_runs_s'])} "
            f"(cached tokens {pp['cold_num_cached_tokens']}); cached runs ms "
            f"{runs_ms(pp['cached_runs_s'])} (cached tokens {pp['cached_num_cached_tokens']})"
        )
    kv = pd.get("kv_cache")
    if kv:
        lines.append(
            f"- pdserve KV cache: {kv['bytes']} bytes ({kv['bytes'] / 2**20:.0f} MiB), "
            f"{kv['num_blocks']} blocks x {kv['block_size']} tokens "
            f"({kv['num_blocks'] * kv['block_size']} token slots), shape {kv['shape']}, "
            f"kv_cache_memory={kv['kv_cache_memory_config']}"
        )
    for side, r in (("HF", hf), ("pdserve", pd)):
        mp, ml = r.get("memory_peak") or {}, r.get("memory_after_load") or {}
        if mp:
            lines.append(
                f"- {side} memory: after load RSS {ml.get('vm_rss_bytes', 0) / 2**20:.0f} MiB; "
                f"peak ru_maxrss {mp['ru_maxrss_bytes'] / 2**20:.0f} MiB, "
                f"VmHWM {mp['vm_hwm_bytes'] / 2**20:.0f} MiB; load {r.get('load_s', 0):.1f} s"
            )
    contended = []
    for side, r in (("HF", hf), ("pdserve", pd)):
        for name, cpu in (r.get("cpu_contention") or {}).items():
            f = cpu.get("foreign_cores_avg")
            if name != "warmup" and f is not None:
                contended.append(f"{side} {name} {f:.2f}")
    if contended:
        worst = max(float(x.rsplit(" ", 1)[1]) for x in contended)
        lines.append(
            f"- CPU used by OTHER processes during each section (avg cores of "
            f"{m.get('cpu_count')}): {', '.join(contended)}"
            + (
                " -- WARNING: the machine was shared, timings are disturbed"
                if worst >= CONTENTION_WARN_CORES
                else ""
            )
        )
    ag = s.get("output_agreement")
    if ag:
        lines.append(
            f"- greedy output agreement pdserve vs HF: {ag['identical_requests']}/"
            f"{ag['num_requests']} requests identical, mean common prefix "
            f"{ag['mean_common_prefix']:.1f}/{M} tokens (min {ag['min_common_prefix']})"
        )
    for side, r in (("HF", hf), ("pdserve", pd)):
        if r.get("error"):
            lines.append(f"- {side} ERROR: {r['error']}")
        for k, v in r.items():
            if isinstance(v, dict) and "error" in v:
                lines.append(f"- {side} {k} ERROR: {v['error']}")
    return "\n".join(lines)
