"""The deployment's secrets out of its processes' environments and in owner-only files
(deploy/secret_files.py), Ray's token file made 0600 (deploy/ray_join.py), and ray.bind
(deploy/config/schema.py). The whole deployment, its sockets and its processes' environments:
tests/e2e/test_up_exposure.py."""

from __future__ import annotations

import ctypes
import os
import stat

import pytest

from pdserve.deploy import launcher, ray_join, secret_files
from pdserve.deploy.config.load import ConfigError, validate_config

SECRET = "a-cluster-secret-of-32-characters"


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_secret_folder_is_the_owners_only_and_removed(tmp_path):
    d = secret_files.SecretDir(SECRET, parent=str(tmp_path))
    assert _mode(d.path) == 0o700
    assert _mode(d.secret_file) == 0o600
    assert secret_files.read_secret_file(d.secret_file) == SECRET
    d.remove()
    d.remove()  # twice is fine
    assert not d.path.exists()
    with pytest.raises(RuntimeError, match="cannot read the cluster secret file"):
        secret_files.read_secret_file(d.secret_file)


def _a_dead_pid() -> int:
    """A process id no process has now (the highest free one below the kernel's limit)."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def test_a_killed_launchers_secret_folder_is_removed_by_the_next_one(tmp_path):
    """`pdserve up` killed with -9 leaves its folder; the next SecretDir on the machine removes
    it, and leaves a live launcher's folder and anything not named as a secret folder alone."""
    dead = tmp_path / f"pdserve-secrets-{_a_dead_pid()}-abc"
    live = tmp_path / f"pdserve-secrets-{os.getpid()}-def"
    other = tmp_path / "pdserve-secrets-notapid"
    for d in (dead, live, other):
        d.mkdir(mode=0o700)
        (d / "cluster_secret").write_text(SECRET)
    d = secret_files.SecretDir(SECRET, parent=str(tmp_path))
    try:
        assert not dead.exists() and live.exists() and other.exists()
        assert d.path.name.startswith(f"pdserve-secrets-{os.getpid()}-")
        assert secret_files.remove_stale(str(tmp_path)) == []  # its own folder stays too
        assert d.path.exists()
    finally:
        d.remove()


def test_the_secrets_leave_os_environ_and_come_back(monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", SECRET)
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-key-0001")
    monkeypatch.setenv("PDSERVE_OTHER", "stays")
    withheld = secret_files.withhold_from_environment()
    assert "PDSERVE_CLUSTER_SECRET" not in os.environ and "PDSERVE_API_KEYS" not in os.environ
    assert os.environ["PDSERVE_OTHER"] == "stays"
    assert "sk-key" not in repr(withheld) and SECRET not in repr(withheld)
    withheld.restore()
    withheld.restore()
    assert os.environ["PDSERVE_CLUSTER_SECRET"] == SECRET
    assert os.environ["PDSERVE_API_KEYS"] == "sk-key-0001"


def test_the_environment_block_loses_the_values_only():
    """What /proc/<pid>/environ shows: the values of the names go, every other entry stays (and
    an entry whose value merely contains the name is not taken for it)."""
    block = b"A=1\0PDSERVE_API_KEYS=sk-1,sk-2\0B=x PDSERVE_API_KEYS=no\0PDSERVE_CLUSTER_SECRET=s3\0"
    buf = ctypes.create_string_buffer(block, len(block))
    assert secret_files.wipe_block(
        ctypes.addressof(buf), len(block), ("PDSERVE_API_KEYS", "PDSERVE_CLUSTER_SECRET")
    )
    after = buf.raw
    assert b"sk-1" not in after and b"s3" not in after
    assert after.startswith(b"A=1\0PDSERVE_API_KEYS=\0\0\0\0\0\0\0\0\0\0B=x PDSERVE_API_KEYS=no\0")
    assert not secret_files.wipe_block(ctypes.addressof(buf), len(block), ("NOT_THERE",))


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_this_process_environment_block_is_found():
    start, end = secret_files._environment_block()
    with open("/proc/self/environ", "rb") as f:
        shown = f.read()
    assert ctypes.string_at(start, end - start)[: len(shown)] == shown


def test_an_existing_token_readable_by_others_is_made_0600(tmp_path):
    token = tmp_path / "auth_token"
    token.write_text("t" * 32)
    token.chmod(0o644)
    said = ray_join.protect_token_file(token, {})
    assert _mode(token) == 0o600 and "0600" in said and "-rw-r--r--" in said
    assert ray_join.protect_token_file(token, {}) == ""  # already private: nothing to do


def test_a_missing_token_is_written_only_where_ray_would_make_one(tmp_path):
    token = tmp_path / "ray" / "auth_token"
    for env in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_TOKEN": "x" * 32}):
        assert ray_join.protect_token_file(token, env) == ""
        assert not token.exists()
    assert "0600" in ray_join.protect_token_file(token, {})
    assert _mode(token) == 0o600 and _mode(token.parent) == 0o700
    assert len(token.read_text()) >= 32


def test_ray_bind_defaults_to_loopback_and_all_is_for_a_local_ray():
    assert validate_config({}).ray.bind == "loopback"
    assert validate_config({"ray": {"bind": "all"}}).ray.bind == "all"
    with pytest.raises(ConfigError, match="ray.bind"):
        validate_config({"ray": {"bind": "everywhere"}})
    with pytest.raises(ConfigError, match="bind: only for the local Ray"):
        validate_config({"ray": {"bind": "all", "address": "10.0.0.1:6379"}})


def test_the_secret_goes_by_file_only_when_every_node_is_this_machine(monkeypatch):
    monkeypatch.setattr(launcher.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    here = {"NodeManagerAddress": "127.0.0.1"}
    assert launcher.on_one_machine([here, here])
    assert not launcher.on_one_machine([here, {"NodeManagerAddress": "10.0.0.2"}])
    assert not launcher.on_one_machine([])
