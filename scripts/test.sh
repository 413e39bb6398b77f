#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the gates, then the test suite in two lanes. Extra
# arguments go to both pytest runs.
#
#   gates: ruff check, ruff format --check (the repo), mypy (common/ and services/)
#   lanes: the fast lane (not gpu, not slow) first, then the interp lane (every Triton
#          kernel test, marked interp, on CPU through Triton's interpreter:
#          TRITON_INTERPRET=1), then the slow one (processes, the real model), each on
#          pytest-xdist workers; GPU tests run on a CUDA machine (benchmarks/gpu.sh tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
venv=${PDSERVE_VENV:-.venv}
python=$venv/bin/python

echo "== ruff check" && "$python" -m ruff check .
echo "== ruff format --check" && "$python" -m ruff format --check .
echo "== mypy common services" && bash scripts/typecheck.sh

# pytest-xdist: a lane's modules go to workers whole (--dist loadfile: module fixtures stay
# shared). Three workers on the slow lane: its tests wait on processes and timeouts as much
# as they compute, and a third worker fills those waits. PDSERVE_TEST_WORKERS="FAST SLOW"
# changes the counts ("0 0": one process each, as plain pytest).
read -r fast_workers slow_workers <<< "${PDSERVE_TEST_WORKERS:-2 3}"
lane() {  # exit code 5: the lane selected no tests (e.g. a -k that matches only one lane)
    local rc=0
    "$python" -m pytest --durations=15 -n "$2" --dist loadfile -m "$1" "${@:3}" || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
}
echo "== fast lane" && lane "not gpu and not slow" "$fast_workers" "$@"
# TRITON_INTERPRET must be set before triton is imported: the lane is a process of its own.
# Its tests skip without triton (importorskip), so its absence fails here instead. The MoE
# decode kernels, off by default until timed on a GPU, are on here (whole models take them).
echo "== interp lane" && "$python" -c "import triton" \
    && TRITON_INTERPRET=1 PDSERVE_MOE_DECODE_PAIRS=128 lane "interp" "$fast_workers" "$@"
echo "== slow lane" && lane "slow and not gpu" "$slow_workers" "$@"
