"""What the tests of n > 1 (issue #16) share: the sampling of n sequences they send, greedy and
seeded, and the model length; tests/unit/test_n_sequences_engine.py (the engines and the commit
frame) and tests/integration/test_n_sequences.py (through the workers and the Router).

Not a test module: imported as `from helpers.n_sequences import ...` (tests/helpers/ is a package on pytest's sys.path).
"""

from __future__ import annotations

from pdserve.protos.pdserve.v1 import pdserve_pb2

MAX_MODEL_LEN = 128


def proto_sampling(**kw) -> pdserve_pb2.SamplingParams:
    return pdserve_pb2.SamplingParams(**kw)


SEEDED = dict(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)
