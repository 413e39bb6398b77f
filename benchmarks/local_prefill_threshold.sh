#!/usr/bin/env bash
# The default of local_prefill_threshold (#38): TTFT of prompts of each length served
# through the prefill instance (threshold 0: "disaggregated") or prefilled by the decode
# instance (a threshold above every length: "local"), the same requests (bench serve's
# seed), on the embedded model. The length under which local prefill's TTFT is the lower
# one is the default. A fresh deployment per length and mode, the two modes alternating
# first and second, so that a shared machine's busy minutes fall on both. From the
# repository root:
#     bash benchmarks/local_prefill_threshold.sh    # results/local_threshold_{mode}_{len}.json
set -euo pipefail
LENGTHS=${LENGTHS:-32 64 128 256 512}
RATE=${RATE:-0.25}
PROMPTS=${PROMPTS:-8}
OUT=${OUT:-benchmarks/results}
PD=.venv/bin/pdserve
one() {  # mode, prompt length
    local mode=$1 len=$2 threshold=0 port=$((7800 + RANDOM % 100 * 100))
    [ "$mode" = local ] && threshold=100000
    $PD up --zmq-port "$port" --http-port $((port + 99)) --local-prefill-threshold "$threshold" \
        --log-dir "/tmp/pdserve-threshold-$mode" 2>"/tmp/pdserve-threshold-$mode.err" &
    local pid=$!
    until curl -sf "http://127.0.0.1:$((port + 99))/health" >/dev/null; do sleep 1; done
    $PD bench serve --url "http://127.0.0.1:$((port + 99))" --num-prompts "$PROMPTS" \
        --request-rate "$RATE" --input-len "$len" --output-len 32 --label "$mode-$len" \
        --json "$OUT/local_threshold_${mode}_${len}.json" | grep -E "TTFT (mean|median)|local" || true
    kill -INT $pid; wait $pid || true
}
flip=0
for len in $LENGTHS; do
    if [ $flip = 0 ]; then one disaggregated "$len"; one local "$len"
    else one local "$len"; one disaggregated "$len"; fi
    flip=$((1 - flip))
done
