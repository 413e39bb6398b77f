#!/usr/bin/env bash
# GPU machine, fourth batch: bench transfer on VRAM after releases moved to a notifier
# agent (common/transfer/kv_transfer.py), producer progressing every 5 ms as in serving.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR=/tmp/pdcache UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 300 python3 -m pdserve bench transfer --device cuda --shape 1b,8b --tokens 1024,8192,32768 --fragment 8 --repeats 9 \
  --json "$OUT/transfer_h200.json" 2>"$OUT/transfer_err.txt" | tail -16
tail -3 "$OUT/transfer_err.txt"
