"""Must-show c of issue #16: a real Prometheus server (Debian's `prometheus`) scrapes the router's
GET /metrics during a `pdserve bench` run, and what Prometheus answers matches what the bench
measured.

    python -m experiments.prometheus_check                       # local cluster (experiments/http_cluster.py)
    python -m experiments.prometheus_check --router HOST:PORT --http http://HOST:PORT   # a running one

The cluster gets a few warm-up requests; Prometheus starts with a generated config that scrapes
the router every --scrape-interval; once it has a sample, `pdserve bench` (a subprocess) sends
the load; after Prometheus has scraped the end of it, the script queries Prometheus's HTTP API
and compares (`check` says what). Results: experiments/results/prometheus_check.json and
BENCHMARKS.md, "Prometheus and an external client against the HTTP front".
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from benchmarks.bench_common import REPO_ROOT, log, run_header, script_parser, write_result
from experiments import http_cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A prometheus server in a temporary directory scraping one /metrics URL."""

    def __init__(self, binary: str, metrics_url: str, interval_s: float, workdir: str):
        target = urllib.parse.urlsplit(metrics_url)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = os.path.join(workdir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(
                "global:\n"
                f"  scrape_interval: {int(interval_s * 1000)}ms\n"
                f"  scrape_timeout: {int(interval_s * 1000)}ms\n"
                "scrape_configs:\n"
                "  - job_name: pdserve\n"
                f"    scheme: {target.scheme}\n"
                f"    metrics_path: {target.path or '/metrics'}\n"
                "    static_configs:\n"
                f"      - targets: ['{target.netloc}']\n"
            )
        self.log = open(os.path.join(workdir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready (see {self.log.name})")
            time.sleep(0.2)

    def query(self, expr: str, at: float | None = None) -> list:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        result = self.query(expr, at)
        return float(result[0]["value"][1]) if result else None

    def last_scrape(self) -> float:
        """The unix time of the newest sample of the target's `up` series (0: none yet)."""
        result = self.query('timestamp(up{job="pdserve"})')
        return float(result[0]["value"][1]) if result else 0.0

    def wait_scrape_after(self, t: float, timeout_s: float = 60.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last = self.last_scrape()
            if last > t:
                return last
            time.sleep(0.2)
        raise TimeoutError(f"prometheus did not scrape after {t}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


COUNTERS = {  # what the bench sums -> the Prometheus expression whose increase must equal it
    "requests": "sum(vllm:time_to_first_token_seconds_count)",
    "prompt_tokens": "sum(vllm:prompt_tokens_total)",
    "generation_tokens": "sum(vllm:generation_tokens_total)",
    "kv_bytes_router": "sum(pdserve:request_kv_transfer_bytes_sum)",
    "kv_bytes_prefill_workers": 'sum(pdserve:kv_transfer_bytes_total{role="prefill"})',
    "kv_bytes_decode_workers": 'sum(pdserve:kv_transfer_bytes_total{role="decode"})',
}


def bucket_around(value_s: float, buckets: list[float]) -> tuple[float, float]:
    """The histogram bucket (lower, upper] that holds value_s."""
    lower = 0.0
    for upper in buckets:
        if value_s <= upper:
            return lower, upper
        lower = upper
    return lower, float("inf")


def run_bench(args, router: str, out_json: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "bench",
        "--router",
        router,
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--num-requests",
        str(args.num_requests),
        "--rate",
        str(args.rate),
        "--seed",
        str(args.seed),
        "--out",
        out_json,
    ]
    log("bench: " + " ".join(cmd[2:]))
    env = dict(os.environ, PDSERVE_NO_PROGRESS="1")
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, env=env)
    with open(out_json) as f:
        return json.load(f)


def warm_up(router: str, n: int) -> None:
    from pdserve.tuning import loadgen, workload

    card = loadgen.model_card(router)
    reqs = [workload.RequestSpec(0.0, 32, 4)] * n
    loadgen.run_load(router, reqs, workload.build_prompts(reqs, card.vocab_size, 99))


def check(args, router: str, metrics_url: str, workdir: str) -> dict:
    """Runs the load under Prometheus and compares. The queries:
      histogram_quantile(0.5, sum by (le) (increase(vllm:time_to_first_token_seconds_bucket[W])))
      (W: from before the load to its end, so the increase is the bench's requests exactly) and
      the same for vllm:inter_token_latency_seconds; the increases of
      vllm:time_to_first_token_seconds_count, vllm:prompt_tokens_total,
      vllm:generation_tokens_total, pdserve:request_kv_transfer_bytes_sum and
      pdserve:kv_transfer_bytes_total{role=prefill|decode}.
    The median TTFT Prometheus estimates must lie within one bucket width (the histogram's
    resolution there) of the bench's median; the counts and token totals must equal the bench's;
    the KV bytes must equal the sum of the bench's per-request Finish.usage.kv_transfer_bytes
    (router histogram, prefill workers' pushes and decode workers' received frames alike)."""
    from pdserve.router.metrics import ITL_BUCKETS, TTFT_BUCKETS

    warm_up(router, args.warmup)
    prom = Prometheus(args.prometheus, metrics_url, args.scrape_interval, workdir)
    try:
        t_before = prom.wait_scrape_after(time.time())
        before = {k: prom.scalar(e, t_before) or 0.0 for k, e in COUNTERS.items()}
        bench = run_bench(args, router, os.path.join(workdir, "bench.json"))
        records = [r for r in bench["requests"] if not r["error"]]
        summary = bench["summary"]
        want = {
            "requests": len(records),
            "prompt_tokens": sum(r["prompt_len"] for r in records),
            "generation_tokens": sum(r["output_tokens"] for r in records),
        }
        kv = sum(r["kv_transfer_bytes"] for r in records)
        want.update(kv_bytes_router=kv, kv_bytes_prefill_workers=kv, kv_bytes_decode_workers=kv)
        # the workers' counters reach /metrics through the router's next health sweep, and
        # Prometheus at its next scrape: wait until a scrape has every figure (or time out)
        deadline = time.monotonic() + 30
        while True:
            t_after = prom.wait_scrape_after(time.time())
            got = {k: (prom.scalar(e, t_after) or 0.0) - before[k] for k, e in COUNTERS.items()}
            if all(got[k] == want[k] for k in want) or time.monotonic() > deadline:
                break
        window = f"{max(1, int(t_after - t_before + 1))}s"
        quantile = "histogram_quantile(0.5, sum by (le) (increase(vllm:{name}_bucket[{w}])))"
        prom_ttft = prom.scalar(
            quantile.format(name="time_to_first_token_seconds", w=window), t_after
        )
        prom_itl = prom.scalar(
            quantile.format(name="inter_token_latency_seconds", w=window), t_after
        )
    finally:
        prom.stop()
    bench_ttft = summary["median_ttft_ms"] / 1e3
    bench_itl = summary["median_itl_per_token_ms"] / 1e3  # the histogram counts per token
    lo, hi = bucket_around(bench_ttft, TTFT_BUCKETS)
    ilo, ihi = bucket_around(bench_itl, ITL_BUCKETS)
    ttft_ok = prom_ttft is not None and abs(prom_ttft - bench_ttft) <= hi - lo
    counts_ok = all(got[k] == want[k] for k in want)
    return {
        "bench_summary": {
            k: summary.get(k)
            for k in (
                "completed",
                "failed",
                "duration",
                "median_ttft_ms",
                "median_itl_per_token_ms",
            )
        },
        "bench_server_ms": summary.get("server_ms"),
        "prometheus": {
            "scrape_interval_s": args.scrape_interval,
            "window": window,
            "median_ttft_s": prom_ttft,
            "median_itl_s": prom_itl,
            "increases": got,
        },
        "bench_totals": want,
        "ttft": {
            "bench_median_s": bench_ttft,
            "prometheus_median_s": prom_ttft,
            "bucket_s": [lo, hi],
            "pass": ttft_ok,
        },
        "itl": {
            "bench_median_s": bench_itl,
            "prometheus_median_s": prom_itl,
            "bucket_s": [ilo, ihi],
            "within_bucket_width": prom_itl is not None and abs(prom_itl - bench_itl) <= ihi - ilo,
        },
        "counts_pass": counts_ok,
        "pass": ttft_ok and counts_ok,
    }


def main(argv=None) -> int:
    ap = script_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--router", help="a running router's gRPC address (else: a local cluster)")
    ap.add_argument("--http", help="its HTTP front, e.g. http://127.0.0.1:8000 (with --router)")
    ap.add_argument("--prometheus", default="prometheus", help="the prometheus binary")
    ap.add_argument("--scrape-interval", type=float, default=1.0, help="seconds (default 1)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=1.0, help="req/s, Poisson arrivals")
    args = http_cluster.parse_args(ap, argv, "prometheus_check.json")
    if shutil.which(args.prometheus) is None:
        ap.error(f"{args.prometheus} not found: apt-get install -y prometheus")
    report = run_header("experiments.prometheus_check", argv)
    report["load"] = {
        k: getattr(args, k) for k in ("prompt_len", "output_len", "num_requests", "rate", "seed")
    }
    version = subprocess.run([args.prometheus, "--version"], capture_output=True, text=True)
    report["prometheus_version"] = (version.stdout or version.stderr).splitlines()[0]
    cluster = None
    workdir = tempfile.mkdtemp(prefix="pdprom")
    try:
        cluster, router, http, report["cluster"] = http_cluster.open_cluster(args)
        report.update(check(args, router, f"{http}/metrics", workdir))
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_result(args.out, report)
    print(json.dumps({k: report[k] for k in ("ttft", "itl", "bench_totals", "pass")}, indent=1))
    print(json.dumps(report["prometheus"]["increases"]))
    log(f"{'PASS' if report['pass'] else 'FAIL'}; written to {args.out}")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
