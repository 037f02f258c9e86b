"""Multi-turn chat sessions through `pdserve up`, prefix reuse on against off (issue 49, must-show
a, b and the document-Q&A shape of c).

    python -m benchmarks.cluster.multiturn                   # 1P+1D and 2P+2D, shapes a-e
    python -m benchmarks.cluster.multiturn --quick           # smoke run: 1P+1D, small shapes
    python -m benchmarks.cluster.multiturn --topologies 1x1 --shapes a,d --wait-idle 60

For each topology, `pdserve up` (a child process) serves deploy/examples/local-cpu.yaml, the
embedded SmolLM2, with that many prefill and decode replicas and the router on free ports: first
as it is (prefix reuse on, the YAML's default), then with `enable_prefix_caching: false` on every
pool (reuse off). Each deployment is warmed up with one short request, then runs every shape
with tuning/sessions.py, the same sessions and seeds on both, so each shape's turns compare one
to one: metrics.compare_runs per turn index (TTFT P50/P90 and ITL P90 on / off, TTFT saved) and
metrics.same_answers (greedy answers must not change with reuse). A turn's reuse-off TTFT is the
TTFT of a cold prompt of the same length. The shapes (full size; --quick shrinks them):

  a  sessions one after another (concurrency 1): 3 sessions x 6 turns, turn 1 = a 1536-token
     document of the session's own + a 96-token message, then 96-token messages, 128-token
     answers: prompts grow 1632 -> 2752 tokens
  b  many sessions at once: 6 sessions x 4 turns, all in flight (768 + 64, 64, answers 64)
  c  no reuse: 12 one-turn sessions of distinct random 512-token prompts, 6 in flight, answers 64
     (throughput and TTFT, on against off)
  d  document Q&A: one 2048-token document shared by 4 sessions x 4 turns, 2 in flight, 64-token
     questions and answers
  e  long sessions one after another: 2 sessions x 4 turns, turn 1 = a 3200-token document +
     a 96-token message, then 96-token messages, 128-token answers: prompts grow 3296 -> 3968.
     A later turn computes its new message and the answer's last partial block (~112 tokens),
     so its TTFT over a cold prompt's has a floor of about 112 / prompt length: 0.06 at a's
     turn 2 (1856 tokens), above the issue's 0.05; 0.028-0.034 here

The goals the issue sets are evaluated from the measured figures (`goals`). Each run records the
CPU other processes used meanwhile (the machine is shared). A turn its decode worker prefilled
itself also gets where its TTFT went (`ttft_parts_ms`, logged per turn: the client to the router,
the router's pick and Reserve, the decode worker's engine to the first token, the relay back),
from the Finish timings. Writes benchmarks/results/multiturn.json.

    python -m benchmarks.cluster.multiturn --host-tier       # must-show c: eviction pressure

`--host-tier` runs instead the host-memory tier's comparison (engine/kv_host_tier.py, issue 49
must-show c): 1P+1D with the decode worker's KV cache cut to TIER_POOL's blocks and the prefill
worker's prefix cache off (else its cache, bigger than the sessions, serves the later turns
without any tier; a prefill cache cut as small as the decode one made 5 of 15 turns fail
UNAVAILABLE without the tier on a loaded machine, which is another matter; the pools'
max_model_len 2048, the KV cache in bfloat16 so that a block's bytes are known),
prefix reuse on in both runs, first with `kv_host_tier_bytes` on the decode pool (a cap the
sessions overflow too), then without it. Shapes:

  e  eviction pressure: 6 sessions x 3 turns, all in flight, each with a 768-token document of
     its own, 64-token messages, 48-token answers: the sessions' KV is about 3x the decode cache,
     so a session's earlier turns are evicted before its next one
  d  document Q&A: one 1024-token document shared by 4 sessions x 3 turns, 2 in flight

During each shape the router's /metrics (its HTTP port) is read every TIER_SAMPLE_S: the decode
worker's tier bytes (their peak against the cap) and, per shape, the prefix-hit tokens by source
(device, host) and the tier's blocks stored, restored and pushed out. After the last shape the
run waits for the decode worker to be idle and records that no block is in use. Writes
benchmarks/results/multiturn_host_tier.json.

    python -m benchmarks.cluster.multiturn --host-tier --disk-tier   # the disk tier below it

`--disk-tier` (with --host-tier) compares instead the decode pool's host tier capped small
(DISK_POOL's host_blocks) with a disk tier below it (engine/kv_disk_tier.py, DISK_POOL's
disk_blocks, files under the run's temp dir) against the same small host tier alone, the same
shapes and pools otherwise; /metrics adds the disk tier's bytes and counters and the disk hits.
Writes benchmarks/results/multiturn_disk_tier.json.

    python -m benchmarks.cluster.multiturn --peer-fetch      # which reuse path, 1P+1D

`--peer-fetch` runs instead the reuse paths' comparison (issue 49 item 4): 1P+1D, the same
sessions (PEER_SHAPES: one after another, and all at once) under four router settings (PEER_RUNS):
the local-prefill path alone (peer fetch off: the router before it), the defaults (both paths, by
estimated cost), the peer fetch alone (turns never run on their decode worker) and the recompute
alone (neither). Per run and turn: TTFT and ITL, hit share, and from the router's /metrics the
turns' paths, the prompt-cache hits by source and the fetches' seconds. Writes
benchmarks/results/multiturn_peer_fetch.json.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from benchmarks import bench_common as bc
from benchmarks.chaos_harness import (
    START_TIMEOUT_S,
    example_config,
    fail_up,
    router_address,
    start_up,
    stop_up,
)

# name -> sessions, turns, message_len, answer_len, doc_len, shared_doc, concurrency, seed
FULL = {
    "a_sequential": dict(sessions=3, turns=6, message=96, answer=128, doc=1536, shared=False,
                         concurrency=1, seed=101),
    "b_concurrent": dict(sessions=6, turns=4, message=64, answer=64, doc=768, shared=False,
                         concurrency=None, seed=102),
    "c_no_reuse": dict(sessions=12, turns=1, message=512, answer=64, doc=0, shared=False,
                       concurrency=6, seed=103),
    "d_doc_qa": dict(sessions=4, turns=4, message=64, answer=64, doc=2048, shared=True,
                     concurrency=2, seed=104),
    "e_long_sequential": dict(sessions=2, turns=4, message=96, answer=128, doc=3200,
                              shared=False, concurrency=1, seed=105),
}  # fmt: skip
QUICK = {
    "a_sequential": dict(sessions=1, turns=3, message=64, answer=16, doc=128, shared=False,
                         concurrency=1, seed=101),
    "b_concurrent": dict(sessions=3, turns=2, message=32, answer=16, doc=64, shared=False,
                         concurrency=None, seed=102),
    "c_no_reuse": dict(sessions=4, turns=1, message=128, answer=16, doc=0, shared=False,
                       concurrency=4, seed=103),
    "d_doc_qa": dict(sessions=2, turns=2, message=32, answer=16, doc=256, shared=True,
                     concurrency=2, seed=104),
    "e_long_sequential": dict(sessions=1, turns=2, message=32, answer=16, doc=384,
                              shared=False, concurrency=1, seed=105),
}  # fmt: skip
THINK_S = 0.1
# --host-tier (must-show c)
TIER_SHAPES = {
    "e_pressure": dict(sessions=6, turns=3, message=64, answer=48, doc=768, shared=False,
                       concurrency=None, seed=105),
    "d_doc_qa": dict(sessions=4, turns=3, message=64, answer=48, doc=1024, shared=True,
                     concurrency=2, seed=104),
}  # fmt: skip
BF16_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2  # SmolLM2-135M: layers, K+V, tokens, kv heads, dim
TIER_POOL = dict(decode_blocks=144, tier_blocks=256, max_model_len=2048)
TIER_SAMPLE_S = 0.5
# --disk-tier: the host tier capped below the sessions' blocks, the disk tier above them (a file
# is a block's bytes and a header of a few hundred bytes: DISK_FILE_SLACK covers it)
DISK_POOL = dict(host_blocks=32, disk_blocks=512)
DISK_FILE_SLACK = 4096
# --peer-fetch (issue 49 item 4): the shapes, and the router settings compared
PEER_SHAPES = {
    "a_sequential": dict(sessions=2, turns=4, message=64, answer=64, doc=1024, shared=False,
                         concurrency=1, seed=101),
    "b_concurrent": dict(sessions=4, turns=3, message=64, answer=64, doc=512, shared=False,
                         concurrency=None, seed=102),
}  # fmt: skip
PEER_RUNS = {
    "local_only": {"peer_fetch": {"enabled": False}},
    "defaults": {},
    "fetch_only": {"local_prefill": {"reuse_max_new_tokens": 0}},
    "recompute_only": {
        "local_prefill": {"reuse_max_new_tokens": 0},
        "peer_fetch": {"enabled": False},
    },
}
# the router's series read around each --peer-fetch shape: name -> the label kept (None: none)
PEER_COUNTERS = {
    "pdserve:reuse_paths_total": "path",
    "pdserve:local_prefills_total": None,
    "pdserve:prompt_cache_hit_tokens_total": "source",
    "pdserve:peer_fetch_duration_seconds_sum": None,
    "pdserve:peer_fetch_duration_seconds_count": None,
    "pdserve:peer_fetch_bytes_total": None,
    "pdserve:peer_fetch_failures_total": None,
    "pdserve:peer_fetch_refused_blocks_total": None,
}
TIER_COUNTERS = {
    "pdserve:prefix_cache_hit_tokens_by_source_total": "source",
    "pdserve:kv_host_tier_stored_blocks_total": None,
    "pdserve:kv_host_tier_restored_blocks_total": None,
    "pdserve:kv_host_tier_evicted_blocks_total": None,
    "pdserve:kv_disk_tier_stored_blocks_total": None,
    "pdserve:kv_disk_tier_restored_blocks_total": None,
    "pdserve:kv_disk_tier_evicted_blocks_total": None,
    "vllm:prefix_cache_hits_total": None,
    # the router's own: turns prefilled on their decode worker, and the refusals of a stale hint
    "pdserve:local_prefills_total": None,
    "pdserve:stale_cache_hints_total": None,
}


def run_shape(address: str, shape: dict, card) -> dict:
    """One shape's sessions against the router at `address`: the summary, the per-turn table,
    compact per-turn records, the records themselves (under "_records", not written) and the
    CPU others used meanwhile."""
    from pdserve.tuning import metrics, sessions

    ss = sessions.option_sessions(
        shape["sessions"], shape["turns"], shape["message"], shape["answer"], shape["doc"],
        shape["shared"],
    )  # fmt: skip
    ss, _ = sessions.fit_sessions(ss, card.max_model_len)
    prompts = sessions.build_session_prompts(ss, card.vocab_size, shape["seed"])
    mon = bc.CpuMonitor()
    records, duration_s = sessions.run_sessions(
        address, ss, prompts, concurrency=shape["concurrency"], think_time_s=THINK_S,
        seed=shape["seed"],
    )  # fmt: skip
    cpu = mon.stop()
    summary = metrics.summarize(records, duration_s)
    turns = metrics.summarize_turns(records, sessions.planned_turns(ss))
    parts = turn_parts(records)
    if parts:
        bc.log(f"  TTFT parts, p50 per turn (ms), turns run on their decode worker: {parts}")
    bc.log(
        f"  {len(records)} turns in {duration_s:.1f} s, {summary['failed']} failed; TTFT p50 per "
        f"turn (ms): {[round(t['median_ttft_ms'] or 0) for t in turns]}; hit % per turn: "
        f"{[None if t['hit_share'] is None else round(t['hit_share'] * 100, 1) for t in turns]}"
    )
    return dict(
        prompt_lens=ss[0].prompt_lens(),
        duration_s=duration_s,
        summary={k: v for k, v in summary.items() if k != "server_ms"},
        server_ms=summary["server_ms"],
        turns=turns,
        requests=[
            dict(
                session=r.session,
                turn=r.turn,
                prompt_len=r.prompt_len,
                ttft_ms=None if r.ttft_s is None else round(r.ttft_s * 1e3, 2),
                reusable=r.reusable_prompt_tokens,
                cached=r.cached_prompt_tokens,
                cache_hits=r.cache_hits,
                error=r.error,
                ttft_parts_ms=ttft_parts(r),
            )
            for r in records
        ],  # fmt: skip
        cpu=cpu,
        _records=records,
    )


def ttft_parts(record) -> dict | None:
    """Where a turn's TTFT went, in ms, for a turn its decode worker prefilled itself (no
    prefill worker stamps; None otherwise): the client's send to the router's arrival (the
    request's bytes on the way, its checks), the router's arrival to the Reserve's success (the
    pick, the Reserve call; the decode worker adds the request to its engine inside it), then to
    the first token leaving the decode worker (the engine's queue, the prompt's compute, the
    sampling, the stream's send), then to the client's receipt (the router's relay)."""
    t = record.timings or {}
    if record.ttft_s is None or t.get("prefill_start_unix_ns") or not t.get("first_token_unix_ns"):
        return None
    send, queued = record.send_unix_ns, t.get("queued_unix_ns", 0)
    reserved, first = t.get("reserved_unix_ns", 0), t["first_token_unix_ns"]
    if not (send and queued and reserved):
        return None
    got = send + record.ttft_s * 1e9
    return dict(
        to_router=round((queued - send) / 1e6, 2),
        router_reserve=round((reserved - queued) / 1e6, 2),
        engine_first_token=round((first - reserved) / 1e6, 2),
        to_client=round((got - first) / 1e6, 2),
    )


def turn_parts(records) -> dict:
    """The median of each ttft_parts part per turn index, over the turns that have them."""
    import statistics

    by_turn: dict[int, list[dict]] = {}
    for r in records:
        parts = ttft_parts(r)
        if parts is not None:
            by_turn.setdefault(r.turn, []).append(parts)
    return {
        turn: {k: round(statistics.median(p[k] for p in ps), 1) for k in ps[0]}
        for turn, ps in sorted(by_turn.items())
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(http_port: int) -> dict:
    """The router's /metrics as {(name, the decode pool's label of interest or None): value},
    summed over the decode workers (and the router's own TIER_COUNTERS); {} when it does not
    answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.labels.get("role") != "decode" and sample.name not in TIER_COUNTERS:
                continue
            key = (sample.name, sample.labels.get("source"))
            out[key] = out.get(key, 0.0) + sample.value
    return out


class TierSampler:
    """Reads the router's /metrics every TIER_SAMPLE_S on a thread: the decode pool's tier bytes
    (peak) and cap."""

    def __init__(self, http_port: int):
        import threading

        self.port, self.peak, self.cap, self.samples = http_port, 0.0, 0.0, 0
        self.disk_peak = self.disk_cap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(TIER_SAMPLE_S):
            got = scrape(self.port)
            if got:
                self.samples += 1
                self.peak = max(self.peak, got.get(("pdserve:kv_host_tier_bytes", None), 0.0))
                self.cap = got.get(("pdserve:kv_host_tier_capacity_bytes", None), self.cap)
                disk = got.get(("pdserve:kv_disk_tier_bytes", None), 0.0)
                self.disk_peak = max(self.disk_peak, disk)
                self.disk_cap = got.get(("pdserve:kv_disk_tier_capacity_bytes", None), 0.0)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        out = dict(peak_tier_bytes=self.peak, tier_cap_bytes=self.cap, samples=self.samples)
        if self.disk_cap:
            out.update(peak_disk_tier_bytes=self.disk_peak, disk_tier_cap_bytes=self.disk_cap)
        return out


def scrape_router(http_port: int) -> dict:
    """PEER_COUNTERS from the router's /metrics, {"name{label}": value}, summed over workers."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            label = PEER_COUNTERS.get(sample.name, False)
            if label is False:
                continue
            key = sample.name + (f"{{{sample.labels.get(label)}}}" if label else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: round(v - before.get(k, 0.0), 4) for k, v in sorted(after.items())}


def counters_delta(before: dict, after: dict) -> dict:
    out = {}
    for name, label in TIER_COUNTERS.items():
        for key in after:
            if key[0] == name and (label is None) == (key[1] is None):
                short = name.removesuffix("_total") + (f"{{{key[1]}}}" if key[1] else "")
                out[short] = after[key] - before.get(key, 0.0)
    return out


def run_deployment(
    prefill: int,
    decode: int,
    reuse: bool,
    shapes: dict,
    wait_idle: float,
    host_tier: bool | None = None,
    router: dict | None = None,
    disk_tier: bool | None = None,
) -> dict:
    """`pdserve up` of the example YAML with `prefill`+`decode` replicas, reuse on or off; every
    shape in turn. host_tier (not None: the --host-tier comparison): the decode pool cut to
    TIER_POOL's size, with (True) or without (False) a host tier; /metrics sampled per shape.
    router: more router keys (the --peer-fetch comparison); the router's PEER_COUNTERS are then
    read from its /metrics before and after each shape. disk_tier (not None: the --disk-tier
    comparison): the host tier capped at DISK_POOL's host_blocks, with (True) or without (False)
    a disk tier below it."""
    import grpc
    import yaml

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc
    from pdserve.tuning import loadgen

    work = tempfile.mkdtemp(prefix="multiturn-")
    config = example_config(0, prefill, decode, prefix_caching=reuse)
    config["router"]["http_port"] = None  # gRPC only: no fixed HTTP port on a shared machine
    if router is not None:
        config["router"].update(router)
        http_port = free_port()
        config["router"]["http_port"] = http_port
    if host_tier is not None:
        http_port = free_port()
        config["router"]["http_port"] = http_port  # for /metrics
        config["kv_cache_dtype"] = "bfloat16"  # a block's bytes known: BF16_BLOCK_BYTES
        for pool in config["pools"].values():
            pool["max_model_len"] = TIER_POOL["max_model_len"]
        dec = config["pools"]["decode"]
        dec["kv_cache_memory"] = TIER_POOL["decode_blocks"] * BF16_BLOCK_BYTES
        config["pools"]["prefill"]["enable_prefix_caching"] = False
        if host_tier:
            blocks = TIER_POOL["tier_blocks"] if disk_tier is None else DISK_POOL["host_blocks"]
            dec["kv_host_tier_bytes"] = blocks * BF16_BLOCK_BYTES
        if disk_tier:
            dec["kv_disk_tier_bytes"] = DISK_POOL["disk_blocks"] * (
                BF16_BLOCK_BYTES + DISK_FILE_SLACK
            )
            dec["kv_disk_tier_dir"] = os.path.join(work, "kv-disk-tier")
    path = os.path.join(work, "deploy.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    label = f"{prefill}P+{decode}D reuse {'on' if reuse else 'off'}"
    if host_tier is not None:
        label += f", host tier {'on' if host_tier else 'off'}"
    if disk_tier is not None:
        label += f", disk tier {'on' if disk_tier else 'off'}"
    out: dict = {"reuse": reuse, "yaml_pools": config["pools"]}
    t0 = time.perf_counter()
    up, err_path = start_up([sys.executable, "-m", "pdserve", "up", path], work)
    try:
        address = router_address(up, START_TIMEOUT_S)
        out["up_s"] = round(time.perf_counter() - t0, 1)
        bc.log(f"{label}: `pdserve up` ready on {address} after {out['up_s']} s")
        card = loadgen.model_card(address)
        with grpc.insecure_channel(address) as channel:  # warm-up: one short request
            warm = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=bc.random_prompts(999, 1, 64)[0]),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            )
            for _ in pdserve_pb2_grpc.PDServeStub(channel).Generate(warm, timeout=600):
                pass
        for name, shape in shapes.items():
            if wait_idle:
                out.setdefault("wait_idle", {})[name] = bc.wait_for_idle_machine(wait_idle)
            bc.log(f"{label}: shape {name} {shape}")
            if router is not None:
                before = scrape_router(http_port)
                out[name] = run_shape(address, shape, card)
                out[name]["router"] = delta(before, scrape_router(http_port))
                bc.log(f"  {label} {name}: {out[name]['router']}")
                continue
            if host_tier is None:
                out[name] = run_shape(address, shape, card)
                continue
            before, sampler = scrape(http_port), TierSampler(http_port)
            out[name] = run_shape(address, shape, card)
            out[name]["tier"] = dict(sampler.stop(), **counters_delta(before, scrape(http_port)))
            bc.log(f"  {label} {name}: {out[name]['tier']}")
        if host_tier is not None:
            out["idle"] = wait_decode_idle(http_port)
        return out
    except BaseException:
        fail_up(up, err_path, label)
        raise
    finally:
        out["stop_returncode"] = stop_up(up)
        shutil.rmtree(config["ray"]["temp_dir"], ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def wait_decode_idle(http_port: int, timeout_s: float = 60.0) -> dict:
    """Waits until the decode pool holds no block in use, nothing running or waiting (all its
    KV free: cached blocks are free blocks); what it saw last."""
    deadline = time.monotonic() + timeout_s
    got: dict = {}
    while time.monotonic() < deadline:
        got = scrape(http_port)
        usage = got.get(("vllm:kv_cache_usage_perc", None))
        busy = got.get(("vllm:num_requests_running", None), 1) + got.get(
            ("vllm:num_requests_waiting", None), 1
        )
        if usage == 0 and busy == 0:
            break
        time.sleep(0.5)
    return dict(
        kv_cache_usage_perc=got.get(("vllm:kv_cache_usage_perc", None)),
        running=got.get(("vllm:num_requests_running", None)),
        waiting=got.get(("vllm:num_requests_waiting", None)),
        reserved=got.get(("pdserve:num_requests_reserved", None)),
        tier_bytes=got.get(("pdserve:kv_host_tier_bytes", None)),
        tier_cap_bytes=got.get(("pdserve:kv_host_tier_capacity_bytes", None)),
        disk_tier_bytes=got.get(("pdserve:kv_disk_tier_bytes", None)),
    )


def compare(on: dict, off: dict, shapes: dict) -> dict:
    from pdserve.tuning import metrics

    out = {}
    for name in shapes:
        a, b = on[name], off[name]
        out[name] = dict(
            **metrics.compare_runs(a, b),
            answers=metrics.same_answers(a["_records"], b["_records"]),
        )
    return out


def goals(on: dict, cmp: dict) -> dict:
    """The issue's goals, each with the figure it is judged on and whether it is met."""

    def entry(value, ok):
        return dict(value=value, met=None if value is None else bool(ok(value)))

    out = {}
    hits = [
        t["hit_share"]
        for name in ("a_sequential", "b_concurrent", "d_doc_qa")
        if name in on
        for t in on[name]["turns"]
        if t["turn"] >= 2 and t["hit_share"] is not None
    ]
    out["hit_share_from_turn_2_min"] = entry(min(hits, default=None), lambda v: v >= 0.9)
    for name, key in (("a_sequential", "a"), ("e_long_sequential", "e")):
        if name in cmp:
            later = [t["ttft_p50_ratio"] for t in cmp[name]["turns"] if t["turn"] >= 2]
            later = [v for v in later if v is not None]
            out[f"{key}_later_turn_ttft_over_cold_max"] = entry(
                max(later, default=None), lambda v: v <= 0.05
            )
    if "b_concurrent" in cmp:
        o = cmp["b_concurrent"]["overall"]
        out["b_ttft_p50_on_over_off"] = entry(o["ttft_p50_ratio"], lambda v: v <= 1 / 3)
        out["b_itl_p90_on_over_off"] = entry(o["itl_p90_ratio"], lambda v: v <= 1.1)
    if "c_no_reuse" in cmp:
        o = cmp["c_no_reuse"]["overall"]
        out["c_output_throughput_on_over_off"] = entry(
            o["output_throughput_ratio"], lambda v: abs(v - 1) <= 0.03
        )
        out["c_ttft_p50_on_over_off"] = entry(o["ttft_p50_ratio"], lambda v: abs(v - 1) <= 0.03)
    answers = [c["answers"] for c in cmp.values()]
    out["answers_identical"] = dict(
        compared=sum(a["compared"] for a in answers),
        identical=sum(a["identical"] for a in answers),
    )
    return out


def strip(run: dict) -> dict:
    return {
        k: ({x: y for x, y in v.items() if x != "_records"} if isinstance(v, dict) else v)
        for k, v in run.items()
    }


def main_peer_fetch(args, argv) -> int:
    """The --peer-fetch comparison (module docstring): four router settings, same sessions."""
    out = args.out
    if os.path.basename(out) == "multiturn.json":
        out = os.path.join(os.path.dirname(out), "multiturn_peer_fetch.json")
    t0 = time.perf_counter()
    report: dict = {
        **bc.run_header("benchmarks.cluster.multiturn", argv),
        "think_time_s": THINK_S,
        "shapes": PEER_SHAPES,
        "runs": {k: v for k, v in PEER_RUNS.items()},
    }
    runs = {}
    for name, router in PEER_RUNS.items():
        runs[name] = run_deployment(1, 1, True, PEER_SHAPES, args.wait_idle, router=router)
        report[name] = strip(runs[name])
        bc.write_timed(out, report, t0)
    report["compare"] = {
        f"{a} / {b}": compare(runs[a], runs[b], PEER_SHAPES)
        for a, b in (("defaults", "local_only"), ("fetch_only", "recompute_only"))
    }
    bc.write_timed(out, report, t0)
    for pair, cmp in report["compare"].items():
        for shape, c in cmp.items():
            bc.log(
                f"{pair} {shape}: TTFT p50 per turn "
                f"{[None if t['ttft_p50_ratio'] is None else round(t['ttft_p50_ratio'], 3) for t in c['turns']]}, "
                f"ITL p90 {c['overall']['itl_p90_ratio']}, "
                f"answers identical {c['answers']['identical']}/{c['answers']['compared']}"
            )
    bc.log(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = bc.script_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: 1P+1D, small shapes")
    p.add_argument(
        "--topologies",
        default=None,
        help="PxD,... (default 1x1,2x2; --quick: 1x1)",
    )
    p.add_argument("--shapes", default="a,b,c,d,e", help="which shapes (default a,b,c,d,e)")
    p.add_argument(
        "--host-tier",
        action="store_true",
        help="must-show c: 1P+1D under eviction pressure, the decode pool's host tier on vs off "
        "(shapes e and d; writes multiturn_host_tier.json unless --out)",
    )
    p.add_argument(
        "--off-first", action="store_true", help="--host-tier: run the tier off first, then on"
    )
    p.add_argument(
        "--disk-tier",
        action="store_true",
        help="with --host-tier: a small host tier with a disk tier below it vs the small host "
        "tier alone (writes multiturn_disk_tier.json unless --out)",
    )
    p.add_argument(
        "--peer-fetch",
        action="store_true",
        help="issue 49 item 4: 1P+1D, local prefill / peer fetch / both / neither "
        "(writes multiturn_peer_fetch.json unless --out)",
    )
    bc.add_out_arg(p, "multiturn.json")
    bc.add_wait_idle_arg(p, "each shape")
    args = p.parse_args(argv)
    os.environ.setdefault("PDSERVE_NO_PROGRESS", "1")
    if args.disk_tier and not args.host_tier:
        p.error("--disk-tier goes with --host-tier")
    if args.host_tier:
        return main_host_tier(args, argv)
    if args.peer_fetch:
        return main_peer_fetch(args, argv)
    table = QUICK if args.quick else FULL
    wanted = [s.strip() for s in args.shapes.split(",") if s.strip()]
    shapes = {name: table[name] for name in table if name[0] in wanted}
    if not shapes or len(shapes) != len(wanted):
        p.error(f"--shapes {args.shapes!r}: choose from a, b, c, d, e")
    topo_text = args.topologies or ("1x1" if args.quick else "1x1,2x2")
    try:
        topologies = [tuple(int(n) for n in t.split("x")) for t in topo_text.split(",")]
        assert all(len(t) == 2 and min(t) >= 1 for t in topologies)
    except (ValueError, AssertionError):
        p.error(f"--topologies {topo_text!r}: expected PxD,... e.g. 1x1,2x2")
    t0 = time.perf_counter()
    report: dict = {
        **bc.run_header("benchmarks.cluster.multiturn", argv),
        "quick": args.quick,
        "think_time_s": THINK_S,
        "shapes": shapes,
        "topologies": {},
    }
    for prefill, decode in topologies:
        name = f"{prefill}P+{decode}D"
        on = run_deployment(prefill, decode, True, shapes, args.wait_idle)
        off = run_deployment(prefill, decode, False, shapes, args.wait_idle)
        cmp = compare(on, off, shapes)
        report["topologies"][name] = dict(
            on=strip(on), off=strip(off), compare=cmp, goals=goals(on, cmp)
        )
        bc.write_timed(args.out, report, t0)
        for shape, c in cmp.items():
            bc.log(
                f"{name} {shape}: TTFT p50 on/off per turn "
                f"{[None if t['ttft_p50_ratio'] is None else round(t['ttft_p50_ratio'], 3) for t in c['turns']]}, "
                f"answers identical {c['answers']['identical']}/{c['answers']['compared']}"
            )
    bc.log(f"wrote {args.out}")
    return 0


def main_host_tier(args, argv) -> int:
    """The --host-tier comparison (module docstring): tier on, then off, same sessions."""
    out = args.out
    disk = True if args.disk_tier else None
    if os.path.basename(out) == "multiturn.json":
        name = "multiturn_disk_tier.json" if disk else "multiturn_host_tier.json"
        out = os.path.join(os.path.dirname(out), name)
    t0 = time.perf_counter()
    report: dict = {
        **bc.run_header("benchmarks.cluster.multiturn", argv),
        "think_time_s": THINK_S,
        "shapes": TIER_SHAPES,
        "pool": dict(
            TIER_POOL,
            block_bytes=BF16_BLOCK_BYTES,
            decode_kv_bytes=TIER_POOL["decode_blocks"] * BF16_BLOCK_BYTES,
            tier_cap_bytes=TIER_POOL["tier_blocks"] * BF16_BLOCK_BYTES,
        ),
    }
    if disk:  # on: the small host tier with a disk tier; off: the small host tier alone
        report["pool"].update(
            DISK_POOL,
            tier_cap_bytes=DISK_POOL["host_blocks"] * BF16_BLOCK_BYTES,
            disk_cap_bytes=DISK_POOL["disk_blocks"] * (BF16_BLOCK_BYTES + DISK_FILE_SLACK),
        )
        report["compared"] = "disk tier on / off, host tier capped small in both"
    # with --disk-tier both runs have the (small) host tier, and the disk tier is what differs
    tier_on = dict(host_tier=True, disk_tier=disk)
    tier_off = dict(host_tier=bool(disk), disk_tier=False if disk else None)
    report["order"] = "off, on" if args.off_first else "on, off"
    if args.off_first:  # the other order: a drift of the machine's load then favours the other
        off = run_deployment(1, 1, True, TIER_SHAPES, args.wait_idle, **tier_off)
        on = run_deployment(1, 1, True, TIER_SHAPES, args.wait_idle, **tier_on)
    else:
        on = run_deployment(1, 1, True, TIER_SHAPES, args.wait_idle, **tier_on)
        off = run_deployment(1, 1, True, TIER_SHAPES, args.wait_idle, **tier_off)
    cmp = compare(on, off, TIER_SHAPES)
    report.update(tier_on=strip(on), tier_off=strip(off), compare=cmp)
    bc.write_timed(out, report, t0)
    for shape, c in cmp.items():
        bc.log(
            f"{shape}: TTFT p50 tier on/off per turn "
            f"{[None if t['ttft_p50_ratio'] is None else round(t['ttft_p50_ratio'], 3) for t in c['turns']]}, "
            f"p90 {[None if t['ttft_p90_ratio'] is None else round(t['ttft_p90_ratio'], 3) for t in c['turns']]}, "
            f"answers identical {c['answers']['identical']}/{c['answers']['compared']}"
        )
    bc.log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
