"""`pdserve chat` through a router with API keys (pdserve/chat_session.py, pdserve/client.py): with
no message it is a conversation driven from a piped stdin, each reply streamed and equal to the
engine's for the same history, the key given by --api-key; without a key, the refusal names
--api-key and PDSERVE_API_KEY, for `chat` and for `bench`. The tiny chat model and its workers are
helpers/http.py's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.http import KEY
from pdserve.cli import main
from pdserve.engine import SamplingParams

MAX_TOKENS = 3
TURNS = ["t5 t6", "t9 t8 t7"]


@pytest.fixture(scope="module")
def keyed(workers):
    r = workers.router(api_keys=(KEY,))
    yield r
    r.stop()


def test_a_piped_conversation_keeps_its_history(keyed, llm, idle):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    messages, want = [{"role": "system", "content": "t2"}], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        text = llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": text})
        want.append(text)
    assert all(want), want  # replies to compare, not only empty ones
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "chat", "--router", keyed.address, "--system", "t2",
         "--api-key", KEY, "--max-tokens", str(MAX_TOKENS)],
        input="\n".join(TURNS) + "\n/exit\nt5 never sent\n", capture_output=True, text=True,
        timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(w if w.endswith("\n") else w + "\n" for w in want)
    assert done.stderr.count("finish=") == len(TURNS), done.stderr  # one summary a turn
    assert KEY not in done.stdout + done.stderr


def test_without_a_key_the_refusal_names_the_option(keyed, idle, monkeypatch, capsys):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    argv = ["chat", "t5", "--router", keyed.address, "--max-tokens", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "UNAUTHENTICATED" in err[0], err
    assert "--api-key" in err[0] and "PDSERVE_API_KEY" in err[0] and "metadata" not in err[0]
    assert main([*argv, "--api-key", "sk-not-a-key-0000"]) == 1
    assert "the key given was refused" in capsys.readouterr().err


def test_bench_without_a_key_names_the_option_too(keyed, monkeypatch):
    """`pdserve bench` asks the router for its model first (tuning/loadgen.py)."""
    from pdserve.tuning import loadgen

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with pytest.raises(loadgen.LoadgenError) as e:
        loadgen.model_card(keyed.address)
    assert "--api-key" in str(e.value) and "PDSERVE_API_KEY" in str(e.value)
    assert "metadata" not in str(e.value)


def test_a_piped_conversation_with_no_router_exits_2(monkeypatch, capsys):
    """Nothing listens at --router: nothing was sent, so exit 2 (cli.py's scheme), one line that
    says where to look."""
    import io
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(sys, "stdin", io.StringIO("t5\n"))
    assert main(["chat", "--router", address, "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("is `pdserve up` running there?" in line for line in err), err
