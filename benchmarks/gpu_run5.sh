#!/usr/bin/env bash
# GPU machine, fifth batch, part A: the GPU tests (Triton attention and pointwise kernels,
# VRAM serving, CUDA-graph decode) and `pdserve bench transfer` in both KV storage orders.
source benchmarks/gpu_common.sh
stamp "GPU tests"
timeout 200 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_serving.py -p no:cacheprovider \
  > "$OUT/gpu_tests.txt" 2>&1; tail -12 "$OUT/gpu_tests.txt"
stamp "bench transfer (VRAM, two processes on the one GPU), head- and block-major"
timeout 240 python3 -m pdserve bench transfer --device cuda --shape 1b,8b --tokens 1024,8192,32768 --fragment 8 \
  --order head,block --repeats 7 --json "$OUT/transfer_h200.json" 2>"$OUT/transfer_err.txt" | tail -26
tail -2 "$OUT/transfer_err.txt"
stamp "done"
