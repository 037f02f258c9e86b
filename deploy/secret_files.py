"""The deployment's secrets kept out of its processes' environments, and handed to the workers
that read them as files only their owner can read.

`pdserve up` reads the cluster secret and the client API keys once, in the launcher (the YAML, the
files it names, or PDSERVE_CLUSTER_SECRET and PDSERVE_API_KEYS in the user's shell). Every process
Ray starts (the GCS, the raylet, its agents, the autoscaler, the workers) inherits the launcher's
environment, so `withhold_from_environment` takes those two variables out of os.environ before Ray
starts, and wipes their values from the launcher's own initial environment block (what
/proc/<pid>/environ shows) on Linux; `Withheld.restore` puts them back in os.environ when the
deployment stops, for a caller (a notebook) that goes on. The API keys stay in the launcher: the
router, in that process, is the only one that reads them.

A worker on this machine gets the cluster secret by path: `SecretDir` is a directory of its own,
0700, with the secret in a 0600 file (and, with TLS between the processes, their private key in
another), made before the first worker starts and removed when the deployment stops
(deploy/launcher.py); the worker reads them once, at its start (deploy/workers.py), so neither is
in its start arguments, which Ray keeps in its actor table. A worker on another host cannot read a
file here, so a deployment on a multi-node cluster still hands its workers the secret and the key
with their config, through Ray (its object store and actor table,
which the cluster's token authentication guards), never through an environment. A `pdserve up`
killed with -9 leaves the directory behind (owner-only, under the user's runtime or temp dir);
its name carries the launcher's process id, and the next `pdserve up` on the machine removes each
such directory whose launcher is gone (`remove_stale`) before it makes its own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pathlib
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

from pdserve.deploy.config.files import API_KEYS_ENV, SECRET_ENV

log = logging.getLogger("pdserve.deploy.launcher")
SECRET_NAMES = (SECRET_ENV, API_KEYS_ENV)
SECRET_FILE = "cluster_secret"
TLS_KEY_FILE = "tls_key.pem"  # beside it: the processes' TLS private key, when TLS is on


@dataclass
class Withheld:
    """The variables `withhold_from_environment` took out of os.environ (name -> value)."""

    values: dict[str, str] = field(default_factory=dict, repr=False)

    def restore(self) -> None:
        """Puts them back in os.environ (where they are unset still). Safe to call twice."""
        for name, value in self.values.items():
            os.environ.setdefault(name, value)
        self.values = {}


def withhold_from_environment(names: tuple[str, ...] = SECRET_NAMES) -> Withheld:
    """Takes `names` out of os.environ, so that no process started from here inherits them, and
    wipes them from this process's initial environment block (`wipe_initial_environment`)."""
    taken = {name: os.environ.pop(name) for name in names if name in os.environ}
    if taken:
        wiped = wipe_initial_environment(tuple(taken))
        log.info(
            "%s: kept out of the environment of the processes this one starts%s",
            ", ".join(taken),
            " and wiped from its own" if wiped else "",
        )
    return Withheld(taken)


def _environment_block() -> tuple[int, int] | None:
    """(start, end) addresses of this process's initial environment block (fields 50 and 51 of
    /proc/self/stat, Linux 3.5 and later), or None where they cannot be read."""
    if sys.platform != "linux":
        return None
    try:
        with open("/proc/self/stat", "rb") as f:
            data = f.read()
        fields = data[data.rfind(b")") + 2 :].split()
        start, end = int(fields[50 - 3]), int(fields[51 - 3])
    except (OSError, IndexError, ValueError):
        return None
    return (start, end) if 0 < start < end else None


def wipe_initial_environment(names: tuple[str, ...]) -> bool:
    """Overwrites with NUL bytes the values of `names` in the environment block the kernel gave
    this process at exec, which /proc/<pid>/environ shows for its whole life: os.environ.pop
    (unsetenv) only drops libc's pointer to the string, not the string. Call it after the names
    are out of os.environ (nothing points at those strings then). Returns whether it wiped any;
    False where the block cannot be found (not Linux)."""
    block = _environment_block()
    if block is None:
        return False
    start, end = block
    return wipe_block(start, end - start, names)


def wipe_block(start: int, size: int, names: tuple[str, ...]) -> bool:
    """Overwrites with NUL bytes, in the NUL-separated NAME=value entries of the `size` bytes at
    address `start`, the values of `names`; whether there were any."""
    data = ctypes.string_at(start, size)
    wiped = False
    for name in names:
        prefix = name.encode() + b"="
        at = 0
        while True:
            at = data.find(prefix, at)
            if at < 0:
                break
            if at == 0 or data[at - 1] == 0:  # the start of an entry, not the middle of one
                value_at = at + len(prefix)
                value_end = data.find(b"\0", value_at)
                value_end = len(data) if value_end < 0 else value_end
                ctypes.memset(start + value_at, 0, value_end - value_at)
                wiped = True
            at += len(prefix)
    return wiped


def _runtime_parent() -> str | None:
    """The user's runtime directory (XDG_RUNTIME_DIR: a per-user tmpfs) when it is usable, else
    None (tempfile's default temp dir)."""
    path = os.environ.get("XDG_RUNTIME_DIR")
    if path and os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK):
        return path
    return None


PREFIX = "pdserve-secrets-"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (another user's counts as running). kvpool has
    the same check for the engine's files; the launcher keeps its own, since importing kvpool
    would import torch into a process that never needs it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


def remove_stale(parent: str | None = None) -> list[str]:
    """Removes the secret directories under `parent` (default: where SecretDir makes them) that
    this user owns and whose launcher process is gone (a `pdserve up` killed with -9); returns
    their paths. A directory whose process id is alive stays (if another process took the id,
    the directory waits for the next sweep after that one ends)."""
    base = pathlib.Path(parent or _runtime_parent() or tempfile.gettempdir())
    removed = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        pid_text = entry.name[len(PREFIX) :].split("-", 1)[0]
        if not entry.name.startswith(PREFIX) or not pid_text.isdigit():
            continue
        try:
            st = entry.lstat()
        except OSError:
            continue
        if not entry.is_dir() or entry.is_symlink() or st.st_uid != os.getuid():
            continue
        if not pid_alive(int(pid_text)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    if removed:
        log.info("removed %d secret dir(s) of pdserve up runs that ended uncleanly", len(removed))
    return removed


class SecretDir:
    """A 0700 directory holding the cluster secret in a 0600 file, for the workers on this
    machine (see the module docstring), named after this process's id. `remove` deletes it;
    safe to call twice."""

    def __init__(self, secret: str, parent: str | None = None, tls_key: bytes | None = None):
        remove_stale(parent)
        self.path = pathlib.Path(
            tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent or _runtime_parent())
        )  # mkdtemp makes it 0700
        self.secret_file = str(self.path / SECRET_FILE)
        try:
            _write_private(self.secret_file, secret.encode())
            if tls_key:  # (read by the workers from beside the secret: tls_key_beside)
                _write_private(str(self.path / TLS_KEY_FILE), tls_key)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def tls_key_beside(secret_file: str) -> bytes:
    """The TLS private key SecretDir wrote beside the secret file `secret_file`; RuntimeError
    naming the file when it cannot be read."""
    path = pathlib.Path(secret_file).with_name(TLS_KEY_FILE)
    try:
        key = path.read_bytes()
    except OSError as e:
        raise RuntimeError(f"cannot read the TLS key file {path}: {e.strerror or e}") from None
    if not key.strip():
        raise RuntimeError(f"the TLS key file {path} is empty")
    return key


def read_secret_file(path: str) -> str:
    """The cluster secret a worker reads from `path` at its start; RuntimeError naming the file
    when it cannot (a worker that cannot read it must not serve without the secret)."""
    try:
        secret = pathlib.Path(path).read_text().strip()
    except OSError as e:
        raise RuntimeError(
            f"cannot read the cluster secret file {path}: {e.strerror or e} (a worker reads it on "
            f"the machine `pdserve up` runs on; was the deployment stopped?)"
        ) from None
    if not secret:
        raise RuntimeError(f"the cluster secret file {path} is empty")
    return secret
