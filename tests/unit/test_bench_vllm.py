"""`pdserve bench` against `vllm bench serve` (vllm/benchmarks/serve.py and
lib/endpoint_request_func.py), on a fake PDServe stub: ITL is one gap per streamed message, as vLLM
counts one per SSE chunk, and pdserve's per-token split is kept apart under its own name; TPOT is
(E2E - TTFT) / (output tokens - 1); the summary has std and the percentiles asked for; the result
file carries vLLM's flat keys; vLLM's option names run (--num-prompts, --request-rate,
--max-concurrency as vLLM's semaphore, --dataset-name random, --goodput, --save-result, ...);
and the TLS options, with the message for a TLS mismatch. Against a real router:
tests/integration/test_bench_vllm_cluster.py."""

from __future__ import annotations

import argparse
import json
import threading

import numpy as np
import pytest

from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb
from pdserve.tuning import bench, loadgen
from pdserve.tuning.metrics import RequestRecord, summarize, vllm_keys
from pdserve.tuning.workload import RequestSpec

VOCAB = 500


class FakeStub:
    """A PDServe stub whose Generate streams each request's tokens in messages of `sizes` tokens
    (cycled), then a Finish. `barrier`: every stream waits on it before its first message (it
    proves that many run at once). Counts the streams in flight and their peak."""

    def __init__(self, sizes=(1,), barrier=None):
        self.sizes, self.barrier = sizes, barrier
        self.lock = threading.Lock()
        self.inflight = self.peak = 0

    def Generate(self, msg, timeout=None, metadata=()):
        with self.lock:
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        try:
            if self.barrier is not None:
                self.barrier.wait(timeout=30)
            n, sent, k = msg.sampling.max_tokens, 0, 0
            while sent < n:
                size = min(self.sizes[k % len(self.sizes)], n - sent)
                ids = [(7 * (sent + i)) % VOCAB for i in range(size)]
                yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=ids))
                sent, k = sent + size, k + 1
            usage = pb.Usage(prompt_tokens=len(msg.token_ids.ids))
            yield pb.GenerateResponse(finish=pb.Finish(finish_reason="length", usage=usage))
        finally:
            with self.lock:
                self.inflight -= 1


def bench_args(*argv: str):
    p = argparse.ArgumentParser()
    bench.add_args(p, "127.0.0.1:1")
    return p.parse_args(list(argv))


def one_request(stub, output_len: int) -> RequestRecord:
    rec = RequestRecord(0, 0.0, 4, output_len)
    msg = loadgen.make_request(RequestSpec(0.0, 4, output_len), [1, 2, 3, 4])
    loadgen._send(stub, msg, rec, 0.0, 10.0, lambda: None)
    return rec


# ---- F7: vLLM's ITL and TPOT ----------------------------------------------------------------------
def test_itl_is_one_gap_per_streamed_message_and_the_per_token_split_is_named_apart():
    # speculation or stream_interval: messages of 1, 2, 1 and 3 tokens (7 tokens, 4 messages)
    r = one_request(FakeStub(sizes=(1, 2, 1, 3)), 7)
    assert r.ok and r.output_tokens == 7
    # vLLM appends one gap per chunk after the first: 3 here, not 6
    assert len(r.itl_s) == 3
    # pdserve's per-token figure: one gap per token after the first, the same total time
    assert len(r.itl_per_token_s) == 6
    assert sum(r.itl_s) == pytest.approx(sum(r.itl_per_token_s))
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 6)
    s = summarize([r], 1.0)
    assert s["mean_itl_ms"] == pytest.approx(np.mean(r.itl_s) * 1e3)
    assert s["median_itl_ms"] == pytest.approx(np.median(r.itl_s) * 1e3)
    assert s["mean_itl_per_token_ms"] == pytest.approx(np.mean(r.itl_per_token_s) * 1e3)
    assert s["mean_tpot_ms"] == pytest.approx(r.tpot_s * 1e3)
    out = r.to_json()
    assert len(out["itl_s"]) == 3 and len(out["itl_per_token_s"]) == 6


def test_one_token_per_message_gives_the_same_itl_both_ways():
    r = one_request(FakeStub(sizes=(1,)), 5)
    assert r.itl_s == r.itl_per_token_s and len(r.itl_s) == 4


# ---- F9: std, chosen percentiles, vLLM's flat keys ------------------------------------------------
def record(i, ttft, e2e, tokens, itl=()):
    r = RequestRecord(i, 0.0, 10, tokens, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens)
    r.itl_s = list(itl)
    return r


def test_summary_has_std_and_the_percentiles_asked_for_as_vllm_computes_them():
    records = [record(i, 0.1 * (i + 1), 1.0 + i, 11, itl=(0.01 * (i + 1),) * 3) for i in range(5)]
    s = summarize(records, 2.0, percentiles=(50, 99.9))
    ttfts = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    assert s["std_ttft_ms"] == pytest.approx(np.std(ttfts) * 1e3)  # numpy's, ddof 0, as vLLM
    assert s["p50_ttft_ms"] == pytest.approx(np.percentile(ttfts, 50) * 1e3)
    assert s["p99.9_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99.9) * 1e3)
    # the table's P90 and P99 are always there
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90) * 1e3)
    assert s["p99_itl_ms"] is not None and s["std_tpot_ms"] is not None
    flat = vllm_keys(s, ("ttft", "tpot", "itl", "e2el"), (50, 99.9))
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert flat[f"{stat}_{name}_ms"] == s[f"{stat}_{name}_ms"]
    assert flat["request_throughput"] == pytest.approx(2.5)
    assert flat["output_throughput"] == pytest.approx(55 / 2)
    assert flat["total_token_throughput"] == pytest.approx((50 + 55) / 2)
    assert flat["completed"] == 5 and flat["request_goodput"] is None


def test_vllm_keys_read_zero_where_there_is_no_value_as_vllm_writes():
    s = summarize([record(0, 0.1, 0.1, 1)], 1.0)  # one token: no ITL, no TPOT
    assert s["mean_itl_ms"] is None
    flat = vllm_keys(s, ("itl", "tpot"), (99,))
    assert flat["mean_itl_ms"] == 0.0 and flat["p99_tpot_ms"] == 0.0


# ---- F9: --max-concurrency, vLLM's semaphore, in the open loop ------------------------------------
def test_max_concurrency_caps_the_streams_in_flight_and_records_the_wait():
    stub = FakeStub(sizes=(2,), barrier=threading.Barrier(2))  # each stream waits for a partner
    specs = [RequestSpec(0.0, 4, 5)] * 6  # all arrive at once
    prompts = [[1, 2, 3, 4]] * 6
    records, duration_s = loadgen.drive_load(stub, specs, prompts, max_concurrency=2)
    assert all(r.ok for r in records) and stub.peak == 2
    assert any(r.client_queue_s > 0 for r in records)
    s = summarize(records, duration_s)
    assert s["max_concurrent_requests"] == 2
    # the wait comes before the send (TTFT counts from the send) and is not the client's lag
    assert all(r.send_s >= r.arrival_s + r.client_queue_s - 1e-9 for r in records)
    lag = max(r.send_s - r.arrival_s - r.client_queue_s for r in records)
    assert s["max_send_lag_ms"] == pytest.approx(lag * 1e3)
    with pytest.raises(ValueError, match="--max-concurrency must be >= 1"):
        loadgen.drive_load(stub, specs, prompts, max_concurrency=0)


def test_without_a_cap_every_request_is_in_flight_at_once():
    stub = FakeStub(barrier=threading.Barrier(6))  # passes only with all six in flight
    records, _ = loadgen.drive_load(stub, [RequestSpec(0.0, 4, 3)] * 6, [[1, 2, 3, 4]] * 6)
    assert all(r.ok for r in records) and stub.peak == 6


# ---- F9: vLLM's option names ------------------------------------------------------------------------
def test_a_vllm_bench_serve_command_line_maps_onto_pdserves_options(tmp_path):
    args = bench_args(
        "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
        "--num-prompts", "5", "--request-rate", "2", "--max-concurrency", "3",
        "--goodput", "ttft:500", "tpot:50", "e2el:2000", "--percentile-metrics", "ttft,itl",
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(tmp_path / "res"),
        "--ignore-eos", "--disable-tqdm", "--seed", "3", "--burstiness", "1",
    )  # fmt: skip
    bench._vllm_options(args)
    assert (args.prompt_len, args.output_len, args.num_requests) == (8, 4, 5)
    assert (args.rate, args.max_concurrency) == (2.0, 3)
    assert args.slo == "ttft=500ms,tpot=50ms,e2e=2000ms"
    assert bench.table_metrics(args) == ("ttft", "itl")
    assert bench.table_percentiles(args) == (50.0, 99.0)
    # vLLM's file name, in --result-dir (made), the model's id filled in once known
    assert (tmp_path / "res").is_dir() and args.out.startswith(str(tmp_path / "res" / ""))
    assert "pdserve-2.0qps-concurrency3-{model}-" in args.out
    bench._name_result(args, pb.ModelCard(id="org/tiny-model"))
    assert "pdserve-2.0qps-concurrency3-tiny-model-" in args.out and args.out.endswith(".json")
    # --input-len is vLLM's general name; --dataset-name random alone takes vLLM's lengths
    assert bench_args("--input-len", "16").prompt_len == 16
    plain = bench_args("--dataset-name", "random")
    bench._vllm_options(plain)
    assert (plain.prompt_len, plain.output_len) == (1024, 128)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--dataset-name", "sharegpt"], "--trace"),
        (["--dataset-name", "random", "--trace", "azure_conv"], "exclude each other"),
        (["--prompt-len", "8", "--output-len", "4", "--random-range-ratio", "0.5"], "same lengths"),
        (["--goodput", "ttft=500"], "KEY:VALUE"),
        (["--goodput", "itl:5"], "KEY:VALUE"),
        (["--goodput", "ttft:500", "--slo", "ttft=1s"], "give one"),
        (["--out", "x.json", "--save-result"], "give one"),
        (["--percentile-metrics", "ttft,goodput"], "--percentile-metrics"),
        (["--metric-percentiles", "50,101"], "from 0 to 100"),
        (["--metric-percentiles", "p99"], "from 0 to 100"),
        (["--append-result"], "give --save-result or --out"),
        (["--out", "x.json", "--metadata", "tp"], "KEY=VALUE"),
    ],
)
def test_what_vllms_options_cannot_mean_here_is_refused_with_what_to_use(argv, named, capsys):
    assert bench.run(bench_args(*argv)) == 2
    assert named in capsys.readouterr().err


def test_max_concurrency_is_an_open_loop_option():
    argv = ["--sessions", "2", "--turns", "2", "--message-len", "4", "--answer-len", "2"]
    with pytest.raises(bench.BenchError, match="--max-concurrency is an open-loop option"):
        bench._plan_sessions(bench_args(*argv, "--max-concurrency", "2"))


def _fake_router(monkeypatch, stub, model_id: str) -> None:
    """The bench's router calls answered by `stub` (Generate) and a card of `model_id`."""
    card = pb.ModelCard(id=model_id, max_model_len=256, vocab_size=VOCAB, dtype="float32")
    monkeypatch.setattr(loadgen, "model_card", lambda address, model="", **kw: card)
    monkeypatch.setattr(
        loadgen,
        "run_load",
        lambda address, reqs, prompts, tls=None, **kw: loadgen.drive_load(
            stub, reqs, prompts, **kw
        ),
    )


def test_the_result_file_has_vllms_keys_beside_pdserves_layout(tmp_path, monkeypatch, capsys):
    _fake_router(monkeypatch, FakeStub(sizes=(1, 3)), "tiny")
    out = tmp_path / "r.json"
    argv = ["--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "7",
            "--num-prompts", "4", "--max-concurrency", "2", "--metric-percentiles", "50,99",
            "--goodput", "ttft:10000", "--save-result", "--result-filename", str(out),
            "--save-detailed", "--disable-tqdm", "--api-key", "secret"]  # fmt: skip
    p = argparse.ArgumentParser()
    bench.add_args(p, "127.0.0.1:1")
    p.add_argument("--api-key")  # pdserve/cli.py adds it to bench
    assert bench.run(p.parse_args(argv)) == 0
    table = capsys.readouterr().out
    assert "P50 ITL (ms):" in table and "P90 ITL (ms):" not in table
    assert "Peak concurrent requests:" in table and "at most 2 in flight" in table
    result = json.loads(out.read_text())
    # pdserve's layout
    assert result["kind"] == "run" and result["summary"]["completed"] == 4
    assert len(result["requests"]) == 4 and "secret" not in out.read_text()
    # vLLM's flat keys
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert isinstance(result[f"{stat}_{name}_ms"], float), (stat, name)
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert result[key] == result["summary"][key]
    assert result["request_goodput"] == result["summary"]["request_goodput"]
    assert result["completed"] == 4 and result["total_output_tokens"] == 28
    assert result["model_id"] == "tiny" and result["num_prompts"] == 4
    assert result["max_concurrency"] == 2 and result["request_rate"] == "inf"
    assert result["max_concurrent_requests"] <= 2
    # --save-detailed: vLLM's per-request lists; 7 tokens in messages of 1, 3, 1, 2: 3 gaps
    assert result["output_lens"] == [7] * 4 and [len(i) for i in result["itls"]] == [3] * 4
    assert result["errors"] == [""] * 4 and len(result["ttfts"]) == 4


def test_append_result_label_and_metadata_as_vllm_writes_them(tmp_path, monkeypatch, capsys):
    """Two runs with --append-result: one JSON document a line, each with --label and the
    --metadata pairs at its top level (a pair naming a result key keeps the result's value);
    --label prefixes --save-result's default file name."""
    _fake_router(monkeypatch, FakeStub(sizes=(2,)), "org/tiny")
    common = ["--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
              "--num-prompts", "2", "--disable-tqdm", "--save-result", "--label", "nightly",
              "--append-result", "--metadata", "version=0.3.3", "tp=1", "completed=99"]  # fmt: skip
    for where in (["--result-dir", str(tmp_path)], None):
        if where is None:  # the second run names the file the first one wrote
            where = ["--result-filename", str(next(tmp_path.iterdir()))]
        p = argparse.ArgumentParser()
        bench.add_args(p, "127.0.0.1:1")
        assert bench.run(p.parse_args(where + common)) == 0
    (path,) = tmp_path.iterdir()
    assert path.name.startswith("nightly-infqps-tiny-")
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        doc = json.loads(line)
        assert (doc["label"], doc["version"], doc["tp"]) == ("nightly", "0.3.3", "1")
        assert doc["completed"] == 2  # the result's own, not the metadata's
    assert "--metadata completed: the result's own kept" in capsys.readouterr().err


# ---- F10: TLS ---------------------------------------------------------------------------------------
def test_bench_takes_the_tls_options_of_the_other_clients(tmp_path):
    args = bench_args("--tls-ca", "ca.pem", "--tls-server-name", "router.example")
    assert (args.tls_ca, args.tls_server_name) == ("ca.pem", "router.example")
    assert loadgen.uses_tls(args) and not loadgen.uses_tls(bench_args())
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match=f"cannot read {missing}"):
        loadgen.open_channel("127.0.0.1:1", bench_args("--tls-ca", missing))
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        loadgen.open_channel("127.0.0.1:1", bench_args("--tls-cert", missing))


class Unavailable(Exception):
    def code(self):
        import grpc

        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "failed to connect to all addresses; Socket closed"


@pytest.mark.parametrize(
    ("tls_there", "argv", "says", "not_said"),
    [
        (True, [], "speaks TLS (router.tls is set there)", "unreachable"),
        (False, ["--tls-ca", "ca.pem"], "does not speak TLS", "unreachable"),
        (True, ["--tls-ca", "ca.pem"], "the TLS handshake failed", "unreachable"),
        (None, [], "unreachable", "TLS"),
        (False, [], "unreachable", "TLS"),
    ],
)
def test_a_tls_mismatch_is_said_as_such_not_as_unreachable(
    monkeypatch, tls_there, argv, says, not_said
):
    monkeypatch.setattr(loadgen, "speaks_tls", lambda address, timeout_s=3.0: tls_there)
    err = loadgen._not_reached("127.0.0.1:9", bench_args(*argv), Unavailable())
    assert says in str(err) and not_said not in str(err)
