"""Helpers shared by the engine tests on tiny random models (tests/unit/test_engine_*.py).

Not a test module: imported as `from engine_helpers import ...` (pytest's default "prepend" import
mode puts tests/unit on sys.path). The fixtures those tests share (`refs`, the HF greedy reference
continuations, and `one_thread`) are in tests/conftest.py, with the reference set's constants.
"""

from __future__ import annotations

from conftest import NEW
from pdserve.engine import SamplingParams

KV = 1 << 22


def greedy(max_tokens: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_until_done(engine, max_steps: int = 10_000) -> list:
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        outs += engine.step()
    raise AssertionError("engine did not finish")
