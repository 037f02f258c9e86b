"""Fixtures of the end-to-end tests: one local Ray per test module that deploys on it."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from pdserve.deploy.ray_connect import start_local_ray

    tmp = tempfile.mkdtemp(prefix="pdray")  # short: Ray's socket paths live under it
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    yield
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
