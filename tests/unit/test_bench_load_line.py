"""`pdserve bench`'s summary names the workload and the rate it ran (tuning/report.describe_load),
for a trace, synthetic lengths, a re-timed rate, all at once and a sweep (issue 28), and the
server it loaded: the router's gRPC API or an OpenAI-compatible HTTP endpoint."""

from __future__ import annotations

import pytest

from helpers.tuning import bench_args
from pdserve.tuning import report
from pdserve.tuning.metrics import summarize


@pytest.mark.parametrize(
    ("argv", "load"),
    [
        (
            ["--trace", "azure_conv", "--scale", "0.1", "--num-requests", "20", "--rate", "2"],
            ("trace azure_conv (x0.1), 20 requests", "2 req/s (Poisson)"),
        ),
        (
            ["--trace", "azure_code", "--num-requests", "5"],
            ("trace azure_code, 5 requests", "the trace's own arrival times"),
        ),
        (
            ["--prompt-len", "256", "--output-len", "32", "--rate", "1", "--burstiness", "0.5"],
            ("synthetic 256 in / 32 out, 100 requests", "1 req/s (gamma, burstiness 0.5)"),
        ),
        (
            ["--prompt-len", "8", "--output-len", "4", "--rate", "inf"],
            ("synthetic 8 in / 4 out, 100 requests", "all at once (inf)"),
        ),
        (
            ["--trace", "azure_conv", "--sweep-rates", "0.5,1"],
            ("trace azure_conv, 100 requests", "sweep 0.5,1 req/s"),
        ),
    ],
)
def test_the_load_is_named(argv, load):
    assert report.describe_load(bench_args(*argv)) == load


def test_the_summary_starts_with_it():
    load = report.describe_load(bench_args("--trace", "azure_conv", "--rate", "3"))
    lines = report.format_summary(summarize([], 1.0, None), load=load).splitlines()
    assert lines[1:3] == [
        "Workload: trace azure_conv, 100 requests",
        "Request rate: 3 req/s (Poisson)",
    ]


def test_the_summary_names_the_server():
    grpc_args = bench_args("--router", "127.0.0.1:50051")
    http_args = bench_args("--base-url", "http://10.0.0.5:8000/", "--vocab-size", "1000")
    http_args.backend = "openai"  # (resolved so by the bench's checks: --base-url implies it)
    for args, server in (
        (grpc_args, "pdserve gRPC, 127.0.0.1:50051"),
        (http_args, "OpenAI-compatible HTTP, http://10.0.0.5:8000/v1/completions"),
    ):
        load = (*report.describe_load(args), report.describe_server(args))
        lines = report.format_summary(summarize([], 1.0, None), load=load).splitlines()
        assert lines[3] == f"Server: {server}"
