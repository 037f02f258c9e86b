"""Triton's interpreter for the kernel tests on CPU (tests/unit/test_fused_triton.py,
tests/unit/test_paged_decode_triton.py). Not a test module."""

from __future__ import annotations

import sys

import pytest

_INTERPRETED: list = []  # the triton package imported under TRITON_INTERPRET=1, once imported


def interpreted_triton():
    """Triton's Python modules imported with TRITON_INTERPRET=1 set: triton decorates its own
    helpers (tl.sum's combine function, ...) when it is imported, so a triton that another test
    of this process imported without the variable is imported again (its compiled extension,
    triton._C, stays loaded). Kernels built against an earlier import must be built again.
    The caller sets TRITON_INTERPRET=1 first (monkeypatch.setenv)."""
    current = sys.modules.get("triton")
    if current is not None and _INTERPRETED and current is _INTERPRETED[0]:
        return
    if current is not None:
        for name in [m for m in sys.modules if m.split(".")[0] == "triton"]:
            if not name.startswith("triton._C"):
                del sys.modules[name]
    _INTERPRETED[:] = [pytest.importorskip("triton")]
