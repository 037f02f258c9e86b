"""Closed-loop chat sessions (tuning/sessions.py, `pdserve bench --sessions`) against the
integration tests' tiny cluster (a router, one prefill and one decode worker on the tiny random
model; tests/integration/conftest.py): each turn's prompt is the previous turn's prompt, the
answer the cluster streamed and a new message, every record is complete, and the CLI writes the
per-turn table. The same logic on a fake stub: tests/unit/test_sessions.py."""

from __future__ import annotations

import json

import grpc

from helpers.up import greedy_tokens
from pdserve.cli import main
from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc
from pdserve.tuning import loadgen, metrics, sessions

ANSWER = 8


def test_two_sessions_of_three_turns_send_the_answers_they_got(router, idle):
    card = loadgen.model_card(router.address)
    shapes = sessions.option_sessions(2, 3, 12, ANSWER, doc_len=16, shared_doc=True)
    shapes, fit = sessions.fit_sessions(shapes, card.max_model_len)
    assert fit == dict(turns_cut=0, sessions_dropped=0)
    prompts = sessions.build_session_prompts(shapes, card.vocab_size, seed=3)
    records, duration_s = sessions.run_sessions(
        router.address, shapes, prompts, concurrency=1, think_time_s=0.05, request_timeout_s=60
    )
    assert duration_s > 0
    assert [(r.session, r.turn) for r in records] == [(s, k) for s in (0, 1) for k in (1, 2, 3)]
    for r in records:
        assert r.ok, (r.error, r.error_message)
        assert r.finish_reason == "length" and r.output_tokens == ANSWER == len(r.answer_ids)
        assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s and len(r.itl_per_token_s) == ANSWER - 1
        assert r.prompt_len == len(r.prompt_ids) == shapes[0].prompt_lens()[r.turn - 1]
        assert r.timings["decode_worker"]
        if (r.session, r.turn) == (0, 1):
            assert r.timings["prefill_worker"]
        elif r.turn > 1:  # the decode worker holds the earlier turns and runs this one
            # (router/legs.py; one session at a time: no other turn's local prefill makes the
            # decode worker busy)
            assert not r.timings["prefill_worker"], r.timings
            assert r.cache_hits["decode_worker"] == r.cached_prompt_tokens >= 32
        # session 1's first turn shares only the document with session 0: since the router's
        # block index knows the decode worker holds it, that turn may run there as well
        assert 0 <= r.cached_prompt_tokens < r.prompt_len
        assert all(0 <= t < card.vocab_size for t in r.answer_ids)
    for s in (0, 1):
        turns = [r for r in records if r.session == s]
        assert turns[0].prompt_ids == prompts[s].first and turns[0].reusable_prompt_tokens == 0
        for k, (prev, r) in enumerate(zip(turns, turns[1:])):
            assert r.prompt_ids == prev.prompt_ids + prev.answer_ids + prompts[s].messages[k]
            assert r.reusable_prompt_tokens == len(prev.prompt_ids) + ANSWER
    # the answers are the model's: a fresh greedy stream of a last turn's prompt gives the same
    last = records[2]
    with grpc.insecure_channel(router.address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        assert greedy_tokens(stub, pb, last.prompt_ids, ANSWER) == last.answer_ids
    rows = metrics.summarize_turns(records, sessions.planned_turns(shapes))
    assert [(t["turn"], t["requests"], t["completed"], t["skipped"]) for t in rows] == [
        (1, 2, 2, 0),
        (2, 2, 2, 0),
        (3, 2, 2, 0),
    ]


def test_bench_sessions_writes_every_turn(router, idle, tmp_path, capsys):
    out = tmp_path / "sessions.json"
    argv = ["bench", "--router", router.address, "--sessions", "2", "--turns", "3",
            "--message-len", "10", "--answer-len", "6", "--think-time", "0.05",
            "--concurrency", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Per turn" in printed
    result = json.loads(out.read_text())
    assert result["kind"] == "sessions" and result["summary"]["completed"] == 6
    assert [t["requests"] for t in result["turns"]] == [2, 2, 2]
    reqs = result["requests"]
    assert [(r["session"], r["turn"]) for r in reqs] == [(s, k) for s in (0, 1) for k in (1, 2, 3)]
    assert [r["prompt_len"] for r in reqs] == [10, 26, 42] * 2
    assert all(r["error"] == "" and len(r["answer_ids"]) == 6 for r in reqs)
    # concurrency 1: the second session starts after the first one's last turn ended
    first_end = max(r["send_s"] + r["e2e_s"] for r in reqs if r["session"] == 0)
    assert min(r["send_s"] for r in reqs if r["session"] == 1) >= first_end
    # a session longer than the context is refused before anything is sent
    too_long = argv[:-2] + ["--turns", "30"]
    assert main(too_long) == 2
    assert "at most" in capsys.readouterr().err
