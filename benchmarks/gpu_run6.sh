#!/usr/bin/env bash
# GPU machine, fifth batch, part B: `pdserve bench engine` with and without CUDA graphs
# (against HF transformers and the machine's floors) and `pdserve bench serve --compare`
# at three loads with the HF generate reference, on the 1B-shaped random Llama.
source benchmarks/gpu_common.sh
stamp "bench engine, CUDA graphs"
timeout 150 python3 -m pdserve bench engine --model /tmp/llama1b --device cuda --dtype bfloat16 --prompt-len 1024 \
  --gen-len 64 --batch-sizes 1,16,64 --json "$OUT/engine_h200.json" 2>"$OUT/engine_err.txt" | tail -12
tail -2 "$OUT/engine_err.txt"
stamp "bench engine, eager (no graphs)"
timeout 80 python3 -m pdserve bench engine --model /tmp/llama1b --device cuda --dtype bfloat16 --prompt-len 1024 \
  --gen-len 64 --batch-sizes 1,16,64 --repeats 2 --no-hf --no-cuda-graphs --json "$OUT/engine_h200_eager.json" \
  2>"$OUT/engine_eager_err.txt" | tail -5
tail -2 "$OUT/engine_eager_err.txt"
stamp "bench serve --compare --hf-reference"
PDSERVE_ENGINE__GPU_MEMORY_UTILIZATION=0.3 timeout 300 python3 -m pdserve bench serve --compare --model /tmp/llama1b \
  --device cuda --num-prompts 32 --max-concurrency 1,8,32 --input-len 1024 --output-len 128 --hf-reference \
  --json "$OUT/serve_h200.json" 2>"$OUT/serve_err.txt" | tail -40
tail -3 "$OUT/serve_err.txt"
stamp "done"
