# Sourced by the gpu_run*.sh scripts: wheels for what the GPU machine lacks (.whl/), a tiny
# random model carrying the embedded model's tokenizer (.gpu/tok/) for the tests, and a
# 1B-shaped random Llama (Llama-3.2-1B's layers, heads and MLP; SmolLM2's vocabulary).
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR=/tmp/pdcache UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
export OUT=${OUT:-/tmp/out} PDSERVE_TEST_MODEL=/tmp/tokmodel
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
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
