# The usage lines below are `pdserve --help`'s text (description=__doc__, raw): the formatter
# must keep their indent.
# fmt: off
"""`pdserve` command line.

    pdserve up [CONFIG] [--address ADDR]      launch the deployment on Ray, serve until Ctrl-C
                  [--http-port PORT|off]      (gRPC and OpenAI-compatible HTTP, default :8000)
    pdserve up CONFIG --check                 validate the config as `up` would; start nothing
    pdserve generate TEXT [--router H:P]      complete a prompt through the router
    pdserve chat MESSAGE [--router H:P]       one chat turn through the router
    pdserve generate TEXT --local             run the engine in this process instead
    pdserve bench --trace NAME [--rate R]     open-loop load test: latency table, SLO goodput
    pdserve profile --model M --tp 1[,3] --out profile.json [--quick]   measure step latencies
    pdserve tune --profile P --workload W --slo ttft=..,tpot=.. --devices N   best placement
    pdserve shift-trace --phase NAME=SOURCE:SECONDS[:RATE] ... --out F   a workload-shift trace
    pdserve ctl [--router H:P] [--secret-file F] roles        workers, roles and states
    pdserve ctl [--router H:P] [--secret-file F] flip ID prefill|decode   move a worker's role
"""
# fmt: on

from __future__ import annotations

import argparse
import logging
import sys
import time

from pdserve.deploy.config import DTYPES, ConfigError, DeployConfig, load_config


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _mode_args(p: argparse.ArgumentParser, where: str = "") -> None:
    p.add_argument(
        "--dtype",
        choices=DTYPES[:1] + DTYPES[1::2],
        default=None,
        help=f"{where}dtype: 'auto' is bfloat16 on GPU, and on CPU float32 activations "
        "with the fastest quantization whose quality passes a probe",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "int8", "int4", "auto"],
        default=None,
        help=f"{where}quantization (CPU): int8 weights and activations, int4 weights, or auto",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=DTYPES[:1] + DTYPES[1::2],
        default=None,
        help=f"{where}the KV cache's dtype ('auto': the activations')",
    )


def _mode_overrides(args) -> dict:
    out = {}
    if args.dtype is not None:
        out["dtype"] = args.dtype
    if args.quantization is not None:
        out["quantization"] = None if args.quantization == "none" else args.quantization
    if args.kv_cache_dtype is not None:
        out["kv_cache_dtype"] = args.kv_cache_dtype
    return out


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--router",
        default=DeployConfig().router.address,
        help="the router's host:port (default: %(default)s)",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="run the engine in this process instead of asking a router",
    )
    p.add_argument(
        "--model",
        default=None,
        help="router: a served model id (default: its default); --local: 'smollm2', "
        "a .gguf file or an HF directory",
    )
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="--local only")
    p.add_argument(
        "--kv-cache-memory", type=int, default=None, help="--local only: bytes of KV cache"
    )
    _mode_args(p, "--local only: ")
    _tls_args(p)
    _sampling_args(p)


def _tls_args(p: argparse.ArgumentParser) -> None:
    tls = p.add_argument_group(
        "TLS, for a router with router.tls (the client API needs no secret; with API keys "
        "configured, put one in the environment: PDSERVE_API_KEY)"
    )
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


def _channel(args):
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


def _run_local(args) -> int:
    from pdserve.engine import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
        t0 = time.perf_counter()
        llm = LLM(
            args.model or "smollm2",
            tensor_parallel_size=args.tensor_parallel_size,
            kv_cache_memory=args.kv_cache_memory,
            **_mode_overrides(args),
        )
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        if args.cmd == "generate":
            out = llm.generate(args.prompt, params, use_tqdm=False)[0]
        else:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            out = llm.chat(
                messages + [{"role": "user", "content": args.message}], params, use_tqdm=False
            )[0]
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    c = out.outputs[0]
    print(c.text, end="" if c.text.endswith("\n") else "\n", flush=True)
    ttft = out.metrics.get("first_token", 0) - out.metrics.get("arrival", 0)
    print(
        f"[{len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated, "
        f"finish={c.finish_reason}; load {t_load:.1f}s, TTFT {ttft * 1e3:.0f} ms, "
        f"total {elapsed:.2f}s, {len(c.token_ids) / max(elapsed, 1e-9):.1f} tok/s; "
        f"{llm.engine.mode_note}]",
        file=sys.stderr,
    )
    llm.shutdown()
    return 0


def _request(args):
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    sampling = pb.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    if args.seed is not None:
        sampling.seed = args.seed
    req = pb.GenerateRequest(model=args.model or "", sampling=sampling)
    if args.cmd == "generate":
        req.text = args.prompt
    else:
        messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(pb.ChatMessage(role="user", content=args.message))
        req.chat.CopyFrom(pb.ChatMessages(messages=messages))
    return req


def _run_remote(args) -> int:
    """Streams the router's reply to stdout as it arrives; timings go to stderr."""
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc
    from pdserve.protos.security import client_key_metadata

    num_tokens, finish, t_first, ends_line = 0, None, None, True
    t0 = time.perf_counter()
    try:
        channel = _channel(args)
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    try:
        with channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            for resp in stub.Generate(
                _request(args), metadata=client_key_metadata(), wait_for_ready=False
            ):
                if resp.HasField("delta"):
                    if t_first is None:
                        t_first = time.perf_counter()
                    num_tokens += len(resp.delta.token_ids)
                    sys.stdout.write(resp.delta.text)
                    sys.stdout.flush()
                    ends_line = resp.delta.text.endswith("\n") if resp.delta.text else ends_line
                elif resp.HasField("finish"):
                    finish = resp.finish
    except grpc.RpcError as e:
        hint = (
            " (is `pdserve up` running there? pass its address with --router)"
            if e.code() == grpc.StatusCode.UNAVAILABLE
            else ""
        )
        print(
            f"\npdserve: router {args.router}: {e.code().name}: {e.details()}{hint}",
            file=sys.stderr,
        )
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    elapsed = time.perf_counter() - t0
    # the text ends its line whatever stopped it (a `length` stop ends mid-line), and reaches
    # stdout before the summary reaches stderr, even when both go to one file
    print("" if ends_line else "\n", end="", flush=True)
    reason = finish.finish_reason if finish is not None else "?"
    ttft = f"{(t_first - t0) * 1e3:.0f} ms" if t_first is not None else "-"
    decode_s = elapsed - (t_first - t0) if t_first is not None else 0.0
    rate = (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else 0.0
    prompt = f"{finish.usage.prompt_tokens} prompt tokens, " if finish is not None else ""
    print(
        f"[{prompt}{num_tokens} generated, finish={reason}; TTFT {ttft}, total {elapsed:.2f}s, "
        f"{rate:.1f} tok/s]",
        file=sys.stderr,
    )
    if finish is not None and finish.finish_reason == "error":
        print(f"pdserve: {finish.message}", file=sys.stderr)
        return 1
    return 0


def _refused(args, e: Exception) -> int:
    """A refusal before anything started, printed alike by `up` and `up --check`: one line per
    problem, each naming the config (a ConfigError: its keys) or what to change; exit code 2."""
    prefix = f"{args.config or 'default config'}: " if isinstance(e, ConfigError) else ""
    for line in str(e).splitlines() or [type(e).__name__]:
        print(f"pdserve: {prefix}{line}", file=sys.stderr)
    return 2


def _preflight(args, config: DeployConfig) -> list[str] | int:
    """deploy/prechecks.preflight: the notes on what it could not check, or 2 once refused."""
    from pdserve.deploy.prechecks import DeployError, preflight

    try:
        return preflight(config, args.address)
    except (ConfigError, DeployError) as e:
        return _refused(args, e)


def _check_up(args, config: DeployConfig) -> int:
    """`pdserve up --check`: the checks `up` runs before Ray starts, the same ones in the same
    order (deploy/prechecks.preflight); 0 when `up` would go on, 2 with its first refusal."""
    notes = _preflight(args, config)
    if isinstance(notes, int):
        return notes
    for note in notes:
        print(f"note: {note}")
    pools = ", ".join(f"{k} {p.replicas} x tp {p.tp}" for k, p in config.worker_pools())
    print(f"{args.config or 'default config'}: ok ({config.model}; {pools}); nothing started")
    return 0


def _with_http_port(config: DeployConfig, value: str) -> DeployConfig:
    """--http-port over the YAML's router.http_port ('off': no HTTP front), checked as that key
    is (a port, not router.port)."""
    from pdserve.deploy.config import validate_config

    try:
        port = None if value == "off" else int(value)
    except ValueError:
        raise ConfigError(f"--http-port: {value!r} is not a port number or 'off'") from None
    router = {"host": config.router.host, "port": config.router.port, "http_port": port}
    validate_config({"router": router}, "--http-port")
    return config.model_copy(
        update={"router": config.router.model_copy(update={"http_port": port})}
    )


def _run_up(args) -> int:
    """Exit codes: 0 stopped by Ctrl-C or SIGTERM, 2 could not start (the message says what to
    change; no traceback), 130 interrupted while starting."""
    try:
        config = load_config(args.config).model_copy(update=_mode_overrides(args))
        if args.http_port is not None:
            config = _with_http_port(config, args.http_port)
    except ConfigError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    if args.check:
        return _check_up(args, config)
    notes = _preflight(args, config)  # as --check: the same refusals, in the same order
    if isinstance(notes, int):
        return notes
    # the deployment's own lines (deaths, replacements, the secret's source: never the secret)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pdserve.deploy").setLevel(logging.INFO)
    from pdserve.deploy.launcher import DeployError, up

    try:
        cluster = up(config, address=args.address, block=False)
    except (ConfigError, DeployError) as e:  # Ray's resources, a worker that failed to start
        return _refused(args, e)
    except KeyboardInterrupt:
        return 130
    print(f"router on {cluster.router_address}", flush=True)  # gRPC: pdserve.v1.PDServe
    if cluster.http_url:
        print(f"OpenAI-compatible HTTP on {cluster.http_url}/v1", flush=True)
    print("ready", flush=True)
    print(cluster.start_table(), flush=True)  # each worker: node, cores, precision, KV, log
    cluster.wait()  # until Ctrl-C / SIGTERM, replacing dead workers meanwhile; then stops
    return 0


def _documented_command(sub, name: str, module, summary: str) -> argparse.ArgumentParser:
    """The subcommand `name`, whose --help shows `module`'s docstring as written."""
    return sub.add_parser(
        name,
        help=summary,
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> int:
    from pdserve import __version__

    parser = argparse.ArgumentParser(
        prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    upp = sub.add_parser("up", help="launch the deployment on Ray and serve until Ctrl-C")
    upp.add_argument(
        "config",
        nargs="?",
        default=None,
        help="deployment YAML (default: SmolLM2, 1 prefill + 1 decode, local Ray)",
    )
    upp.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto' or host:port); overrides ray.address",
    )
    upp.add_argument(
        "--check",
        action="store_true",
        help="run the checks `up` runs before starting Ray, in the same order (the model path, "
        "the gRPC and HTTP ports, the environment's keys, the cache, the resources a local Ray "
        "would have, the pools against the model), say what only a start can tell, and exit: "
        "0 ok, 2 refused with `up`'s first line",
    )
    upp.add_argument(
        "--http-port",
        default=None,
        metavar="PORT",
        help="the OpenAI-compatible HTTP front's port (0: a free one; 'off': none); overrides "
        "router.http_port (default 8000)",
    )
    _mode_args(upp, "overrides the YAML's ")
    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    _client_args(gen)
    chat = sub.add_parser("chat", help="one chat turn (the model's chat template is applied)")
    chat.add_argument("message")
    chat.add_argument("--system", default=None)
    _client_args(chat)
    from pdserve.tuning import bench as bench_cmd

    bench = _documented_command(
        sub, "bench", bench_cmd, "open-loop load test of a router: latency, SLO attainment, goodput"
    )
    bench_cmd.add_args(bench, DeployConfig().router.address)
    from pdserve.tuning import profiler as profile_cmd, tune_cmd

    for name, module, summary in (
        (
            "profile",
            profile_cmd,
            "measure this machine's step latencies and KV transfer for the tuner",
        ),
        ("tune", tune_cmd, "search placements for the best goodput (simulated)"),
    ):
        module.add_args(_documented_command(sub, name, module, summary))
    from pdserve.tuning import shift_trace

    shift_trace.add_arguments(
        _documented_command(
            sub, "shift-trace", shift_trace, "build a workload-shift trace from traces' phases"
        )
    )
    from pdserve import ctl

    ctlp = _documented_command(sub, "ctl", ctl, "operate a running deployment: roles, flips")
    ctlp.add_argument(
        "--router",
        default=DeployConfig().router.address,
        help="the router's host:port (default: %(default)s)",
    )
    _tls_args(ctlp)
    ctl.add_args(ctlp)
    args = parser.parse_args(argv)

    if args.cmd == "up":
        return _run_up(args)
    if args.cmd == "profile":
        return profile_cmd.run(args)
    if args.cmd == "tune":
        return tune_cmd.run(args)
    if args.cmd == "bench":
        return bench_cmd.run(args)
    if args.cmd == "shift-trace":
        return shift_trace.run(args)
    if args.cmd == "ctl":
        try:
            channel = _channel(args)
        except ValueError as e:
            print(f"pdserve ctl: {e}", file=sys.stderr)
            return 2
        return ctl.run(args, channel)
    return _run_local(args) if args.local else _run_remote(args)


if __name__ == "__main__":
    sys.exit(main())
