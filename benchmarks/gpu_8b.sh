#!/usr/bin/env bash
# GPU machine (#13): the 8B-shape crash reproduced on the old kernels, the GPU tests on the
# new ones, and `bench engine` at the 8B and 1B shapes. Usage: bash benchmarks/gpu_8b.sh PART
# HF_FLAG= (empty) adds the HF reference to engine8b. (PART: crash | tests | engine8b | engine1b | profile), several parts in one call allowed.
set -uo pipefail
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR=/tmp/pdcache UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
export OUT=${OUT:-/tmp/out} PDSERVE_TEST_MODEL=/tmp/tokmodel PDSERVE_GIT_COMMIT=$(cat .gpu/commit 2>/dev/null || echo unknown)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
[ -d /tmp/tokmodel ] || python3 - <<'PY'
import shutil, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).save_pretrained("/tmp/tokmodel")
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".gpu/tok/{f}", f"/tmp/tokmodel/{f}")
PY
BENCH="python3 -m pdserve bench engine --device cuda --dtype bfloat16 --tokenizer /tmp/tokmodel"
for part in "$@"; do
  case $part in
  crash)
    stamp "8B shape on the OLD kernels, CUDA graphs on (expected: illegal memory access)"
    cp kernels/triton_ops.py /tmp/new_triton_ops.py && cp .gpu/old_triton_ops.py kernels/triton_ops.py
    PDSERVE_ENGINE__GPU_MEMORY_UTILIZATION=0.3 timeout 200 python3 -m pdserve bench engine --device cuda \
      --dtype bfloat16 --tokenizer /tmp/tokmodel --shape 8b --prompt-len 2048 --gen-len 32 --batch-sizes 1,16,64 \
      --repeats 1 --no-hf > "$OUT/crash_old.txt" 2>&1; echo "exit $?"; grep -E "Error|error" "$OUT/crash_old.txt" | tail -3
    stamp "the new >2^31-element kernel test on the OLD kernels (expected: fails)"
    timeout 120 python3 -m pytest -q -x -m gpu tests/test_kernels.py -k past_2_31 -p no:cacheprovider \
      > "$OUT/past231_old.txt" 2>&1; tail -2 "$OUT/past231_old.txt"
    cp /tmp/new_triton_ops.py kernels/triton_ops.py ;;
  tests)
    stamp "GPU tests"
    timeout 400 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_serving.py -p no:cacheprovider \
      --durations=10 > "$OUT/gpu_tests.txt" 2>&1; tail -15 "$OUT/gpu_tests.txt" ;;
  engine8b)
    stamp "bench engine 8B, 2k prompt, graphs on, with HF"
    timeout 400 $BENCH --shape 8b --prompt-len 2048 --gen-len 32 --batch-sizes 1,16,64 --repeats 2 ${HF_FLAG---no-hf} \
      --json "$OUT/engine_8b_h200.json" 2>"$OUT/engine_8b.err" | tail -12 ;;
  engine1b)
    stamp "bench engine 1B, 1k and 8k prompts, no HF"
    timeout 200 $BENCH --shape 1b --prompt-len 1024 --gen-len 64 --batch-sizes 1,16,64 --repeats 3 --no-hf \
      --json "$OUT/engine_1b_1k_h200.json" 2>"$OUT/engine_1b.err" | tail -5
    timeout 200 $BENCH --shape 1b --prompt-len 8192 --gen-len 64 --batch-sizes 1,16 --repeats 3 --no-hf \
      --json "$OUT/engine_1b_8k_h200.json" 2>>"$OUT/engine_1b.err" | tail -5 ;;
  profile)
    stamp "host profile of decode steps (1B batch 64, 8B batch 1)"
    timeout 150 env PYTHONPATH=/tmp/site:. python3 benchmarks/profile_step.py --shape 1b --batch 64 --context 1024 --tokenizer /tmp/tokmodel \
      > "$OUT/profile_1b_b64.txt" 2>&1; head -30 "$OUT/profile_1b_b64.txt"
    timeout 150 env PYTHONPATH=/tmp/site:. python3 benchmarks/profile_step.py --shape 8b --batch 1 --context 2048 --tokenizer /tmp/tokmodel \
      > "$OUT/profile_8b_b1.txt" 2>&1; head -3 "$OUT/profile_8b_b1.txt" ;;
  esac
done
stamp done
