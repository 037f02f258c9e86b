"""`pdserve chat` without a message (pdserve/chat_session.py) and the client commands' key option
(pdserve/client.py), without a router: the session's turns from a non-terminal stdin, the history
each turn sends, its ends (EOF, /exit, a failed turn); --api-key over PDSERVE_API_KEY, and a
refusal for want of a key that names both. The session through a router:
tests/integration/test_chat_session_router.py."""

from __future__ import annotations

import io

import grpc
import pytest

from helpers.rpc import Refused
from pdserve import chat_session, client
from pdserve.cli import main


def _session(monkeypatch, stdin: str, system=None, fail_on: int | None = None):
    """Runs a session on `stdin`; (exit status, the messages each turn was given)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    seen = []

    def turn(messages):
        seen.append([dict(m) for m in messages])
        if len(seen) == fail_on:
            return 1, ""
        return 0, f"reply {len(seen)}"

    return chat_session.converse(turn, system), seen


def test_each_turn_sends_the_conversation_so_far(monkeypatch):
    status, seen = _session(monkeypatch, "hello\n\n  second  \nthird", system="be brief")
    assert status == 0 and len(seen) == 3  # the empty line is no turn; EOF without a newline ends
    assert seen[2] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "reply 2"},
        {"role": "user", "content": "third"},
    ]


def test_exit_and_a_failed_turn_end_the_session(monkeypatch):
    status, seen = _session(monkeypatch, "one\n/exit\nnever sent\n")
    assert status == 0 and [len(s) for s in seen] == [1]
    status, seen = _session(monkeypatch, "one\ntwo\nthree\n", fail_on=2)
    assert status == 1 and len(seen) == 2
    assert _session(monkeypatch, "")[0] == 0


def test_a_refusal_for_want_of_a_key_names_the_option_and_the_variable(monkeypatch):
    monkeypatch.delenv(client.API_KEY_ENV, raising=False)
    e = Refused(grpc.StatusCode.UNAUTHENTICATED, "send the metadata entry 'authorization: ...'")
    line = client.refusal("127.0.0.1:1", e)
    assert "--api-key" in line and "PDSERVE_API_KEY" in line and "no key was given" in line
    assert "metadata" not in line
    monkeypatch.setenv(client.API_KEY_ENV, "sk-wrong-key-000001")
    line = client.refusal("127.0.0.1:1", e)
    assert "the key given was refused" in line and "sk-wrong" not in line
    down = client.refusal("127.0.0.1:1", Refused(grpc.StatusCode.UNAVAILABLE, "down"))
    assert "--router" in down


@pytest.mark.parametrize("cmd", ["generate", "chat", "bench"])
def test_api_key_option_wins_over_the_environment(cmd, monkeypatch):
    """Every client command takes --api-key; it is the key the command's calls send."""
    monkeypatch.setenv(client.API_KEY_ENV, "sk-from-the-env-0001")
    seen = {}

    def fake(args, *rest):
        seen["key"] = client_key()
        return 0

    from pdserve.protos.security import client_key_metadata as client_key

    monkeypatch.setattr(client, "run_remote", fake)
    monkeypatch.setattr(chat_session, "run_remote", fake)
    from pdserve.tuning import bench

    monkeypatch.setattr(bench, "run", fake)
    argv = {"generate": ["generate", "x"], "chat": ["chat"], "bench": ["bench"]}[cmd]
    assert main([*argv, "--api-key", "sk-from-the-flag-01"]) == 0
    assert seen["key"] == (("authorization", "Bearer sk-from-the-flag-01"),)
