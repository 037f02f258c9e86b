#!/usr/bin/env bash
# Fails when a file tracked by git is larger than the limit (default 2 MB = 2,000,000 bytes;
# MAX_BYTES overrides it). Benchmark output, traces, models and other data do not belong in the
# repository: benchmarks/results/ keeps only the result BENCHMARKS.md quotes (see .gitignore), and
# larger data goes elsewhere (a package, a release asset, a download at first use).
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${MAX_BYTES:-2000000}
too_big=0
while IFS= read -r -d '' path; do
  [ -f "$path" ] && [ ! -L "$path" ] || continue   # deleted in the work tree, a link or a submodule
  size=$(wc -c < "$path")
  if [ "$size" -gt "$limit" ]; then
    echo "check_sizes: $path is $size bytes, over the $limit-byte limit" >&2
    too_big=$((too_big + 1))
  fi
done < <(git ls-files -z)
if [ "$too_big" -gt 0 ]; then
  echo "check_sizes: $too_big tracked file(s) over the limit: keep them out of git (.gitignore)" >&2
  exit 1
fi
echo "check_sizes: every tracked file is at most $limit bytes"
