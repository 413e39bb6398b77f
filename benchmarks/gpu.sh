#!/usr/bin/env bash
# What the GPU machine checks and measures, by suite (the device tool's `run`):
#
#   bash benchmarks/gpu.sh SUITE [SUITE...]     results and logs in $OUT (default /tmp/out)
#
#   tests         the GPU tests: Triton kernels, VRAM serving, CUDA-graph decode
#   engine        pdserve bench engine with CUDA graphs, against HF transformers and the floors
#   engine-eager  the same without CUDA graphs and HF (the before of the graphs)
#   serve         pdserve bench serve --compare at three loads, with the HF generate reference
#   transfer      pdserve bench transfer on VRAM (two processes, one GPU), both KV orders
#   pcp           PCP prefill latency (benchmarks/pcp_prefill.py), ranks sharing the GPU
#   all           tests engine serve transfer engine-eager, in that order of priority
#
# Models: a tiny random model carrying the embedded model's tokenizer (.gpu/tok/) for the
# tests, and a 1B-shaped random Llama (Llama-3.2-1B's layers, heads and MLP; SmolLM2's
# vocabulary) for the benchmarks. Wheels for what the machine lacks travel in .whl/.
# The tree there has no .git: the results JSON's commit comes from PDSERVE_GIT_COMMIT, else
# from .gpu/commit (write `git rev-parse HEAD` there before the copy), else git.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '2,17p' "$0"; exit 2; }
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR=/tmp/pdcache UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
export OUT=${OUT:-/tmp/out} PDSERVE_TEST_MODEL=/tmp/tokmodel
export PDSERVE_GIT_COMMIT=${PDSERVE_GIT_COMMIT:-$(cat .gpu/commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || true)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
[ -d /tmp/llama1b ] || python3 - <<'PY'
import shutil, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).save_pretrained("/tmp/tokmodel")
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".gpu/tok/{f}", f"/tmp/tokmodel/{f}")
from pdserve.common.model.random import save_random_llama
save_random_llama("/tmp/llama1b", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                  intermediate_size=8192, max_position_embeddings=16384, tokenizer_from="/tmp/tokmodel")
PY

ENGINE=(python3 -m pdserve bench engine --model /tmp/llama1b --device cuda --dtype bfloat16
        --prompt-len 1024 --gen-len 64)

suite_tests() {
    timeout 200 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_serving.py \
        -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
    local rc=$?; tail -12 "$OUT/gpu_tests.txt"; return $rc
}
suite_engine() {
    timeout 150 "${ENGINE[@]}" --batch-sizes 1,16,64 --json "$OUT/engine_h200.json" \
        2>"$OUT/engine_err.txt" | tail -12
}
suite_engine-eager() {
    timeout 80 "${ENGINE[@]}" --batch-sizes 1,16,64 --repeats 2 --no-hf --no-cuda-graphs \
        --json "$OUT/engine_h200_eager.json" 2>"$OUT/engine_eager_err.txt" | tail -5
}
suite_serve() {
    PDSERVE_ENGINE__GPU_MEMORY_UTILIZATION=0.3 timeout 300 python3 -m pdserve bench serve --compare \
        --model /tmp/llama1b --device cuda --num-prompts 32 --max-concurrency 1,8,32 \
        --input-len 1024 --output-len 128 --hf-reference --json "$OUT/serve_h200.json" \
        2>"$OUT/serve_err.txt" | tail -40
}
suite_transfer() {
    timeout 240 python3 -m pdserve bench transfer --device cuda --shape 1b,8b --tokens 1024,8192,32768 \
        --fragment 8 --order head,block --repeats 9 --json "$OUT/transfer_h200.json" \
        2>"$OUT/transfer_err.txt" | tail -26
}
suite_pcp() {
    timeout 200 python3 benchmarks/pcp_prefill.py --model /tmp/llama1b --device cuda \
        --lengths 1024,4096,8192 --pcp 1,2,4 --chunk 8192 --repeats 3 --json "$OUT/pcp_h200.json" \
        2>&1 | grep -E "^pcp|Error|error" | tail -20
}

suites=("$@")
[ "${suites[*]}" = all ] && suites=(tests engine serve transfer engine-eager)
status=0
for suite in "${suites[@]}"; do
    if ! declare -F "suite_$suite" >/dev/null; then
        echo "unknown suite '$suite' (tests, engine, engine-eager, serve, transfer, pcp, all)"; exit 2
    fi
    stamp "$suite"
    "suite_$suite" || { status=$?; echo "suite $suite failed (exit $status)"; }
done
stamp "done"
exit $status
