#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run real prompts through the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
PDSERVE=${PDSERVE_VENV:-.venv}/bin/pdserve
for prompt in "What is the capital of France?" "Write a haiku about the sea." "Explain in one sentence what a KV cache is."; do
  echo "> $prompt"
  "$PDSERVE" generate --prompt "$prompt" --max-tokens 64
done
