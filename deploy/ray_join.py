"""Joining a Ray cluster by address (`pdserve up --address HOST:PORT`, ray.address) the way Ray's own
command line clients do, token authentication included.

Since Ray 2.52 a cluster started with `ray start --head` may require a token on every call
(RAY_AUTH_MODE=token on the head, or a token already in ~/.ray/auth_token when it started). A
driver that joins by an explicit address does not look for a token unless RAY_AUTH_MODE=token is
set in its own environment, and then fails after twenty seconds of InvalidAuthToken lines.
`prepare_join` runs before ray.init: it asks the cluster's GCS once, with no token, whether it
wants one (GetClusterId, which answers UNAUTHENTICATED when it does); if so it finds the token
where Ray's clients look for it (RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH names, then
~/.ray/auth_token), checks the cluster accepts it, and turns on token mode in this process as Ray's
CLI does for a token it finds (RAY_AUTH_MODE=token, before ray.init reads it). When it cannot, it
raises a DeployError whose one line says what to set. Nothing here keeps state; the process's
RAY_AUTH_MODE stays set for its lifetime (ray.init reads it, and so do Ray's own clients).

A local Ray that `pdserve up` starts turns token mode on by itself and, when no token exists yet,
writes a fresh one to ~/.ray/auth_token with the default mode (0644 under the usual umask: every
user of the machine could read the token that lets anyone run code in the cluster).
`protect_token_file` runs before and after that start (deploy/ray_connect.py): before, it writes
the missing token itself, 0600 in a 0700 ~/.ray, so Ray finds it and writes none; after, it makes
the file 0600 should it be readable by others (a token an older start, or Ray, left so). It logs
what it changed.
"""

from __future__ import annotations

import logging
import os
import pathlib
import stat

from pdserve.deploy.prechecks import DeployError

MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
PROBE_TIMEOUT_S = 5.0
log = logging.getLogger("pdserve.deploy.launcher")
WHAT_TO_SET = (
    "put the head's token (`ray get-auth-token` on the head node prints it) in ~/.ray/auth_token, "
    f"or set {TOKEN_ENV} to it, or {TOKEN_PATH_ENV} to a file holding it"
)


def default_token_path() -> pathlib.Path:
    return pathlib.Path.home() / ".ray" / "auth_token"


def find_token(environ=os.environ) -> tuple[str | None, str]:
    """(the token Ray's clients would send, where it came from), in Ray's order: RAY_AUTH_TOKEN,
    the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token; (None, "") when none has one. A
    RAY_AUTH_TOKEN_PATH that cannot be read, or an empty one, is refused (Ray aborts on it)."""
    token = environ.get(TOKEN_ENV, "").strip()
    if token:
        return token, TOKEN_ENV
    path = environ.get(TOKEN_PATH_ENV)
    if path:
        try:
            token = pathlib.Path(path).expanduser().read_text().strip()
        except OSError as e:
            raise DeployError(
                f"{TOKEN_PATH_ENV}: cannot read {path} ({e.strerror}); point it at the file "
                f"holding the Ray cluster's token, or unset it"
            ) from None
        if not token:
            raise DeployError(
                f"{TOKEN_PATH_ENV}: {path} is empty; it must hold the cluster's token"
            )
        return token, f"{TOKEN_PATH_ENV} ({path})"
    default = default_token_path()
    try:
        token = default.read_text().strip()
    except OSError:
        return None, ""
    return (token, str(default)) if token else (None, "")


def protect_token_file(path: pathlib.Path | None = None, environ=os.environ) -> str:
    """Ray's default token file (~/.ray/auth_token) readable by its owner only; returns what it
    did, in words ("" when nothing). A missing one is written here, 0600 in a 0700 folder, when
    a local Ray would make one (RAY_AUTH_MODE unset or token, and no RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH to take it from); an existing one that others can read is made 0600, if
    this user owns it. Never raises for the file's sake: the start goes on, with a warning."""
    path = path or default_token_path()
    try:
        info = path.stat()
    except FileNotFoundError:
        mode = environ.get(MODE_ENV)
        if (
            (mode is not None and mode.lower() != "token")
            or environ.get(TOKEN_ENV)
            or (environ.get(TOKEN_PATH_ENV))
        ):
            return ""
        return _write_token(path)
    except OSError as e:
        log.warning("cannot check the Ray token file %s: %s", path, e.strerror or e)
        return ""
    if not stat.S_ISREG(info.st_mode) or not info.st_mode & 0o077:
        return ""
    if info.st_uid != os.getuid():
        log.warning(
            "the Ray token file %s is readable by others and not this user's to change", path
        )
        return ""
    try:
        os.chmod(path, 0o600)
    except OSError as e:
        log.warning("cannot make the Ray token file %s 0600: %s", path, e.strerror or e)
        return ""
    done = f"made the Ray token file {path} 0600 (it was {stat.filemode(info.st_mode)})"
    log.info("%s", done)
    return done


def _write_token(path: pathlib.Path) -> str:
    """A fresh token in `path`, as Ray would make it but 0600 (in a 0700 folder, if it makes one)."""
    try:
        from ray._private.authentication.authentication_token_generator import (
            generate_new_authentication_token,
        )
    except ImportError:  # a Ray without token authentication makes no file either
        return ""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # another start wrote one meanwhile: checked after the start
        return ""
    except OSError as e:
        log.warning("cannot write a Ray token file %s: %s", path, e.strerror or e)
        return ""
    with os.fdopen(fd, "w") as f:
        f.write(generate_new_authentication_token())
    done = f"wrote a new Ray token file {path}, 0600"
    log.info("%s", done)
    return done


def probe(address: str, token: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """What the GCS at `address` says to one call carrying `token` (None: no token): "ok",
    "refused" (it wants a token, or another one), or "unreachable: <why>"."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "refused"
            details = (e.details() or e.code().name).split("; last error:")[-1].strip()
            if details.startswith("UNKNOWN: "):  # "UNKNOWN: ipv4:HOST:PORT: what happened"
                details = details.split(": ", 2)[-1]
            return f"unreachable: {e.code().name.lower()}, {details}"
    return "ok"


def _probe_applies(address: str) -> bool:
    """host:port of a GCS that takes plaintext gRPC: not "auto" (Ray finds a local cluster and its
    token itself), not a Ray Client address, not a cluster with TLS on (RAY_USE_TLS)."""
    host, _, port = address.rpartition(":")
    tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    return bool(host) and port.isdigit() and "://" not in address and not tls


def enable_token_mode() -> None:
    """Token authentication for this process's Ray client, as Ray's CLI turns it on for a token it
    finds: RAY_AUTH_MODE=token, and Ray's cached config told (it read the environment at import)."""
    os.environ[MODE_ENV] = "token"
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # an older Ray reads the environment at ray.init
        pass


def prepare_join(address: str, environ=os.environ) -> str:
    """Makes this process ready to join the Ray cluster at `address` (see the module docstring);
    returns how it authenticates, for the log. Raises DeployError, one line, when the cluster
    cannot be reached or wants a token this process cannot give."""
    if not _probe_applies(address):
        return "as Ray decides (not a host:port address)"
    where = f"the Ray cluster at {address} (ray.address, --address)"
    first = probe(address, None)
    if first.startswith("unreachable"):
        raise DeployError(
            f"cannot reach {where}: {first.removeprefix('unreachable: ')}; is `ray start --head` "
            f"running there, and is {address.rpartition(':')[2]} its --port (the GCS port, "
            f"default 6379)?"
        )
    if first == "ok":
        return "no token authentication (the cluster asks for none)"
    mode = environ.get(MODE_ENV)
    if mode is not None and mode.lower() != "token":
        raise DeployError(
            f"{where} requires token authentication, but {MODE_ENV}={mode}: set {MODE_ENV}=token "
            f"(or unset it) and {WHAT_TO_SET}"
        )
    token, source = find_token(environ)
    if token is None:
        raise DeployError(
            f"{where} requires token authentication and no token was found: {WHAT_TO_SET}"
        )
    if probe(address, token) != "ok":
        raise DeployError(
            f"{where} refuses the token from {source} (not the cluster's): {WHAT_TO_SET}"
        )
    if mode is None:
        enable_token_mode()
    return f"token authentication, the token from {source}"
