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

A `vllm serve` command line runs as it is where pdserve can honour it: the model in CONFIG's place
(`pdserve up ./model.gguf`, a model folder, a Hub id: positional_model) is --model; vLLM's flags
are mapped to the key pdserve has for them (-tp, --[no-]enable-prefix-caching, --seed,
--kv-cache-memory-bytes, --disable-log-stats), its spellings of values read as vLLM reads them
(human_int: 32k, 32K), its flags that change nothing here taken with a note (VLLM_NO_EFFECT), and
the rest refused in one line that names what to use instead (VLLM_REFUSED), never with their value
taken for CONFIG. vLLM's --port is its HTTP port, pdserve's the router's gRPC port: port_note says
so where it matters.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from dataclasses import dataclass, field

from pdserve.deploy.config.load import (
    MODEL_HINT,
    ConfigError,
    read_config_data,
    validate_config,
)
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


# vLLM's human-readable integers (vllm/engine/arg_utils.py human_readable_int): a lowercase suffix
# is decimal and may follow a decimal number (25.6k), an uppercase one binary (32K = 32768)
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(flag: str, value: str) -> int:
    """An integer as vLLM reads --max-model-len, --max-num-batched-tokens and
    --kv-cache-memory-bytes: 4096, 32k (32000), 32K (32768), 1.5m; a ConfigError naming `flag`."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", value.strip())
    if found is None:
        raise ConfigError(
            f"{flag}: must be an integer, optionally with vLLM's k/m/g (x1000) or K/M/G (x1024) "
            f"suffix, got {value!r}"
        )
    number, suffix = found.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ConfigError(
            f"{flag}: a decimal number needs a decimal suffix (k, m, g), got {value!r}"
        )
    return int(number) * _BINARY.get(suffix, 1)


def _names(flag: str, values: list[str]) -> str | list[str]:
    """vLLM's --served-model-name: one name, or several (the first is the model's id, the rest
    aliases that requests may name too): the YAML's string or list."""
    return values[0] if len(values) == 1 else list(values)


def _boolean(flag: str, value: bool) -> bool:
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


def domains(flag: str, value: str) -> list:
    """vLLM's --allowed-media-domains, as one value: the domains separated by commas (or a JSON
    list); the YAML's key checks each."""
    if value.lstrip().startswith("["):
        return origins(flag, value)
    names = [d.strip() for d in value.split(",") if d.strip()]
    if not names:
        raise ConfigError(
            f"{flag}: domains separated by commas, e.g. 'example.com,cdn.example.org'"
        )
    return names


def modality_limits(flag: str, value: str) -> dict:
    """vLLM's --limit-mm-per-prompt: a JSON object ('{"image": 2}') or `image=2`; the YAML's key
    checks the modality and the count."""
    if value.lstrip().startswith("{"):
        return json_flag(flag, value)
    out = {}
    for pair in value.split(","):
        name, _, count = pair.partition("=")
        if not count.strip().isdigit():
            raise ConfigError(f"{flag}: a JSON object or image=N, e.g. '{{\"image\": 2}}'")
        out[name.strip()] = int(count)
    return out


def json_flag(flag: str, value: str):
    """`value` read as JSON (`null` included), or a one-line ConfigError naming `flag`."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{flag}: not valid JSON ({e.msg} at character {e.pos}): {value!r}; e.g. "
            f'\'{{"method": "ngram", "num_speculative_tokens": 4}}\''
        ) from None


def _override_generation_config(flag: str, value: str) -> dict:
    """vLLM's --override-generation-config JSON object (the YAML's key checks its fields)."""
    data = json_flag(flag, value)
    if not isinstance(data, dict):
        raise ConfigError(
            f"{flag}: a JSON object, e.g. '{{\"temperature\": 0.5}}', got {value[:200]!r}"
        )
    return data


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
        _names,
        "the id clients name the model by, then any aliases they may name it by too "
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
    (
        "--max-model-len",
        "pools.*.max_model_len",
        human_int,
        "longest sequence, every pool (vLLM's 32k = 32000, 32K = 32768)",
    ),
    ("--max-num-seqs", "pools.*.max_num_seqs", _integer, "sequences a step runs, every pool"),
    (
        "--max-num-batched-tokens",
        "pools.*.max_num_batched_tokens",
        human_int,
        "tokens a step runs (longer prompts in chunks: chunked prefill is always on), every pool",
    ),
    (
        "--kv-cache-memory-bytes",
        "pools.*.kv_cache_memory",
        human_int,
        "bytes of KV cache of each worker rank, every pool (vLLM's flag: its per-GPU KV cache; "
        "e.g. 4G)",
    ),
    (
        "--enable-prefix-caching",
        "pools.*.enable_prefix_caching",
        _boolean,
        "reuse the KV of prompts' shared prefixes, every pool (on by default; "
        "--no-enable-prefix-caching: off)",
    ),
    (
        "--generation-config",
        "generation_config",
        _text,
        "the model's sampling defaults and extra end-of-sequence ids: 'auto' (its "
        "generation_config.json, the default), 'vllm' (its sampling fields ignored) or a folder "
        "holding a generation_config.json (vLLM's flag)",
    ),
    (
        "--override-generation-config",
        "override_generation_config",
        _override_generation_config,
        "sampling defaults laid over the generation config's, a JSON object of its fields "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) (vLLM's flag)",
    ),
    (
        "--seed",
        "seed",
        _integer,
        "the engines' random seed: sampling without a request seed starts from it "
        "(vLLM's; default 0)",
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
    (
        "--allowed-media-domains",
        "router.allowed_media_domains",
        domains,
        "vLLM's: the hosts (and hosts under them) whose image links a chat may send, fetched "
        "by the router, separated by commas (default: none; images come as data URLs)",
    ),
    (
        "--limit-mm-per-prompt",
        "router.limit_mm_per_prompt",
        modality_limits,
        "vLLM's: the images one prompt may hold, '{\"image\": N}' or image=N (0: none; "
        "default: 16)",
    ),
    (
        "--mm-processor-kwargs",
        "router.mm_processor_kwargs",
        json_flag,
        "vLLM's: more arguments of the model processor's call for a chat's images, a JSON "
        'object (Qwen2-VL\'s \'{"size": {"shortest_edge": 3136, "longest_edge": 1003520}}\')',
    ),
)
# each flag's other spellings (vLLM's short ones)
_ALIASES = {"--tensor-parallel-size": ("-tp",)}
_API_KEY = ("--api-key", "router.api_keys")
# vLLM's flags that name what pdserve reads from the model itself (router/chat_tools.py, the
# reasoning split): taken, so that a vLLM command line runs, and said to be unneeded
VLLM_PARSER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser")
_ENABLE_LORA = ("--enable-lora", "lora.enabled")
# switches that set a YAML key (`store_true`: given, the key gets the value; not given, the YAML's)
_SWITCHES = (
    (
        "--pause-endpoints",
        "router.pause_endpoints",
        True,
        "vLLM's POST /pause and /resume and GET /is_paused, for a trainer's weight sync",
    ),
    (
        "--weight-updates",
        "router.weight_updates",
        True,
        "SGLang's POST /update_weights_from_disk: both pools load a checkpoint at run time",
    ),
    (
        "--enable-sleep-mode",
        "router.sleep_mode",
        True,
        "vLLM's: POST /sleep and /wake_up and GET /is_sleeping, every worker's engine frees "
        "its memory while a trainer runs",
    ),
    (
        "--disable-log-stats",
        "observability.stats_interval_s",
        0.0,
        "vLLM's: no periodic console lines of the pools' load",
    ),
)
_LORA_MODULES = ("--lora-modules", "lora.modules")
# `vllm serve` flags that change nothing here, taken so that a vLLM command line runs and said to
# change nothing: (flag, whether it takes a value, why)
VLLM_NO_EFFECT = (
    (
        "--trust-remote-code",
        False,
        "pdserve never runs a checkpoint's own Python code: it serves the architectures it "
        "implements and refuses another by its name",
    ),
    (
        "--enable-chunked-prefill",
        False,
        "chunked prefill is always on (a prompt longer than --max-num-batched-tokens is "
        "prefilled in chunks)",
    ),
    (
        "--disable-log-requests",
        False,
        "pdserve writes no line per request (--capture-trace FILE records each finished one)",
    ),
    ("--max-log-len", True, "pdserve writes no line per request, so no prompt to shorten"),
)
# `vllm serve` flags with no counterpart here: refused in one line that says what to use instead
VLLM_REFUSED = (
    (
        "--gpu-memory-utilization",
        True,
        "pdserve does not budget a share of the whole device; each worker rank's KV cache is "
        "--kv-cache-memory-bytes N (vLLM's flag; YAML pools.*.kv_cache_memory: bytes, or a "
        "fraction of the memory free when the worker starts)",
    ),
    (
        "--no-enable-chunked-prefill",
        False,
        "chunked prefill is always on; --max-num-batched-tokens (pools.*.max_num_batched_tokens) "
        "sets the longest chunk",
    ),
    (
        "--uvicorn-log-level",
        True,
        "the HTTP front's lines follow --log-level (observability.log_level), and it writes no "
        "access log",
    ),
    (
        "--enable-log-requests",
        False,
        "pdserve writes no line per request; --capture-trace FILE (observability.capture_trace) "
        "records each finished one",
    ),
    (
        "--pipeline-parallel-size",
        True,
        "pipeline stages are the prefill pool's: --prefill-pp N (pools.prefill.pp)",
    ),
    (
        "--data-parallel-size",
        True,
        "replicas are per pool: --prefill-replicas and --decode-replicas, or "
        "--colocated-replicas (pools.*.replicas)",
    ),
    ("--revision", True, "the revision goes with the model: --model ORG/NAME@REVISION"),
)
_VLLM_ALIASES = {"--pipeline-parallel-size": ("-pp",), "--data-parallel-size": ("-dp",)}


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


_METAVARS = {
    _integer: "N",
    human_int: "N",
    _number: "S",
    _port_or_off: "PORT",
    json_flag: "JSON",
    hf_overrides: "JSON",
    _override_generation_config: "JSON",
    origins: "JSON",
    _names: "NAME",
}


def add_up_flags(p: argparse.ArgumentParser) -> None:
    """The flags, each overriding its YAML key (named in its help); all default to unset."""
    group = p.add_argument_group(
        "overrides of the YAML's keys (a flag, else the YAML, else the default)"
    )
    for flag, key, parse, what in _FLAGS:
        key = key.replace("+", "decode|colocated")
        names = (flag, *_ALIASES.get(flag, ()))
        shape = {"metavar": _METAVARS.get(parse)}
        if parse is _boolean:
            shape = {"action": argparse.BooleanOptionalAction}
        elif parse is _names:
            shape["nargs"] = "+"
        group.add_argument(*names, default=None, help=f"{what} (YAML: {key})", **shape)
    group.add_argument(
        _API_KEY[0],
        action="extend",
        nargs="+",
        default=None,
        metavar="KEY",
        help="client API keys (several, or the flag repeated); replaces router.api_keys and "
        ".api_keys_file, and wins over PDSERVE_API_KEYS",
    )
    group.add_argument(
        _ENABLE_LORA[0],
        action="store_true",
        default=None,
        help="serve LoRA adapters (YAML: lora.enabled)",
    )
    for flag, key, value, what in _SWITCHES:
        group.add_argument(
            flag, action="store_true", default=None, help=f"{what} (YAML: {key}: {value})"
        )
    group.add_argument(
        _LORA_MODULES[0],
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters every worker loads at start, each name=path (PEFT's directory) or "
        "a JSON object with name and path; replaces the YAML's (YAML: lora.modules)",
    )
    _add_vllm_flags(p)


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags that pdserve takes without a key: its parser flags and those that change
    nothing here (each said so once), and those refused with what to use instead (not listed in
    --help: they exist so that their values are not taken for CONFIG)."""
    vllm = p.add_argument_group(
        "vLLM's flags taken with no effect (`up` says why): the router reads the model's tool "
        "call and reasoning formats from its tokenizer and chat template"
    )
    vllm.add_argument(VLLM_PARSER_FLAGS[0], action="store_true", default=None, help="(always on)")
    for flag in VLLM_PARSER_FLAGS[1:]:
        vllm.add_argument(flag, default=None, metavar="NAME", help="(read from the model)")
    for flag, takes_value, why in VLLM_NO_EFFECT:
        shape = {"metavar": "X"} if takes_value else {"action": "store_true"}
        vllm.add_argument(flag, default=None, help=f"({why})", **shape)
    for flag, takes_value, _ in VLLM_REFUSED:
        shape = {} if takes_value else {"action": "store_true"}
        names = (flag, *_VLLM_ALIASES.get(flag, ()))
        p.add_argument(*names, default=None, help=argparse.SUPPRESS, **shape)


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
            if key not in ("model", "seed"):  # words too; the other keys are spelled like none
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
    given = [g for g in given if getattr(args, _dest(g[0]), None) is not None]
    for flag, key, parse in sorted(given, key=lambda g: g[1][:7] not in ("pools.*", "pools.+")):
        value = parse(flag, getattr(args, _dest(flag)))
        which = key.split(".")[1] if key.startswith("pools.") else ""
        if which in ("*", "+"):
            if any(f.startswith("--colocated-") for f, _, _ in given):
                data.setdefault("pools", {}).setdefault("colocated", {})
            keys = [key.replace(which, pool, 1) for pool in _pools_of(data, which)]
        else:
            keys = [key]
        named = f"--no-{flag[2:]}" if value is False else flag  # BooleanOptionalAction's "off"
        for k in keys:
            if _set(data, k, value):
                done.by_key[k] = named
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
    for flag, key, value, _ in _SWITCHES:
        if getattr(args, _dest(flag), None) and _set(data, key, value):
            done.by_key[key] = flag
    if getattr(args, "api_key", None) is not None:
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


def _written(args: argparse.Namespace, flag: str) -> str | None:
    """`flag` as the command line gave it (with its value), or None when not given."""
    value = getattr(args, _dest(flag), None)
    if value is None:
        return None
    return flag if value is True else f"{flag} {value}"


def no_effect_notes(args: argparse.Namespace) -> list[str]:
    """One line for each vLLM flag given that changes nothing here (VLLM_NO_EFFECT): what it is
    and why nothing needs it."""
    notes = []
    for flag, _, why in VLLM_NO_EFFECT:
        written = _written(args, flag)
        if written is not None:
            notes.append(f"{written}: taken, no effect here: {why}")
    return notes


def vllm_refusals(args: argparse.Namespace) -> list[str]:
    """One line for each vLLM flag given that pdserve has no counterpart of (VLLM_REFUSED),
    naming what to use instead."""
    return [
        f"{written}: not supported: {why}"
        for flag, _, why in VLLM_REFUSED
        if (written := _written(args, flag)) is not None
    ]


def port_note(args: argparse.Namespace, config: DeployConfig | None) -> str | None:
    """vLLM's --port is its HTTP port, pdserve's the router's gRPC port: when --port is given
    without --http-port, a line that says where HTTP is (`config`: the deployment, None when it
    was refused) and which flag moves it; None otherwise."""
    if getattr(args, "port", None) is None or getattr(args, "http_port", None) is not None:
        return None
    where = "stays on its own port"
    if config is not None:
        http = config.router.http_port
        where = (
            "is off (router.http_port: null)"
            if http is None
            else "takes a free port"
            if http == 0
            else f"stays on :{http}"
        )
    return (
        f"--port {args.port} is the router's gRPC port; the OpenAI-compatible HTTP front {where} "
        f"(vLLM's --port is --http-port here)"
    )


YAML_SUFFIXES = (".yaml", ".yml")
# files of a checkpoint's weights: its folder is the model
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
GGUF_MAGIC = b"GGUF"


def positional_model(value: str) -> str | None:
    """`pdserve up VALUE`: None when VALUE is the deployment YAML, else VALUE itself when it is
    the model to serve, as `vllm serve MODEL` takes it: a .gguf file, a model folder (config.json
    inside), "smollm2" or a Hub id ORG/NAME[@REVISION] that is no file here. A YAML is a
    .yaml/.yml name (there or not: reading it says which) or any other file; anything else, a
    GGUF file by another name included, is a ConfigError that says what CONFIG may be. Reads at
    most four bytes of a file."""
    from pdserve.engine.loader.hub import parse_hub_id
    from pdserve.engine.loader.resolve import SMOLLM2_ALIAS

    path = pathlib.Path(value).expanduser()
    suffix = path.suffix.lower()
    if suffix in YAML_SUFFIXES:
        return None
    if path.is_dir():
        if (path / "config.json").is_file():
            return value
        raise ConfigError(
            f"{value}: a folder with no config.json, so no model folder; {MODEL_HINT}"
        )
    if suffix == ".gguf":
        return value
    if suffix in _WEIGHT_SUFFIXES and path.is_file():
        raise ConfigError(f"{value}: a weights file; serve its folder (with config.json) instead")
    if path.is_file():
        try:
            with open(path, "rb") as f:
                gguf = f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
        except OSError:
            return None  # reading it as the YAML says why it cannot be read
        if gguf:
            raise ConfigError(
                f"{value}: a GGUF file, which pdserve loads by its .gguf name: rename it"
            )
        return None
    if value.strip().lower() == SMOLLM2_ALIAS or parse_hub_id(value) is not None:
        return value
    raise ConfigError(f"{value}: no such file or directory; {MODEL_HINT}")


def _take_positional_model(args: argparse.Namespace) -> bool:
    """A model given where CONFIG goes (positional_model) becomes --model, with no YAML: the
    same deployment as `pdserve up --model MODEL`; a second, different --model is refused.
    Whether the positional was the model."""
    if getattr(args, "config", None) is None:
        return False
    model = positional_model(args.config)
    if model is None:
        return False
    if args.model is not None and args.model != model:
        raise ConfigError(
            f"the model is given twice: {model!r} (in CONFIG's place) and --model "
            f"{args.model!r}; give one"
        )
    args.config, args.model = None, model
    return True


def up_config(args: argparse.Namespace) -> tuple[DeployConfig, Overrides]:
    """The deployment `pdserve up` starts: args.config's YAML (or nothing: the defaults; or
    the model given in its place) with the flags over it, validated as one; a ConfigError whose
    lines name the flag or the file's key. vLLM's flags with no counterpart here are refused
    first, before any file is read."""
    refused = vllm_refusals(args)
    if refused:
        raise ConfigError("\n".join(refused))
    positional = _take_positional_model(args)
    source = args.config or "default config"
    data = read_config_data(args.config) if args.config is not None else {}
    base_dir = pathlib.Path(args.config).parent if args.config is not None else pathlib.Path(".")
    overrides = apply_flags(args, data)
    if positional:  # a refusal of the model names it as the user gave it
        overrides.by_key["model"] = "MODEL"
    try:
        return validate_config(data, source, base_dir), overrides
    except ConfigError as e:
        raise overrides.refusal(e, source) from None


# vLLM's --quantization names for a checkpoint quantized ahead, each with the quant_method its
# config.json names (vLLM's *_marlin kernels read the same files); pdserve reads these itself
# (engine/loader/prequantized.py), so the flag asks for nothing it would not do anyway
PREQUANTIZED = {
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "marlin": "gptq",
    "fp8": "fp8",
    "mxfp4": "mxfp4",
    "compressed-tensors": "compressed-tensors",
}
# pdserve's own: how a CPU pool quantizes float weights as it loads them (YAML quantization)
QUANTIZATIONS = ("none", "int8", "int4", "bf16", "auto")


def quantization_arg(value: str) -> str:
    """`pdserve up --quantization`'s argparse type: pdserve's own modes, or vLLM's name of a
    checkpoint quantized ahead (checked against the checkpoint by checkpoint_quantization)."""
    if value in QUANTIZATIONS or value in PREQUANTIZED:
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r}: pdserve quantizes float weights on CPU with {', '.join(QUANTIZATIONS[1:])} "
        f"(YAML quantization), and reads a checkpoint quantized ahead (gptq, awq, "
        f"compressed-tensors, fp8, mxfp4) by itself"
    )


def checkpoint_quantization(model: str, method: str, on_this_machine: bool) -> str:
    """vLLM's `--quantization METHOD` (a PREQUANTIZED name) held against `model`'s checkpoint:
    a note when the checkpoint is quantized so (pdserve reads it so without the flag), or when
    the model is not on this machine to look at; a ConfigError when it is not, since pdserve
    does not quantize to vLLM's formats."""
    want = PREQUANTIZED[method]
    if not on_this_machine:
        return (
            f"--quantization {method}: not checked here (the model loads on the cluster's "
            f"nodes); pdserve reads a checkpoint's own quantization without the flag"
        )
    from pdserve.engine.loader import load_hf_config, resolve_model
    from pdserve.engine.loader.prequantized import quant_method

    has = quant_method(load_hf_config(resolve_model(model)))  # resolved by the checks already
    if has != want:
        what = "not quantized" if has is None else f"quantized with {has}"
        raise ConfigError(
            f"--quantization {method}: the checkpoint is {what}, and pdserve does not quantize "
            f"to {want}: drop the flag (on a CPU, --quantization int8, int4 or bf16 quantizes "
            f"float weights as they load)"
        )
    return (
        f"--quantization {method}: taken, no effect here: pdserve reads the checkpoint's own "
        f"quantization ({has}) without the flag"
    )
