"""`pdserve up`'s flags for the deployment YAML's common keys, and how they meet the YAML.

    pdserve up --model HuggingFaceTB/SmolLM2-135M-Instruct --decode-replicas 2 --port 50052
    pdserve up deploy.yaml --tp 2 --api-key "$KEY" --http-port off

Precedence, key by key: a flag, else the YAML's key, else the schema's default (deploy/config/schema.py);
with no YAML at all, the flags go over the defaults. A pool flag (`--prefill-tp`) wins over the
flag for every pool (`--tp`). The flags are applied to the YAML's data before it is validated, so a
value is checked as the key would be (the same schema, then the same checks before the start), and
every refusal of a value a flag gave names the flag instead of the key (`--decode-tp: Input should
be greater than or equal to 1 (got 0)`). Nothing here keeps state: `up_config` reads the command
line and the file once, at the start of `pdserve up`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from dataclasses import dataclass, field

from pdserve.deploy.config.load import ConfigError, read_config_data, validate_config
from pdserve.deploy.config.schema import DeployConfig

POOLS = ("prefill", "decode", "colocated")


def _integer(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag}: must be an integer, got {value!r}") from None


def _port_or_off(flag: str, value: str) -> int | None:
    if value == "off":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag}: {value!r} is not a port number or 'off'") from None


def _text(flag: str, value: str) -> str:
    return value


def _number(flag: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{flag}: must be a number, got {value!r}") from None


def origins(flag: str, value: str) -> list:
    """vLLM's --allowed-origins: a JSON list of origins (`'["http://localhost:3000"]'`), or the
    origins separated by commas; the YAML's key checks each."""
    if value.lstrip().startswith("["):
        try:
            data = json.loads(value)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, list):
            return data
    elif value.strip():
        return [o.strip() for o in value.split(",")]
    raise ConfigError(
        f"{flag}: a JSON list of origins, e.g. '[\"http://localhost:3000\"]' ('[\"*\"]': any), "
        f"got {value[:200]!r}"
    )


def json_flag(flag: str, value: str):
    """`value` read as JSON (`null` included), or a one-line ConfigError naming `flag`."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{flag}: not valid JSON ({e.msg} at character {e.pos}): {value!r}; e.g. "
            f'\'{{"method": "ngram", "num_speculative_tokens": 4}}\''
        ) from None


def hf_overrides(flag: str, value: str) -> dict:
    """vLLM's --hf-overrides JSON object (the YAML's hf_overrides checks its keys)."""
    data = json_flag(flag, value)
    if not isinstance(data, dict):
        raise ConfigError(
            f'{flag}: a JSON object, e.g. \'{{"classifier_from_token": ["no", "yes"]}}\', '
            f"got {value[:200]!r}"
        )
    return data


# (flag, the key it sets, its parser, its help); a key under `pools.*` is set on each pool the
# deployment has ("*": prefill and decode, or colocated), one under `pools.+` on each pool that
# decodes (decode, or colocated), a key under `pools.<pool>` on that one.
_FLAGS = (
    (
        "--model",
        "model",
        _text,
        "'smollm2', a .gguf file, an HF directory, or a Hugging Face Hub "
        "id ORG/NAME[@REVISION] (from the hub cache; downloaded unless HF_HUB_OFFLINE=1)",
    ),
    (
        "--served-model-name",
        "served_model_name",
        _text,
        "the id clients name the model by "
        "(default: a Hub id's ORG/NAME, else the model's directory or file name)",
    ),
    (
        "--chat-template",
        "chat_template",
        _text,
        "the Jinja chat template the router renders chats with instead of the tokenizer's: a "
        "file, or the template itself (vLLM's flag)",
    ),
    (
        "--hf-overrides",
        "hf_overrides",
        hf_overrides,
        "vLLM's JSON; pdserve takes classifier_from_token (a generative model's label tokens: "
        '\'{"classifier_from_token": ["no", "yes"]}\' serves Qwen3-Reranker), is_matryoshka and '
        "matryoshka_dimensions",
    ),
    ("--tp", "pools.*.tp", _integer, "tensor-parallel degree of every pool"),
    ("--tensor-parallel-size", "pools.*.tp", _integer, "vLLM's name for --tp"),
    ("--max-model-len", "pools.*.max_model_len", _integer, "longest sequence, every pool"),
    ("--max-num-seqs", "pools.*.max_num_seqs", _integer, "sequences a step runs, every pool"),
    (
        "--max-num-batched-tokens",
        "pools.*.max_num_batched_tokens",
        _integer,
        "tokens a step runs (longer prompts in chunks), every pool",
    ),
    *(
        (f"--{pool}-{name.replace('_', '-')}", f"pools.{pool}.{name}", _integer, f"{what}")
        for pool in POOLS
        for name, what in (
            ("replicas", f"{pool} workers"),
            ("tp", f"{pool} workers' tensor-parallel degree (over --tp)"),
            ("pp", f"{pool} workers' pipeline stages (prefill only)"),
        )
    ),
    (
        "--speculative-config",
        "pools.+.speculative_config",
        json_flag,
        "speculative decoding on the decode (or colocated) workers, vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' or \'{"model": "self", '
        '"quantization": "int4", "num_speculative_tokens": 4}\'; null: off',
    ),
    (
        "--log-level",
        "observability.log_level",
        _text,
        "debug, info, warning or error: the pdserve lines on the console (default: "
        "PDSERVE_LOG_LEVEL, else info)",
    ),
    ("--log-format", "observability.log_format", _text, "text, or json: one object a line"),
    (
        "--stats-interval",
        "observability.stats_interval_s",
        _number,
        "seconds between the router's console lines per pool (0: none; default 10)",
    ),
    (
        "--otlp-traces-endpoint",
        "observability.otlp_traces_endpoint",
        _text,
        "OpenTelemetry: every process's spans to this OTLP endpoint, e.g. http://localhost:4317 "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off)",
    ),
    (
        "--capture-trace",
        "observability.capture_trace",
        _text,
        "append every finished request to FILE as a Mooncake-format trace line "
        "(pdserve bench --trace FILE replays it)",
    ),
    (
        "--scheduling-policy",
        "router.scheduling_policy",
        _text,
        "fcfs (a request's priority must be 0) or priority (vLLM's: lower first; default fcfs)",
    ),
    (
        "--stream-interval",
        "router.stream_interval",
        _integer,
        "decode workers send a stream's tokens in groups of this many (vLLM's and SGLang's; "
        "the first token and the end at once; 1 to 64, default 1)",
    ),
    ("--max-loras", "lora.max_loras", _integer, "LoRA adapters a step runs, resident at once"),
    ("--max-lora-rank", "lora.max_lora_rank", _integer, "the largest LoRA rank r served"),
    ("--host", "router.host", _text, "the router's address for clients (gRPC and HTTP)"),
    ("--port", "router.port", _integer, "the router's gRPC port (0: a free one)"),
    (
        "--http-port",
        "router.http_port",
        _port_or_off,
        "the OpenAI-compatible HTTP front's port "
        "(0: a free one; 'off': none; default 8000, or a free one with --port 0)",
    ),
    (
        "--allowed-origins",
        "router.cors_allowed_origins",
        origins,
        "vLLM's: the origins whose web pages may call the HTTP front, a JSON list "
        "('[\"http://localhost:3000\"]'; '[\"*\"]': any page; default: none)",
    ),
)
_API_KEY = ("--api-key", "router.api_keys")
# vLLM's flags that name what pdserve reads from the model itself (router/chat_tools.py, the
# reasoning split): taken, so that a vLLM command line runs, and said to be unneeded
VLLM_PARSER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser")
_ENABLE_LORA = ("--enable-lora", "lora.enabled")
# switches that turn a YAML key on (`store_true`: given, the key is true; not given, the YAML's)
_SWITCHES = (
    (
        "--pause-endpoints",
        "router.pause_endpoints",
        "vLLM's POST /pause and /resume and GET /is_paused, for a trainer's weight sync",
    ),
    (
        "--weight-updates",
        "router.weight_updates",
        "SGLang's POST /update_weights_from_disk: both pools load a checkpoint at run time",
    ),
)
_LORA_MODULES = ("--lora-modules", "lora.modules")


def lora_modules(flag: str, values: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules: each `name=path`, or a JSON object {"name": ..., "path": ...}."""
    out = {}
    for value in values:
        if value.startswith("{"):
            obj = json_flag(flag, value)
            if not isinstance(obj, dict) or not {"name", "path"} <= set(obj):
                raise ConfigError(f'{flag}: a JSON module needs "name" and "path", got {value!r}')
            name, path = obj["name"], obj["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"{flag}: expected name=path, got {value!r}")
        out[str(name)] = str(path)
    return out


def add_up_flags(p: argparse.ArgumentParser) -> None:
    """The flags, each overriding its YAML key (named in its help); all default to unset."""
    group = p.add_argument_group(
        "overrides of the YAML's keys (a flag, else the YAML, else the default)"
    )
    for flag, key, parse, what in _FLAGS:
        metavar = {
            _integer: "N",
            _number: "S",
            _port_or_off: "PORT",
            json_flag: "JSON",
            hf_overrides: "JSON",
            origins: "JSON",
        }.get(parse)
        key = key.replace("+", "decode|colocated")
        group.add_argument(flag, default=None, metavar=metavar, help=f"{what} (YAML: {key})")
    group.add_argument(
        _API_KEY[0],
        action="append",
        default=None,
        metavar="KEY",
        help="a client API key (repeat for more); replaces router.api_keys and .api_keys_file, "
        "and wins over PDSERVE_API_KEYS",
    )
    group.add_argument(
        _ENABLE_LORA[0],
        action="store_true",
        default=None,
        help="serve LoRA adapters (YAML: lora.enabled)",
    )
    for flag, key, what in _SWITCHES:
        group.add_argument(
            flag, action="store_true", default=None, help=f"{what} (YAML: {key}: true)"
        )
    vllm = p.add_argument_group(
        "vLLM's parser flags: taken and not needed (the router reads the model's tool call and "
        "reasoning formats from its tokenizer and chat template)"
    )
    vllm.add_argument(VLLM_PARSER_FLAGS[0], action="store_true", default=None, help="(always on)")
    for flag in VLLM_PARSER_FLAGS[1:]:
        vllm.add_argument(flag, default=None, metavar="NAME", help="(read from the model)")
    group.add_argument(
        _LORA_MODULES[0],
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters every worker loads at start, each name=path (PEFT's directory) or "
        "a JSON object with name and path; replaces the YAML's (YAML: lora.modules)",
    )


@dataclass
class Overrides:
    """What the flags set: each key (as the YAML spells it) and the flag that set it."""

    by_key: dict[str, str] = field(default_factory=dict)

    def name(self, line: str) -> tuple[str, bool]:
        """`line` (a refusal) with every key a flag set spelled as that flag, and whether the line
        is about such a key (then it needs no config file's name in front)."""
        own = False
        for key, flag in sorted(self.by_key.items(), key=lambda kv: -len(kv[0])):
            head = re.match(rf"(?:[^:]*: )?{re.escape(key)}(?:\.\d+)?: ", line)
            if head:  # "source: pools.decode.tp: ..." or "pools.decode.tp: ..."
                line, own = f"{flag}: {line[head.end() :]}", True
            if key != "model":  # "model" is also a word; the others are spelled like no word
                line = re.sub(rf"(?<![\w.]){re.escape(key)}(?![\w])", flag, line)
        return line, own

    def refusal(self, error: ConfigError, source: str) -> ConfigError:
        """`error` from validating the YAML and the flags, each line naming the flag that gave
        the value it refuses; a line about a key that holds a flag's value says so."""
        lines = []
        for line in str(error).splitlines():
            named, own = self.name(line)
            if not own:
                key = line.removeprefix(f"{source}: ").split(": ", 1)[0]
                flags = sorted({f for k, f in self.by_key.items() if k.startswith(f"{key}.")})
                if flags:
                    named += f" (given by {', '.join(flags)})"
            if named not in lines:  # a flag for every pool: one line, not one per pool
                lines.append(named)
        return ConfigError("\n".join(lines))


def _pools_of(data: dict, which: str = "*") -> tuple[str, ...]:
    """The pools the deployment will have: colocated, or prefill and decode; with which="+",
    those that decode (colocated, or decode)."""
    pools = data.get("pools")
    colocated = isinstance(pools, dict) and "colocated" in pools
    if colocated:
        return ("colocated",)
    return ("decode",) if which == "+" else ("prefill", "decode")


def _set(data: dict, key: str, value) -> bool:
    """data[a][b][c] = value for key "a.b.c", making the mappings on the way; False (nothing set)
    where the YAML has something else than a mapping there, which validation then refuses."""
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return False
    node[last] = value
    return True


def apply_flags(args: argparse.Namespace, data: dict) -> Overrides:
    """Sets each flag given in `data` (the YAML's, changed in place): the flags for every pool
    first, so that one pool's own flag wins over them."""
    done = Overrides()
    given = [(flag, key, parse) for flag, key, parse, _ in _FLAGS]
    given = [g for g in given if getattr(args, _dest(g[0])) is not None]
    for flag, key, parse in sorted(given, key=lambda g: g[1][:7] not in ("pools.*", "pools.+")):
        value = parse(flag, getattr(args, _dest(flag)))
        which = key.split(".")[1] if key.startswith("pools.") else ""
        if which in ("*", "+"):
            if any(f.startswith("--colocated-") for f, _, _ in given):
                data.setdefault("pools", {}).setdefault("colocated", {})
            keys = [key.replace(which, pool, 1) for pool in _pools_of(data, which)]
        else:
            keys = [key]
        for k in keys:
            if _set(data, k, value):
                done.by_key[k] = flag
    lora = None
    if getattr(args, "enable_lora", None):
        lora = data.setdefault("lora", {})
        if isinstance(lora, dict):
            lora["enabled"] = True
            done.by_key[_ENABLE_LORA[1]] = _ENABLE_LORA[0]
    if getattr(args, "lora_modules", None) is not None:
        lora = data.setdefault("lora", {})
        if isinstance(lora, dict):
            lora["modules"] = lora_modules(_LORA_MODULES[0], args.lora_modules)
            done.by_key[_LORA_MODULES[1]] = _LORA_MODULES[0]
    for flag, key, _ in _SWITCHES:
        if getattr(args, _dest(flag), None) and _set(data, key, True):
            done.by_key[key] = flag
    if args.api_key is not None:
        router = data.setdefault("router", {})
        if isinstance(router, dict):
            router.pop("api_keys_file", None)
            router["api_keys"] = list(args.api_key)
            done.by_key[_API_KEY[1]] = _API_KEY[0]
    return done


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def unneeded_flags(args: argparse.Namespace) -> list[str]:
    """The vLLM parser flags given (VLLM_PARSER_FLAGS), each as it was written: `pdserve up` says
    once that the router reads those formats from the model."""
    given = []
    for flag in VLLM_PARSER_FLAGS:
        value = getattr(args, _dest(flag), None)
        if value is True:
            given.append(flag)
        elif value is not None:
            given.append(f"{flag} {value}")
    return given


def up_config(args: argparse.Namespace) -> tuple[DeployConfig, Overrides]:
    """The deployment `pdserve up` starts: args.config's YAML (or nothing: the defaults) with the
    flags over it, validated as one; a ConfigError whose lines name the flag or the file's key."""
    source = args.config or "default config"
    data = read_config_data(args.config) if args.config is not None else {}
    base_dir = pathlib.Path(args.config).parent if args.config is not None else pathlib.Path(".")
    overrides = apply_flags(args, data)
    try:
        return validate_config(data, source, base_dir), overrides
    except ConfigError as e:
        raise overrides.refusal(e, source) from None
