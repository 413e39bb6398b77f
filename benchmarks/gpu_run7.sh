#!/usr/bin/env bash
# GPU machine, sixth batch (one call): GPU tests, bench engine with CUDA graphs (vs HF and
# the floors), bench serve --compare at three loads with the HF reference, bench transfer
# at 8k/32k in both orders, and bench engine without graphs (the before), in that order
# of priority: what does not fit in the call's 600 s is cut from the end.
source benchmarks/gpu_common.sh
stamp "GPU tests"
timeout 170 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_serving.py -p no:cacheprovider -x \
  > "$OUT/gpu_tests.txt" 2>&1; tail -4 "$OUT/gpu_tests.txt"
stamp "bench engine, CUDA graphs"
timeout 110 python3 -m pdserve bench engine --model /tmp/llama1b --device cuda --dtype bfloat16 --prompt-len 1024 \
  --gen-len 64 --batch-sizes 1,16,64 --json "$OUT/engine_h200.json" 2>"$OUT/engine_err.txt" | tail -11
tail -2 "$OUT/engine_err.txt"
stamp "bench serve --compare --hf-reference"
PDSERVE_ENGINE__GPU_MEMORY_UTILIZATION=0.3 timeout 200 python3 -m pdserve bench serve --compare --model /tmp/llama1b \
  --device cuda --num-prompts 32 --max-concurrency 1,8,32 --input-len 1024 --output-len 128 --hf-reference \
  --json "$OUT/serve_h200.json" 2>"$OUT/serve_err.txt" | head -20
tail -3 "$OUT/serve_err.txt"
stamp "bench transfer"
timeout 70 python3 -m pdserve bench transfer --device cuda --shape 1b,8b --tokens 8192,32768 --fragment 8 \
  --order head,block --repeats 7 --json "$OUT/transfer_h200.json" 2>"$OUT/transfer_err.txt" | tail -17
stamp "bench engine, eager"
timeout 45 python3 -m pdserve bench engine --model /tmp/llama1b --device cuda --dtype bfloat16 --prompt-len 1024 \
  --gen-len 64 --batch-sizes 1,64 --repeats 1 --no-hf --no-cuda-graphs --json "$OUT/engine_h200_eager.json" \
  2>"$OUT/engine_eager_err.txt" | tail -4
stamp "done"
