"""The outside reference of ``pdserve bench serve --compare --hf-reference``: Hugging Face
transformers' ``generate`` on the same model, prompts and lengths, in the benchmark's
process on the same device.

``generate`` is offline batching: each load's concurrency c becomes batches of c prompts
run one after another (a static batch waits for its slowest member, as generate does), so
its throughput is what a server built on it would reach at that concurrency, with no
network, tokenizer or scheduling cost. Only throughputs and the per-batch latency (as
E2E) are reported; generate has no per-token stream to time TTFT or ITL from.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any


def hf_runs(args: argparse.Namespace, loads: list[int | None], id_range: tuple[int, int],
            progress: Any) -> list[dict[str, Any]]:  # fmt: skip
    import torch
    import transformers

    from pdserve.cli.bench.serve_load import make_prompts, stats
    from pdserve.common.model.checkpoint.files import resolve_model

    transformers.logging.set_verbosity_error()
    device = args.device or "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model_dir = resolve_model(args.model)
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    )
    generate = _batch_generate(model, device, args.output_len)

    runs = []
    for index, load in enumerate(loads):
        size = load or args.num_prompts
        prompts = make_prompts(args.num_prompts, args.input_len, id_range, args.seed + index)
        generate(
            make_prompts(
                min(size, args.num_prompts), args.input_len, id_range, args.seed, "warm-up"
            )
        )
        label = f"HF generate c={size}"
        progress(f"{label}: {args.num_prompts} prompts in batches of {size}")
        latencies = []
        start = time.perf_counter()
        for first in range(0, len(prompts), size):
            batch_start = time.perf_counter()
            generate(prompts[first : first + size])
            latencies += [time.perf_counter() - batch_start] * len(prompts[first : first + size])
        duration = time.perf_counter() - start
        n = len(prompts)
        metrics: dict[str, Any] = {
            "completed": n, "failed": 0, "duration_s": duration,
            "total_input_tokens": n * args.input_len, "total_output_tokens": n * args.output_len,
            "cached_prompt_tokens": 0, "request_throughput": n / duration,
            "output_throughput": n * args.output_len / duration,
            "total_token_throughput": n * (args.input_len + args.output_len) / duration,
            **stats("ttft", []), **stats("tpot", []), **stats("itl", []), **stats("e2el", latencies),
        }  # fmt: skip
        runs.append(
            {
                "label": label,
                "load": load,
                "mode": "hf",
                "metrics": metrics,
                "server": {"model": str(model_dir)},
                "requests": [],
            }
        )
    del generate, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return runs


def _batch_generate(model: Any, device: str, output_len: int) -> Callable[[list[list[int]]], None]:
    """``generate`` of exactly ``output_len`` greedy tokens for a batch of equal-length prompts."""
    import torch

    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)

    def generate(batch: list[list[int]]) -> None:
        ids = torch.tensor(batch, dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad,
            )
        if device == "cuda":
            torch.cuda.synchronize()
        if out.shape[1] != ids.shape[1] + output_len:
            raise RuntimeError(
                f"HF generated {out.shape[1] - ids.shape[1]} tokens, not {output_len}"
            )

    return generate
