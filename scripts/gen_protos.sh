#!/usr/bin/env bash
# Regenerates the committed Python code for protos/pdserve/v1/*.proto:
# *_pb2.py (messages), *_pb2_grpc.py (stubs/servicers) and *_pb2.pyi (type stubs).
#
#   usage: scripts/gen_protos.sh [OUT_DIR]
#
# OUT_DIR defaults to protos/ (the committed files); tests/integration/test_protos_server.py passes
# a temp dir and compares byte for byte, so run this after every .proto edit and commit the result.
#
# Import layout: the .proto files keep their canonical paths (pdserve/v1/pdserve.proto, include
# root protos/), so other languages and server reflection see clean file names. protoc then
# writes Python imports relative to that root ("from pdserve.v1 import pdserve_pb2"), which
# would only resolve with protos/ on sys.path; the sed below rewrites them to the installed
# package, "from pdserve.protos.pdserve.v1 import pdserve_pb2". It also rewrites the module name
# the messages are built under ('pdserve.v1.pdserve_pb2' -> 'pdserve.protos.pdserve.v1.pdserve_pb2'),
# so their __module__ is importable and they pickle (Ray passes objects by pickle). The script
# fails if either pattern is left unrewritten, e.g. after a protoc upgrade changes its output.
#
# Deterministic: protoc's output depends only on the .proto files and the grpcio-tools version
# (pinned in pyproject's dev extra), and the files are processed in C-locale order.
set -euo pipefail
export LC_ALL=C
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/protos}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}

cd "$ROOT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PY" -m grpc_tools.protoc -I protos \
  --python_out="$tmp" --grpc_python_out="$tmp" --pyi_out="$tmp" \
  protos/pdserve/v1/*.proto

generated=$(cd "$tmp" && find . -type f \( -name '*_pb2.py' -o -name '*_pb2_grpc.py' -o -name '*_pb2.pyi' \) | sort)
for f in $generated; do
  sed -i -E \
    -e 's/^(from|import) pdserve([. ])/\1 pdserve.protos.pdserve\2/' \
    -e "s/^(_builder\.BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'pdserve\./\1'pdserve.protos.pdserve./" \
    "$tmp/$f"
done
if grep -nE "^(from|import) pdserve\.v1([. ]|\$)|BuildTopDescriptorsAndMessages\(DESCRIPTOR, 'pdserve\.v1\." \
    $(for f in $generated; do echo "$tmp/$f"; done); then
  echo "gen_protos.sh: the lines above still name 'pdserve.v1' instead of 'pdserve.protos.pdserve.v1'; fix the sed" >&2
  exit 1
fi

# Replace the previous generation wholesale, so code of a deleted .proto does not linger.
rm -f "$OUT"/pdserve/v1/*_pb2.py "$OUT"/pdserve/v1/*_pb2_grpc.py "$OUT"/pdserve/v1/*_pb2.pyi
for f in $generated; do
  mkdir -p "$OUT/$(dirname "$f")"
  cp "$tmp/$f" "$OUT/$f"
done
