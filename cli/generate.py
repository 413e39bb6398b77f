"""``pdserve generate``: one prompt through the monolithic engine; prints only the text."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pdserve.cli.engine_flags import add_kv_cache_dtype


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (monolithic engine)")
    p.add_argument("--prompt", required=True, help="the prompt (a user message unless --raw)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: embedded)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_kv_cache_dtype(p, default="auto")
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s spelling: \'{"method": "ngram", '
        '"num_speculative_tokens": 5}\' or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 5}\'',
    )
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.common.runtime.log import configure_logging

    configure_logging(args.log_level)
    # Flags are checked before torch is imported or the model loaded: a bad one fails fast.
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.sampling_params import SamplingParams

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    sampling.validate()
    from pdserve.common.engine.spec_decode.config import parse_speculative_config

    spec = parse_speculative_config(args.speculative_config) if args.speculative_config else None
    config = EngineConfig(
        model=args.model,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=spec,
    )
    from pdserve.common.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    tok = engine.tokenizer
    if args.raw:
        prompt = tok.encode(args.prompt)
    else:
        prompt = tok.encode_chat([{"role": "user", "content": args.prompt}])
    [result] = engine.generate([prompt], sampling)
    sys.stdout.write(result.text + "\n")
    return 0
