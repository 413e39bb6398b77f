#!/usr/bin/env bash
# GPU machine, third batch: the kernels and VRAM pulls over the head-major KV layout (TP),
# and `pdserve bench transfer` on VRAM. Same set-up as gpu_run.sh. Results in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR=/tmp/pdcache UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 - <<'PY'
import shutil, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).save_pretrained("/tmp/tokmodel")
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".gpu/tok/{f}", f"/tmp/tokmodel/{f}")
PY
export PDSERVE_TEST_MODEL=/tmp/tokmodel
echo "== GPU tests"
timeout 240 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_serving.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -8
echo "== bench transfer (VRAM, two processes on the one GPU)"
timeout 240 python3 -m pdserve bench transfer --device cuda --shape 1b,8b --tokens 1024,8192,32768 --fragment 8 \
  --json "$OUT/transfer_h200.json" 2>"$OUT/transfer_err.txt" | tail -30
tail -3 "$OUT/transfer_err.txt"
