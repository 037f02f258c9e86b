"""The pdserve cache a test run uses: its own folder, so that the suite leaves a developer's cache
as it found it, sharing only what is costly to rebuild and the same for every run.

pdserve keeps converted models, compiled kernels, precision verdicts, a local Ray's files and the
KV disk tier under one folder (PDSERVE_CACHE_DIR, by default ~/.cache/pdserve). The tiny models
of the suite live in fresh temporary folders, so every run probes a hundred-odd new precision
keys that no later run can use; in the developer's own folder, which keeps only the most recently
used verdicts, they would push out the verdict of the developer's own `pdserve up` (whose next
start then pays the probe again). A run therefore sets PDSERVE_CACHE_DIR to a folder of its own,
before pytest-xdist starts its test processes (they, the Ray clusters and the subprocesses the
tests start inherit it), with `models` and `kernels` linked to the developer's folders: a
converted GGUF and a compiled kernel depend only on their inputs, and rebuilding them every run
would cost minutes. Everything else (precision verdicts, Ray's session files, the disk tier)
starts empty, as on a CI machine, and is removed when the run ends. Tests that need a cache of
their own still set PDSERVE_CACHE_DIR themselves.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from pdserve.engine.loader.resolve import CACHE_ENV, default_cache_dir

SHARED = ("models", "kernels")  # the developer's folders a run links to

_run_dir: pathlib.Path | None = None


def pytest_configure(config):
    """In the run's first process (a plain pytest, or pytest-xdist's controller), before any test
    process starts: the run's cache folder, linked and exported."""
    global _run_dir
    if hasattr(config, "workerinput"):
        return  # an xdist test process: it inherited the controller's folder
    own = default_cache_dir()
    # short: a local Ray keeps its socket files under <cache>/ray, and socket paths are short
    _run_dir = pathlib.Path(tempfile.mkdtemp(prefix="pdt-"))
    for name in SHARED:
        try:
            (own / name).mkdir(parents=True, exist_ok=True)
        except OSError:
            continue  # the developer's cache cannot be written: the run builds its own
        (_run_dir / name).symlink_to(own / name, target_is_directory=True)
    os.environ[CACHE_ENV] = str(_run_dir)


def pytest_unconfigure(config):
    if _run_dir is not None:
        shutil.rmtree(_run_dir, ignore_errors=True)  # the links only: their targets stay
