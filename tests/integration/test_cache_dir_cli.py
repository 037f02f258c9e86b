"""`pdserve up`, `up --check` and `pdserve generate --local` on the real SmolLM2 with an empty
read-only cache directory (PDSERVE_CACHE_DIR): exit 2 with a one-line message naming the
directory and what to set, no traceback (issue #26), whichever cache is written first: the
compiled kernels', a local Ray's, the converted model's. Run as commands; as root, without the
capability that lets root write into a read-only directory (setpriv). The same refusals without
a process of their own: tests/unit/test_cache_dir.py. And that those refusals come before
torch and transformers are imported."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parents[2]


@pytest.fixture
def read_only(tmp_path):
    """(command prefix, an empty read-only directory that the command cannot write)."""
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root writes into a read-only directory, and setpriv is not here")
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
    yield prefix, cache
    cache.chmod(0o755)


def pdserve(prefix, cache, *args, **env):
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "pdserve", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PDSERVE_CACHE_DIR": str(cache), **env},
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stderr.strip().splitlines()[-1]


def test_an_unwritable_cache_is_one_line_and_exit_2(read_only, tmp_path):
    prefix, cache = read_only
    config = tmp_path / "up.yaml"
    config.write_text("model: smollm2\nrouter: {port: 0, http_port: null}\n")
    fix = f"PDSERVE_CACHE_DIR={cache} must be a directory you can write; set it to one"
    rc, line = pdserve(prefix, cache, "up", str(config))
    assert rc == 2 and line == (
        f"pdserve: cannot write to {cache / 'kernels'} (Permission denied): {fix} (or "
        "PDSERVE_CPU_KERNELS=0 to run without the compiled CPU kernels)"
    )
    rc, line = pdserve(prefix, cache, "up", str(config), PDSERVE_CPU_KERNELS="0")
    assert rc == 2 and line == (
        f"pdserve: cannot write to {cache / 'ray'} (Permission denied): {fix} (or ray.temp_dir "
        "for Ray's files)"
    )
    config.write_text(config.read_text() + f"ray: {{temp_dir: {tmp_path / 'ray'}}}\n")
    models = f"cannot write to {cache / 'models'} (Permission denied): {fix}"
    rc, line = pdserve(prefix, cache, "up", str(config), PDSERVE_CPU_KERNELS="0")
    assert rc == 2 and line == f"pdserve: {models}"
    rc, line = pdserve(prefix, cache, "up", str(config), "--check", PDSERVE_CPU_KERNELS="0")
    assert rc == 2 and line == f"pdserve: {models}"  # the same line as `up`'s
    rc, line = pdserve(prefix, cache, "generate", "hi", "--local")
    assert rc == 2 and line == f"pdserve: {models}"


def test_the_refusals_come_before_torch_is_imported(tmp_path):
    """`up`, `up --check` and `generate --local` refuse an unwritable cache without importing
    torch or transformers (seconds of a CLI's start): the loader's cache paths and the pre-start
    checks import them only once a model is converted or its fit checked. In a fresh interpreter,
    since this one has imported them long ago."""
    (tmp_path / "file").write_text("")
    blocked = tmp_path / "file" / "cache"  # its parent is a regular file
    fake_gguf = tmp_path / "m.gguf"
    fake_gguf.write_bytes(b"GGUF")
    config = tmp_path / "up.yaml"
    config.write_text(
        f"model: {fake_gguf}\nrouter: {{port: 0, http_port: null}}\n"
        f"ray: {{temp_dir: {tmp_path / 'ray'}}}\n"
    )
    script = (
        "import sys\n"
        "from pdserve.cli import main\n"
        "for argv in sys.argv[1:]:\n"
        "    assert main(argv.split()) == 2, argv\n"
        "print(sorted({'torch', 'transformers', 'gguf'} & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            f"up {config}",
            f"up {config} --check",
            f"generate hi --local --model {fake_gguf}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PDSERVE_CACHE_DIR": str(blocked), "PDSERVE_CPU_KERNELS": "0"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    assert done.stderr.count("cannot write to") == 3, done.stderr
