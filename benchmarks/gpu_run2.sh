#!/usr/bin/env bash
# GPU machine, second batch: serving (disaggregated vs colocated) and PCP prefill latency
# on a 1B-shaped random Llama in bf16. Same set-up as gpu_run.sh. Results in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR=/tmp/pdcache UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 - <<'PY'
import shutil, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
transformers.LlamaForCausalLM(cfg).save_pretrained("/tmp/tokmodel")
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".gpu/tok/{f}", f"/tmp/tokmodel/{f}")
from pdserve.common.model.random import save_random_llama
save_random_llama("/tmp/llama1b", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                  intermediate_size=8192, max_position_embeddings=16384, tokenizer_from="/tmp/tokmodel")
PY
echo "== bench serve --compare (1B, cuda)"
timeout 330 python3 -m pdserve bench serve --compare --model /tmp/llama1b --device cuda --num-prompts 128 \
  --max-concurrency 32 --input-len 1024 --output-len 128 --json "$OUT/serve_h200.json" 2>"$OUT/serve_err.txt" | tail -30
tail -3 "$OUT/serve_err.txt"
echo "== PCP prefill latency (1B, cuda, ranks share the GPU through gloo)"
timeout 200 python3 benchmarks/pcp_prefill.py --model /tmp/llama1b --device cuda --lengths 1024,4096,8192 --pcp 1,2,4 \
  --chunk 8192 --repeats 3 --json "$OUT/pcp_h200.json" 2>&1 | grep -E "^pcp|Error|error" | tail -20
