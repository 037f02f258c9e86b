"""What the deployment YAML names outside itself, and its security settings: files read when the
config is loaded (LoadedFile: certificates, keys, the cluster secret, API keys, sent to every
worker with its config as bytes, never as a path that may exist on one node only), the cluster
secret's and the API keys' checks, and the `security` and `router.tls` sections. deploy/config.py
builds the whole schema from these and re-exports them.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass, field as dataclass_field
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    PlainSerializer,
    PlainValidator,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.protos.security import MIN_SECRET_CHARS, ClusterSecurity, TLSConfig, check_api_key

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
API_KEYS_ENV = "PDSERVE_API_KEYS"
MAX_API_KEYS = 1024


class _Frozen(BaseModel):
    # strict: YAML gives real types, so "2" for an integer is a mistake worth reporting
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


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


_AS_PATH = PlainSerializer(lambda f: f.path, return_type=str)  # a dump shows the path, not the key
CertFile = Annotated[
    LoadedFile, _read_file("a PEM certificate", b"-----BEGIN CERTIFICATE-----"), _AS_PATH
]
KeyFile = Annotated[LoadedFile, _read_file("a PEM private key", b"PRIVATE KEY-----"), _AS_PATH]
SecretFile = Annotated[LoadedFile, _read_file("a file holding the cluster secret"), _AS_PATH]
KeysFile = Annotated[LoadedFile, _read_file("a file holding API keys"), _AS_PATH]


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


def _check_secret(value: str, where: str) -> str:
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{where}must have at least {MIN_SECRET_CHARS} characters, has "
            f"{len(value)}; leave it unset and pdserve up makes one"
        )
    return value


class ClusterTLS(_Frozen):
    """Mutual TLS between the deployment's processes: every certificate signed by ca_file."""

    ca_file: CertFile
    cert_file: CertFile
    key_file: KeyFile
    server_name: str = ""  # the name in the certificates, when it is not the host dialled

    def tls_config(self) -> TLSConfig:
        return TLSConfig(
            self.ca_file.data, self.cert_file.data, self.key_file.data, self.server_name
        )


class RouterTLS(_Frozen):
    """TLS on the client-facing port; with ca_file, clients must show a certificate it signed.
    It needs security.tls too, because the workers register through that port."""

    cert_file: CertFile
    key_file: KeyFile
    ca_file: CertFile | None = None

    def tls_config(self) -> TLSConfig:
        return TLSConfig(
            self.ca_file.data if self.ca_file else b"", self.cert_file.data, self.key_file.data
        )


class SecuritySettings(_Frozen):
    """Security between the deployment's own processes. Secret and PEM files are read when the
    config is loaded, relative to the YAML file's folder."""

    cluster_secret: SecretStr | None = None  # SecretStr: a repr or log line shows ******
    cluster_secret_file: SecretFile | None = None
    tls: ClusterTLS | None = None

    @field_validator("cluster_secret")
    @classmethod
    def _secret_length(cls, v):
        if v is not None:
            _check_secret(v.get_secret_value(), "")
        return v

    @field_validator("cluster_secret_file")
    @classmethod
    def _file_secret(cls, v):
        if v is None:
            return v
        try:
            text = v.data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"{v.path} must hold the secret as UTF-8 text") from None
        _check_secret(text, f"the secret in {v.path} ")
        return v

    @model_validator(mode="after")
    def _one_secret(self):
        if self.cluster_secret is not None and self.cluster_secret_file is not None:
            raise ValueError("set cluster_secret or cluster_secret_file, not both")
        return self

    def secret(self, environ=os.environ) -> tuple[str | None, str]:
        """(the cluster secret, which setting gave it); (None, "") when none did, and then
        `pdserve up` makes a fresh one. The first found wins: cluster_secret_file, cluster_secret,
        then the environment's PDSERVE_CLUSTER_SECRET. The file wins over the environment because
        it is the reviewed description of the deployment; the environment is for a secret that
        should be in no file. Every worker gets the secret from `up` with its config."""
        if self.cluster_secret_file is not None:
            return (
                self.cluster_secret_file.data.decode().strip(),
                f"security.cluster_secret_file ({self.cluster_secret_file.path})",
            )
        if self.cluster_secret is not None:
            return self.cluster_secret.get_secret_value(), "security.cluster_secret"
        value = environ.get(SECRET_ENV, "").strip()
        return (value, SECRET_ENV) if value else (None, "")

    def cluster_security(self, secret: str) -> ClusterSecurity:
        return ClusterSecurity(secret, self.tls.tls_config() if self.tls else None)
