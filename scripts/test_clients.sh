#!/usr/bin/env bash
# The benchmark clients' lane (issue 52): guidellm 0.8.1 and inference-perf 0.7.0, the clients
# vLLM users point at a server, run against pdserve by tests/integration/test_benchmark_clients.py
# (an in-process cluster) and tests/e2e/test_benchmark_clients_up.py (`pdserve up`). CI's `.ci/run`
# runs it after scripts/test.sh; extra arguments go to pytest.
#
# The clients are not project dependencies: they go into a venv of their own (PDSERVE_CLIENTS_VENV,
# default .venv-clients/ in the checkout, ignored by git and kept between runs) that sees the
# project's install ($PYTHON's site-packages, in $PYTHON's order, so `pdserve` imports from the
# same place it does there) and installs nothing of it again: pip runs with pdserve's own
# dependencies, at the versions $PYTHON has, as constraints, so torch, transformers and the rest
# stay as the project has them.
# inference-perf declares Python >= 3.12 and pins transformers==5.13.0, but runs on 3.11 and on the
# project's transformers: it goes in without its declared dependencies (on any Python: its
# transformers pin conflicts with the project's), then what it imports
# (tests/helpers/bench_clients.py's docstring).
#
# In this lane a missing client fails its tests instead of skipping them
# (PDSERVE_REQUIRE_CLIENTS=1, read by tests/helpers/bench_clients.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PDSERVE_CLIENTS_VENV:-.venv-clients}
GUIDELLM_PIN="guidellm==0.8.1"
INFERENCE_PERF_PIN="inference-perf==0.7.0"
# What inference-perf imports beyond guidellm's dependencies (datasets, aiofiles, uvloop come
# with guidellm), installed by hand since its declared requirements cannot be used.
INFERENCE_PERF_IMPORTS=(aiohttp av tiktoken google-cloud-storage)
start=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
CPY="$VENV/bin/python"
# The project's site-packages, added after the venv's own by a .pth file (`site.addsitedir`, so
# their own .pth files, the editable install's finder among them, are processed too).
"$PY" - "$("$CPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'EOF'
import pathlib
import site
import sys

dirs = list(site.getsitepackages())
if site.ENABLE_USER_SITE and site.getusersitepackages() not in dirs:
    dirs.append(site.getusersitepackages())
lines = [f"import site; site.addsitedir({d!r})" for d in dirs if pathlib.Path(d).is_dir()]
pathlib.Path(sys.argv[1], "pdserve_project.pth").write_text("\n".join(lines) + "\n")
EOF
want=$("$PY" -c 'import pdserve; print(pdserve.__file__)')
got=$("$CPY" -c 'import pdserve; print(pdserve.__file__)')
if [ "$want" != "$got" ]; then
  echo "the clients' venv imports pdserve from $got, the project from $want" >&2
  exit 1
fi

# Constraints: pdserve's own dependencies (not its extras) at the versions $PYTHON has, so that
# the clients cannot re-point torch, transformers or anything else the project serves with; what
# only the clients use beside them (click, which guidellm pins to 8.4) may take another version
# in the clients' venv.
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
"$PY" - >"$CONSTRAINTS" <<'EOF'
import importlib.metadata as md
import re

for req in md.requires("pdserve") or []:
    if "extra ==" not in req:
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
        print(f"{name}=={md.version(name)}")
EOF
pipi() { "$CPY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@"; }

installed() { "$CPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
if ! installed guidellm "${GUIDELLM_PIN#*==}"; then
  pipi "$GUIDELLM_PIN"
fi
if ! installed inference-perf "${INFERENCE_PERF_PIN#*==}"; then
  pipi "${INFERENCE_PERF_IMPORTS[@]}"
  pipi --no-deps --ignore-requires-python "$INFERENCE_PERF_PIN"
fi
"$CPY" -c 'import guidellm, inference_perf'
echo "clients installed in $VENV: $((SECONDS - start)) s"

export PDSERVE_REQUIRE_CLIENTS=1
# One test process: each file's benchmarks load the machine on their own (guidellm's throughput
# stage sends 512 requests at once), and run side by side on 2 cores the in-process sweep's
# throughput stage once finished 1 request in its 4 s, so the constant stage that guidellm paces
# from it sent one request, which did not finish either (CI, 2026-12-04).
rc=0
PDSERVE_TEST_JOBS=1 PYTHON="$CPY" bash scripts/test.sh tests/integration/test_benchmark_clients.py \
  tests/e2e/test_benchmark_clients_up.py "$@" || rc=$?
echo "clients lane: $((SECONDS - start)) s in all"
exit "$rc"
