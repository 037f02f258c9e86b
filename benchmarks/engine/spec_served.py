"""Speculative decoding through `pdserve up` (issue #31, must-show e and the served part of a; the
engine-level figures are benchmarks/engine/spec_decode.py's).

  python -m benchmarks.engine.spec_served                   # ~7 min on 2 cores
  python -m benchmarks.engine.spec_served --wait-idle 120   # first wait for a quiet CPU, each deployment
  python -m benchmarks.engine.spec_served --methods ngram   # no speculation and ngram only
  python -m benchmarks.engine.spec_served --quick --out /tmp/spec_served_quick.json   # smoke run

Starts `pdserve up` three times on the embedded default model (smollm2, dtype "auto": the default
mode), each as a child process with one prefill and one decode worker of one reserved core and one
torch thread each (a small YAML: `deploy_yaml`; the rest by flags, `--port 0 --http-port 0`):
"off" (`--speculative-config null`; left unset it is "auto", prompt lookup in the default
mode), "ngram" (`--speculative-config '{"method": "ngram",
"num_speculative_tokens": 4}'`) and "draft" (`'{"method": "draft_model", "model": "self",
"quantization": "int4", "num_speculative_tokens": 4}'`: the target's own int4 copy). It reads the
router's gRPC address and HTTP URL from the child's stdout and, per deployment:

(0) warm-up: two copy prompts one after the other (64 tokens each), so the gate
    (engine/spec/gate.py) has measured one stream's step costs; before (2), the 32 at once for 16
    tokens. (No prompt is prefilled alone first: how a prompt's prefill is cut into chunks, which
    concurrent arrivals change, no longer changes its outputs, and the comparison shows it.)
(1) one stream at a time over --prompts copy tasks (benchmarks/engine/spec_tasks.py: edit code, quote
    text, summarize text), greedy, max_tokens --new, as gRPC `Generate` with chat messages (the
    router applies the model's chat template; every delta carries token ids, timestamped on
    arrival). Decode tok/s per prompt = tokens after the first delta / (last delta's arrival -
    first's); over all prompts, the sums of both;
(2) 32 concurrent streams (copy_tasks(32), greedy, max_tokens --new32), one client thread each,
    released together; decode tok/s as chaos_harness.decode_rate: tokens received after
    the last request's first token / the time from then to the last token;
(3) on a speculating deployment, (1) and (2) run twice: first with every request opted out
    (SamplingParams.speculative = false), then speculating; the "paired" ratio compares the two
    on the same deployment a minute apart, out of reach of the VM's drift between deployments.
    On "off", (1) and (2) run twice as well ("_repeat"): the deployment against itself;
(4) the router's /metrics before and after each part (once the workers' heartbeats have brought
    the counters to rest): the speculative decoding counters' increase over the part, summed
    over the workers and per worker, and the accepted tokens per draft position (an opted-out
    part should add none).

Every request's tokens are compared with the "off" deployment's (equal count, first mismatch).
Ratios: on / off per method for (1) (over all prompts, per prompt and their median) and (2).
Acceptance = accepted / draft tokens. Each part records other processes' CPU use (this process's
tree, `pdserve up`, Ray and the workers, counts as its own). --dtype float32 serves the float32
target instead of the default mode (the engine bench's draft pair runs there).

Writes benchmarks/results/spec_served.json (--out): the header (command, date, commit, CPU model,
count and ISA flags), per deployment the command, YAML, start table, each part's figures, tokens,
counters and CPU use, and the summary ("summary": per method and part the ratios, token
agreement, acceptance, per-position counts, whether every counter moved).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from benchmarks.bench_common import (
    TreeCpuMonitor,
    add_out_arg,
    add_wait_idle_arg,
    fmt,
    log,
    run_header,
    script_parser,
    wait_for_idle_machine,
    write_result,
)
from benchmarks.chaos_harness import START_TIMEOUT_S, decode_rate, fail_up, start_up, stop_up
from benchmarks.engine.spec_decode import DRAFT, NGRAM
from benchmarks.engine.spec_tasks import compare_tokens, copy_tasks

METHODS = {"off": None, "ngram": NGRAM, "draft": DRAFT}
DECODE_KV_BYTES = 2 << 30  # 32 sequences of ~600 prompt + 128 new tokens fit twice in float32
SPEC_COUNTERS = {  # family (no _total) -> key in the scraped figures
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    "pdserve:spec_decode_draft_prefill_tokens": "draft_prefill_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def deploy_yaml(ray_tmp: str) -> dict:
    """What has no `pdserve up` flag: 1 core and 1 thread per worker, the decode pool's KV, a local
    Ray of 2 CPUs under a short temp dir (Ray's socket paths live under it)."""
    pool = {"resources": {"num_cpus": 1}, "num_threads": 1}
    return {
        "pools": {"prefill": dict(pool), "decode": {**pool, "kv_cache_memory": DECODE_KV_BYTES}},
        "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
    }


def read_stdout(proc: subprocess.Popen, timeout_s: float) -> dict:
    """Reads `proc`'s stdout on a thread of its own until `ready`: the router's gRPC address, the
    HTTP URL, and (in `lines`, filled on) every line, the start table among them."""
    seen, found = threading.Event(), {"lines": []}

    def read():
        for line in proc.stdout:
            line = line.rstrip("\n")
            found["lines"].append(line)
            if m := re.fullmatch(r"router on (\S+)", line.strip()):
                found["grpc"] = m[1]
            if m := re.fullmatch(r"OpenAI-compatible HTTP on (\S+)/v1", line.strip()):
                found["http"] = m[1]
            if line.strip() == "ready":
                seen.set()
        seen.set()  # stdout closed: the child exited

    threading.Thread(target=read, daemon=True).start()
    seen.wait(timeout_s)
    if "grpc" not in found or "http" not in found or proc.poll() is not None:
        state = f"exited {proc.poll()}" if proc.poll() is not None else "still starting"
        raise RuntimeError(f"`pdserve up` printed no 'ready' within {timeout_s:.0f}s ({state})")
    return found


def request(pb, messages: list[dict], new: int, speculative: bool | None = None):
    """A greedy chat Generate request (the router renders the model's chat template)."""
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=new)
    if speculative is not None:
        sampling.speculative = speculative
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
    return pb.GenerateRequest(chat=chat, sampling=sampling)


def stream(stub, req, start: threading.Barrier | None = None) -> dict:
    """One stream: [(arrival time, token ids)] per delta, the finish reason and prompt tokens."""
    if start is not None:
        start.wait()
    deltas, finish = [], {}
    for resp in stub.Generate(req, timeout=900):
        if resp.HasField("delta"):
            deltas.append((time.perf_counter(), list(resp.delta.token_ids)))
        elif resp.HasField("finish"):
            f = resp.finish
            finish = {"reason": f.finish_reason, "prompt_tokens": f.usage.prompt_tokens}
    return {"deltas": deltas, **finish}


def tokens_of(r: dict) -> list[int]:
    return [t for _, toks in r["deltas"] for t in toks]


def one_rate(deltas) -> tuple[int, float]:
    """(tokens after the first delta, seconds from the first delta to the last)."""
    return sum(len(t) for _, t in deltas[1:]), deltas[-1][0] - deltas[0][0]


def scrape(http: str) -> dict:
    """The speculative decoding counters on the router's /metrics: summed, per worker, per position."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{http}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict = {key: 0.0 for key in SPEC_COUNTERS.values()}
    out.update(per_worker={}, accepted_per_pos={}, families_seen=[])
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            base = s.name.removesuffix("_total")
            if base in SPEC_COUNTERS:
                key = SPEC_COUNTERS[base]
                who = f"{s.labels.get('role')}/{s.labels.get('worker')}"
                out["per_worker"].setdefault(who, {})[key] = s.value
                out[key] += s.value
            elif base == PER_POS:
                pos = s.labels.get("position")
                out["accepted_per_pos"][pos] = out["accepted_per_pos"].get(pos, 0.0) + s.value
            else:
                continue
            if base not in out["families_seen"]:
                out["families_seen"].append(base)
    return out


def settled(http: str, timeout_s: float = 15.0) -> dict:
    """Scrapes until two scrapes 1.5 s apart agree (the router shows each worker's last
    heartbeat's counters), at most `timeout_s`."""
    last, t0 = scrape(http), time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        time.sleep(1.5)
        now = scrape(http)
        if all(now[k] == last[k] for k in SPEC_COUNTERS.values()):
            return now
        last = now
    return last


def increase(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    pos = after["accepted_per_pos"]
    out["accepted_per_pos"] = {
        p: pos[p] - before["accepted_per_pos"].get(p, 0.0) for p in sorted(pos, key=int)
    }
    out["acceptance"] = (
        out["accepted_tokens"] / out["draft_tokens"] if out["draft_tokens"] else None
    )
    out["per_worker_after"] = after["per_worker"]
    return out


def one_stream(stub, pb, tasks, new: int, speculative: bool | None = None) -> dict:
    runs = [stream(stub, request(pb, msgs, new, speculative)) for _, msgs in tasks]
    counts = [one_rate(r["deltas"]) for r in runs]
    return {
        "kinds": [kind for kind, _ in tasks],
        "prompt_tokens": [r.get("prompt_tokens") for r in runs],
        "finish": [r.get("reason") for r in runs],
        "per_prompt_tok_s": [n / t if t > 0 else None for n, t in counts],
        "decode_tok_s": sum(n for n, _ in counts) / sum(t for _, t in counts),
        "deltas_per_request": [len(r["deltas"]) for r in runs],
        "tokens": [tokens_of(r) for r in runs],
    }


def concurrent(stub, pb, tasks, new: int, speculative: bool | None = None) -> dict:
    n = len(tasks)
    barrier, results = threading.Barrier(n + 1), [None] * n

    def client(i: int) -> None:
        try:
            results[i] = stream(stub, request(pb, tasks[i][1], new, speculative), barrier)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t_start = time.perf_counter()
    for t in threads:
        t.join()
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)}/{n} streams failed: {failed[0]!r}")
    out = decode_rate([r["deltas"] for r in results], t_start)
    out.update(
        prompt_tokens=[r.get("prompt_tokens") for r in results],
        deltas_per_request=[len(r["deltas"]) for r in results],
        tokens=[tokens_of(r) for r in results],
    )
    return out


def measured(name: str, fn, http: str, report: dict) -> None:
    """Runs one part between two settled scrapes; records its figures, counters and CPU use."""
    before = settled(http)
    mon = TreeCpuMonitor()
    out = fn()
    out["cpu"] = mon.stop()
    out["spec"] = increase(before, settled(http))
    report[name] = out
    log(
        f"  {name}: {fmt(out['decode_tok_s'])} tok/s; drafts {out['spec']['drafts']:.0f}, "
        f"acceptance {out['spec']['acceptance']}; others used "
        f"{out['cpu'].get('foreign_cores_avg') or 0:.2f} cores"
    )


def spec_log_lines(sources: list[str]) -> dict:
    """Lines that mention speculation in `up`'s stderr and in each worker's log (the start
    table's last column names them): where a worker says what it speculates with."""
    paths = [w for x in sources for w in x.split() if w.endswith((".err", ".out", ".log"))]
    out = {}
    for path in dict.fromkeys(paths):
        try:
            with open(path, errors="replace") as f:
                found = [x.strip()[:300] for x in f if "specul" in x.lower()]
        except OSError:
            continue
        if found:
            out[os.path.basename(path)] = found[:10]
    return out


def deployment(method: str, spec: dict | None, tasks1, tasks32, warm, args) -> dict:
    import grpc
    import yaml

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    ray_tmp = tempfile.mkdtemp(prefix="pdray")
    work = tempfile.mkdtemp(prefix="spec-served-")
    config = deploy_yaml(ray_tmp)
    config_path = os.path.join(work, "served.yaml")
    with open(config_path, "w") as f:
        yaml.safe_dump(config, f)
    flags = ["--model", "smollm2", "--prefill-replicas", "1", "--decode-replicas", "1",
             "--port", "0", "--http-port", "0", "--dtype", args.dtype]  # fmt: skip
    flags += ["--speculative-config", json.dumps(spec)]  # "null": off (unset is "auto": ngram)
    command = [sys.executable, "-m", "pdserve", "up", config_path, *flags]
    report: dict = {
        "command": " ".join(["pdserve", "up", "CONFIG", *flags]),
        "yaml": config,
        "speculative_config": spec,
    }
    t0 = time.perf_counter()
    up, err_path = start_up(command, work)
    try:
        found = read_stdout(up, START_TIMEOUT_S)
        report["start_s"] = time.perf_counter() - t0
        log(f"{method}: `pdserve up` ready on {found['grpc']} after {report['start_s']:.0f} s")
        time.sleep(1.0)  # the start table follows `ready`
        report["start_table"] = found["lines"]
        http = found["http"]
        with grpc.insecure_channel(found["grpc"]) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            for _, msgs in warm:  # warm-up, one stream at a time
                stream(stub, request(pb, msgs, args.warm_tokens))
            # speculating: the part with every request opted out first (the paired ratio); off:
            # the part twice (how far two runs of the same deployment differ)
            tails = ([False, "_optout"], [None, ""]) if spec else ([None, "_repeat"], [None, ""])
            for opt, tail in tails:
                fn = lambda: one_stream(stub, pb, tasks1, args.new, opt)  # noqa: E731
                measured("one_stream" + tail, fn, http, report)
            concurrent(stub, pb, tasks32, 16)  # warm-up, the batch
            for opt, tail in tails:
                fn = lambda: concurrent(stub, pb, tasks32, args.new32, opt)  # noqa: E731
                measured("streams32" + tail, fn, http, report)
        report["metrics_total"] = scrape(http)
        report["spec_log_lines"] = spec_log_lines([err_path, *found["lines"]])
        return report
    except BaseException:
        fail_up(up, err_path, method)
        raise
    finally:
        report["stop_returncode"] = stop_up(up)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def ratios(base: dict, on: dict) -> dict:
    """on / base decode tok/s: over all prompts (or streams), per prompt and its median."""
    out = {"ratio": on["decode_tok_s"] / base["decode_tok_s"]}
    if "per_prompt_tok_s" in on:
        pairs = zip(base["per_prompt_tok_s"], on["per_prompt_tok_s"])
        per = [b / a if a and b else None for a, b in pairs]
        out.update(ratio_per_prompt=per, ratio_median=statistics.median(x for x in per if x))
    return out


def summarize(off: dict, on: dict) -> dict:
    """Per part: tok/s off (the "off" deployment), opted out (same deployment) and on, the ratios,
    tokens against off's, the counters' increase over the part."""
    s: dict = {}
    for part in ("one_stream", "streams32"):
        if part not in on or part not in off:
            continue
        o, n, x = off[part], on[part], on.get(part + "_optout")
        s[part] = {
            "off_tok_s": o["decode_tok_s"],
            "on_tok_s": n["decode_tok_s"],
            **ratios(o, n),
            "tokens": compare_tokens(o["tokens"], n["tokens"]),
            "acceptance": n["spec"]["acceptance"],
            "drafts": n["spec"]["drafts"],
            "draft_tokens": n["spec"]["draft_tokens"],
            "accepted_tokens": n["spec"]["accepted_tokens"],
            "accepted_per_pos": n["spec"]["accepted_per_pos"],
            "draft_prefill_tokens": n["spec"]["draft_prefill_tokens"],
        }
        if x is not None:
            s[part]["paired"] = {
                "optout_tok_s": x["decode_tok_s"],
                **ratios(x, n),
                "optout_tokens": compare_tokens(o["tokens"], x["tokens"]),
                "on_vs_optout_tokens": compare_tokens(x["tokens"], n["tokens"]),
                "optout_drafts": x["spec"]["drafts"],
            }
    s["off_deployment_drafts"] = off.get("metrics_total", {}).get("drafts")  # 0: it was off
    total = on.get("metrics_total", {})
    s["metrics_populated"] = {k: total.get(k, 0) > 0 for k in SPEC_COUNTERS.values()}
    s["metrics_populated"]["accepted_per_pos"] = any(total.get("accepted_per_pos", {}).values())
    parts = [v for d in (off, on) for v in d.values() if isinstance(v, dict) and "cpu" in v]
    cpu = [v["cpu"].get("foreign_cores_avg") for v in parts]
    s["others_cores_avg_max"] = max((c for c in cpu if c is not None), default=None)
    return s


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__doc__)
    ap.add_argument("--methods", default="ngram,draft", help="after 'off': ngram, draft")
    ap.add_argument("--prompts", type=int, default=3, help="one-stream prompts (default 3)")
    ap.add_argument("--new", type=int, default=256, help="one-stream max_tokens (default 256)")
    ap.add_argument("--new32", type=int, default=128, help="32-stream max_tokens (default 128)")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams (default 32)")
    ap.add_argument("--warm-tokens", type=int, default=64, help="warm-up max_tokens (default 64)")
    ap.add_argument("--dtype", default="auto", help="`pdserve up --dtype` (default auto)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 prompt x 32, 8 x 16")
    add_out_arg(ap, "spec_served.json")
    add_wait_idle_arg(ap, "each deployment")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new, args.new32, args.streams, args.warm_tokens = 1, 32, 16, 8, 16
    methods = ["off", *[m for m in args.methods.split(",") if m and m != "off"]]
    for m in methods:
        if m not in METHODS:
            ap.error(f"--methods: unknown method {m!r} (known: ngram, draft)")
    tasks = copy_tasks(max(args.streams, args.prompts + 2))
    tasks1, warm = tasks[: args.prompts], tasks[args.prompts : args.prompts + 2]
    tasks32 = tasks[: args.streams]
    report = run_header("benchmarks.engine.spec_served", argv)
    report.update(
        prompts=args.prompts, new=args.new, new32=args.new32, streams=args.streams,
        model="smollm2", dtype=args.dtype, deployments={}, idle_waits={},
    )  # fmt: skip
    for method in methods:
        if args.wait_idle > 0:
            report["idle_waits"][method] = wait_for_idle_machine(args.wait_idle)
        log(f"{method}: speculative_config {METHODS[method]}")
        report["deployments"][method] = deployment(
            method, METHODS[method], tasks1, tasks32, warm, args
        )
        write_result(args.out, report)
    off = report["deployments"]["off"]
    report["summary"] = summary = {m: summarize(off, report["deployments"][m]) for m in methods[1:]}
    report["summary_off_repeat"] = {  # the "off" deployment against itself: the noise floor
        part: {**ratios(off[part + "_repeat"], off[part]),
               "tokens": compare_tokens(off[part + "_repeat"]["tokens"], off[part]["tokens"])}
        for part in ("one_stream", "streams32")
    }  # fmt: skip
    write_result(args.out, report)
    for m, s in summary.items():
        for part, p in s.items():
            if part not in ("one_stream", "streams32"):
                continue
            paired = p.get("paired", {})
            print(
                f"{m} {part}: {p['off_tok_s']:.1f} -> {p['on_tok_s']:.1f} tok/s "
                f"({p['ratio']:.2f}x; median {fmt(p.get('ratio_median'), '.2f')}x; against "
                f"opted-out requests {fmt(paired.get('ratio'), '.2f')}x), tokens equal "
                f"{p['tokens']['equal']}/{p['tokens']['of']}, acceptance "
                f"{fmt(p['acceptance'], '.3f')}, accepted per position {p['accepted_per_pos']}"
            )
    for part, p in report["summary_off_repeat"].items():
        print(f"off against itself, {part}: {p['ratio']:.2f}x, tokens equal {p['tokens']['equal']}")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
