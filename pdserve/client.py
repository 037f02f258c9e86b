"""The client commands' side of a router: `pdserve generate` and `pdserve chat` (one turn, or a
session: chat_session.py) stream a Generate call to stdout; `bench` and `ctl` reuse the options.

Owns the options every client command shares: the channel (plaintext, or TLS with --tls-*) and the
client API key, --api-key else PDSERVE_API_KEY (the one place a command reads it from: the
process's environment, which tuning/loadgen.py's calls read too), and the one-line messages for a
router's refusal, which name the option to change. Nothing is kept between calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

API_KEY_ENV = "PDSERVE_API_KEY"  # protos/security.client_key_metadata reads it


def add_api_key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"the deployment's client API key, when it has keys (default: ${API_KEY_ENV})",
    )


def use_api_key(args: argparse.Namespace) -> None:
    """--api-key, when given, as the key every call of this process sends (over PDSERVE_API_KEY)."""
    if args.api_key is not None:
        os.environ[API_KEY_ENV] = args.api_key


def add_tls_args(p: argparse.ArgumentParser) -> None:
    tls = p.add_argument_group("TLS, for a router with router.tls (the client API needs no secret)")
    tls.add_argument("--tls-ca", metavar="PEM", help="trust the router's certificate from this CA")
    tls.add_argument(
        "--tls-cert", metavar="PEM", help="client certificate (router.tls.ca_file set)"
    )
    tls.add_argument("--tls-key", metavar="PEM", help="its private key")
    tls.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name in the router's certificate, when not the --router host",
    )


def channel(args):
    """A channel to the router: plaintext, or TLS when any --tls-* option is given."""
    import grpc

    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return grpc.insecure_channel(args.router)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")

    def read(path):
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from None

    credentials = grpc.ssl_channel_credentials(
        read(args.tls_ca), read(args.tls_key), read(args.tls_cert)
    )
    options = (
        [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    )
    return grpc.secure_channel(args.router, credentials, options=options)


def reached(channel) -> bool:
    """Whether `channel` is connected to its router now: after a failed call, whether the router
    itself answered (its connection stays up) or the call never got there (no connection: nothing
    listens, the name does not resolve, a TLS port reached without --tls-ca). Reads the state the
    channel is in, without connecting again; at most a second's wait for gRPC to report it."""
    import queue

    import grpc

    states: queue.Queue = queue.Queue()
    callback = states.put
    channel.subscribe(callback, try_to_connect=False)
    try:
        return states.get(timeout=1.0) == grpc.ChannelConnectivity.READY
    except queue.Empty:
        return False
    finally:
        channel.unsubscribe(callback)


def refusal(router: str, e, was_reached: bool | None = None) -> str:
    """One line for a failed call `e` (a grpc.RpcError) to `router`, with what to change;
    `was_reached`: whether the router answered (reached), None when not known."""
    import grpc

    code, details = e.code(), e.details()
    if was_reached is False:
        details += (
            " (is `pdserve up` running there? pass its address with --router, and --tls-ca for a "
            "router with router.tls)"
        )
    elif code == grpc.StatusCode.UNAVAILABLE and was_reached is None:
        details += " (is `pdserve up` running there? pass its address with --router)"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        given = "the key given was refused" if os.environ.get(API_KEY_ENV) else "no key was given"
        details = (
            f"the deployment needs one of its client API keys ({given}): pass it with --api-key "
            f"or set {API_KEY_ENV}"
        )
    return f"pdserve: router {router}: {code.name}: {details}"


def sampling(args):
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    params = pb.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    if args.seed is not None:
        params.seed = args.seed
    return params


def request(args, messages: list[dict] | None = None):
    """The GenerateRequest of `pdserve generate` (args.prompt) or of a chat turn (`messages`)."""
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    req = pb.GenerateRequest(model=args.model or "", sampling=sampling(args))
    if messages is None:
        req.text = args.prompt
    else:
        chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        req.chat.CopyFrom(pb.ChatMessages(messages=chat))
    return req


@dataclass
class Reply:
    text: str
    num_tokens: int
    finish: object  # the Finish message, or None when the stream ended without one
    t_first: float | None
    elapsed: float


def stream(stub, req) -> Reply:
    """One Generate call, its text written to stdout as it arrives; raises grpc.RpcError, once
    the text written so far has its line ended (the refusal then starts a line of its own)."""
    import grpc

    from pdserve.protos.security import client_key_metadata

    text, num_tokens, finish, t_first = [], 0, None, None
    t0 = time.perf_counter()
    try:
        for resp in stub.Generate(req, metadata=client_key_metadata(), wait_for_ready=False):
            if resp.HasField("delta"):
                if t_first is None:
                    t_first = time.perf_counter() - t0
                num_tokens += len(resp.delta.token_ids)
                text.append(resp.delta.text)
                sys.stdout.write(resp.delta.text)
                sys.stdout.flush()
            elif resp.HasField("finish"):
                finish = resp.finish
    except grpc.RpcError:
        end_line("".join(text))
        raise
    return Reply("".join(text), num_tokens, finish, t_first, time.perf_counter() - t0)


def summary(reply: Reply) -> str:
    """The line on stderr after a reply: tokens, why it stopped, TTFT and speed."""
    reason = reply.finish.finish_reason if reply.finish is not None else "?"
    ttft = f"{reply.t_first * 1e3:.0f} ms" if reply.t_first is not None else "-"
    decode_s = reply.elapsed - reply.t_first if reply.t_first is not None else 0.0
    n = reply.num_tokens
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
    prompt = (
        f"{reply.finish.usage.prompt_tokens} prompt tokens, " if reply.finish is not None else ""
    )
    return (
        f"[{prompt}{n} generated, finish={reason}; TTFT {ttft}, total {reply.elapsed:.2f}s, "
        f"{rate:.1f} tok/s]"
    )


def end_line(text: str) -> None:
    """Ends the reply's line whatever stopped it (a `length` stop ends mid-line), on stdout before
    the summary reaches stderr, even when both go to one file."""
    print("" if not text or text.endswith("\n") else "\n", end="", flush=True)


def exit_code(e, was_reached: bool = True) -> int:
    """A client command's exit status for a failed call `e` (cli.py's scheme): 1 for a call the
    router answered, whatever its status (it refused or failed the request), 2 for one that never
    reached it (was_reached False: nothing was sent)."""
    return 1 if was_reached else 2


def run_remote(args, messages: list[dict] | None = None) -> int:
    """`pdserve generate` (or one chat turn: `messages`) through the router: the text streams to
    stdout as it arrives; timings go to stderr."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    try:
        ch = channel(args)
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    with ch:
        try:
            reply = stream(pdserve_pb2_grpc.PDServeStub(ch), request(args, messages))
        except grpc.RpcError as e:
            answered = reached(ch)
            print(refusal(args.router, e, answered), file=sys.stderr)
            return exit_code(e, answered)
    end_line(reply.text)
    print(summary(reply), file=sys.stderr)
    if reply.finish is not None and reply.finish.finish_reason == "error":
        print(f"pdserve: {reply.finish.message}", file=sys.stderr)
        return 1
    return 0
