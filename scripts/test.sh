#!/usr/bin/env bash
# Runs the test suite (or the lanes, files or tests named in the arguments, which go to pytest).
# Three test files at a time with pytest-xdist (the dev extra installs it): most tests wait on
# sockets, subprocess starts and timeouts, so more files than cores keep the cores busy (the
# times with 2 and 3: docs/contributing.md); the fast lane alone runs one a core. The files go out
# in the order tests/helpers/lanes.py gives them (longest first, so the run does not end on one
# long file); tests marked `serial` run while no other test does. PDSERVE_TEST_JOBS sets the
# number of test processes (1: one process, as plain pytest runs); an `-n`/`--numprocesses` or
# `-p no:xdist` in the arguments is left to pytest. pytest's "no tests collected" (exit 5) is a
# failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export PDSERVE_NO_PROGRESS=1
# pytest rewrites each test module's asserts and keeps the result beside it in __pycache__ (git
# ignores it) only where Python may write bytecode: without it every test process rewrites all
# the modules it collects again (the times: docs/contributing.md)
unset PYTHONDONTWRITEBYTECODE
PY=${PYTHON:-python3}
# The fast lane (only paths under tests/unit named) computes and never waits on a socket or a
# process: one test process a core. The rest of the suite waits often: three on two cores.
unit_only=0
other=0
for arg in "$@"; do
  case "$arg" in
    -*) ;;
    tests/unit | tests/unit/* | ./tests/unit | ./tests/unit/*) unit_only=1 ;;
    *) other=1 ;;
  esac
done
if [ "$unit_only" -eq 1 ] && [ "$other" -eq 0 ]; then
  default_jobs=$(nproc 2>/dev/null || echo 2)
else
  default_jobs=3
fi
JOBS=${PDSERVE_TEST_JOBS:-$default_jobs}
if ! [[ "$JOBS" =~ ^[1-9][0-9]*$ ]]; then
  echo "PDSERVE_TEST_JOBS must be a whole number of processes, 1 or more (got '$JOBS')" >&2
  exit 2
fi
parallel=()
if [ "$JOBS" -gt 1 ]; then
  chosen=0
  for arg in "$@"; do
    case "$arg" in
      -n | -n* | --numprocesses | --numprocesses=* | no:xdist | -pno:xdist) chosen=1 ;;
    esac
  done
  if [ "$chosen" -eq 1 ]; then
    :
  elif "$PY" -c "import xdist" 2>/dev/null; then
    # a crashed test process is not replaced: with --dist loadfile, pytest-xdist 3.8 can wait
    # forever after a replacement (its issue #1378; a CI run here hung 12 minutes until stopped);
    # the run goes on in the other processes and fails, naming the test the crash happened in
    parallel=(-n "$JOBS" --dist loadfile --no-loadscope-reorder --max-worker-restart=0)
  else
    echo "pytest-xdist is not installed (the dev extra has it): running the tests in one process" >&2
  fi
fi
"$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
