"""A pdserve cache that cannot be written (PDSERVE_CACHE_DIR, ray.temp_dir): a one-line refusal
that names the directory and what to set, from the engine's loader (engine/loader/resolve.py),
`pdserve up` and `up --check` (deploy/prechecks.check_writable_dirs) and `generate --local`,
instead of a traceback. Unwritable here means a directory under a regular file, or a write that
fails with EACCES (root may write into a read-only directory). Against the real SmolLM2, and an
empty read-only directory where the user is not root: tests/integration/
test_cache_dir_cli.py."""

from __future__ import annotations

import errno
import pathlib
import tempfile

import pytest

from pdserve.cli import main
from pdserve.deploy.config.load import validate_config
from pdserve.deploy.prechecks import DeployError, check_writable_dirs
from pdserve.engine.loader import CacheDirError, resolve_model, writable_dir


@pytest.fixture
def blocked(tmp_path) -> pathlib.Path:
    """A cache path no one can create: its parent is a regular file."""
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "cache"


@pytest.fixture
def fake_gguf(tmp_path) -> str:
    """A .gguf file the loader would convert (the cache is refused before it is read)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def test_writable_dir_creates_the_directory_or_says_what_to_set(tmp_path, blocked, monkeypatch):
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    assert writable_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    with pytest.raises(CacheDirError) as e:
        writable_dir(blocked / "kernels")
    assert str(e.value) == (
        f"cannot write to {blocked / 'kernels'} (Not a directory): set PDSERVE_CACHE_DIR to a "
        "directory you can write (pdserve's cache of converted models, compiled kernels and a "
        "local Ray's files)"
    )
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocked))
    with pytest.raises(CacheDirError, match=rf"PDSERVE_CACHE_DIR={blocked} must be a directory"):
        writable_dir(blocked / "kernels")
    with pytest.raises(CacheDirError, match=r"\(Not a directory\): do this$"):
        writable_dir(blocked, "do this")


def test_a_directory_that_exists_but_refuses_writes_is_refused(tmp_path, monkeypatch):
    def refuse(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(dir))

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    with pytest.raises(CacheDirError, match=rf"^cannot write to {tmp_path} \(Permission denied\)"):
        writable_dir(tmp_path)


def test_a_model_to_convert_into_an_unwritable_cache_is_refused_before_it_is_read(
    blocked, fake_gguf, monkeypatch
):
    with pytest.raises(CacheDirError) as e:
        resolve_model(fake_gguf, cache_dir=blocked)
    assert str(e.value) == (
        f"cannot write to {blocked / 'models'} (Not a directory): pass a cache_dir you can write"
    )
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocked))
    with pytest.raises(CacheDirError, match="PDSERVE_CACHE_DIR="):
        resolve_model(fake_gguf)


def test_up_refuses_the_kernels_and_ray_dirs_it_cannot_write(blocked, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocked))
    monkeypatch.delenv("PDSERVE_CPU_KERNELS", raising=False)
    config = validate_config({})
    with pytest.raises(DeployError) as e:
        check_writable_dirs(config, on_this_machine=True, local_ray=True)
    assert str(e.value).startswith(f"cannot write to {blocked / 'kernels'} (Not a directory)")
    assert str(e.value).endswith(
        "(or PDSERVE_CPU_KERNELS=0 to run without the compiled CPU kernels)"
    )
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    with pytest.raises(DeployError) as e:
        check_writable_dirs(config, on_this_machine=True, local_ray=True)
    assert str(e.value).startswith(f"cannot write to {blocked / 'ray'} (Not a directory)")
    assert str(e.value).endswith("(or ray.temp_dir for Ray's files)")
    check_writable_dirs(config, on_this_machine=False, local_ray=False)  # nothing written here
    own = validate_config({"ray": {"temp_dir": str(blocked / "ray")}})
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "ok"))
    with pytest.raises(DeployError, match=r"\): set ray.temp_dir to a directory you can write$"):
        check_writable_dirs(own, on_this_machine=True, local_ray=True)


def test_the_cli_says_it_in_one_line_and_exits_2(
    blocked, fake_gguf, tmp_path, capsys, monkeypatch, tiny_models
):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocked))
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    config = tmp_path / "up.yaml"
    config.write_text(
        f"model: {fake_gguf}\nrouter: {{port: 0, http_port: null}}\n"
        f"ray: {{temp_dir: {tmp_path / 'ray'}}}\n"
    )
    models = f"cannot write to {blocked / 'models'} (Not a directory): PDSERVE_CACHE_DIR="
    for argv in (["up", str(config)], ["up", str(config), "--check"]):
        capsys.readouterr()
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("pdserve: ") and models in line, line
    capsys.readouterr()
    assert main(["generate", "hi", "--local", "--model", fake_gguf]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"pdserve: {models}"), line
