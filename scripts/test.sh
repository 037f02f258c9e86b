#!/usr/bin/env bash
# Runs the test suite. pytest's "no tests collected" (exit 5) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export PDSERVE_NO_PROGRESS=1
python3 -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
