"""Closed-loop chat sessions (tuning/sessions.py, `pdserve bench --sessions`) against a fake PDServe
stub that answers deterministic tokens and reports as cached the prompt prefix an earlier turn's
prompt and answer covered: each turn extends the previous one with the answer it got, the shapes
from options and from the Mooncake trace's hash-id chains, the context check, the closed loop's
concurrency, the per-turn table and the reuse on/off comparison. The same against the tiny
cluster: tests/integration/test_sessions_cluster.py."""

from __future__ import annotations

import json
import threading

import pytest

from helpers.tuning import bench_args
from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb
from pdserve.tuning import bench, loadgen, metrics, report, sessions
from pdserve.tuning.metrics import SessionRecord

VOCAB = 5000
BLOCK = 16


class FakeServer:
    """A PDServe stub's Generate: the answer is max_tokens ids computed from the prompt, streamed
    two per delta; cached_prompt_tokens is the longest prefix of the prompt that an earlier
    request's prompt + answer held, in whole blocks of 16 (what a server that keeps a finished
    turn's KV would find). `fail`: (session's first prompt id, turn) pairs answered with an
    error Finish; `barrier`: every turn-1 request waits on it (proves they are in flight at
    once)."""

    def __init__(self, fail=(), barrier=None):
        self.held: list[list[int]] = []
        self.lock = threading.Lock()
        self.inflight = self.max_inflight = 0
        self.fail, self.barrier = set(fail), barrier
        self.calls = 0

    @staticmethod
    def answer(prompt: list[int], n: int) -> list[int]:
        return [1000 + (sum(prompt) * 31 + 7 * i) % (VOCAB - 1000) for i in range(n)]

    def Generate(self, msg, timeout=None, metadata=()):
        prompt, n = list(msg.token_ids.ids), msg.sampling.max_tokens
        assert msg.sampling.temperature == 0.0 and msg.sampling.ignore_eos
        with self.lock:
            self.calls += 1
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            common = max((_common(prompt, h) for h in self.held), default=0)
        try:
            if self.barrier is not None and len(prompt) == FIRST:
                self.barrier.wait(timeout=60)
            answer = self.answer(prompt, n)
            for i in range(0, n, 2):
                yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=answer[i : i + 2]))
            cached = min(common, len(prompt) - 1) // BLOCK * BLOCK
            usage = pb.Usage(prompt_tokens=len(prompt), cached_prompt_tokens=cached)
            usage.cache_hits.decode_worker = cached
            failed = any(prompt[0] == p and turn(prompt) == k for p, k in self.fail)
            yield pb.GenerateResponse(
                finish=pb.Finish(finish_reason="error" if failed else "length", usage=usage)
            )
            with self.lock:
                self.held.append(prompt + answer)
        finally:
            with self.lock:
                self.inflight -= 1


FIRST = 40  # turn 1's prompt length in the tests below (doc 24 + message 16)


def turn(prompt: list[int]) -> int:
    """The turn of a prompt of the shapes below: 40, then + 8 answer + 12 message a turn."""
    return 1 + (len(prompt) - FIRST) // 20


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shapes(n=3, turns=3):
    """n sessions: a 24-token document each, a 16-token first message, then 12-token messages;
    answers of 8 (prompts of 40, 60, 80, ... tokens: FIRST and turn() above)."""
    later = (sessions.Turn(12, 8),) * (turns - 1)
    return [sessions.Session(i, (sessions.Turn(16, 8), *later), doc_len=24) for i in range(n)]


def run(server, ss, seed=0, **kw):
    prompts = sessions.build_session_prompts(ss, VOCAB, seed)
    kw.setdefault("think_time_s", 0.0)
    return sessions.drive(server, ss, prompts, **kw)


# ---- shapes -------------------------------------------------------------------------------------
def test_option_shapes_and_their_prompt_lengths():
    ss = sessions.option_sessions(4, 5, 256, 128, doc_len=1024, shared_doc=True)
    assert len(ss) == 4 and [s.index for s in ss] == [0, 1, 2, 3]
    assert ss[0].prompt_lens() == [1280, 1664, 2048, 2432, 2816]
    assert all(s.shared_doc and s.doc_len == 1024 for s in ss)
    for args, named in [
        ((0, 1, 1, 1), "--sessions must be >= 1"),
        ((1, 0, 1, 1), "--turns must be >= 1"),
        ((1, 1, 0, 1), "--message-len must be >= 1"),
        ((1, 1, 1, 0), "--answer-len must be >= 1"),
        ((1, 1, 1, 1, -1), "--doc-len must be >= 0"),
        ((1, 1, 1, 1, 0, True), "--shared-doc needs a document"),
    ]:
        with pytest.raises(sessions.SessionsError, match=named):
            sessions.option_sessions(*args)


def test_prompts_are_deterministic_and_the_shared_document_is_shared():
    shared = sessions.option_sessions(3, 3, 16, 8, doc_len=24, shared_doc=True)
    own = sessions.option_sessions(3, 3, 16, 8, doc_len=24)
    a = sessions.build_session_prompts(shared, VOCAB, seed=5)
    assert a == sessions.build_session_prompts(shared, VOCAB, seed=5)
    assert a != sessions.build_session_prompts(shared, VOCAB, seed=6)
    assert [len(p.first) for p in a] == [40] * 3 and all(len(p.messages) == 2 for p in a)
    assert all(len(m) == 16 for p in a for m in p.messages)
    assert a[0].first[:24] == a[1].first[:24] == a[2].first[:24]  # one document
    assert a[0].first[24:] != a[1].first[24:]  # each its own message
    b = sessions.build_session_prompts(own, VOCAB, seed=5)
    assert b[0].first[:24] != b[1].first[:24]  # a document each
    msgs = [m for p in a for m in p.messages]
    assert len({tuple(m) for m in msgs}) == len(msgs)  # no two messages alike
    assert all(1000 <= t < VOCAB for p in a + b for t in p.first + sum(p.messages, []))


# ---- the closed loop ----------------------------------------------------------------------------
def test_each_turn_sends_the_previous_prompt_the_answer_it_got_and_a_new_message():
    ss = shapes(n=3, turns=4)
    prompts = sessions.build_session_prompts(ss, VOCAB, 0)
    server = FakeServer()
    records, duration_s = sessions.drive(server, ss, prompts, think_time_s=0.0)
    assert duration_s > 0 and server.calls == 12
    assert [(r.session, r.turn) for r in records] == [
        (s, k) for s in range(3) for k in (1, 2, 3, 4)
    ]
    assert sorted(r.index for r in records) == list(range(12))  # send order, each once
    for s in range(3):
        turns = [r for r in records if r.session == s]
        assert turns[0].prompt_ids == prompts[s].first and turns[0].reusable_prompt_tokens == 0
        for k, (prev, r) in enumerate(zip(turns, turns[1:])):
            assert prev.answer_ids == FakeServer.answer(prev.prompt_ids, 8)  # what came back
            assert r.prompt_ids == prev.prompt_ids + prev.answer_ids + prompts[s].messages[k]
            assert r.reusable_prompt_tokens == len(prev.prompt_ids) + len(prev.answer_ids)
            # the fake held the previous turn: cached = its whole blocks
            assert r.cached_prompt_tokens == r.reusable_prompt_tokens // BLOCK * BLOCK
    for r in records:
        assert r.ok and r.finish_reason == "length" and r.output_tokens == r.output_len == 8
        assert r.prompt_len == len(r.prompt_ids) == ss[0].prompt_lens()[r.turn - 1]
        assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s and len(r.itl_s) == 3  # a gap a message
        assert len(r.itl_per_token_s) == 7  # (the fake sends two tokens a message)
        assert r.cache_hits == {
            "prefill_worker": 0,
            "decode_worker": r.cached_prompt_tokens,
            "peer": 0,
        }
        out = r.to_json()
        assert "prompt_ids" not in out and out["answer_ids"] == r.answer_ids
        assert json.loads(json.dumps(out))["turn"] == r.turn


def test_concurrency_one_runs_sessions_one_after_another():
    server = FakeServer()
    records, _ = run(server, shapes(n=3, turns=2), concurrency=1, think_time_s=0.01)
    assert server.max_inflight == 1
    ends = {s: max(r.send_s + r.e2e_s for r in records if r.session == s) for s in range(3)}
    starts = {s: min(r.send_s for r in records if r.session == s) for s in range(3)}
    assert starts[1] >= ends[0] and starts[2] >= ends[1]
    for s in range(3):  # the think time between a turn's end and the next send
        a, b = [r for r in records if r.session == s]
        assert b.send_s >= a.send_s + a.e2e_s + 0.01


def test_without_a_bound_every_session_is_in_flight_at_once():
    # every turn-1 request waits until all four are in flight: a run that sent them one at a
    # time would break the barrier (and its requests would fail)
    server = FakeServer(barrier=threading.Barrier(4))
    records, _ = run(server, shapes(n=4, turns=2))
    assert all(r.ok for r in records) and server.max_inflight >= 4
    server = FakeServer()
    run(server, shapes(n=4, turns=3), concurrency=2)
    assert server.max_inflight <= 2


def test_a_failed_turn_ends_its_session_and_the_rest_are_skipped():
    ss = shapes(n=2, turns=3)
    prompts = sessions.build_session_prompts(ss, VOCAB, 0)
    server = FakeServer(fail={(prompts[0].first[0], 2)})
    records, _ = sessions.drive(server, ss, prompts, think_time_s=0.0)
    assert [(r.session, r.turn, r.error) for r in records] == [
        (0, 1, ""), (0, 2, "error"), (1, 1, ""), (1, 2, ""), (1, 3, ""),
    ]  # fmt: skip
    rows = metrics.summarize_turns(records, sessions.planned_turns(ss))
    assert [(t["turn"], t["requests"], t["failed"], t["skipped"]) for t in rows] == [
        (1, 2, 0, 0), (2, 2, 1, 0), (3, 1, 0, 1),
    ]  # fmt: skip
    assert rows[1]["errors"] == {"error": 1}


def test_think_times_are_exponential_when_asked():
    server = FakeServer()
    records, _ = run(server, shapes(n=1, turns=3), think_time_s=0.02, think_dist="exponential")
    assert all(r.ok for r in records)  # the draws come from the seed; only completion is checked
    for bad in (dict(concurrency=0), dict(session_rate=0), dict(think_time_s=-1),
                dict(think_dist="uniform")):  # fmt: skip
        with pytest.raises(sessions.SessionsError):
            run(FakeServer(), shapes(n=1, turns=1), **bad)


# ---- the Mooncake trace -------------------------------------------------------------------------
def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trace_chains_follow_hash_ids_that_hold_the_previous_prompt_and_answer(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1200, "output_length": 100, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 900, "output_length": 10, "hash_ids": [7, 8]},
        # shares the first's first block but does not hold its answer: a new conversation
        {"timestamp": 2, "input_length": 1250, "output_length": 5, "hash_ids": [1, 4]},
        # the first's blocks but its last (a partial block), and longer: its second turn (it
        # could continue the third one too, whose all-but-last ids [1] lead it: the longer wins)
        {"timestamp": 3, "input_length": 1500, "output_length": 50, "hash_ids": [1, 2, 9]},
        {"timestamp": 4, "input_length": 1800, "output_length": 40, "hash_ids": [1, 2, 9, 10]},
        {"timestamp": 5, "input_length": 30, "output_length": 3, "hash_ids": [20]},
    ]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    assert sessions.trace_chains(sessions.workload.load_trace(trace)) == [
        [0, 3, 4], [1], [2], [5],
    ]  # fmt: skip
    (s,) = sessions.from_trace(trace, scale=0.5)
    assert s.block_ids == (1, 2, 3) and s.block_tokens == 256
    # turn 1: the first request; then the growth minus the answer: 1500-1200-100, 1800-1500-50
    assert [(t.message_len, t.answer_len) for t in s.turns] == [(600, 50), (100, 25), (125, 20)]
    capped = sessions.from_trace(trace, scale=0.5, max_message=110, max_answer=30, max_turns=2)
    assert [(t.message_len, t.answer_len) for t in capped[0].turns] == [(110, 30), (100, 25)]
    with pytest.raises(sessions.SessionsError, match="no multi-turn conversation"):
        sessions.from_trace(write_trace(tmp_path / "one.jsonl", rows[1:3]))


def test_the_shipped_trace_gives_chains_of_growing_prompts():
    reqs = sessions.workload.load_trace("mooncake_synthetic")
    ss = sessions.from_trace("mooncake", scale=0.05)
    multi = [c for c in sessions.trace_chains(reqs) if len(c) > 1]
    assert len(ss) == len(multi) > 100 and max(len(s.turns) for s in ss) >= 3
    for chain in multi:
        for i, j in zip(chain, chain[1:]):
            a, b = reqs[i], reqs[j]
            assert (
                a.arrival_s <= b.arrival_s
                and b.block_ids[: len(a.block_ids) - 1] == a.block_ids[:-1]
            )
            assert b.prompt_len >= a.prompt_len + a.output_len
    assert len(sessions.from_trace("mooncake", scale=0.05, max_sessions=7)) == 7
    # sessions that share a document share its tokens: some turn-1 prompts share leading blocks
    firsts = [s.block_ids[0] for s in ss]
    assert len(set(firsts)) < len(firsts)


# ---- the context -------------------------------------------------------------------------------
def test_prompts_that_do_not_fit_are_refused_or_cut():
    ss = sessions.option_sessions(2, 5, 256, 128, doc_len=1024)  # last turn: 2816 + 128
    kept, info = sessions.fit_sessions(ss, 2944)
    assert kept == ss and info == dict(turns_cut=0, sessions_dropped=0)
    with pytest.raises(sessions.SessionsError, match=r"turn 5 would need 2944 .* at most 4 turns"):
        sessions.fit_sessions(ss, 2943)
    with pytest.raises(sessions.SessionsError, match="even turn 1 does not fit"):
        sessions.fit_sessions(ss, 1000)
    mixed = [
        sessions.Session(0, (sessions.Turn(100, 10),) * 3),  # 100, 210, 320 (+10)
        sessions.Session(1, (sessions.Turn(500, 10),) * 2),
    ]
    kept, info = sessions.fit_sessions(mixed, 250, cap=True)
    assert [len(s.turns) for s in kept] == [2] and info == dict(turns_cut=3, sessions_dropped=1)
    with pytest.raises(sessions.SessionsError, match="lower --scale"):
        sessions.fit_sessions(mixed, 50, cap=True)


# ---- the tables ---------------------------------------------------------------------------------
def rec(session, turn, ttft, reusable=0, cached=0, itl=(0.01,), error=""):
    r = SessionRecord(0, 0.0, 100, 2, session=session, turn=turn)
    r.ttft_s, r.e2e_s, r.itl_s, r.output_tokens = ttft, ttft + sum(itl), list(itl), len(itl) + 1
    r.reusable_prompt_tokens, r.cached_prompt_tokens, r.error = reusable, cached, error
    return r


def test_the_per_turn_table_and_the_hit_share():
    records = [
        rec(0, 1, 0.4), rec(1, 1, 0.6),
        rec(0, 2, 0.1, reusable=200, cached=192), rec(1, 2, 0.3, reusable=200, cached=96),
        rec(0, 3, 0.2, error="UNAVAILABLE"),
    ]  # fmt: skip
    rows = metrics.summarize_turns(records, {1: 2, 2: 2, 3: 2})
    one, two, three = rows
    assert one["hit_share"] is None and one["median_ttft_ms"] == pytest.approx(500)
    assert two["hit_share"] == pytest.approx(288 / 400) and two["cached_prompt_tokens"] == 288
    assert two["sum_ttft_s"] == pytest.approx(0.4) and two["p90_itl_ms"] == pytest.approx(10)
    assert (three["requests"], three["completed"], three["skipped"]) == (1, 0, 1)
    assert three["median_ttft_ms"] is None and three["errors"] == {"UNAVAILABLE": 1}
    text = report.format_turns(rows)
    assert "72.0" in text and "288/400" in text and "UNAVAILABLE" in text


def test_reuse_on_against_off_per_turn():
    def result(ttfts, duration):
        records = [rec(0, k, t) for k, t in enumerate(ttfts, start=1)]
        return dict(summary=metrics.summarize(records, duration),
                    turns=metrics.summarize_turns(records))  # fmt: skip

    on, off = result([0.5, 0.05, 0.06], 2.0), result([0.5, 0.6, 0.8], 3.0)
    cmp = metrics.compare_runs(on, off)
    assert [t["turn"] for t in cmp["turns"]] == [1, 2, 3]
    one, two, three = cmp["turns"]
    assert one["ttft_p50_ratio"] == pytest.approx(1.0) and one["ttft_saved_s"] == pytest.approx(0)
    assert two["ttft_p50_ratio"] == pytest.approx(0.05 / 0.6)
    assert three["ttft_p90_ratio"] == pytest.approx(0.06 / 0.8)
    assert three["ttft_saved_ms_mean"] == pytest.approx(740) and two["itl_p90_ratio"] == 1.0
    assert cmp["overall"]["time_saved_s"] == pytest.approx(1.0)
    assert cmp["overall"]["output_throughput_ratio"] == pytest.approx(1.5)
    assert "0.083" in report.format_comparison(cmp)


def test_answers_of_two_runs_compared():
    a = [rec(0, 1, 0.1), rec(0, 2, 0.1), rec(1, 1, 0.1)]
    b = [rec(0, 1, 0.1), rec(0, 2, 0.1), rec(1, 1, 0.1, error="X")]
    for r, ids in zip(a + b, ([1, 2], [3], [4], [1, 2], [5], [4])):
        r.answer_ids = ids
    assert metrics.same_answers(a, b) == dict(compared=2, identical=1, differ=[(0, 2)])


def test_cache_hits_read_from_the_finish():
    assert sessions.cache_hits(None) is None
    assert sessions.cache_hits(pb.Finish()) is None  # the server did not set it
    f = pb.Finish()
    f.usage.cache_hits.decode_worker = 96
    assert sessions.cache_hits(f) == dict(prefill_worker=0, decode_worker=96, peer=0)


# ---- `pdserve bench --sessions` -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--sessions", "2", "--turns", "2", "--message-len", "8", "--answer-len", "4",
          "--rate", "2"], "--rate is an open-loop option"),
        (["--sessions", "2", "--turns", "2", "--message-len", "8", "--answer-len", "4",
          "--trace", "azure_conv", "--slo", "ttft=1s"], "--trace, --slo are open-loop options"),
        (["--sessions", "2", "--turns", "2"], "needs --message-len, --answer-len"),
        (["--sessions", "2", "--turns", "2", "--message-len", "8", "--answer-len", "4",
          "--scale", "0.5"], "--scale shape(s) a trace's sessions"),
        (["--sessions-from", "mooncake", "--message-len", "8"], "takes the shapes from the trace"),
        (["--trace", "azure_conv", "--turns", "3"], "--turns shape chat sessions"),
        (["--prompt-len", "8", "--output-len", "2", "--concurrency", "2"], "--concurrency shape"),
        (["--sessions", "2", "--turns", "2", "--message-len", "8", "--answer-len", "4",
          "--concurrency", "0"], "--concurrency must be >= 1"),
        (["--sessions", "2", "--turns", "2", "--message-len", "8", "--answer-len", "4",
          "--session-rate", "-1"], "--session-rate must be > 0"),
        (["--sessions", "0", "--turns", "2", "--message-len", "8", "--answer-len", "4"],
         "--sessions must be >= 1"),
        (["--sessions-from", "azure_conv"], "has no hash_ids"),
    ],
)  # fmt: skip
def test_session_options_that_do_not_go_together_exit_2(argv, named, capsys):
    assert bench.run(bench_args(*argv)) == 2
    assert named in capsys.readouterr().err


def test_bench_sessions_writes_the_per_turn_table(tmp_path, monkeypatch, capsys):
    server = FakeServer()
    card = pb.ModelCard(id="fake", max_model_len=4096, vocab_size=VOCAB, dtype="float32")
    monkeypatch.setattr(loadgen, "model_card", lambda address, model="": card)
    monkeypatch.setattr(
        sessions,
        "run_sessions",
        lambda address, ss, prompts, **kw: sessions.drive(server, ss, prompts, **kw),
    )
    out = tmp_path / "s.json"
    argv = ["--sessions", "2", "--turns", "3", "--message-len", "16", "--answer-len", "8",
            "--doc-len", "24", "--shared-doc", "--think-time", "0", "--concurrency", "1",
            "--out", str(out)]  # fmt: skip
    assert bench.run(bench_args(*argv)) == 0
    text = capsys.readouterr().out
    assert "2 sessions x 3 turns, message 16, answer 8, shared document 24" in text
    assert "closed loop: all at once, at most 1 in flight, think 0 s" in text and "Per turn" in text
    result = json.loads(out.read_text())
    assert result["kind"] == "sessions" and result["fit"] == dict(turns_cut=0, sessions_dropped=0)
    assert [t["requests"] for t in result["turns"]] == [2, 2, 2]
    assert [len(r["answer_ids"]) for r in result["requests"]] == [8] * 6
    assert result["sessions"][0]["prompt_lens"] == [40, 64, 88]
    # the second session's turn 1 finds the shared document (24 tokens: one whole block)
    assert [r["cached_prompt_tokens"] for r in result["requests"] if r["turn"] == 1] == [0, 16]
    two = result["turns"][1]
    assert two["hit_share"] == pytest.approx(2 * 48 / (2 * 48))
    # a context too small for turn 3 is refused before anything is sent
    card.max_model_len = 80
    assert bench.run(bench_args(*argv)) == 2
    assert "turn 3 would need 96" in capsys.readouterr().err and server.calls == 6


def test_sessions_start_at_the_session_rate():
    server = FakeServer()
    records, _ = run(server, shapes(n=3, turns=1), session_rate=20.0)
    starts = sorted(r.send_s for r in records)
    assert all(s >= i / 20.0 for i, s in enumerate(starts))  # never before its slot


def test_bench_sessions_from_a_trace_cuts_what_does_not_fit(tmp_path, monkeypatch, capsys):
    rows = [
        {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 150, "output_length": 10, "hash_ids": [1, 3]},
        {"timestamp": 2, "input_length": 400, "output_length": 10, "hash_ids": [1, 3, 4]},
        {"timestamp": 3, "input_length": 60, "output_length": 5, "hash_ids": [8, 9]},
        {"timestamp": 4, "input_length": 80, "output_length": 5, "hash_ids": [8, 7]},
    ]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    server = FakeServer()
    card = pb.ModelCard(id="fake", max_model_len=200, vocab_size=VOCAB, dtype="float32")
    monkeypatch.setattr(loadgen, "model_card", lambda address, model="": card)
    monkeypatch.setattr(
        sessions, "run_sessions", lambda address, ss, p, **kw: sessions.drive(server, ss, p, **kw)
    )
    out = tmp_path / "s.json"
    argv = ["--sessions-from", trace, "--think-time", "0", "--out", str(out)]
    assert bench.run(bench_args(*argv)) == 0
    # session 0: 100 (+10), 150 (+10), 400: its third turn does not fit 200 and is cut
    assert "1 turns do not fit max_model_len 200" in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert [s["prompt_lens"] for s in result["sessions"]] == [[100, 150], [60, 80]]
    assert [(r["session"], r["turn"]) for r in result["requests"]] == [
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
    ]
    assert server.calls == 4
