"""Loading the deployment YAML: its text to plain data (read_config_data, which `pdserve up`'s
flags then go over), and plain data to the frozen schema (validate_config), with every problem
raised as one ConfigError that names the file and each bad key, and for an unknown key the keys
allowed there. Loading happens once, at the start of `pdserve up`, `pdserve tune` or a test; the
result is a DeployConfig (schema.py) and nothing here keeps state.
"""

from __future__ import annotations

import pathlib
from typing import get_args

import yaml
from pydantic import BaseModel, ValidationError

from pdserve.deploy.config.files import read_text
from pdserve.deploy.config.schema import DeployConfig


class ConfigError(ValueError):
    """A deployment config that cannot be used; the message names the file and the key."""


# what a file given where the YAML goes, that is no YAML, may have been meant as
MODEL_HINT = (
    "CONFIG is a deployment YAML; a model is given with --model M, or as `pdserve up M` when M is "
    "a .gguf file, a model folder (with config.json) or a Hub id ORG/NAME"
)


def _key(loc: tuple) -> str:
    # pydantic appends the union member it tried ("int", "float") to the location: not a key
    parts = [str(p) for p in loc if p not in ("int", "float", "none", "str")]
    return ".".join(parts) or "(top level)"


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown key"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    given = err.get("input")
    if {"cluster_secret", "api_keys"} & set(err["loc"]):  # never echo a secret, not a wrong one
        return msg
    if err["type"] not in ("missing",) and not isinstance(given, (dict, list)):
        msg += f" (got {given!r})"
    return msg


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys that are valid where an unknown key `loc` was found."""
    model: type[BaseModel] = DeployConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        # X | None: the model inside
        options = (
            [
                a
                for a in (get_args(field.annotation) or (field.annotation,))
                if field and isinstance(a, type) and issubclass(a, BaseModel)
            ]
            if field
            else []
        )
        if not options:
            return []
        model = options[0]
    return sorted(model.model_fields)


def validate_config(
    data: dict, source: str = "<config>", base_dir: str | pathlib.Path = "."
) -> DeployConfig:
    """A DeployConfig from plain data, or a ConfigError naming `source` and each bad key; files
    the config names are read relative to `base_dir`."""
    try:
        config = DeployConfig.model_validate(data, context={"base_dir": str(base_dir)})
    except ValidationError as e:
        lines, seen = [], set()
        for err in e.errors():
            key = _key(err["loc"])
            if key in seen:  # a Union reports once per member: the first says enough
                continue
            seen.add(key)
            line = f"{source}: {key}: {_message(err)}"
            if err["type"] == "extra_forbidden":
                allowed = _allowed_keys(err["loc"])
                if allowed:
                    line += f"; allowed here: {', '.join(allowed)}"
            lines.append(line)
        raise ConfigError("\n".join(lines)) from None
    if config.router.tls is not None and config.security.tls is None:
        # workers register on the router's one port: plaintext would not get through its TLS
        raise ConfigError(
            f"{source}: router.tls: the workers register through the router's "
            f"TLS port, so set security.tls too, its ca_file being the CA that "
            f"signed router.tls.cert_file"
        )
    return config


def load_config(path: str | pathlib.Path | None) -> DeployConfig:
    """The deployment in the YAML file at `path`; None gives the defaults (SmolLM2, one prefill and
    one decode worker, tp 1, a local Ray)."""
    if path is None:
        return DeployConfig()
    return validate_config(read_config_data(path), str(path), pathlib.Path(path).parent)


def read_config_data(path: str | pathlib.Path) -> dict:
    """The YAML file at `path` as plain data, not yet validated (`pdserve up`'s flags go over it
    first: pdserve/up_flags.py); a ConfigError naming the file when it is not a YAML mapping.
    Where the file reuses a node (an anchored pool aliased as the other: `decode: *pool`), each
    use is a copy of its own, so that a flag for one pool (--prefill-tp) leaves the other be."""
    name = str(path)
    text = read_text(path, ConfigError, MODEL_HINT)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{name}: {where}YAML syntax error: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name}: the top level must be a mapping of keys "
            f"(model, pools, router, ...), got {type(data).__name__}"
        )
    return _unaliased(data)


def _unaliased(node):
    """`node` with every mapping and list copied where it is used (YAML aliases are one object)."""
    if isinstance(node, dict):
        return {k: _unaliased(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unaliased(v) for v in node]
    return node
