"""`pdserve chat` with no message: a multi-turn conversation, one user turn per line of stdin.

    $ pdserve chat --system "You are terse."
    > What is the capital of France?
    Paris.
    > And of Italy?
    Rome.
    > /exit

Each reply streams to stdout as it arrives (through the router; `--local`: the engine in this
process, whose reply prints whole) and joins the history, so every turn sends the whole
conversation, the system message first. The session ends at the end of stdin (Ctrl-D) or a line
`/exit`, exit 0; a failed turn ends it with that turn's exit status and one line saying why.
stdin need not be a terminal: piped lines are turns too, with no prompt printed. The history lives
as long as the session, in this process only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

EXIT = "/exit"


def lines(stdin=None) -> Iterator[str]:
    """The user's turns: stdin's lines, with a prompt on a terminal; empty lines are skipped."""
    stdin = stdin or sys.stdin
    tty = stdin.isatty()
    if tty:
        print(f"(one message a line; {EXIT} or Ctrl-D ends the session)", file=sys.stderr)
    while True:
        if tty:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return
        else:
            line = stdin.readline()
            if not line:
                return
        line = line.strip()
        if line == EXIT:
            return
        if line:
            yield line


def converse(turn: Callable[[list[dict]], tuple[int, str]], system: str | None) -> int:
    """Runs the session: `turn(messages)` answers the conversation so far, printing the reply, and
    returns (exit status, the reply's text)."""
    messages = [{"role": "system", "content": system}] if system else []
    for line in lines():
        messages.append({"role": "user", "content": line})
        status, text = turn(messages)
        if status != 0:
            return status
        messages.append({"role": "assistant", "content": text})
    return 0


def run_remote(args) -> int:
    """The session through the router at args.router, on one channel."""
    import grpc

    from pdserve import client
    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    try:
        ch = client.channel(args)
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    stub = pdserve_pb2_grpc.PDServeStub(ch)

    def turn(messages: list[dict]) -> tuple[int, str]:
        try:
            reply = client.stream(stub, client.request(args, messages))
        except grpc.RpcError as e:
            answered = client.reached(ch)  # 1: the router refused it; 2: it never got there
            print(client.refusal(args.router, e, answered), file=sys.stderr)
            return client.exit_code(e, answered), ""
        client.end_line(reply.text)
        print(client.summary(reply), file=sys.stderr)
        if reply.finish is not None and reply.finish.finish_reason == "error":
            print(f"pdserve: {reply.finish.message}", file=sys.stderr)
            return 1, reply.text
        return 0, reply.text

    with ch:
        return converse(turn, args.system)


def run_local(args, llm, params) -> int:
    """The session on `llm` (an engine in this process) with sampling `params`."""

    def turn(messages: list[dict]) -> tuple[int, str]:
        text = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
        return 0, text

    return converse(turn, args.system)
