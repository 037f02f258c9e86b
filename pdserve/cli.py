# The usage lines below are `pdserve --help`'s text (description=__doc__, raw): the formatter
# must keep their indent.
# fmt: off
"""`pdserve` command line.

    pdserve up [CONFIG] [--address ADDR]      launch the deployment on Ray, serve until Ctrl-C
                  [--http-port PORT|off]      (gRPC and OpenAI-compatible HTTP, default :8000)
                  [--model M] [--tp N] ...    flags over the YAML's keys (`pdserve up --help`)
    pdserve up [CONFIG] --check               validate the config as `up` would; start nothing
    pdserve generate TEXT [--router H:P]      complete a prompt through the router
    pdserve chat MESSAGE [--router H:P]       one chat turn through the router
    pdserve chat [--system S]                 a conversation: one message a line of stdin
                  [--api-key KEY]             clients: the deployment's key (or PDSERVE_API_KEY)
    pdserve generate TEXT --local             run the engine in this process instead
    pdserve bench --trace NAME [--rate R]     open-loop load test: latency table, SLO goodput
    pdserve bench --sessions N --turns T ...  closed-loop chat sessions: per-turn TTFT, cache hits
    pdserve profile --model M --tp 1[,3] --out profile.json [--quick]   measure step latencies
    pdserve tune --profile P --workload W --slo ttft=..,tpot=.. --devices N   best placement
    pdserve shift-trace --phase NAME=SOURCE:SECONDS[:RATE] ... --out F   a workload-shift trace
    pdserve batch FILE.jsonl -o OUT.jsonl [--url URL]          an OpenAI batch file, run on a deployment
pdserve ctl [--router H:P] [--secret-file F] roles        workers, roles and states
    pdserve ctl [--router H:P] [--secret-file F] flip ID prefill|decode   move a worker's role

Exit codes, the same for every command:
  0    done (`up`: stopped by Ctrl-C or SIGTERM while it served)
  1    the router, or the --local engine, was reached and refused or failed the request or the
       operation: its status and message on one line (generate, chat, bench, ctl)
  2    nothing was sent or started: a bad flag or value, a file that cannot be read, a
       deployment `up` refuses, a router that cannot be reached; one line that names what to
       change and starts with `pdserve`
  130  interrupted (Ctrl-C or SIGTERM) before the command was done starting
"""
# fmt: on

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import time

from pdserve import client
from pdserve.deploy.config.load import ConfigError
from pdserve.deploy.config.schema import DTYPES, PORT_CLASH, DeployConfig
from pdserve.logs import configure_console
from pdserve.up_flags import (
    PREQUANTIZED,
    Overrides,
    add_up_flags,
    checkpoint_quantization,
    json_flag,
    no_effect_notes,
    port_note,
    quantization_arg,
    unneeded_flags,
    up_config,
)

# the parser's description is the commands' summary, its epilog the exit codes
_SUMMARY, _EXIT_CODES = __doc__.split("\nExit codes", 1)
_EXIT_CODES = "Exit codes" + _EXIT_CODES


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad command line refused in one line that names the flag and points to
    --help (`pdserve up: argument --tp: ... (see `pdserve up --help`)`), exit 2, instead of a
    usage block; every subcommand's parser is one too (add_subparsers makes its own kind)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


# vLLM's spellings of the dtypes (`--dtype half`, `--dtype float`)
VLLM_DTYPES = {"half": "float16", "float": "float32"}


def _dtype(value: str) -> str:
    return VLLM_DTYPES.get(value, value)


def _kv_cache_dtype(value: str) -> str:
    if value.startswith("fp8"):  # vLLM's fp8, fp8_e4m3, fp8_e5m2, ...
        raise argparse.ArgumentTypeError(
            f"{value!r}: pdserve's KV cache is auto (the activations' dtype), float32, float16 "
            f"or bfloat16 (half of float32's bytes); it has no fp8 cache"
        )
    return _dtype(value)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _mode_args(p: argparse.ArgumentParser, where: str = "", up: bool = False) -> None:
    """--dtype, --quantization and --kv-cache-dtype; `up`'s --quantization (also -q) takes vLLM's
    names of checkpoints quantized ahead too (checked against the checkpoint)."""
    p.add_argument(
        "--dtype",
        type=_dtype,
        choices=DTYPES[:1] + DTYPES[1::2],
        default=None,
        help=f"{where}dtype: 'auto' is bfloat16 on GPU, and on CPU float32 activations "
        "with the fastest quantization whose quality passes a probe (vLLM's half and float: "
        "float16 and float32)",
    )
    what = (
        f"{where}quantization (CPU): int8 weights and activations, int4 weights, bf16 "
        "linears with a float32-exact head top, or auto"
    )
    if up:
        p.add_argument(
            "--quantization",
            "-q",
            type=quantization_arg,
            default=None,
            metavar="{none,int8,int4,bf16,auto}",
            help=f"{what}; vLLM's {', '.join(PREQUANTIZED)} are taken when the checkpoint is "
            "quantized so (pdserve reads it so without the flag)",
        )
    else:
        p.add_argument(
            "--quantization",
            choices=["none", "int8", "int4", "bf16", "auto"],
            default=None,
            help=what,
        )
    p.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtype,
        choices=DTYPES[:1] + DTYPES[1::2],
        default=None,
        help=f"{where}the KV cache's dtype ('auto': the activations')",
    )


def _mode_overrides(args) -> dict:
    out = {}
    if args.dtype is not None:
        out["dtype"] = args.dtype
    if args.quantization is not None and args.quantization not in PREQUANTIZED:
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
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="--local only: speculative decoding, vLLM's JSON "
        '(\'{"method": "ngram", "num_speculative_tokens": 4}\', or \'{"model": "self", '
        '"quantization": "int4", "num_speculative_tokens": 4}\'); a deployment sets it in its '
        "YAML (pools.decode.speculative_config) or with `pdserve up --speculative-config`",
    )
    client.add_api_key_arg(p)
    client.add_tls_args(p)
    _sampling_args(p)


def speculative_config(args):
    """--speculative-config's JSON checked as the engine checks it (engine/spec/config.py), before
    any model loads: a SpeculativeConfig, None when not given, or a one-line ConfigError that
    names the flag."""
    if args.speculative_config is None:
        return None
    value = json_flag("--speculative-config", args.speculative_config)
    from pdserve.engine.spec.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(value)
    except ValueError as e:
        why = str(e).removeprefix("speculative_config.").removeprefix("speculative_config ")
        raise ConfigError(f"--speculative-config: {why}") from None


def _spec_note(engine) -> str:
    """The guesses speculative decoding checked and accepted, for the summary line; "" when the
    engine speculated on nothing (or cannot say)."""
    read = getattr(engine, "spec_stats", None)
    stats = read() if callable(read) else {}
    checked = stats.get("spec_draft_tokens", 0)
    if not checked:
        return ""
    return f"; speculative: {stats.get('spec_accepted_tokens', 0)}/{checked} guesses accepted"


def _run_local(args) -> int:
    # the flags, then the model found (or converted), before the engine's imports (torch and
    # transformers: seconds): a bad flag, a model that is not there or a cache that cannot be
    # written is refused at once
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.sampling_params import SamplingParams

    try:
        speculative = speculative_config(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
        resolve_model(args.model or "smollm2")
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    from pdserve.engine import LLM

    try:
        t0 = time.perf_counter()
        llm = LLM(
            args.model or "smollm2",
            tensor_parallel_size=args.tensor_parallel_size,
            kv_cache_memory=args.kv_cache_memory,
            **_mode_overrides(args),
            **({"speculative_config": speculative} if speculative is not None else {}),
        )
    except ValueError as e:  # the engine refused to start: nothing ran
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    t_load = time.perf_counter() - t0
    try:
        return _local_reply(args, llm, params, t_load)
    finally:
        llm.shutdown()


def _local_reply(args, llm, params, t_load: float) -> int:
    """`generate --local`'s reply, one chat turn's, or a session's on `llm`; 1 when the engine
    refuses the request, as a router's refusal is (a prompt too long for the model)."""
    try:
        if args.cmd == "chat" and args.message is None:
            from pdserve import chat_session

            return chat_session.run_local(args, llm, params)
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
        return 1
    c = out.outputs[0]
    print(c.text, end="" if c.text.endswith("\n") else "\n", flush=True)
    ttft = out.metrics.get("first_token", 0) - out.metrics.get("arrival", 0)
    print(
        f"[{len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated, "
        f"finish={c.finish_reason}; load {t_load:.1f}s, TTFT {ttft * 1e3:.0f} ms, "
        f"total {elapsed:.2f}s, {len(c.token_ids) / max(elapsed, 1e-9):.1f} tok/s; "
        f"{llm.engine.mode_note}{_spec_note(llm.engine)}]",
        file=sys.stderr,
    )
    return 0


def _refused(args, e: Exception, flags: Overrides) -> int:
    """A refusal before anything started, printed alike by `up` and `up --check`: one line per
    problem, each naming the flag that gave the value, else the config (a ConfigError: its keys)
    or what to change; exit code 2."""
    prefix = f"{args.config or 'default config'}: " if isinstance(e, ConfigError) else ""
    printed = set()
    for line in str(e).splitlines() or [type(e).__name__]:
        line, from_flag = flags.name(line)
        line = f"pdserve: {'' if from_flag else prefix}{line}"
        if line not in printed:  # a flag for every pool: one line, not one per pool
            printed.add(line)
            print(line, file=sys.stderr)
    return 2


def _preflight(args, config: DeployConfig, flags: Overrides) -> list[str] | int:
    """deploy/prechecks.preflight, then vLLM's --quantization against the checkpoint: the notes
    on what it could not check, or 2 once refused."""
    from pdserve.deploy.prechecks import DeployError, preflight

    try:
        notes = preflight(config, args.address)
    except (ConfigError, DeployError) as e:
        return _refused(args, e, flags)
    method = getattr(args, "quantization", None)
    if method in PREQUANTIZED:  # (the model is found, or converted, by now)
        here = not (args.address or config.ray.address)
        try:
            note = checkpoint_quantization(config.model, method, here)
        except ValueError as e:
            print(f"pdserve: {e}", file=sys.stderr)
            return 2
        print(f"pdserve: note: {note}", file=sys.stderr)
    return notes


def _check_up(args, config: DeployConfig, flags: Overrides) -> int:
    """`pdserve up --check`: the checks `up` runs before Ray starts, the same ones in the same
    order (deploy/prechecks.preflight); 0 when `up` would go on, 2 with its first refusal."""
    notes = _preflight(args, config, flags)
    if isinstance(notes, int):
        return notes
    for note in notes:
        print(f"note: {note}")
    pools = ", ".join(f"{k} {p.replicas} x tp {p.tp}" for k, p in config.worker_pools())
    print(f"{args.config or 'default config'}: ok ({config.model}; {pools}); nothing started")
    return 0


def _up_config(args) -> tuple[DeployConfig, Overrides] | int:
    """The deployment from the YAML and the flags, with a note for each vLLM flag taken that
    changes nothing here and for a --port that is not vLLM's; 2 once refused."""
    try:
        config, flags = up_config(args)
        config = config.model_copy(update=_mode_overrides(args))
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"pdserve: {line}", file=sys.stderr)
        note = port_note(args, None)
        if note and PORT_CLASH in str(e):  # vLLM's --port 8000, written out
            print(f"pdserve: note: {note}", file=sys.stderr)
        return 2
    unneeded = unneeded_flags(args)
    if unneeded:  # a vLLM command line's parser flags: taken, and said to be unneeded
        print(
            f"pdserve: note: {', '.join(unneeded)}: not needed, the router reads the model's tool "
            "call and reasoning formats from its tokenizer and chat template",
            file=sys.stderr,
        )
    for note in [*no_effect_notes(args), port_note(args, config)]:
        if note:
            print(f"pdserve: note: {note}", file=sys.stderr)
    return config, flags


def _run_up(args) -> int:
    """Exit codes: 0 stopped by Ctrl-C or SIGTERM, 2 could not start (the message says what to
    change; no traceback), 130 interrupted (Ctrl-C or SIGTERM) while starting."""
    built = _up_config(args)
    if isinstance(built, int):
        return built
    config, flags = built
    if args.check:
        return _check_up(args, config, flags)
    notes = _preflight(args, config, flags)  # as --check: the same refusals, in the same order
    if isinstance(notes, int):
        return notes
    # the deployment's own lines (deaths, replacements, the secret's source: never the secret),
    # the router's console line, planner decisions, flips (pdserve/logs.py)
    configure_console(config.observability)
    # `kill -USR1 <pid>` writes every thread's stack to stderr: what a stuck `up` is waiting on
    # (the process's own stderr: a caller that swapped sys.stderr, as a test does, has no fd)
    if sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    from pdserve.deploy.launcher import DeployError, up

    try:
        cluster = up(config, address=args.address, block=False)
    except (ConfigError, DeployError) as e:  # Ray's resources, a worker that failed to start
        return _refused(args, e, flags)
    except KeyboardInterrupt:  # (up stopped what it had started before raising it)
        print("pdserve: interrupted while starting", file=sys.stderr)
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


def _add_up_command(sub) -> None:
    """`pdserve up`: the deployment YAML, the Ray address, --check, and the flags over the keys."""
    upp = sub.add_parser("up", help="launch the deployment on Ray and serve until Ctrl-C")
    upp.add_argument(
        "config",
        nargs="?",
        default=None,
        help="deployment YAML (default: SmolLM2, 1 prefill + 1 decode, local Ray); or, as "
        "`vllm serve MODEL` takes it, the model: a .gguf file, a model folder (config.json "
        "inside) or a Hub id ORG/NAME that is no file here (then as --model)",
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
    add_up_flags(upp)
    _mode_args(upp, "overrides the YAML's ", up=True)


def _add_client_commands(sub) -> None:
    """`pdserve generate` and `pdserve chat`: a prompt or a conversation through the router."""
    from pdserve import chat_session

    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    _client_args(gen)
    chat = sub.add_parser(
        "chat",
        help="one chat turn, or without MESSAGE a conversation read from stdin (the model's chat "
        "template is applied)",
        description=chat_session.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument("message", nargs="?", default=None, help="one turn; none: a conversation")
    chat.add_argument("--system", default=None)
    _client_args(chat)


def _add_tool_commands(sub) -> None:
    """The commands whose --help is their module's docstring: bench, profile, tune, shift-trace,
    batch and ctl."""
    from pdserve import batch_cmd, ctl
    from pdserve.tuning import bench as bench_cmd, profiler as profile_cmd, shift_trace, tune_cmd

    bench = _documented_command(
        sub,
        "bench",
        bench_cmd,
        "load test of a router: open-loop latency, SLO attainment, goodput; or chat sessions",
    )
    bench_cmd.add_args(bench, DeployConfig().router.address)
    client.add_api_key_arg(bench)
    for name, module, summary in (
        (
            "profile",
            profile_cmd,
            "measure this machine's step latencies and KV transfer for the tuner",
        ),
        ("tune", tune_cmd, "search placements for the best goodput (simulated)"),
    ):
        module.add_args(_documented_command(sub, name, module, summary))
    shift_trace.add_arguments(
        _documented_command(
            sub, "shift-trace", shift_trace, "build a workload-shift trace from traces' phases"
        )
    )
    batch = _documented_command(
        sub, "batch", batch_cmd, "run an OpenAI batch file on a deployment, results to files"
    )
    batch_cmd.add_args(batch)
    client.add_api_key_arg(batch)
    ctlp = _documented_command(sub, "ctl", ctl, "operate a running deployment: roles, flips")
    ctlp.add_argument(
        "--router",
        default=DeployConfig().router.address,
        help="the router's host:port (default: %(default)s)",
    )
    client.add_tls_args(ctlp)
    ctl.add_args(ctlp)


def _parser() -> argparse.ArgumentParser:
    """`pdserve`'s parser: every subcommand, in the order `pdserve --help` lists them."""
    from pdserve import __version__

    parser = _Parser(
        prog="pdserve",
        description=_SUMMARY,
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_up_command(sub)
    _add_client_commands(sub)
    _add_tool_commands(sub)
    return parser


def _run_tool(args) -> int:
    """Runs bench, profile, tune, shift-trace, batch or ctl; returns the exit code."""
    from pdserve import batch_cmd, ctl
    from pdserve.tuning import bench as bench_cmd, profiler as profile_cmd, shift_trace, tune_cmd

    if args.cmd == "profile":
        return profile_cmd.run(args)
    if args.cmd == "tune":
        return tune_cmd.run(args)
    if args.cmd == "bench":
        client.use_api_key(args)
        return bench_cmd.run(args)
    if args.cmd == "shift-trace":
        return shift_trace.run(args)
    if args.cmd == "batch":
        client.use_api_key(args)
        return batch_cmd.run(args)
    try:
        channel = client.channel(args)
    except ValueError as e:
        print(f"pdserve ctl: {e}", file=sys.stderr)
        return 2
    return ctl.run(args, channel)


def _run_client(args) -> int:
    """Runs generate or chat, in this process (--local) or through the router."""
    from pdserve import chat_session

    if args.local:
        return _run_local(args)
    if args.speculative_config is not None:
        print(
            "pdserve: --speculative-config is for --local; a deployment speculates on its decode "
            "workers (YAML pools.decode.speculative_config, or `pdserve up --speculative-config`)",
            file=sys.stderr,
        )
        return 2
    client.use_api_key(args)
    if args.cmd == "chat" and args.message is None:
        return chat_session.run_remote(args)
    messages = None
    if args.cmd == "chat":
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.message})
    return client.run_remote(args, messages)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, parsed; a word no parser knows is refused in one line by the
    subcommand's parser, naming the subcommand (argparse's own names only `pdserve`)."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        s = "s" if len(unknown) > 1 else ""
        sub.choices[args.cmd].error(f"unrecognized argument{s}: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if args.cmd == "up":
            return _run_up(args)
        if args.cmd in ("generate", "chat"):
            return _run_client(args)
        return _run_tool(args)
    except KeyboardInterrupt:  # Ctrl-C where a command has no handling of its own (its imports,
        # its checks): one line and the shell's code for it, not a traceback out of torch's import
        print("pdserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
