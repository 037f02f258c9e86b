"""One exit-code scheme for every command (pdserve/cli.py's docstring): 1 when the router (or the
--local engine) was reached and refused or failed the request, whatever its status; 2 when
nothing was sent (a bad flag, a router that cannot be reached); and a bad command line refused in
one line that names the flag and the subcommand and points to --help, never argparse's usage
block. The calls are stand-ins (no socket): a refusal as grpc raises it, and a channel whose
connectivity says whether the router answered."""

from __future__ import annotations

import grpc
import pytest

from helpers.rpc import Refused
from pdserve import cli, client
from pdserve.cli import main


class _Channel:
    """A channel whose state is `state` (grpc reports it to a subscriber at once)."""

    def __init__(self, state):
        self.state, self.subscribed = state, []

    def subscribe(self, callback, try_to_connect=False):
        assert not try_to_connect  # reading the state must not connect again
        self.subscribed.append(callback)
        callback(self.state)

    def unsubscribe(self, callback):
        self.subscribed.remove(callback)

    def __getattr__(self, name):  # unary_stream, ...: the stub's calls (client.stream stands in)
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_reached_reads_whether_the_channel_is_connected():
    for state, want in (
        (grpc.ChannelConnectivity.READY, True),
        (grpc.ChannelConnectivity.TRANSIENT_FAILURE, False),
        (grpc.ChannelConnectivity.CONNECTING, False),
    ):
        channel = _Channel(state)
        assert client.reached(channel) is want
        assert channel.subscribed == []  # unsubscribed again


ANSWERED = [
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (grpc.StatusCode.OUT_OF_RANGE, "prompt (9000 tokens) is longer than max_model_len"),
    (grpc.StatusCode.NOT_FOUND, "model 'x' is not served here"),
    (grpc.StatusCode.UNAVAILABLE, "no decode worker is registered with the router"),
]


@pytest.mark.parametrize("code,details", ANSWERED, ids=[c.name for c, _ in ANSWERED])
def test_every_refusal_the_router_answers_exits_1_in_one_line(code, details, monkeypatch, capsys):
    """The router's refusals, whatever their status, are one kind of failure: exit 1, one line
    with the status and the router's words (no blank line first, no hint that it is down)."""

    def refuse(stub, req):
        raise Refused(code, details)

    monkeypatch.setattr(client, "channel", lambda args: _Channel(grpc.ChannelConnectivity.READY))
    monkeypatch.setattr(client, "stream", refuse)
    for argv in (["generate", "hi"], ["chat", "hi"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err == f"pdserve: router 127.0.0.1:50051: {code.name}: {details}\n"


def test_a_router_that_cannot_be_reached_exits_2_and_says_what_to_check(monkeypatch, capsys):
    down = _Channel(grpc.ChannelConnectivity.TRANSIENT_FAILURE)

    def refuse(stub, req):
        raise Refused(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")

    monkeypatch.setattr(client, "channel", lambda args: down)
    monkeypatch.setattr(client, "stream", refuse)
    assert main(["generate", "hi", "--router", "127.0.0.1:1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pdserve: router 127.0.0.1:1: UNAVAILABLE: failed to connect")
    assert "--router" in line and "--tls-ca" in line


def test_text_streamed_before_a_failure_ends_its_line_first(capsys):
    """The refusal starts a line of its own on a terminal: the text streamed so far gets its
    newline on stdout, not a blank line on stderr."""
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    class Stub:
        def Generate(self, req, **kw):
            yield pb.GenerateResponse(delta=pb.TokenDelta(text="partial", token_ids=[1]))
            raise Refused(grpc.StatusCode.INTERNAL, "worker died")

    with pytest.raises(grpc.RpcError):
        client.stream(Stub(), pb.GenerateRequest(text="x"))
    assert capsys.readouterr().out == "partial\n"


def test_the_local_engine_refusing_a_request_exits_1_as_a_router_refusal_does(monkeypatch, capsys):
    import pdserve.engine
    import pdserve.engine.loader

    class Engine:
        def __init__(self, model, **kwargs):
            pass

        def generate(self, *a, **k):
            raise ValueError("prompt (9000 tokens) is longer than max_model_len (2048)")

        def shutdown(self):
            Engine.shut = True

    monkeypatch.setattr(pdserve.engine.loader, "resolve_model", lambda model: model)
    monkeypatch.setattr(pdserve.engine, "LLM", Engine)
    assert main(["generate", "hi", "--local"]) == 1
    assert capsys.readouterr().err == (
        "pdserve: prompt (9000 tokens) is longer than max_model_len (2048)\n"
    )
    assert Engine.shut


BAD_COMMAND_LINES = [
    (["up", "--dtype", "int3"], "pdserve up: argument --dtype: invalid choice: 'int3'"),
    (["up", "--tp"], "pdserve up: argument --tp: expected one argument"),
    (["generate"], "pdserve generate: the following arguments are required: prompt"),
    (["generate", "hi", "--max-tokens", "x"], "pdserve generate: argument --max-tokens: invalid"),
    (["chat", "hi", "--bogus"], "pdserve chat: unrecognized argument: --bogus"),
    (["bench", "--rate", "fast"], "pdserve bench: argument --rate"),
    (["ctl", "flip", "w1", "sideways"], "pdserve ctl flip: argument role: invalid choice"),
    (["ctl", "roles", "--x", "1"], "pdserve ctl: unrecognized arguments: --x 1"),
    (["nope"], "pdserve: argument cmd: invalid choice: 'nope'"),
]


@pytest.mark.parametrize(
    "argv,start", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES]
)
def test_a_bad_command_line_is_one_line_naming_the_flag_and_pointing_to_help(argv, start, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(start), line
    assert line.endswith("--help`)") and "usage:" not in captured.err


def test_the_exit_codes_are_pdserve_help_s_epilog(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith(cli._EXIT_CODES.rstrip())
    assert "  1    the router, or the --local engine, was reached and refused" in out
