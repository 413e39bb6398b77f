#!/usr/bin/env bash
# Set up (scripts/setup.sh), start router + prefill + decode as separate processes on the
# embedded default model, send real prompts through them (HTTP and the ZMQ SDK), stop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
exec "${PDSERVE_VENV:-.venv}/bin/pdserve" demo "$@"
