#!/usr/bin/env bash
# GPU machine, seventh batch: the GPU tests on the final code, and `pdserve bench transfer`
# with timed pulls on a telemetry-free agent (as decode runs) in both KV storage orders.
source benchmarks/gpu_common.sh
stamp "GPU tests"
timeout 170 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_serving.py -p no:cacheprovider \
  > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
stamp "bench transfer"
timeout 120 python3 -m pdserve bench transfer --device cuda --shape 1b,8b --tokens 1024,8192,32768 --fragment 8 \
  --order head,block --repeats 9 --json "$OUT/transfer_h200.json" 2>/dev/null | tail -25
stamp "done"
