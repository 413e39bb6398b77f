#!/usr/bin/env bash
# GPU machine, seventh batch: the GPU tests on the final code, and `pdserve bench transfer`
# with timed pulls on a telemetry-free agent (as decode runs) in both KV storage orders;
# then bench engine at batch 64 without HF.
source benchmarks/gpu_common.sh
stamp "GPU tests"
timeout 170 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_serving.py -p no:cacheprovider \
  > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
stamp "bench transfer"
timeout 120 python3 -m pdserve bench transfer --device cuda --shape 1b,8b --tokens 1024,8192,32768 --fragment 8 \
  --order head,block --repeats 9 --json "$OUT/transfer_h200.json" 2>/dev/null | tail -25
stamp "bench engine, batch 64 (engine step after the scheduler's token slicing)"
timeout 60 python3 -m pdserve bench engine --model /tmp/llama1b --device cuda --dtype bfloat16 --prompt-len 1024 \
  --gen-len 64 --batch-sizes 64 --repeats 2 --no-hf --json "$OUT/engine_h200_b64.json" 2>/dev/null | tail -3
stamp "done"
