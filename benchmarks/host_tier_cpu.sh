#!/usr/bin/env bash
# The host tier under the prefix cache (#39) on CPU, small: the multi-turn chat workload
# (bench serve --multi-turn) against a device pool a few times smaller than its working set,
# the tier off (kv_host_cache_gb 0) and on, disaggregated and colocated. The embedded model,
# 16-token blocks so that a small pool is still many blocks. From the repository root:
#     bash benchmarks/host_tier_cpu.sh    # results/host_tier_cpu_{off,on}.json
# MODES=disaggregated ORDER="on off" TAG=_r2: one mode, the tier on first (a shared
# machine's busy minutes then fall on the other side), into host_tier_cpu_{on,off}_r2.json
set -euo pipefail
BLOCKS=${BLOCKS:-36}      # the device pool of each engine (prefill's and decode's)
USERS=${USERS:-8}
TURNS=${TURNS:-4}
TIER_GB=${TIER_GB:-0.25}  # holds every block of the workload
OUT=${OUT:-benchmarks/results}
MODES=${MODES:-disaggregated,colocated}
ORDER=${ORDER:-off on}
TAG=${TAG:-}
for tier in $ORDER; do
    gb=0
    [ "$tier" = on ] && gb=$TIER_GB
    PDSERVE_ENGINE__BLOCK_SIZE=16 PDSERVE_ENGINE__NUM_KV_BLOCKS=$BLOCKS \
    PDSERVE_ENGINE__KV_HOST_CACHE_GB=$gb \
        .venv/bin/pdserve bench serve --compare --modes "$MODES" \
        --multi-turn "$TURNS" --num-prompts $((USERS * TURNS)) --input-len 64 --output-len 8 \
        --max-concurrency 2 --label "tier-$tier" --json "$OUT/host_tier_cpu_$tier$TAG.json"
done
