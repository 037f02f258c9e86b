"""Where a compiled kernel's build goes in the cache (engine/kernels `_build_key`): one entry per
source, CPU, flags and ninja version, so that two ninjas taking turns (a pip-installed one and the
system's, first on PATH by turns) no longer rebuild each other's entry at every start."""

from __future__ import annotations

from pdserve.engine import kernels


def test_each_ninja_version_builds_into_an_entry_of_its_own(monkeypatch):
    def key(version: str, flags: list[str] | None = None) -> str:
        monkeypatch.setattr(kernels, "_ninja_version", lambda: version)
        return kernels._build_key(kernels._SRC, flags or [])

    assert key("1.11.1") != key("1.13.2.git.kitware.jobserver-pipe-1")
    assert key("1.11.1") == key("1.11.1")  # the same ninja finds its build again
    assert key("1.11.1") != key("1.11.1", ["-mno-avx512f"])
    assert len(key("")) == 12  # no ninja: a key still (the build then fails, logged)


def test_ninja_version_is_the_first_ninja_on_path(monkeypatch, tmp_path):
    """What torch's build runs is `ninja` from PATH: the version asked is that one's."""
    fake = tmp_path / "ninja"
    fake.write_text("#!/bin/sh\necho 9.9.9-test\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    kernels._ninja_version.cache_clear()
    try:
        assert kernels._ninja_version() == "9.9.9-test"
    finally:
        kernels._ninja_version.cache_clear()
