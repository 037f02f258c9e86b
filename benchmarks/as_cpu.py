"""Runs a command as if this machine's CPU were another kind the project meets (engine/cpu.py).

    python -m benchmarks.as_cpu avx2 -- python -m benchmarks.engine.bench --quick
    python -m benchmarks.as_cpu avx512 -- bash scripts/test.sh tests/unit

`avx2` is the AMD EPYC without AVX-512, `avx512` the Intel Xeon with AVX-512 VNNI but no bf16 or
AMX units. The command and everything it starts see the kind's flags only, build the compiled
kernels for them and run torch's libraries capped to them. Figures measured so are estimates for
that kind on this machine's cores, labelled as such in every result (`cpu_features().describe()`
says "run as ..."); a CPU kind's own row in BENCHMARKS.md comes only from that CPU.
"""

from __future__ import annotations

import os
import sys

from pdserve.engine.cpu import emulation_env


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m benchmarks.as_cpu KIND -- CMD [ARG ...]", file=sys.stderr)
        return 2
    try:
        env = emulation_env(argv[0])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    os.execvpe(argv[2], argv[2:], {**os.environ, **env})
    return 0  # (not reached: exec replaces this process)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
