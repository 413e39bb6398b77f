#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the gates, then the test suite in two lanes. Extra
# arguments go to both pytest runs.
#
#   gates: ruff check, ruff format --check (the repo), mypy (common/ and services/)
#   lanes: the fast lane (not gpu, not slow) first, then the slow one (processes, the
#          real model); GPU tests run on a CUDA machine (benchmarks/gpu.sh tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
venv=${PDSERVE_VENV:-.venv}
python=$venv/bin/python

echo "== ruff check" && "$python" -m ruff check .
echo "== ruff format --check" && "$python" -m ruff format --check .
echo "== mypy common services" && bash scripts/typecheck.sh

lane() {  # exit code 5: the lane selected no tests (e.g. a -k that matches only one lane)
    local rc=0
    "$python" -m pytest --durations=15 -m "$1" "${@:2}" || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
}
echo "== fast lane" && lane "not gpu and not slow" "$@"
echo "== slow lane" && lane "slow and not gpu" "$@"
