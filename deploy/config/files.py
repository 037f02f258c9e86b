"""The files and secrets the deployment YAML names outside itself. A file (a certificate, a key, the
cluster secret, API keys) is read once, when the config is loaded, into a LoadedFile: every worker
gets its bytes with its config, never a path that may exist on one node only. The cluster secret's
and the API keys' checks live here, and so does `read_text`, the one way a YAML or profile a user
names is read, with one message for a file that cannot be read. Nothing here keeps state; the
schema (schema.py) uses these validators for its `security` and `router.tls` sections.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field as dataclass_field
from typing import Annotated

from pydantic import PlainSerializer, PlainValidator, ValidationInfo

from pdserve.protos.security import MIN_SECRET_CHARS, check_api_key

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
API_KEYS_ENV = "PDSERVE_API_KEYS"
MAX_API_KEYS = 1024


@dataclass(frozen=True)
class LoadedFile:
    """A file named in the YAML, read when the config is loaded: workers on other nodes get its
    bytes with their config, not a path that may only exist here."""

    path: str
    data: bytes = dataclass_field(repr=False)


def _read_file(what: str, marker: bytes | None = None):
    """A validator turning a path (relative to the YAML's folder) into a LoadedFile."""

    def load(value, info: ValidationInfo) -> LoadedFile:
        if isinstance(value, LoadedFile):
            return value
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"must be the path of {what}")
        path = pathlib.Path(value).expanduser()
        path = pathlib.Path((info.context or {}).get("base_dir", ".")) / path
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
        if marker is not None and marker not in data:
            raise ValueError(f"{path} is not {what} (no '{marker.decode()}' line)")
        return LoadedFile(str(path.resolve()), data)

    return PlainValidator(load)


MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def chat_template_text(value, info: ValidationInfo) -> str:
    """vLLM's --chat-template: a Jinja template given as itself (it holds "{{" or "{%") or as a
    file (relative to the YAML's folder), returned as the template's text once it parses."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a Jinja chat template, or the path of a file holding one")
    text = value
    if "{{" not in value and "{%" not in value:
        path = (
            pathlib.Path((info.context or {}).get("base_dir", "."))
            / pathlib.Path(value).expanduser()
        )
        try:
            if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
                raise ValueError(f"{path} is over {MAX_CHAT_TEMPLATE_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(
                f"is neither a Jinja template nor a readable file: {path}: {why}"
            ) from None
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"is not a Jinja template: {e.message} (line {e.lineno})") from None
    return text


_AS_PATH = PlainSerializer(lambda f: f.path, return_type=str)  # a dump shows the path, not the key
CertFile = Annotated[
    LoadedFile, _read_file("a PEM certificate", b"-----BEGIN CERTIFICATE-----"), _AS_PATH
]
KeyFile = Annotated[LoadedFile, _read_file("a PEM private key", b"PRIVATE KEY-----"), _AS_PATH]
SecretFile = Annotated[LoadedFile, _read_file("a file holding the cluster secret"), _AS_PATH]
KeysFile = Annotated[LoadedFile, _read_file("a file holding API keys"), _AS_PATH]
ProfileFile = Annotated[LoadedFile, _read_file("a `pdserve profile` JSON"), _AS_PATH]


def parse_api_keys(text: str, where: str) -> tuple[str, ...]:
    """Keys from a keys file (one per line; blank lines and # comments skipped) or the environment
    (comma-separated); ValueError naming `where` and the key's position, never the key."""
    if "," in text and "\n" not in text.strip():
        items = text.split(",")
    else:
        items = [line for line in text.splitlines() if not line.strip().startswith("#")]
    keys = tuple(k.strip() for k in items if k.strip())
    if not keys:
        raise ValueError(f"{where} holds no API key")
    if len(keys) > MAX_API_KEYS:
        raise ValueError(f"{where} holds {len(keys)} API keys; at most {MAX_API_KEYS}")
    for i, key in enumerate(keys):
        check_api_key(key, f"API key #{i + 1} of {where}")
    return keys


def check_secret(value: str, where: str) -> str:
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{where}must have at least {MIN_SECRET_CHARS} characters, has "
            f"{len(value)}; leave it unset and pdserve up makes one"
        )
    return value


# a deploy YAML or a tuner profile is kilobytes; a file past this is something else (a model's
# weights given where the YAML goes), refused before it is read into memory
MAX_TEXT_FILE_BYTES = 16 << 20


def read_text(path: str | pathlib.Path, error: type[Exception], hint: str = "") -> str:
    """The text of a file a user names (a deploy YAML, a tuner profile); one that cannot be read,
    is larger than MAX_TEXT_FILE_BYTES or is not UTF-8 text raises `error`, naming the file and
    why, then `hint` (what the user may have meant) where one is given. At most
    MAX_TEXT_FILE_BYTES + 1 bytes are read, whatever the file's size."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_FILE_BYTES + 1)
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    hint = f"; {hint}" if hint else ""
    if len(data) > MAX_TEXT_FILE_BYTES:
        cap = MAX_TEXT_FILE_BYTES
        size = f"{cap >> 20} MiB" if cap >= 1 << 20 else f"{cap} bytes"
        raise error(f"{path}: not a text file (over {size}){hint}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a text file (byte {e.start} is not UTF-8){hint}") from None
    if "\x00" in text:
        raise error(f"{path}: not a text file (it holds NUL bytes){hint}")
    return text


ChatTemplate = Annotated[str, PlainValidator(chat_template_text)]
