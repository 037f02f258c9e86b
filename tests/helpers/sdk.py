"""The official client SDKs' modules (anthropic's and openai's types and stream accumulators),
as the unit tests that check pdserve's shapes against them read them: imported when a test first
reads an attribute, not while pytest collects the test module. Importing anthropic.types costs
~1.7 s and openai.types ~0.5 s, which every fast-lane process paid at collection whether or not
it ran one of those tests. A missing SDK skips the test that reads it (pytest.importorskip)."""

from __future__ import annotations

import pytest


class LazyModule:
    """`name`'s module, imported on the first attribute read."""

    def __init__(self, name: str):
        self._name = name
        self._module = None

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            # pytest's collection probes every module-level name for its own markers
            # (__test__, _pytestfixturefunction, __code__, ...): those probes must not import
            # the SDK, and no test reads a private name of one
            raise AttributeError(attr)
        if self._module is None:
            self._module = pytest.importorskip(self._name)
        return getattr(self._module, attr)
