#!/usr/bin/env bash
# Everything the GPU machine checks and measures, in one go (the device tool's `run`):
#   GPU kernel tests, the CUDA serving test (VRAM pulls), and `pdserve bench engine` on a
#   1B-shaped random Llama. Wheels for what that machine lacks travel in .whl/, the
#   tokenizer files in .gpu/tok/. Results land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

python3 - <<'PY'
# A tiny random model that carries the embedded model's tokenizer: the tests' model_dir.
import shutil, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).save_pretrained("/tmp/tokmodel")
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".gpu/tok/{f}", f"/tmp/tokmodel/{f}")
PY
export PDSERVE_TEST_MODEL=/tmp/tokmodel PDSERVE_CACHE_DIR=/tmp/pdcache

echo "== GPU tests"
python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_serving.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25

echo "== bench engine, 1B-shaped random Llama, bf16"
python3 - <<'PY'
from pdserve.common.model.random import save_random_llama
save_random_llama("/tmp/llama1b", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                  intermediate_size=8192, max_position_embeddings=8192, tokenizer_from="/tmp/tokmodel")
PY
python3 -m pdserve bench engine --model /tmp/llama1b --device cuda --dtype bfloat16 --prompt-len 1024 --gen-len 64 \
  --batch-sizes 1,16,64 --json "$OUT/engine_h200.json" 2>&1 | tail -20
